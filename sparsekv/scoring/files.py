"""The scorer adapter's on-disk format: file names, versions, the config record, and reading and
writing an adapter folder safely. `sparsekv.scoring.adapter` builds on it; this module knows nothing of
models, caches or policies.

Format 2 (written by this version), a folder of:

- `config.json`: `{"sparsekv_type": "scorer_adapter", "format_version": 2, ...}` then the
  `AdapterConfig` fields: the base model's id and shape (model type, layers, KV heads, head dim,
  hidden size), the budgeted layers the head scores, the head's kind and width, `target` (the
  teacher target, `sparsekv.teacher.statistics.TargetConfig.to_dict()`), `uses` (the learned policy's
  settings per use, see below), `lora` (the name of the LoRA subfolder, or null), the sparsekv
  version, and optionally the training config, an evaluation table (Markdown) and evaluation
  results (`huggingface_hub.EvalResult` fields, for the model card's metadata);
- `model.safetensors`: the `GatingHead` state dict (float32; keys `heads.<layer>.<i>.*`); its
  metadata holds `format: pt` and `sparsekv_tensors_sha256`, a digest of the tensors that the
  loader checks, so bytes garbled inside the data are caught. The header's keys are written in
  sorted order, so two saves of the same weights are byte-identical;
- `README.md`: the model card (`sparsekv.scoring.card`);
- optionally `lora/`: a standard PEFT folder (`adapter_config.json` + `adapter_model.safetensors`)
  that `peft.PeftModel.from_pretrained(base_model, "<folder>/lora")` loads on its own.

`config.json`'s fields and their checks are `sparsekv.scoring.adapter_config`'s.

Format 1 (`adapter_config.json` + `adapter_model.safetensors`, the settings as top-level
fields, no type tag) still loads; it gets the default "agnostic" use. Loading checks, in order:
the config (names the file and the field), the safetensors header against the config's shapes
before any tensor is read (a config with huge dimensions allocates nothing), the tensors'
digest, then that every weight is finite (names the tensor). Every error names the file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from sparsekv.scoring.adapter_config import AdapterConfig
from sparsekv.scoring.head import GatingHead

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CARD_NAME = "README.md"
ADAPTER_FILES = (WEIGHTS_NAME, CONFIG_NAME, CARD_NAME)
"""The files of a format-2 folder without a LoRA subfolder."""
LEGACY_CONFIG_NAME = "adapter_config.json"
LEGACY_WEIGHTS_NAME = "adapter_model.safetensors"
DIGEST_KEY = "sparsekv_tensors_sha256"



def hash_tensors(h: Any, state: dict[str, torch.Tensor]) -> Any:
    """Feed every tensor of `state` (name, dtype, shape, raw bytes; sorted by name) into the
    hashlib object `h`; returns it. Shared by the file digest and `ScorerAdapter.fingerprint`."""
    for name, t in sorted(state.items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h


def tensors_digest(state: dict[str, torch.Tensor]) -> str:
    return hash_tensors(hashlib.sha256(), state).hexdigest()



# ---- reading a folder ---------------------------------------------------------------------------
def folder_files(folder: Path) -> tuple[Path, Path, int]:
    """(config path, weights path, format version by file names) of an adapter folder."""
    if (folder / CONFIG_NAME).is_file() or (folder / WEIGHTS_NAME).is_file():
        names, version = (CONFIG_NAME, WEIGHTS_NAME), 2
    elif (folder / LEGACY_CONFIG_NAME).is_file() or (folder / LEGACY_WEIGHTS_NAME).is_file():
        names, version = (LEGACY_CONFIG_NAME, LEGACY_WEIGHTS_NAME), 1
    else:
        raise FileNotFoundError(
            f"{folder} is not a sparsekv adapter folder: missing {WEIGHTS_NAME}, {CONFIG_NAME} "
            f"(format 2) or {LEGACY_WEIGHTS_NAME}, {LEGACY_CONFIG_NAME} (format 1)"
        )
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{folder} is not a complete sparsekv adapter folder: missing {', '.join(missing)}"
        )
    return folder / names[0], folder / names[1], version


def read_config(path: Path, version: int) -> AdapterConfig:
    """The `AdapterConfig` in `path`; errors name the file."""
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not readable JSON: {e}") from e
    if version == 1 and isinstance(d, dict) and d.get("format_version", 1) != 1:
        raise ValueError(
            f"{path}: a format-1 file name with format_version={d.get('format_version')!r}"
        )
    try:
        return AdapterConfig.from_dict(d)
    except (ValueError, TypeError) as e:
        raise ValueError(f"invalid {path}: {e}") from e


def head_for(config: AdapterConfig) -> GatingHead:
    """A fresh `GatingHead` of the shape `config` records (on torch's current default device)."""
    return GatingHead(
        config.hidden_size,
        config.num_kv_heads,
        config.layers,
        kind=config.kind,
        hidden=config.hidden,
        members=config.ensemble,
    )


def expected_shapes(config: AdapterConfig) -> dict[str, tuple[int, ...]]:
    """The head's state-dict shapes for `config`, built on the meta device (allocates nothing)."""
    try:
        with torch.device("meta"):
            head = head_for(config)
    except RuntimeError as e:  # sizes whose element count overflows
        raise ValueError(f"the config's dimensions are too large for a head ({e})") from e
    return {k: tuple(v.shape) for k, v in head.state_dict().items()}


def read_weights(
    path: Path, config: AdapterConfig, require_digest: bool = False
) -> dict[str, torch.Tensor]:
    """The head's tensors from `path`, checked: the header against `config`'s shapes before any
    tensor is read, the recorded digest (format 2; `require_digest`: a header without one is
    refused, since every format-2 writer records it), then finiteness. Errors name the file."""
    from safetensors import safe_open

    try:
        want = expected_shapes(config)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            have = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
            if have != want:
                missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
                wrong = sorted(k for k in set(want) & set(have) if want[k] != have[k])
                detail = "; ".join(
                    s
                    for s in (
                        f"missing {missing}" if missing else "",
                        f"unexpected {extra}" if extra else "",
                        ", ".join(
                            f"{k} is {list(have[k])}, the config needs {list(want[k])}"
                            for k in wrong
                        ),
                    )
                    if s
                )
                raise ValueError(f"{path} does not match its config ({detail})")
            state = {k: f.get_tensor(k) for k in sorted(have)}
    except ValueError:
        raise
    except Exception as e:  # SafetensorError, OSError: a truncated or garbled file
        raise ValueError(
            f"{path} is not a readable safetensors file ({type(e).__name__}: {e})"
        ) from e
    recorded = meta.get(DIGEST_KEY)
    if recorded is None and require_digest:
        raise ValueError(
            f"{path} has no {DIGEST_KEY} in its header, which every format-2 adapter records: "
            "its weights cannot be checked (edited or re-saved by another tool); save the "
            "adapter again with save_pretrained"
        )
    if recorded is not None and recorded != tensors_digest(state):
        raise ValueError(
            f"{path} is damaged: its tensors do not match the digest recorded in its header"
        )
    for k, t in state.items():
        if not t.is_floating_point():
            raise ValueError(
                f"{path}: tensor {k} has dtype {t.dtype}; the head's weights are floating point"
            )
        if not torch.isfinite(t).all():
            raise ValueError(f"{path}: tensor {k} holds non-finite values (NaN or inf)")
    return state


# ---- writing a folder ---------------------------------------------------------------------------
def safetensors_bytes(state: dict[str, torch.Tensor]) -> bytes:
    """`state` serialized as safetensors with the header's keys sorted (the library writes its
    metadata map in a random order), so the same weights always give the same bytes."""
    from safetensors.torch import save

    raw = save(state, metadata={"format": "pt", DIGEST_KEY: tensors_digest(state)})
    n = int.from_bytes(raw[:8], "little")
    header = json.dumps(json.loads(raw[8 : 8 + n]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the data stays 8-byte aligned, as the library pads it
    return len(header).to_bytes(8, "little") + header + raw[8 + n :]


def adapter_files(
    config: AdapterConfig, state: dict[str, torch.Tensor], card: str
) -> dict[str, bytes]:
    """The three format-2 files, by name, in the order `write_folder` replaces them (the weights
    first, the config that describes them last)."""
    return {
        WEIGHTS_NAME: safetensors_bytes(state),
        CARD_NAME: card.encode("utf-8"),
        CONFIG_NAME: (json.dumps(config.to_dict(), indent=2) + "\n").encode("utf-8"),
    }
