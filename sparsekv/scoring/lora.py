"""An adapter's optional LoRA on the base model: held in memory, saved as a standard PEFT folder,
applied to a model for the duration of a `with` block and removed exactly on exit.

This module owns only loading, saving and applying; training the LoRA (peft `LoraConfig` +
`get_peft_model`, KL distillation under eviction) lives with the trainer.

- `LoraWeights(config, state)`: a peft `LoraConfig` and the state dict in PEFT's saved naming
  (`get_peft_model_state_dict`, adapter name stripped), float tensors on the CPU.
- `LoraWeights.from_peft(peft_model)`: take them from a trained `peft.PeftModel`.
- `LoraWeights.from_folder(path)` / `lora.save(path)`: a standard PEFT folder
  (`adapter_config.json` + `adapter_model.safetensors`) that `PeftModel.from_pretrained(model,
  path)` also loads on its own; the safetensors bytes are the same for the same weights.
- `apply_lora(model, lora)`: a context manager that injects the LoRA into `model`'s modules
  (`peft.PeftModel(model, config)` + `set_peft_model_state_dict`), so plain `model(...)` and
  `model.generate(...)` run with it, and on exit unloads it (`PeftModel.unload()`, no merge): the
  original modules come back with their original tensors, so the model's outputs are bitwise
  those from before; each parameter's `requires_grad` and the model's train/eval mode are
  restored too.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

PEFT_CONFIG_NAME = "adapter_config.json"
PEFT_WEIGHTS_NAME = "adapter_model.safetensors"


@dataclass
class LoraWeights:
    """A LoRA for the base model: `config` (peft `LoraConfig`) and `state` (PEFT's saved naming)."""

    config: Any
    state: dict[str, torch.Tensor]

    def __post_init__(self) -> None:
        from peft import LoraConfig

        if not isinstance(self.config, LoraConfig):
            raise ValueError(
                f"lora config must be a peft.LoraConfig, got {type(self.config).__name__}"
            )
        if not isinstance(self.state, dict) or not self.state:
            raise ValueError("lora state must be a non-empty dict of tensors")
        for k, t in self.state.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"lora state[{k!r}] must be a tensor, got {type(t).__name__}")
            if t.is_floating_point() and not torch.isfinite(t).all():
                raise ValueError(f"lora tensor {k} holds non-finite values (NaN or inf)")

    @classmethod
    def from_peft(cls, peft_model: nn.Module, adapter_name: str = "default") -> LoraWeights:
        """The LoRA `adapter_name` of a `peft.PeftModel` (as its `save_pretrained` writes it)."""
        import copy

        from peft import PeftModel, get_peft_model_state_dict

        if not isinstance(peft_model, PeftModel):
            raise ValueError(
                f"lora={type(peft_model).__name__} must be a peft.PeftModel, a LoraWeights "
                "or a PEFT folder"
            )
        if adapter_name not in peft_model.peft_config:
            raise ValueError(
                f"adapter_name={adapter_name!r}; the model has {sorted(peft_model.peft_config)}"
            )
        config = copy.deepcopy(peft_model.peft_config[adapter_name])
        config.inference_mode = True
        state = get_peft_model_state_dict(peft_model, adapter_name=adapter_name)
        return cls(config, {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()})

    @classmethod
    def from_folder(cls, folder: str | Path) -> LoraWeights:
        """Read a PEFT LoRA folder; errors name the file."""
        from peft import LoraConfig
        from safetensors.torch import load_file

        folder = Path(folder)
        cfg_path, w_path = folder / PEFT_CONFIG_NAME, folder / PEFT_WEIGHTS_NAME
        for p in (cfg_path, w_path):
            if not p.is_file():
                raise FileNotFoundError(f"{folder} is not a PEFT LoRA folder: missing {p.name}")
        try:
            d = json.loads(cfg_path.read_text(encoding="utf-8"))
            if d.get("peft_type") != "LORA":
                raise ValueError(f"peft_type={d.get('peft_type')!r}, expected 'LORA'")
            config = LoraConfig.from_pretrained(str(folder))
        except Exception as e:
            raise ValueError(f"invalid {cfg_path}: {type(e).__name__}: {e}") from e
        try:
            state = load_file(str(w_path))
        except Exception as e:  # SafetensorError, OSError: a truncated or garbled file
            raise ValueError(
                f"{w_path} is not a readable safetensors file ({type(e).__name__}: {e})"
            ) from e
        try:
            return cls(config, state)
        except ValueError as e:
            raise ValueError(f"{w_path}: {e}") from e

    def save(self, folder: str | Path) -> Path:
        """Write the PEFT folder (config + weights, deterministic bytes) into `folder`."""
        from sparsekv.scoring.files import safetensors_bytes

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(str(folder))
        (folder / PEFT_WEIGHTS_NAME).write_bytes(safetensors_bytes(dict(self.state)))
        return folder

    def num_parameters(self) -> int:
        return sum(t.numel() for t in self.state.values())


