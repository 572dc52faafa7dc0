"""One loader for the base models sparsekv runs on, shared by training and evaluation.

Model specs:
- "default": google/gemma-3-270m, the shipped Q4_K_M GGUF dequantized (offline,
  `sparsekv.load_default_model`), with its tokenizer;
- "tiny:<family>" (`sparsekv.models.tiny.TINY_FAMILIES`): a 4-layer random model built in-process from
  the seed (no download; the caller's RNG stream is left untouched), without a tokenizer: tiny
  models read the small byte or ASCII vocabularies their callers bring;
- a local Hugging Face model folder (one with a config.json), with its tokenizer;
- where the caller allows it (`hub=True`, training), a Hub model id.

The model comes back in eval mode with every parameter frozen (sparsekv never trains the base
model), in the requested dtype and attention implementation, on `device`. This module knows
nothing about tokenizer wrappers, heads, tasks or rows: `sparsekv.evaluation.running.models` and
`train.models` wrap what it returns for their own callers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sparsekv.io import only_a_path
from sparsekv.models.tiny import TINY_FAMILIES

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


@dataclass(frozen=True)
class LoadedModel:
    """What `load_model` returns: the frozen model, its tokenizer (a Hugging Face tokenizer; None
    for tiny models), and the id a trained adapter records as its base model."""

    model: nn.Module
    tokenizer: Any | None
    base_model_id: str

    @property
    def is_tiny(self) -> bool:
        return self.tokenizer is None


def _allowed(hub: bool) -> str:
    where = "a local model folder" + (" or a Hub model id" if hub else " with a config.json")
    return f"'default' (gemma-3-270m), 'tiny:<family>' ({', '.join(TINY_FAMILIES)}) or {where}"


def validate_model_spec(spec: Any, hub: bool = False, name: str = "model") -> None:
    """Raise ValueError, naming `name` and the allowed values, for a spec that can never load.
    Without `hub` a spec other than "default" and "tiny:<family>" must be a local folder with a
    config.json; with it, anything else is left to the Hub."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{name}={spec!r} must be {_allowed(hub)}")
    if spec.startswith("tiny:"):
        family = spec.removeprefix("tiny:")
        if family not in TINY_FAMILIES:
            raise ValueError(
                f"{name}={spec!r}: tiny model family {family!r}; "
                f"allowed: {', '.join(TINY_FAMILIES)}"
            )
    elif spec != "default" and _is_adapter_folder(Path(spec)):
        raise ValueError(
            f"{name}={spec!r} is a sparsekv adapter folder (a trained scorer), not a model: "
            "pass it as the adapter (--adapter DIR, --policy learned:DIR, lora.adapter=DIR) and "
            f"the base model as {name}; {name} must be {_allowed(hub)}"
        )
    elif spec != "default" and not (Path(spec) / "config.json").is_file():
        if not hub:
            raise ValueError(f"{name}={spec!r} is not {_allowed(hub)}")
        if Path(spec).exists():
            raise ValueError(
                f"{name}={spec!r} is a path without a config.json; it must be {_allowed(hub)}"
            )
        if only_a_path(spec):
            raise ValueError(f"{name}={spec!r}: no such folder; it must be {_allowed(hub)}")


def _is_adapter_folder(folder: Path) -> bool:
    """Whether `folder`'s config.json is a sparsekv adapter's (it records `sparsekv_type`)."""
    import json

    try:
        data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "sparsekv_type" in data


def load_model(
    spec: str,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str = "sdpa",
    seed: int = 0,
    device: str | torch.device = "cpu",
    hub: bool = False,
) -> LoadedModel:
    """Load the model of `spec` (see the module docstring), frozen and in eval mode, on `device`
    (a CUDA device that torch cannot see is refused before anything loads)."""
    from sparsekv.models.default import DEFAULT_MODEL_ID, load_default_model, resolve_dtype

    validate_model_spec(spec, hub=hub)
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"device={str(device)!r}, but this torch ({torch.__version__}) sees no CUDA device; "
            "allowed here: cpu"
        )
    torch_dtype = resolve_dtype(dtype, "dtype")
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"attn_implementation={attn_implementation!r}; "
            f"allowed values: {', '.join(ATTN_IMPLEMENTATIONS)}"
        )
    if spec == "default":
        model, tok = load_default_model(torch_dtype, attn_implementation, device)
        return LoadedModel(model, tok, DEFAULT_MODEL_ID)
    if spec.startswith("tiny:"):
        from sparsekv.models.tiny import tiny_model

        model = tiny_model(
            spec.removeprefix("tiny:"), attn_implementation=attn_implementation, seed=seed
        )
        model.to(torch_dtype)  # built in float32
        tok = None
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            model = AutoModelForCausalLM.from_pretrained(
                spec, dtype=torch_dtype, attn_implementation=attn_implementation
            )
            tok = AutoTokenizer.from_pretrained(spec)
        except OSError as e:  # a Hub id that is not reachable or not there
            raise ValueError(
                f"model={spec!r} could not be loaded ({_allowed(hub)} expected): {e}"
            ) from None
    model.to(device).eval()
    model.requires_grad_(False)
    return LoadedModel(model, tok, spec)


def eos_ids(model: nn.Module) -> list[int]:
    """The end-of-sequence ids of a model's generation config ([] when it has none)."""
    gc = getattr(model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None) if gc is not None else None
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]
