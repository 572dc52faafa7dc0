"""Decode attention that reads the INT8 store (`sparsekv.cache.int8_attention`).

Before it, a static layer's INT8 decode step dequantized every slot of its layer into a copy
twice the size of the store (on the H200: 1.19 GiB per layer at batch 60, 32K tokens, and no
batch above 1 fitted under the 80 GiB cap). These tests pin that both implementations compute
masked softmax attention over the dequantized entries with the step's own entry at full
precision, that a decode step of the static layout allocates nothing the size of a layer's
dequantized keys (also while the learned policy scores it), that scoring a decode step from its
attention (SnapKV) reads the int8 keys a block at a time instead of a dequantized or float32 copy
of the layer, and, through Triton's interpreter on the CPU, that the GPU kernel computes the same
numbers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from sparsekv import EvictionConfig, ScorerAdapter, SparseKVCache, policies
from sparsekv.cache import attention as attn_mod
from sparsekv.cache import dequantize, quantize
from sparsekv.cache import int8 as int8_mod
from sparsekv.cache import layer as cache_mod
from sparsekv.cache.int8_attention import (
    SPLIT_BLOCK,
    decode_attention,
    split_size,
    triton_available,
)

ROOT = Path(__file__).resolve().parents[1]


def _case(b=2, hq=4, hk=2, slots=300, d=16, dtype=torch.float64, seed=0, masked_row=True):
    g = torch.Generator().manual_seed(seed)
    kq, ks = quantize(torch.randn(b, hk, slots, d, generator=g, dtype=dtype))
    vq, vs = quantize(torch.randn(b, hk, slots, d, generator=g, dtype=dtype))
    query = torch.randn(b, hq, 1, d, generator=g, dtype=dtype)
    valid = torch.rand(b, hk, slots, generator=g) > 0.3
    if masked_row:
        valid[0, 0] = False  # only the new entry is visible to this head
    new_k = torch.randn(b, hk, 1, d, generator=g, dtype=dtype)
    new_v = torch.randn(b, hk, 1, d, generator=g, dtype=dtype)
    slot = torch.tensor([slots // 3])
    return query, kq, ks, vq, vs, valid, new_k, new_v, slot


def _reference(query, kq, ks, vq, vs, valid, new_k, new_v, slot, scaling, softcap=None):
    """Dequantize, put the new entry at `slot`, repeat per query head, softmax, in float64."""
    k, v = dequantize(kq, ks).double(), dequantize(vq, vs).double()
    k[:, :, slot], v[:, :, slot] = new_k.double(), new_v.double()
    valid = valid.clone()
    valid[:, :, slot] = True
    g = query.shape[1] // k.shape[1]
    k, v, valid = (t.repeat_interleave(g, dim=1) for t in (k, v, valid))
    logits = torch.einsum("bhqd,bhkd->bhqk", query.double(), k) * scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~valid[:, :, None], float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", logits.softmax(-1), v).transpose(1, 2)


@pytest.mark.parametrize(
    "shape",
    [{}, {"hq": 2, "hk": 2}, {"hq": 8, "hk": 1, "slots": 5}, {"b": 3, "slots": 1000, "d": 32}],
    ids=["gqa2", "mha", "mqa-few-slots", "long"],
)
@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("block", [64, 1024])
def test_torch_kernel_equals_attention_over_the_dequantized_entries(shape, softcap, block):
    args = _case(**shape)
    scaling = args[0].shape[-1] ** -0.5
    out = decode_attention(*args, scaling=scaling, softcap=softcap, kernel="torch", block=block)
    ref = _reference(*args, scaling=scaling, softcap=softcap)
    assert out.shape == ref.shape and out.dtype == args[0].dtype
    assert (out - ref).abs().max() < 1e-12


def test_the_int8_copy_at_the_new_slot_is_not_attended():
    """The step's own entry counts once, at full precision (not also as its int8 copy)."""
    query, kq, ks, vq, vs, valid, new_k, new_v, slot = _case(masked_row=False)
    valid[:] = False  # nothing but the new entry (and, wrongly, its int8 copy) could be read
    valid[:, :, slot] = True
    kq[:, :, slot], vq[:, :, slot] = 100, 100  # a copy that would dominate if attended
    out = decode_attention(query, kq, ks, vq, vs, valid, new_k, new_v, slot, 0.25, kernel="torch")
    g = query.shape[1] // kq.shape[1]
    expected = new_v.repeat_interleave(g, dim=1).transpose(1, 2)
    assert torch.allclose(out, expected, atol=1e-12)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "kernel": "cuda"}, "kernel='cuda' is not supported; allowed values: auto"),
        (lambda a: {**a, "kq": a["kq"].float()}, "keys and values must be int8"),
        (lambda a: {**a, "valid": a["valid"][:, :, :-1]}, "valid has shape"),
        (lambda a: {**a, "new_key": a["new_key"][:, :1]}, "new_key has shape"),
        (lambda a: {**a, "query": a["query"].expand(-1, -1, 2, -1)}, "one new token per sequence"),
    ],
)
def test_bad_operands_fail_with_the_name(change, message):
    names = ("query", "kq", "ks", "vq", "vs", "valid", "new_key", "new_value", "slot")
    args = change(dict(zip(names, _case()), scaling=0.25))
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        decode_attention(**args)