def as_lora(lora: Any) -> LoraWeights | None:
    """`lora` (None, a `LoraWeights`, a `peft.PeftModel` or a PEFT folder path) as `LoraWeights`."""
    if lora is None or isinstance(lora, LoraWeights):
        return lora
    if isinstance(lora, (str, Path)):
        return LoraWeights.from_folder(lora)
    return LoraWeights.from_peft(lora)


@contextmanager
def quiet_peft() -> Iterator[None]:
    """peft (0.21) calls transformers' deprecated `is_gradient_checkpointing` when it wraps a
    model; the FutureWarning is peft's to fix, not the caller's, so it is silenced here."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
        )
        yield


def unload_lora(
    peft_model: nn.Module, model: nn.Module, grads: dict[str, bool], training: bool
) -> None:
    """Take a LoRA out of `model` again (no merge): unload the `peft_model` wrapper, drop the
    attributes peft set on the model, and restore each parameter's `requires_grad` (`grads`, by
    name) and the train/eval mode (`training`) recorded before the LoRA went in."""
    peft_model.unload()
    for attr in ("peft_config", "_hf_peft_config_loaded"):
        if attr in vars(model) and not hasattr(type(model), attr):
            delattr(model, attr)
    for name, p in model.named_parameters():
        p.requires_grad_(grads.get(name, p.requires_grad))
    model.train(training)


@contextmanager
def apply_lora(model: nn.Module, lora: LoraWeights) -> Iterator[nn.Module]:
    """Inject `lora` into `model` for the `with` block (yields the `PeftModel` wrapper; `model`
    itself runs with the LoRA too); unload it on exit, also after an error."""
    import copy

    from peft import PeftModel, set_peft_model_state_dict

    grads = {name: p.requires_grad for name, p in model.named_parameters()}
    training = model.training
    with quiet_peft():
        peft_model = PeftModel(model, copy.deepcopy(lora.config))
    try:
        result = set_peft_model_state_dict(peft_model, lora.state)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise ValueError(f"the LoRA does not fit this model: unexpected keys {unexpected[:5]}")
        peft_model.eval()
        yield peft_model
    finally:
        unload_lora(peft_model, model, grads, training)


def check_lora_folder(folder: Path, lora: LoraWeights) -> None:
    """Refuse an adapter's LoRA whose weights are not those `save_pretrained` wrote: a header
    without the tensors' digest or with another one (edited, truncated to fewer tensors), or a
    low-rank factor without its partner (PEFT would leave the missing one at its random
    initialization)."""
    from safetensors import safe_open

    from sparsekv.scoring.files import DIGEST_KEY, tensors_digest

    path = folder / "adapter_model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        recorded = (f.metadata() or {}).get(DIGEST_KEY)
    if recorded is None:
        raise ValueError(
            f"{path} has no {DIGEST_KEY} in its header, which an adapter's LoRA records: its "
            "weights cannot be checked; save the adapter again with save_pretrained(..., lora=)"
        )
    if recorded != tensors_digest(lora.state):
        raise ValueError(
            f"{path} is damaged: its tensors do not match the digest recorded in its header"
        )
    pairs = (".lora_A.", ".lora_B."), (".lora_embedding_A.", ".lora_embedding_B.")
    for name in sorted(lora.state):
        for a, b in pairs:
            for mine, other in ((a, b), (b, a)):
                if mine in name and name.replace(mine, other) not in lora.state:
                    raise ValueError(
                        f"{path}: {name} has no {name.replace(mine, other)}; a LoRA needs both "
                        "low-rank factors of every module it adapts"
                    )
