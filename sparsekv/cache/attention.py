"""Per-layer attention for caches whose layers hold different entries.

transformers builds one attention mask per forward, sized from the first full-attention layer.
After eviction every budgeted layer (and every KV head in it) holds its own entries, so that
mask is wrong for them. sparsekv registers, through transformers' own extension points
(`AttentionInterface` and `AttentionMaskInterface`), an attention implementation named
`sparsekv_<base>` for base in {sdpa, eager}:

- its mask function returns a `MaskRequest` that remembers how the standard mask would be built
  (and the 2-D padding mask), building it only if a layer needs it;
- its attention function asks the `EvictingLayer` that was just updated for this module (see
  `claim_layer`) for a per-layer, per-head mask built from the stored entries' absolute
  positions, runs the base attention with it, then lets the layer observe the step (scores and
  eviction). Layers without an evicting cache layer use the standard mask unchanged, so a model
  switched to `sparsekv_sdpa` behaves exactly like `sdpa` with any other cache.

Registration happens when a `SparseKVCache` is built, not on import.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import sparsekv.cache.int8_attention as int8_attention
from sparsekv.models.families import eager_attention_function, softcap

BASE_IMPLEMENTATIONS = ("sdpa", "eager")
_registered: set[str] = set()
_local = threading.local()


class MaskRequest:
    """What the model asked the mask function for; builds the standard mask on demand."""

    def __init__(self, base: str, kwargs: dict[str, Any]):
        self.base = base
        # offsets as of the forward's start: a static cache passes its length as a device tensor
        # that its first layer's update advances in place, before the mask is built here
        self.kwargs = {
            k: v.clone() if k.endswith("_offset") and isinstance(v, torch.Tensor) else v
            for k, v in kwargs.items()
        }
        self._mask: Any = None
        self._built = False

    @property
    def padding(self) -> torch.Tensor | None:
        """`(batch, tokens_seen)` bool, True for real tokens, or None when nothing is padded."""
        m = self.kwargs.get("attention_mask")
        return m if isinstance(m, torch.Tensor) and m.ndim == 2 else None

    def standard(self):
        if not self._built:
            from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

            self._mask = ALL_MASK_ATTENTION_FUNCTIONS[self.base](**self.kwargs)
            self._built = True
        return self._mask


def implementation_name(base: str) -> str:
    if base not in BASE_IMPLEMENTATIONS:
        raise ValueError(
            f"attn_implementation={base!r} is not supported by sparsekv; allowed values: "
            f"{', '.join(BASE_IMPLEMENTATIONS)}"
        )
    return f"sparsekv_{base}"


def register(base: str) -> str:
    """Register `sparsekv_<base>` with transformers (idempotent) and return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = implementation_name(base)
    if name in _registered:
        return name

    def mask_fn(**kwargs):
        return MaskRequest(base, kwargs)

    def attn_fn(module, query, key, value, attention_mask, **kwargs):
        return _attention(base, module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, attn_fn)
    AttentionMaskInterface.register(name, mask_fn)
    _registered.add(name)
    return name


def announce_layer(layer_idx: int, layer) -> None:
    """Called by an evicting layer's `update`: the next attention call of `layer_idx` is ours."""
    pending = getattr(_local, "pending", None)
    if pending is None:
        pending = _local.pending = {}
    pending[layer_idx] = layer


def claim_layer(layer_idx: int):
    pending = getattr(_local, "pending", None)
    return pending.pop(layer_idx, None) if pending else None


def _base_function(base: str, module: nn.Module) -> Callable:
    if base == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    return eager_attention_function(module)


def entry_mask(
    positions: torch.Tensor | None,
    seen: int,
    q: int,
    stored: int,
    explicit_causal: bool,
    device: torch.device,
) -> torch.Tensor | None:
    """Mask for the last `q` queries of `seen` tokens over a layer's `stored` entries (True =
    attend), or None when none is needed.

    Without padding (`positions` None) every stored entry from earlier steps is visible to every
    new query and the new entries are causal among themselves, so the mask is shared by all
    heads: `(1, 1, q, stored)`; None for a single query, or a first chunk when the attention
    kernel applies causality itself (`explicit_causal=False`, sdpa). With padding it is per head,
    from the entries' absolute `positions` `(batch, kv_heads, stored)` (-1 = padding):
    `(batch, kv_heads, q, stored)`."""
    if positions is None:
        if q == 1 or (q == stored and not explicit_causal):
            return None
        mask = torch.ones(q, stored, dtype=torch.bool, device=device)
        mask[:, stored - q :] = torch.ones(q, q, dtype=torch.bool, device=device).tril()
        return mask[None, None]
    qpos = torch.arange(seen - q, seen, device=device)
    pos = positions[:, :, None, :]
    return (pos <= qpos[None, None, :, None]) & (pos >= 0)


