"""The state of a `SparseKVCache` between two steps, as named tensors plus JSON, and a new cache
restored from it: what `sparsekv.compress` (sparsekv/serving/compressed.py) copies for every question
and writes to disk.

`snapshot(cache)` -> (tensors, meta). Per cache layer `i`, budgeted (`EvictingLayer`):
`layers.i.keys` / `layers.i.values` `(batch, kv_heads, kept, head_dim)` (int8 with
`layers.i.key_scale` / `layers.i.value_scale` `(batch, kv_heads, kept, 1)` under
`quantize="int8"`), `layers.i.positions`, `layers.i.scores`, `layers.i.observed`
`(batch, kv_heads, kept)`, and in `meta["layers"][i]` the counters `seen`, `decode_steps`,
`evicted`, `has_padding`; other layers (transformers' own, sliding windows): keys and values,
and `cumulative_length` when they have one. `first_valid` `(batch,)` when the cache saw padding.

`restore(cache, tensors, meta, dtype)` fills a new, empty cache (built by the caller on the same
model) with copies of those tensors (never sharing them), so the copy may evict and grow freely.
`model_fingerprint(model)` tells two models of the same shape apart (a saved cache's keys and
values belong to one). It reads the cache's layers; what they keep and why stays in
`sparsekv.cache`.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import torch

from sparsekv.cache.layer import _PER_ENTRY, EvictingLayer
from sparsekv.models.families import attention_modules, model_shape

if TYPE_CHECKING:  # the container imports this module (copy.deepcopy of a cache)
    from sparsekv.cache.container import SparseKVCache

__all__ = ["model_dtype", "model_fingerprint", "restore", "snapshot"]

_EVICTING_COUNTERS = ("seen", "decode_steps", "evicted", "has_padding")


def model_fingerprint(model) -> str:
    """sha256 of the first budgeted layer's key and value projections (float32 bytes): tells two
    models of the same shape apart, which a saved cache's keys and values belong to one of."""
    shape = model_shape(model)
    attn = attention_modules(model)[shape.full_layers[0]]
    h = hashlib.sha256(b"sparsekv-model-fingerprint/1\n")
    for proj in (attn.k_proj, attn.v_proj):
        w = proj.weight.detach().float().cpu().contiguous()
        h.update(w.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def model_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def _layer_kind(layer: Any) -> str:
    return "evicting" if isinstance(layer, EvictingLayer) else type(layer).__name__


def snapshot(cache: SparseKVCache) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The state of every layer of `cache` between two steps: (tensors by name, JSON metadata).

    The tensors are the cache's own (not copies). Raises if the cache is mid-step or holds
    recorded statistics (a `record=` cache is for `fork`, not for this)."""
    tensors: dict[str, torch.Tensor] = {}
    layers: list[dict[str, Any]] = []
    for i, layer in enumerate(cache.layers):
        kind = _layer_kind(layer)
        if not getattr(layer, "is_initialized", False) or layer.keys is None:
            layers.append({"kind": kind, "empty": True})
            continue
        if isinstance(layer, EvictingLayer):
            if (
                layer.num_new
                or getattr(layer, "pending", 0)
                or layer._live is not None
                or layer.recorded
            ):
                raise ValueError(
                    f"layer {i} is mid-step or recorded statistics: nothing to snapshot yet"
                )
            for name in _PER_ENTRY:
                t = getattr(layer, name)
                if t is not None:
                    tensors[f"layers.{i}.{name}"] = t
            meta = {k: getattr(layer, k) for k in _EVICTING_COUNTERS}
            meta["kept"] = int(layer.keys.shape[-2])
        else:
            tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"] = layer.keys, layer.values
            meta = {"kept": int(layer.keys.shape[-2])}
            if hasattr(layer, "cumulative_length"):
                meta["cumulative_length"] = int(layer.cumulative_length)
        layers.append({"kind": kind, "empty": False, **meta})
    if cache.shared.first_valid is not None:
        tensors["first_valid"] = cache.shared.first_valid
    return tensors, {"layers": layers}


def restore(
    cache: SparseKVCache,
    tensors: dict[str, torch.Tensor],
    meta: dict[str, Any],
    dtype: torch.dtype,
) -> SparseKVCache:
    """`cache` (new and empty, built on the model the snapshot came from) filled with copies of a
    `snapshot`'s state (the snapshot is never shared with it, so the cache may evict and grow
    freely); returns it."""
    model = cache.model
    if len(meta["layers"]) != len(cache.layers):
        raise ValueError(
            f"the context has {len(meta['layers'])} cache layers but the model has "
            f"{len(cache.layers)}"
        )
    device = next(model.parameters()).device
    for i, (layer, m) in enumerate(zip(cache.layers, meta["layers"])):
        if m["kind"] != _layer_kind(layer):
            raise ValueError(
                f"cache layer {i}: the context holds a {m['kind']} layer, the model a "
                f"{_layer_kind(layer)} one"
            )
        if m["empty"]:
            continue
        keys = tensors[f"layers.{i}.keys"]
        b, h, _, d = keys.shape
        # Initializes device and dtype bookkeeping as the layer's first update would.
        layer.lazy_initialization(
            torch.empty(b, h, 0, d, dtype=dtype, device=device),
            torch.empty(b, h, 0, d, dtype=dtype, device=device),
        )
        names = _PER_ENTRY if isinstance(layer, EvictingLayer) else ("keys", "values")
        for name in names:
            t = tensors.get(f"layers.{i}.{name}")
            if t is not None:
                setattr(layer, name, t.to(device, copy=True))
        if isinstance(layer, EvictingLayer):
            for k in _EVICTING_COUNTERS:
                setattr(layer, k, type(getattr(layer, k))(m[k]))
        elif "cumulative_length" in m:
            layer.cumulative_length = m["cumulative_length"]
    if "first_valid" in tensors:
        cache.shared.first_valid = tensors["first_valid"].to(device, copy=True)
    cache.reset_peak()
    return cache
