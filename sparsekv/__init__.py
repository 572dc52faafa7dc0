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

if TYPE_CHECKING:  # pragma: no cover  (re-exports: `X as X` marks each as public)
    from sparsekv import policies as policies
    from sparsekv.cache import SparseKVCache as SparseKVCache
    from sparsekv.config import EvictionConfig as EvictionConfig
    from sparsekv.models.default import default_model_path as default_model_path
    from sparsekv.models.default import load_default_model as load_default_model
    from sparsekv.models.families import model_shape as model_shape
    from sparsekv.scoring.adapter import ScorerAdapter as ScorerAdapter
    from sparsekv.serving.compressed import CompressedContext as CompressedContext
    from sparsekv.serving.compressed import TextContext as TextContext
    from sparsekv.serving.compressed import compress as compress
    from sparsekv.serving.compressed import compress_text as compress_text


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod = import_module(_LAZY[name])
        return mod if name == "policies" else getattr(mod, name)
    raise AttributeError(f"module 'sparsekv' has no attribute {name!r}")