def real_new_entries(
    padding: torch.Tensor | None, seen: int, q: int, check_until: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For the `q` new entries that end at token `seen`: `(real, first_valid)`, `real` `(batch,
    q)` bool (True = real) and `first_valid` `(batch,)` the leading pads per sequence, when the
    step is checked (multi-token, or a single token up to `check_until`) and `padding` `(batch,
    seen)` holds a pad; None otherwise."""
    if padding is None or (q == 1 and seen > check_until):
        return None
    padding = padding.to(device, torch.bool)
    if padding.all():  # the one host sync of a prefill step
        return None
    real = padding[:, seen - q : seen]
    if real.shape[-1] != q:
        raise ValueError(
            f"attention_mask covers {padding.shape[-1]} tokens but the cache has seen {seen}; "
            "pass the mask of all tokens so far (past + new)"
        )
    return real, (padding.long().cumsum(-1) == 0).sum(-1)


def expand_heads(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """`(batch, kv_heads, q, k)` -> `(batch, kv_heads * groups, q, k)` (query-head order of GQA)."""
    if groups == 1:
        return mask
    b, h, q, k = mask.shape
    return mask[:, :, None].expand(b, h, groups, q, k).reshape(b, h * groups, q, k)


def packed_decode_sdpa(query, key, value, mask, **kwargs):
    """Grouped-query attention of one new token per sequence on the KV heads themselves, or None
    when the call is not that case (then transformers' sdpa runs).

    With a mask, transformers' sdpa folds a decode query's heads onto the KV heads only outside
    `torch.compile`; compiled, it repeats every key and value `groups` times per layer and step
    (`repeat_kv`), which for a long cache is the largest allocation and most of the memory traffic
    of the step. Here the query `(batch, heads, 1, dim)` becomes `(batch, kv_heads, groups, dim)`:
    the groups ride in the query-length axis, the mask `(batch or 1, kv_heads or 1, 1, k)` (or
    per query head) broadcasts over them, and the keys are read once. Same arithmetic, any mode."""
    b, hq, q, _ = query.shape
    hk = key.shape[1]
    if (
        q != 1
        or hq == hk
        or not isinstance(mask, torch.Tensor)
        or mask.dtype != torch.bool
        or mask.shape[1] not in (1, hk, hq)
        or kwargs.get("dropout", 0.0)
        or kwargs.get("softcap") is not None
        or kwargs.get("position_bias") is not None
        or kwargs.get("s_aux") is not None
    ):
        return None
    g = hq // hk
    if mask.shape[1] == hq:  # per query head, in GQA order: fold like the query
        mask = mask.reshape(mask.shape[0], hk, g, mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(b, hk, g, query.shape[-1]),
        key,
        value,
        attn_mask=mask,
        scale=kwargs.get("scaling"),
    )
    return out.reshape(b, hq, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def _plain(kwargs) -> bool:
    """No dropout, position bias or attention sinks: what the fused decode paths compute."""
    return not (
        kwargs.get("dropout", 0.0)
        or kwargs.get("position_bias") is not None
        or kwargs.get("s_aux") is not None
    )


def int8_decode(query, operands, kv_mask, module, **kwargs) -> torch.Tensor:
    """Attention of a decode step over a layer's INT8 store, read as int8
    (`sparsekv.cache.int8_attention`); `kv_mask` `(batch or 1, kv_heads or 1, 1, stored)` marks the
    entries to attend, None all of them."""
    kq, ks, vq, vs, new_k, new_v, slot = operands
    if kv_mask is None:
        valid = torch.ones(kq.shape[:3], dtype=torch.bool, device=kq.device)
    else:
        valid = kv_mask[:, :, 0].expand(kq.shape[:3])
    return int8_attention.decode_attention(
        query, kq, ks, vq, vs, valid, new_k, new_v, slot,
        scaling=kwargs.get("scaling") or module.head_dim**-0.5,
        softcap=kwargs.get("softcap"),
    )


def _attention(base, module, query, key, value, attention_mask, **kwargs):
    request = attention_mask if isinstance(attention_mask, MaskRequest) else None
    fn = _base_function(base, module)
    layer = claim_layer(module.layer_idx)
    if layer is None:
        mask = request.standard() if request is not None else attention_mask
        packed = packed_decode_sdpa(query, key, value, mask, **kwargs) if base == "sdpa" else None
        return packed or fn(module, query, key, value, mask, **kwargs)

    groups = query.shape[1] // key.shape[1]
    layer.note_padding(request.padding if request is not None else None)
    # (batch or 1, kv_heads or 1, q, k) bool, or None when the kernel needs none
    kv_mask = layer.attention_mask(query.shape[2], explicit_causal=base == "eager")
    int8 = layer.int8_step()
    packed = None
    if int8 is not None:  # an INT8 decode step: `key`, `value` are the layer's int8 store
        if base == "sdpa" and _plain(kwargs):
            packed = int8_decode(query, int8, kv_mask, module, **kwargs), None
        else:
            key, value = layer.dequantized_step()
    if packed is None and base == "sdpa":
        packed = packed_decode_sdpa(query, key, value, kv_mask, **kwargs)
    if packed is not None:
        out, weights = packed
    else:
        mask = None
        if kv_mask is not None:
            mask = expand_heads(kv_mask, groups) if kv_mask.shape[1] > 1 else kv_mask
            if base == "eager":
                mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                    ~mask, torch.finfo(query.dtype).min
                )
        out, weights = fn(module, query, key, value, mask, **kwargs)
    layer.observe(
        module=module,
        query=query,
        kv_mask=kv_mask,
        scaling=kwargs.get("scaling") or module.head_dim**-0.5,
        softcap=kwargs.get("softcap", softcap(module)),
    )
    return out, weights


KEY_BLOCK = 4096
"""Keys converted to float32 at a time by `received_attention` when its queries are one block."""


def received_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    kv_mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    block_size: int = 256,
    *,
    key_scale: torch.Tensor | None = None,
    last_key: torch.Tensor | None = None,
    key_block: int | None = None,
) -> torch.Tensor:
    """Attention probability each key receives, summed over the given queries and over the query
    heads of its KV group.

    query `(batch, heads, q, dim)`, key `(batch, kv_heads, k, dim)`, kv_mask bool broadcastable
    to `(batch, kv_heads, q, k)` (True = may attend), or None: then the queries are taken to be
    the last `q` entries of the keys, seeing everything before them and causal among themselves.
    Returns `(batch, kv_heads, k)` float32. Queries are processed `block_size` at a time, so the
    peak extra memory is O(block_size x k), never q x k.

    `key_scale` `(batch, kv_heads, k, 1)`: `key` is an INT8 store, read as `key * key_scale`
    (`sparsekv.cache.dequantize`); `last_key` `(batch, kv_heads, 1, dim)`: the last key at full
    precision, replacing the stored one (a decode step's own entry, as attention saw it). The
    float32 keys are made once for all query blocks; when the queries fit in one block (a decode
    step, an observation window), `key_block` (default `KEY_BLOCK`) keys at a time instead, so
    that scoring one query never holds a float32 (or dequantized) copy of the whole layer: at a
    serving batch that copy is the step's largest transient.
    """
    b, hq, q, d = query.shape
    hk, k = key.shape[1], key.shape[2]
    g = hq // hk
    key_block = KEY_BLOCK if key_block is None else key_block
    if key_block < 1:
        raise ValueError(f"key_block={key_block} must be >= 1")

    def floats(start: int, stop: int) -> torch.Tensor:
        """Keys [start, stop) in float32, dequantized, the last one replaced by `last_key`."""
        kb = key[:, :, start:stop]
        if key_scale is not None:
            kb = kb.to(key_scale.dtype) * key_scale[:, :, start:stop]
        if last_key is not None and stop == k:
            kb = torch.cat([kb[:, :, :-1], last_key.to(kb.dtype)], dim=-2)
        return kb.float()

    copies = key.dtype != torch.float32 or key_scale is not None or last_key is not None
    in_blocks = copies and q <= block_size and k > key_block  # one pass over the keys
    kf = None if in_blocks else floats(0, k)
    out = torch.zeros(b, hk, k, dtype=torch.float32, device=query.device)
    for s in range(0, q, block_size):
        qb = query[:, :, s : s + block_size].float().reshape(b, hk, g, -1, d)
        if kf is not None:
            logits = torch.einsum("bhgqd,bhkd->bhgqk", qb, kf)
        else:
            logits = qb.new_empty(b, hk, g, qb.shape[3], k)
            for t in range(0, k, key_block):
                stop = min(t + key_block, k)
                logits[..., t:stop] = torch.einsum("bhgqd,bhkd->bhgqk", qb, floats(t, stop))
        logits = logits * scaling
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        if kv_mask is not None:
            logits = logits.masked_fill(~kv_mask[:, :, None, s : s + block_size], float("-inf"))
        elif q > 1:
            qpos = torch.arange(k - q + s, k - q + s + qb.shape[3], device=query.device)
            future = torch.arange(k, device=query.device)[None, :] > qpos[:, None]
            logits = logits.masked_fill(future, float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
        out += probs.sum(dim=(2, 3))
    return out
