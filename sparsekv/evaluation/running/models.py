"""Which model the harness evaluates, with the codec its tasks tokenize through: a thin wrapper
over the shared loader (`sparsekv.models.loading`).

Model specs: "default" (gemma-3-270m, offline), "tiny:<family>" (a 4-layer random model from
`sparsekv.models.tiny`, read through the ASCII codec: no download), a local Hugging Face model
folder, or a Hub model id (as `train.py` and `ScorerAdapter.from_pretrained` take: the rows record
the id in the grid's config.yaml).
"""

from __future__ import annotations

from typing import Any

from sparsekv.evaluation.tasks.codec import AsciiCodec, Codec, HFCodec
from sparsekv.models.loading import eos_ids
from sparsekv.models.loading import load_model as _load
from sparsekv.models.loading import validate_model_spec as _validate
from sparsekv.models.tiny import TINY_FAMILIES, tiny_config  # noqa: F401  (public names of this module)


def validate_model_spec(spec: Any) -> None:
    """Raise ValueError for a spec that can never load (checked before any work starts)."""
    _validate(spec, hub=True)


def load_model(spec: str, dtype: str = "float32", attn_implementation: str = "sdpa", seed: int = 0,
               device: str = "cpu"):
    """Return `(model, codec)` for a model spec; the model is in eval mode without gradients, on
    `device` ("cpu", "cuda", "cuda:<index>"; a CUDA device torch cannot see is refused by the
    shared loader)."""
    loaded = _load(spec, dtype, attn_implementation, seed=seed, device=device, hub=True)
    codec: Codec
    if loaded.is_tiny:
        codec = AsciiCodec(loaded.model.config.vocab_size)
    else:
        codec = HFCodec(loaded.tokenizer, eos_ids(loaded.model), name=loaded.base_model_id)
    return loaded.model, codec