def test_split_sizes_cover_the_slots_in_whole_blocks():
    for slots in (1, 63, 64, 65, 1000, 10_353, 32_768):
        for programs in (1, 8, 344, 4096):
            size = split_size(slots, programs)
            splits = -(-slots // size)
            blocks = size // SPLIT_BLOCK
            assert size % SPLIT_BLOCK == 0 and blocks & (blocks - 1) == 0  # 2^k blocks
            assert (splits - 1) * size < slots <= splits * size
            # at least half the splits wanted (rounding to 2^k blocks may halve them)
            wanted = max(1, min(-(-slots // (4 * SPLIT_BLOCK)), -(-1024 // programs)))
            assert 2 * splits >= wanted, (slots, programs, size)
    # a growing cache meets few split sizes (one compiled kernel each)
    assert len({split_size(n, 16) for n in range(1, 40_000)}) <= 10


# ---- the static layout's decode step --------------------------------------------------------
def _largest_allocation(fn) -> int:
    """Bytes of the largest single allocation an op makes while `fn` runs (CPU profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(e.cpu_memory_usage for e in prof.events())


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_an_int8_decode_step_allocates_no_copy_of_its_layer(attn_implementation, monkeypatch):
    """The learned policy (which reads no keys) on a static INT8 cache of many slots: a decode
    step, scoring and eviction included, neither calls `dequantize` on a layer nor makes an
    allocation half the size of one layer's dequantized keys. With the eager attention (which
    cannot read int8) the dequantized fallback runs: that is what the measure sees otherwise."""
    model = tiny_model("llama", attn_implementation)
    torch.manual_seed(0)
    policy = ScorerAdapter.for_model(model).policy(blend=0.0)
    cfg = EvictionConfig(budget=0.3, layout="static", max_length=16_384, quantize="int8")
    cache = SparseKVCache(model, cfg, policy)
    ids = torch.randint(3, 128, (2, 40))
    tok = model(input_ids=ids, cache=cache).logits[:, -1:].argmax(-1)
    tok = model(input_ids=tok, cache=cache).logits[:, -1:].argmax(-1)  # first decode step
    layer = cache.layers[cache.budgeted_layers[0]]
    keys = layer._slots.buf["keys"]
    dequantized = keys.numel() * torch.finfo(model.dtype).bits // 8
    calls = []
    real = cache_mod.dequantize

    def counting(q, scale):
        calls.append(q.shape)
        return real(q, scale)

    monkeypatch.setattr(cache_mod, "dequantize", counting)
    monkeypatch.setattr(int8_mod, "dequantize", counting)  # what dequantize_with calls
    monkeypatch.setattr(type(layer), "codec", (quantize, counting))
    pos = torch.tensor([[41], [41]])
    biggest = _largest_allocation(lambda: model(input_ids=tok, position_ids=pos, cache=cache))
    cache.close()
    if attn_implementation == "sdpa":
        assert not calls, calls
        assert biggest < dequantized // 2, (biggest, dequantized)
    else:
        assert calls and biggest >= dequantized, (biggest, dequantized)


def test_int8_static_decoding_matches_the_dynamic_layout_with_a_policy_that_reads_keys():
    """K-norm reads the dequantized keys (with the step's own entry at full precision) while
    scoring a decode step: the static layout builds them on that read and keeps the same set."""
    model = tiny_model("qwen3").double()
    ids = torch.randint(3, 128, (2, 48), generator=torch.Generator().manual_seed(3))
    kept, logits = {}, {}
    for layout in ("dynamic", "static"):
        cfg = EvictionConfig(
            budget=0.3, recent_window=4, sink_tokens=2, rerank_every=5, evict_slack=2,
            prefill_chunk=16, layout=layout, max_length=128, quantize="int8",
        )
        cache = SparseKVCache(model, cfg, policies.get("knorm"))
        out = [model(input_ids=ids, cache=cache).logits[:, -1]]
        tok = out[-1].argmax(-1, keepdim=True)
        for t in range(16):
            pos = torch.full((2, 1), 48 + t)
            out.append(model(input_ids=tok, position_ids=pos, cache=cache).logits[:, -1])
            tok = out[-1].argmax(-1, keepdim=True)
        kept[layout] = [cache.layers[i].positions.clone() for i in cache.budgeted_layers]
        logits[layout] = torch.stack(out)
        cache.close()
    assert all(torch.equal(a, b) for a, b in zip(kept["dynamic"], kept["static"]))
    assert (logits["dynamic"] - logits["static"]).abs().max() < 1e-10


@pytest.mark.parametrize("layout", ["dynamic", "static"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("name", ["snapkv", "learned"])
def test_int8_decoding_reading_int8_equals_the_dequantized_path(layout, padded, name, monkeypatch):
    """The decode attention that reads the int8 store against the computation before it (the
    dequantized copy with the step's own entry at full precision, then sdpa; what an attention
    that cannot read int8 still gets). Same model, float64: the same kept entries and logits
    within 1e-10 at every decode step, evictions and re-ranks included, with and without left
    padding."""
    ids = torch.randint(3, 128, (3, 40), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :7], mask[2, :13] = 0, 0
    model = tiny_model("mistral").double()
    got, reads = {}, []
    real = attn_mod.int8_decode
    monkeypatch.setattr(attn_mod, "int8_decode", lambda *a, **k: reads.append(1) or real(*a, **k))
    for path in ("int8", "dequantized"):
        if path == "dequantized":
            monkeypatch.setattr(attn_mod, "_plain", lambda kwargs: False)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            policy = (ScorerAdapter.for_model(model).policy(blend=0.5, kernel_size=3)
                      if name == "learned" else policies.get(name))
        cfg = EvictionConfig(budget=0.3, recent_window=4, sink_tokens=2, rerank_every=5,
                             evict_slack=2, prefill_chunk=16, layout=layout, max_length=128,
                             quantize="int8")
        cache = SparseKVCache(model, cfg, policy)
        m = mask.clone()
        out = [model(input_ids=ids, attention_mask=m, cache=cache).logits[:, -1]]
        tok = out[-1].argmax(-1, keepdim=True)
        for _ in range(14):
            m = torch.cat([m, torch.ones_like(tok)], 1)
            pos = (m.cumsum(-1) - 1)[:, -1:]
            out.append(model(input_ids=tok, attention_mask=m, position_ids=pos, cache=cache).logits[:, -1])
            tok = out[-1].argmax(-1, keepdim=True)
        got[path] = ([cache.layers[i].positions.clone() for i in cache.budgeted_layers], torch.stack(out))
        cache.close()
        if path == "int8":  # every budgeted layer's every decode step read the int8 store
            assert len(reads) == 14 * len(cache.budgeted_layers)
    (k8, l8), (kd, ld) = got["int8"], got["dequantized"]
    assert all(torch.equal(a, b) for a, b in zip(k8, kd))
    assert (l8 - ld).abs().max() < 1e-10


# ---- scoring a decode step from the attention it paid (SnapKV, H2O, TOVA) --------------------
@pytest.mark.parametrize("q, masked", [(1, True), (6, True), (6, False)], ids=["decode", "window", "causal"])
@pytest.mark.parametrize("stored", ["bf16", "int8", "int8+own"])
def test_received_attention_in_key_blocks_equals_one_float_copy(q, masked, stored):
    """`received_attention` converts keys a block at a time when its queries are one pass (what
    scoring a decode step does), reads an INT8 store through its scales and takes the step's own
    key at full precision: the same probabilities as converting the dequantized layer at once."""
    g = torch.Generator().manual_seed(1)
    b, hq, hk, k, d = 2, 4, 2, 37, 16
    query = torch.randn(b, hq, q, d, generator=g, dtype=torch.bfloat16)
    keys = torch.randn(b, hk, k, d, generator=g, dtype=torch.bfloat16)
    mask = (torch.rand(b, hk, q, k, generator=g) > 0.2) if masked else None
    own = torch.randn(b, hk, 1, d, generator=g, dtype=torch.bfloat16)
    kw = dict(scaling=d**-0.5, softcap=20.0)
    if stored == "bf16":
        stored_kw, dense = {}, keys
    else:
        kq, ks = quantize(keys)
        dense = dequantize(kq, ks)
        stored_kw = dict(key_scale=ks)
        if stored == "int8+own":
            stored_kw["last_key"] = own
            dense = torch.cat([dense[:, :, :-1], own], dim=-2)
        keys = kq
    want = attn_mod.received_attention(query, dense.float(), mask, **kw)
    for block in (5, 37, 64):
        got = attn_mod.received_attention(query, keys, mask, **kw, **stored_kw, key_block=block)
        assert got.dtype == torch.float32 and got.shape == (b, hk, k)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="key_block=0"):
        attn_mod.received_attention(query, keys, mask, **kw, **stored_kw, key_block=0)


@pytest.mark.parametrize("store", ["int8", "bf16"])
@pytest.mark.parametrize("layout", ["dynamic", "static"])
def test_a_decode_step_scored_from_attention_makes_no_copy_of_its_layer(layout, store, monkeypatch):
    """SnapKV scores a decode step from the attention its query paid to every kept key. On an
    INT8 cache that scoring reads the int8 keys a block at a time with the step's own key at full
    precision: it neither dequantizes the layer nor makes a float32 copy of its keys (before, it
    built both, 1.5x the layer's keys in the model's dtype plus 2x in float32, per layer and
    step). A bfloat16 store is converted to float32 a block at a time too."""
    monkeypatch.setattr(attn_mod, "KEY_BLOCK", 64)
    model = tiny_model("llama")
    if store == "bf16":
        model = model.to(torch.bfloat16)
    cfg = EvictionConfig(budget=0.5, layout=layout, max_length=4500, quantize="int8" if store == "int8" else None,
                         prefill_chunk=256, recent_window=8, evict_slack=4, rerank_every=0)
    cache = SparseKVCache(model, cfg, policies.get("snapkv"))
    ids = torch.randint(3, 128, (2, 4400), generator=torch.Generator().manual_seed(2))
    tok = model(input_ids=ids, cache=cache).logits[:, -1:].argmax(-1)
    pos = torch.tensor([[4400], [4400]])
    tok = model(input_ids=tok, position_ids=pos, cache=cache).logits[:, -1:].argmax(-1)
    layer = cache.layers[cache.budgeted_layers[0]]
    stored = layer.keys.shape[-2]
    assert stored > 2 * 1024  # many key blocks, and more than one block of the int8 attention
    float_keys = layer.keys.numel() * 4  # the float32 copy of the kept keys
    calls = []
    real = cache_mod.dequantize

    def counting(q, scale):
        calls.append(tuple(q.shape))
        return real(q, scale)

    monkeypatch.setattr(cache_mod, "dequantize", counting)
    monkeypatch.setattr(int8_mod, "dequantize", counting)  # what dequantize_with calls
    if layout == "static":
        monkeypatch.setattr(type(layer), "codec", (quantize, counting))
    pos = pos + 1
    biggest = _largest_allocation(lambda: model(input_ids=tok, position_ids=pos, cache=cache))
    cache.close()
    assert not [c for c in calls if c[-2] == stored + 1], calls  # no dequantized layer
    assert biggest < float_keys, (biggest, float_keys)  # the dynamic layout's store grows by a cat
    if layout == "static":
        assert biggest < float_keys // 2, (biggest, float_keys)


@pytest.mark.parametrize("layout", ["dynamic", "static"])
@pytest.mark.parametrize("name, reads", [("full", 0), ("random", 0), ("snapkv", 0), ("knorm", 1)])
def test_an_int8_decode_step_dequantizes_only_what_its_policy_reads(layout, name, reads, monkeypatch):
    """Per budgeted layer and decode step, the layer-sized `dequantize` calls: none for policies
    that read neither keys nor values (full and random read only where the scores live), one
    (the keys, not the values) for key-norm."""
    model = tiny_model("llama")
    cfg = EvictionConfig(budget=1.0 if name == "full" else 0.5, layout=layout, max_length=400,
                         quantize="int8", prefill_chunk=64, evict_slack=4, rerank_every=0)
    cache = SparseKVCache(model, cfg, policies.get(name))
    tok = model(input_ids=_case_ids(300), cache=cache).logits[:, -1:].argmax(-1)
    layers = [cache.layers[i] for i in cache.budgeted_layers]
    stored = {layer.keys.shape[-2] + 1 for layer in layers}  # after this step's entry
    calls = []
    real = cache_mod.dequantize

    def counting(q, scale):
        calls.append(q.shape[-2])
        return real(q, scale)

    monkeypatch.setattr(cache_mod, "dequantize", counting)
    monkeypatch.setattr(int8_mod, "dequantize", counting)  # what dequantize_with calls
    if layout == "static":
        monkeypatch.setattr(type(layers[0]), "codec", (quantize, counting))
    model(input_ids=tok, position_ids=torch.tensor([[300], [300]]), cache=cache)
    cache.close()
    assert len([n for n in calls if n in stored]) == reads * len(layers), calls


def _case_ids(n: int) -> torch.Tensor:
    return torch.randint(3, 128, (2, n), generator=torch.Generator().manual_seed(4))


# ---- the Triton kernel, through Triton's interpreter on the CPU -------------------------------
_TRITON_CHECK = r"""
import torch
from sparsekv.cache.int8_attention import decode_attention
from test_int8_attention import _case, _reference

worst = {}
for name, shape, softcap, dtype in [
    ("gqa2", dict(), None, torch.float32),
    ("splits", dict(b=2, hq=8, hk=2, slots=1000, d=32), 30.0, torch.float32),
    ("mha", dict(hq=2, hk=2, slots=70), None, torch.float16),
    ("few", dict(hq=4, hk=1, slots=5), None, torch.float32),
]:
    args = _case(**shape, dtype=dtype)
    scaling = args[0].shape[-1] ** -0.5
    out = decode_attention(*args, scaling=scaling, softcap=softcap, kernel="triton")
    ref = _reference(*args, scaling=scaling, softcap=softcap)
    assert out.shape == ref.shape and out.dtype == dtype, name
    worst[name] = (out.double() - ref).abs().max().item()
print(worst)
assert max(v for k, v in worst.items() if k != "mha") < 1e-5, worst
assert worst["mha"] < 2e-3, worst  # float16 probabilities in the value product, as on a GPU
"""


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_triton_kernel_equals_attention_over_the_dequantized_entries():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-c", _TRITON_CHECK],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
