"""sparsekv: teach a frozen Hugging Face causal LM which KV-cache entries it can forget."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from sparsekv._version import __version__

# Heavy submodules are imported on first use so that `import sparsekv` stays fast.
_LAZY = {
    "load_default_model": "sparsekv.models.default",
    "default_model_path": "sparsekv.models.default",
    "EvictionConfig": "sparsekv.config",
    "SparseKVCache": "sparsekv.cache",
    "ScorerAdapter": "sparsekv.scoring.adapter",
    "policies": "sparsekv.policies",
    "model_shape": "sparsekv.models.families",
    "compress": "sparsekv.serving.compressed",
    "compress_text": "sparsekv.serving.compressed",
    "CompressedContext": "sparsekv.serving.compressed",
    "TextContext": "sparsekv.serving.compressed",
}

__all__ = list(_LAZY) + ["__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from sparsekv import policies
    from sparsekv.cache import SparseKVCache
    from sparsekv.config import EvictionConfig
    from sparsekv.models.default import default_model_path, load_default_model
    from sparsekv.models.families import model_shape
    from sparsekv.scoring.adapter import ScorerAdapter
    from sparsekv.serving.compressed import (
        CompressedContext,
        TextContext,
        compress,
        compress_text,
    )


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod = import_module(_LAZY[name])
        return mod if name == "policies" else getattr(mod, name)
    raise AttributeError(f"module 'sparsekv' has no attribute {name!r}")
