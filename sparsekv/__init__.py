"""sparsekv: teach a frozen Hugging Face causal LM which KV-cache entries it can forget."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Heavy submodules are imported on first use so that `import sparsekv` stays fast.
_LAZY = {
    "load_default_model": "sparsekv.default_model",
    "default_model_path": "sparsekv.default_model",
    "EvictionConfig": "sparsekv.config",
    "SparseKVCache": "sparsekv.cache",
    "ScorerAdapter": "sparsekv.adapter",
    "policies": "sparsekv.policies",
    "model_shape": "sparsekv.families",
    "compress": "sparsekv.compressed",
    "compress_text": "sparsekv.compressed",
    "CompressedContext": "sparsekv.compressed",
}

__all__ = list(_LAZY) + ["__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from sparsekv import policies
    from sparsekv.adapter import ScorerAdapter
    from sparsekv.cache import SparseKVCache
    from sparsekv.compressed import CompressedContext, compress, compress_text
    from sparsekv.config import EvictionConfig
    from sparsekv.default_model import default_model_path, load_default_model
    from sparsekv.families import model_shape


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod = import_module(_LAZY[name])
        return mod if name == "policies" else getattr(mod, name)
    raise AttributeError(f"module 'sparsekv' has no attribute {name!r}")
