"""A masked full-attention reference for cache tests.

`run_sparse` feeds a sequence through a `SparseKVCache` in steps and records, after every step,
the absolute positions each budgeted layer keeps per head. `masked_reference` recomputes the
whole sequence in one eager forward in which every query sees exactly what the sparse cache let
it see: the entries kept after the previous step, plus the causal part of its own step.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from sparsekv.cache.attention import expand_heads
from sparsekv.models.families import eager_attention_function

_MASKS: dict[int, torch.Tensor] = {}
NAME = "sparsekv_test_reference"


def _ref_attention(module, query, key, value, attention_mask, **kwargs):
    m = _MASKS.get(module.layer_idx)
    if m is not None:
        groups = query.shape[1] // key.shape[1]
        m = expand_heads(m, groups)
        attention_mask = torch.zeros(m.shape, dtype=query.dtype).masked_fill(~m, torch.finfo(query.dtype).min)
    return eager_attention_function(module)(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(NAME, _ref_attention)
AttentionMaskInterface.register(NAME, eager_mask)


def run_sparse(model, cache, ids, steps, attention_mask=None):
    """Feed `ids` (batch, n) through `cache` in steps of the given sizes; return the last
    logits of every step and, per budgeted layer, the kept positions after every step."""
    logits, snaps, s = [], [], 0
    for q in steps:
        e = s + q
        out = model(
            input_ids=ids[:, s:e],
            attention_mask=None if attention_mask is None else attention_mask[:, :e],
            cache=cache,
            use_cache=True,
        )
        logits.append(out.logits)
        snaps.append({i: cache.layers[i].positions.clone() for i in cache.budgeted_layers})
        s = e
    return logits, snaps


def masked_reference(model, ids, steps, snaps, layers, attention_mask=None):
    """Logits `(batch, n, vocab)` of one eager forward where each query sees what it saw."""
    b, n = ids.shape
    heads = model.config.num_key_value_heads
    _MASKS.clear()
    for layer in layers:
        m = torch.zeros(b, heads, n, n, dtype=torch.bool)
        s = 0
        for j, q in enumerate(steps):
            e = s + q
            if j > 0:
                kept = snaps[j - 1][layer]  # (b, h, k) absolute positions, -1 = padding
                for bi in range(b):
                    for h in range(heads):
                        p = kept[bi, h]
                        p = p[p >= 0]
                        m[bi, h, s:e, p] = True
            causal = torch.ones(q, q, dtype=torch.bool).tril()
            m[:, :, s:e, s:e] = causal
            if attention_mask is not None:
                m[:, :, s:e, :] &= attention_mask[:, None, None, :n].bool()
                m[:, :, s:e, s:e] |= torch.eye(q, dtype=torch.bool)  # padded rows stay finite
            s = e
        _MASKS[layer] = m
    previous = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    try:
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=attention_mask, use_cache=False).logits
    finally:
        model.set_attn_implementation(previous)
        _MASKS.clear()


def run_prefill_chunked(model, cache, ids, decode=0, attention_mask=None):
    """Feed the first `n - decode` tokens of `ids` in ONE call, which the cache (built with
    `prefill_chunk=`) splits into chunks itself, then `decode` single tokens. Returns the last
    logits of every forward the model ran (inner chunks included), the kept positions after
    each, and the step sizes, in the form `masked_reference` takes."""
    logits, snaps, steps = [], [], []
    done = [0]

    def after_forward(module, args, kwargs, out):
        ids_in = kwargs.get("input_ids", args[0] if args else None)
        steps.append(ids_in.shape[1])
        logits.append(out.logits[:, -1:])
        snaps.append({i: cache.layers[i].positions.clone() for i in cache.budgeted_layers})
        done[0] += ids_in.shape[1]

    hook = model.register_forward_hook(after_forward, with_kwargs=True)
    try:
        n = ids.shape[1] - decode
        with torch.no_grad():
            model(input_ids=ids[:, :n], cache=cache, use_cache=True,
                  attention_mask=None if attention_mask is None else attention_mask[:, :n])
            for e in range(n + 1, ids.shape[1] + 1):
                model(input_ids=ids[:, e - 1 : e], cache=cache, use_cache=True,
                      attention_mask=None if attention_mask is None else attention_mask[:, :e])
    finally:
        hook.remove()
    assert done[0] == ids.shape[1] and sum(steps) == ids.shape[1]
    return logits, snaps, steps
