"""Grouped-query decode attention on the KV heads (`sparsekv.cache.attention.packed_decode_sdpa`).

Compiled, transformers' sdpa repeats every key and value `groups` times for a masked decode step
(measured on the H200: a 6.6 GiB allocation per layer at batch 84, 32K tokens, 0.3 budget); the
packed call reads them once. These tests pin that it computes the same attention, that it steps
aside where it does not apply, and that a decode step through `sparsekv_sdpa` never repeats the
keys even when transformers believes it is being compiled."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from transformers import StaticCache

from sparsekv import EvictionConfig, SparseKVCache
from sparsekv.cache import attention as attn
from sparsekv.cache.attention import packed_decode_sdpa


def _reference(query, key, value, mask, scaling):
    """Plain masked softmax attention with the keys repeated per query head (GQA order)."""
    g = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(g, dim=1)
    v = value.repeat_interleave(g, dim=1)
    logits = torch.einsum("bhqd,bhkd->bhqk", query, k) * scaling
    if mask.shape[1] == key.shape[1]:
        mask = mask.repeat_interleave(g, dim=1)
    logits = logits.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", logits.softmax(-1), v).transpose(1, 2)


@pytest.mark.parametrize("mask_heads", ["shared", "kv", "query"])
def test_packed_decode_equals_repeated_keys(mask_heads):
    g = torch.Generator().manual_seed(0)
    b, hk, groups, k, d = 3, 2, 4, 37, 8
    hq = hk * groups
    query = torch.randn(b, hq, 1, d, generator=g, dtype=torch.float64)
    key = torch.randn(b, hk, k, d, generator=g, dtype=torch.float64)
    value = torch.randn(b, hk, k, d, generator=g, dtype=torch.float64)
    heads = {"shared": 1, "kv": hk, "query": hq}[mask_heads]
    mask = torch.rand(b, heads, 1, k, generator=g) > 0.4
    mask[..., 0] = True  # every row attends somewhere
    out, weights = packed_decode_sdpa(query, key, value, mask, scaling=0.3)
    assert weights is None and out.shape == (b, 1, hq, d)
    assert torch.allclose(out, _reference(query, key, value, mask, 0.3), atol=1e-12)


def test_packed_decode_steps_aside_where_it_does_not_apply():
    q1 = torch.randn(1, 4, 1, 8)
    q3 = torch.randn(1, 4, 3, 8)
    kv = torch.randn(1, 2, 5, 8)
    mask = torch.ones(1, 1, 1, 5, dtype=torch.bool)
    assert (
        packed_decode_sdpa(q3, kv, kv, torch.ones(1, 1, 3, 5, dtype=torch.bool)) is None
    )  # prefill
    assert packed_decode_sdpa(q1, kv, kv, None) is None  # no mask: transformers' enable_gqa path
    assert packed_decode_sdpa(q1, kv, kv, mask.float()) is None  # additive masks: not this path
    assert (
        packed_decode_sdpa(q1, torch.randn(1, 4, 5, 8), torch.randn(1, 4, 5, 8), mask) is None
    )  # MHA
    assert packed_decode_sdpa(q1, kv, kv, mask, softcap=30.0) is None
    assert packed_decode_sdpa(q1, kv, kv, mask, dropout=0.1) is None
    assert packed_decode_sdpa(q1, kv, kv, mask) is not None


def _as_if_compiled(monkeypatch):
    """Make transformers' sdpa take its compiled branch, and fail if it repeats a key."""
    import transformers.integrations.sdpa_attention as sdpa

    def refuse(hidden, n_rep):
        if n_rep > 1:
            raise AssertionError("repeat_kv called on a decode step")
        return hidden

    monkeypatch.setattr(sdpa, "is_torchdynamo_compiling", lambda: True)
    monkeypatch.setattr(sdpa, "repeat_kv", refuse)


@pytest.mark.parametrize("layout", ["dynamic", "static"])
def test_decode_steps_read_each_kv_head_once_when_compiled(monkeypatch, layout):
    """SparseKVCache decode steps (evicting layers and the others) with transformers in its
    compiled branch: no key is repeated and the logits are the eager ones."""
    model = tiny_model("llama").to(torch.float64)
    ids = torch.randint(3, 120, (2, 48), generator=torch.Generator().manual_seed(1))
    cfg = EvictionConfig(
        budget=0.4,
        recent_window=4,
        sink_tokens=2,
        rerank_every=3,
        layout=layout,
        max_length=64,
        prefill_chunk=8,
    )

    def run(as_if_compiled: bool):
        cache = SparseKVCache(model, cfg, "snapkv")
        with torch.no_grad(), monkeypatch.context() as patch:
            tok = model(input_ids=ids, cache=cache).logits[:, -1:].argmax(-1)  # prefill: may repeat
            if as_if_compiled:
                _as_if_compiled(patch)
            out = []
            for i in range(6):
                pos = torch.full((2, 1), 48 + i)
                logits = model(input_ids=tok, position_ids=pos, cache=cache).logits[:, -1]
                out.append(logits)
                tok = logits.argmax(-1, keepdim=True)
        cache.close()
        return torch.stack(out)

    assert torch.allclose(run(True), run(False), atol=1e-10)


def test_static_cache_baseline_through_sparsekv_sdpa_reads_each_kv_head_once(monkeypatch):
    """transformers' StaticCache (no evicting layer) under `sparsekv_sdpa`: the standard mask,
    the packed call, the logits of plain sdpa."""
    model = tiny_model("llama").to(torch.float64)
    ids = torch.randint(3, 120, (2, 20), generator=torch.Generator().manual_seed(2))

    def run():
        cache = StaticCache(config=model.config, max_cache_len=32)
        with torch.no_grad():
            model(input_ids=ids, cache=cache)
            pos = torch.full((2, 1), 20)
            return model(input_ids=ids[:, -1:], position_ids=pos, cache=cache).logits

    plain = run()
    model.set_attn_implementation(attn.register("sdpa"))
    _as_if_compiled(monkeypatch)
    assert torch.allclose(run(), plain, atol=1e-10)
