"""The CUDA path: every policy in bf16 and fp16 with sdpa, exactness against the masked
reference, INT8 bytes, device-side eviction, no host syncs while decoding, the static-capacity
layout (same kept set as the default layout, no host syncs, a decode step captured in CUDA
graphs), and the blockwise teacher statistics against a float64 reference.

Skipped without a CUDA device (CI has none); run on a GPU machine with `pytest tests/test_cuda.py`.
`SPARSEKV_TEST_DEVICE=cpu pytest tests/test_cuda.py` runs the device-independent part on the CPU
(the sync and device-memory checks need CUDA and skip there).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from conftest import tiny_model
from reference import masked_reference, run_sparse

from sparsekv import EvictionConfig, ScorerAdapter, SparseKVCache, policies
from sparsekv.cache.layer import _PER_ENTRY
from sparsekv.teacher.statistics import attention_received

CUDA = os.environ.get("SPARSEKV_TEST_DEVICE", "cuda")
ON_GPU = CUDA.startswith("cuda")
pytestmark = pytest.mark.skipif(ON_GPU and not torch.cuda.is_available(), reason="needs a CUDA device")
needs_cuda = pytest.mark.skipif(not ON_GPU, reason="CUDA-only check")
DTYPES = [torch.bfloat16, torch.float16]


def _ids(b=1, n=40, seed=0, device=CUDA):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (b, n), generator=g).to(device)


def _policy(name: str, model):
    if name == "kvzip":  # its repeat prompt through a character-level encoder (the tiny models have 128 ids)
        return policies.get("kvzip", encode=lambda text: [3 + ord(c) % 120 for c in text])
    if not name.startswith("learned"):
        return policies.get(name)
    adapter = ScorerAdapter.for_model(model)  # untrained head: random but real scores
    if name == "learned0":  # blend 0: scored inside the forward, evictions move no key or value
        return adapter.to(model.device).policy(blend=0.0, recency=0.5, kernel_size=3)
    return adapter.to(model.device).policy(blend=0.5, head_layer="first", kernel_size=3)


def _check_on_device(cache, dtype, quantized=False):
    for i in cache.budgeted_layers:
        layer = cache.layers[i]
        for name in _PER_ENTRY:
            t = getattr(layer, name)
            if t is not None:
                assert t.device.type == torch.device(CUDA).type, (i, name, t.device)
        want = torch.int8 if quantized else dtype
        assert layer.keys.dtype == want and layer.values.dtype == want, (i, layer.keys.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", policies.available())  # every heuristic and learned
def test_every_policy_decodes_on_cuda(family, name, dtype):
    model = tiny_model(family).to(CUDA, dtype)
    ids = _ids(2, 96)
    chunk = None if name == "kvzip" else 32  # KVzip repeats the whole prefilled context
    cfg = EvictionConfig(budget=0.3, recent_window=4, sink_tokens=2, rerank_every=4, prefill_chunk=chunk)
    cache = SparseKVCache(model, cfg, _policy(name, model))
    out = model.generate(ids, cache=cache, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert out.device.type == torch.device(CUDA).type and out.shape == (2, 108)
    _check_on_device(cache, dtype)
    if name != "full":
        lengths = cache.layer_lengths()
        assert all(lengths[i] < 108 for i in cache.budgeted_layers), lengths
    logits = model(input_ids=out[:, -1:], cache=cache).logits
    assert torch.isfinite(logits).all()
    cache.close()


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_full_budget_generates_like_dynamic_cache_on_cuda(family, dtype):
    model = tiny_model(family).to(CUDA, dtype)
    ids = _ids(2, 64)
    ref = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
    cache = SparseKVCache(model, EvictionConfig(budget=1.0, rerank_every=3), "snapkv")
    out = model.generate(ids, cache=cache, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)
    cache.close()


@pytest.mark.parametrize("name", ["h2o", "snapkv", "pyramidkv", "tova", "knorm", "streaming", "learned"])
def test_cuda_logits_equal_masked_full_attention(family, name):
    """float32 on the GPU: what each query saw (the GPU's own selection) replayed on the CPU."""
    model = tiny_model(family).to(CUDA)
    ids = _ids(2, 60)
    steps = [40] + [1] * 20
    cfg = EvictionConfig(budget=0.3, recent_window=4, sink_tokens=2, rerank_every=5, evict_slack=2)
    cache = SparseKVCache(model, cfg, _policy(name, model))
    logits, snaps = run_sparse(model, cache, ids, steps)
    budgeted = cache.budgeted_layers
    cache.close()
    cpu = tiny_model(family)
    snaps = [{i: s.cpu() for i, s in snap.items()} for snap in snaps]
    ref = masked_reference(cpu, ids.cpu(), steps, snaps, budgeted)
    s = 0
    for j, q in enumerate(steps):
        s += q
        assert (logits[j][:, -1].cpu() - ref[:, s - 1]).abs().max() < 1e-4, (j, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_int8_halves_bytes_on_cuda(dtype):
    model = tiny_model("llama", head_dim=64, hidden_size=256).to(CUDA, dtype)
    ids = _ids(2, 200)
    got = {}
    for quantize in (None, "int8"):
        cache = SparseKVCache(model, EvictionConfig(budget=0.3, quantize=quantize), "snapkv")
        model(input_ids=ids, cache=cache)
        steps = [model(input_ids=ids[:, i : i + 1], cache=cache).logits for i in range(8)]
        _check_on_device(cache, dtype, quantized=quantize == "int8")
        got[quantize] = (cache.kv_bytes(), torch.cat(steps, 1).float(), cache.layer_lengths())
        cache.close()
    (b16, l16, n16), (b8, l8, n8) = got[None], got["int8"]
    assert n16 == n8
    assert b8 / b16 <= (64 + 2) / 128 + 1e-6  # int8 entries + one 16-bit scale per token and head
    assert (l8 - l16).abs().max() < 5e-2


def _sync_sites(fn) -> list[str]:
    """Run `fn` with CUDA's sync debug mode on; return 'file:line' of every synchronizing call."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


@needs_cuda
@pytest.mark.parametrize("name", ["snapkv", "h2o", "tova", "pyramidkv", "learned"])
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_decode_steps_do_not_sync_with_the_host(name, quantize):
    """Decode steps, incremental evictions and global re-ranks queue device work only: no
    `.item()`, no data-dependent shapes. (Prefill has one documented sync: the padding check.)"""
    model = tiny_model("llama").to(CUDA, torch.bfloat16)
    cfg = EvictionConfig(budget=0.3, recent_window=4, sink_tokens=2, rerank_every=4, evict_slack=2,
                         quantize=quantize)
    cache = SparseKVCache(model, cfg, _policy(name, model))
    ids = _ids(1, 128)
    tok = model(input_ids=ids, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
    first = cache.budgeted_layers[0]
    seen: list[int] = []

    def decode():
        t = tok
        for _ in range(24):  # 6 re-ranks and several incremental evictions
            t = model(input_ids=t, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
            seen.append(cache.layer_lengths()[first])  # host-side shapes: no sync

    sites = _sync_sites(decode)
    assert len(set(seen)) > 1 and max(seen) <= cache.layers[first].capacity() + cfg.evict_slack + 1
    ours = [s for s in sites if "/sparsekv/" in s]
    assert not ours, f"host syncs in sparsekv while decoding: {sorted(set(ours))}"
    others = sorted(set(sites))
    if others:
        print("syncs outside sparsekv while decoding:", others)
    # The test can fail: an .item() is caught, with its file and line.
    assert any("test_cuda.py" in s for s in _sync_sites(lambda: cache.layers[first].keys.sum().item()))
    cache.close()


@pytest.mark.parametrize("window,softcap", [(None, None), (37, 30.0)])
def test_teacher_blockwise_on_cuda_matches_float64(window, softcap):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 300, 32, generator=g)
    k = torch.randn(2, 2, 300, 32, generator=g)
    pad = torch.ones(2, 300, dtype=torch.bool)
    pad[1, :17] = False
    kw = dict(scaling=32**-0.5, softcap=softcap, num_kv_groups=4, sliding_window=window, key_padding=pad)
    ref = attention_received(q.double(), k.double(), block_size=300, **kw)
    for dtype in (torch.float32, torch.bfloat16):
        got = attention_received(q.to(CUDA, dtype), k.to(CUDA, dtype), block_size=64, **kw)
        assert got.device.type == torch.device(CUDA).type and got.dtype == torch.float32
        # bf16 inputs are rounded before the float32 arithmetic
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        rel = (got.cpu().double() - ref).norm() / ref.norm()
        assert rel < tol, (dtype, rel.item())


@needs_cuda
def test_teacher_memory_grows_linearly_on_cuda():
    """Blockwise statistics never build the n x n matrix: peak extra memory grows ~linearly."""

    def extra(n):
        q = torch.randn(1, 32, n, 128, device=CUDA, dtype=torch.bfloat16)
        k = torch.randn(1, 8, n, 128, device=CUDA, dtype=torch.bfloat16)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        attention_received(q, k, scaling=128**-0.5, num_kv_groups=4, block_size=512)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    small, big = extra(4096), extra(8192)
    assert big < 2.3 * small, (small, big)
    naive = 32 * 8192 * 8192 * 4  # the float32 n x n scores of all heads
    assert big < naive / 4, (big, naive)


def test_adapter_attach_generates_on_cuda():
    model = tiny_model("gemma3").to(CUDA, torch.bfloat16)
    adapter = ScorerAdapter.for_model(model)
    ids = _ids(1, 80)
    with adapter.attach(model, budget=0.3) as att:
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.device.type == torch.device(CUDA).type and out.shape == (1, 88)
    assert next(adapter.head.parameters()).device.type == torch.device(CUDA).type
    assert att.last_cache is not None


# ---- the static-capacity layout (EvictionConfig(layout="static"), sparsekv.cache.static) ------
STATIC = dict(budget=0.3, recent_window=4, sink_tokens=2, rerank_every=4, evict_slack=2,
              prefill_chunk=16, layout="static", max_length=160)


def _static_policies() -> list[str]:
    """Every policy but those with a repeat pass (KVzip), which the static layout refuses."""
    from sparsekv.policies.base import _REGISTRY

    return [p for p in policies.available()
            if not getattr(_REGISTRY[p], "scores_after_prefill", False)] + ["learned0"]


@pytest.mark.parametrize("name", _static_policies())
def test_static_layout_keeps_the_same_set_on_cuda(name):
    """float64 on the device (no near-ties from rounding): after every step the static layout
    keeps exactly the default layout's entries, and the logits agree."""
    from reference import run_sparse

    model = tiny_model("llama").to(CUDA, torch.float64)
    ids = _ids(2, 72)
    steps = [40] + [1] * 24
    got = {}
    for layout in ("dynamic", "static"):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # the same untrained head for both layouts (learned)
            policy = _policy(name, model)
        cache = SparseKVCache(model, EvictionConfig(**{**STATIC, "layout": layout}), policy)
        got[layout] = run_sparse(model, cache, ids, steps)
        cache.close()
    (ld, sd), (ls, ss) = got["dynamic"], got["static"]
    for j in range(len(steps)):
        assert all(torch.equal(sd[j][i], ss[j][i]) for i in sd[j]), (name, j)
        assert (ld[j][:, -1] - ls[j][:, -1]).abs().max() < 1e-9, (name, j)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_static_layout_generates_in_bf16_on_cuda(family, quantize):
    model = tiny_model(family).to(CUDA, torch.bfloat16)
    ids = _ids(2, 96)
    cache = SparseKVCache(model, EvictionConfig(**{**STATIC, "quantize": quantize}), "snapkv")
    out = model.generate(ids, cache=cache, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 120)
    _check_on_device(cache, torch.bfloat16, quantized=quantize == "int8")
    first = cache.layers[cache.budgeted_layers[0]]
    assert first.keys.shape[2] < 120 and first._slots.buf["keys"].shape[2] == first.slots
    cache.close()


@needs_cuda
@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("name", ["snapkv", "learned0"])
def test_static_decode_steps_do_not_sync_with_the_host(name, quantize):
    model = tiny_model("llama").to(CUDA, torch.bfloat16)
    cfg = EvictionConfig(**{**STATIC, "quantize": quantize})
    cache = SparseKVCache(model, cfg, _policy(name, model))
    tok = model(input_ids=_ids(1, 64), cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)

    def decode():
        t = tok
        for _ in range(24):
            t = model(input_ids=t, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)

    ours = [s for s in _sync_sites(decode) if "/sparsekv/" in s]
    assert not ours, f"host syncs in sparsekv while decoding: {sorted(set(ours))}"
    cache.close()


@needs_cuda
@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("name", ["snapkv", "learned0"])
def test_static_decode_step_is_captured_in_cuda_graphs(name, quantize):
    """model.forward compiled with mode="reduce-overhead": the decode step runs as CUDA graphs
    (no cudagraph skip, one compiled graph) and gives the eager tokens; with INT8 the step's
    attention is the Triton kernel (`sparsekv.cache.int8_attention`) inside the graph; with
    "learned0" the step's scoring and its writes to freed slots are in the graph too."""
    from torch._dynamo.utils import counters

    model = tiny_model("llama").to(CUDA, torch.float32)
    ids = _ids(1, 40)
    toks = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        cfg = EvictionConfig(**{**STATIC, "quantize": quantize})
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # the same untrained head in both runs
            cache = SparseKVCache(model, cfg, _policy(name, model))
        tok = model(input_ids=ids, cache=cache).logits[:, -1:].argmax(-1)
        if compiled:
            model.forward = torch.compile(model.forward, mode="reduce-overhead", dynamic=False)
        try:
            out = []
            for t in range(24):
                pos = torch.tensor([[40 + t]], device=CUDA)
                tok = model(input_ids=tok, position_ids=pos, cache=cache).logits[:, -1:].argmax(-1)
                out.append(tok.clone())
        finally:
            model.__dict__.pop("forward", None)
        toks[compiled] = torch.cat(out, 1)
        cache.close()
    assert torch.equal(toks[False], toks[True])
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert not counters["inductor"].get("cudagraph_skips"), dict(counters["inductor"])


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("slots, groups", [(10_353, 4), (777, 1), (40, 8)])
def test_int8_triton_kernel_matches_the_torch_one_on_cuda(dtype, slots, groups):
    """The Triton kernel (what CUDA takes by default) against the blockwise torch one, masks,
    softcap and several splits included; float32 within 1e-4, 16-bit within 2e-2."""
    from sparsekv.cache import quantize
    from sparsekv.cache.int8_attention import decode_attention, triton_available

    if not triton_available():
        pytest.skip("triton is not installed")
    g = torch.Generator(device=CUDA).manual_seed(0)
    b, hk, d = 3, 2, 128
    kq, ks = quantize(torch.randn(b, hk, slots, d, device=CUDA, generator=g, dtype=dtype))
    vq, vs = quantize(torch.randn(b, hk, slots, d, device=CUDA, generator=g, dtype=dtype))
    query = torch.randn(b, hk * groups, 1, d, device=CUDA, generator=g, dtype=dtype)
    valid = torch.rand(b, hk, slots, device=CUDA, generator=g) > 0.5
    new_k, new_v = (torch.randn(b, hk, 1, d, device=CUDA, generator=g, dtype=dtype) for _ in "kv")
    slot = torch.tensor([slots - 1], device=CUDA)
    args = (query, kq, ks, vq, vs, valid, new_k, new_v, slot)
    for softcap in (None, 30.0):
        tri = decode_attention(*args, scaling=d**-0.5, softcap=softcap, kernel="triton")
        ref = decode_attention(*args, scaling=d**-0.5, softcap=softcap, kernel="torch")
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        assert (tri.float() - ref.float()).abs().max() < tol, (softcap, dtype)


@needs_cuda
def test_a_static_int8_decode_step_holds_no_copy_of_a_layer_on_cuda():
    """What a decode step (the learned policy's scoring and eviction included) adds to the peak
    device memory stays below half of one layer's dequantized keys (before the kernel, each
    layer's step dequantized every slot: 2x the int8 bytes, held until the forward returned)."""
    model = tiny_model("llama").to(CUDA, torch.bfloat16)
    cfg = EvictionConfig(budget=0.3, layout="static", max_length=65_536, quantize="int8")
    policy = ScorerAdapter.for_model(model).to(CUDA).policy(blend=0.0)  # reads no keys
    cache = SparseKVCache(model, cfg, policy)
    tok = model(input_ids=_ids(4, 64), cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
    tok = model(input_ids=tok, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
    layer = cache.layers[cache.budgeted_layers[0]]
    dequantized = layer._slots.buf["keys"].numel() * 2  # bf16
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model(input_ids=tok, position_ids=torch.full((4, 1), 65, device=CUDA), cache=cache, logits_to_keep=1)
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated() - base
    cache.close()
    assert grown < dequantized // 2, (grown, dequantized)


@needs_cuda
@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("layout", ["dynamic", "static"])
def test_a_snapkv_decode_step_holds_no_float_copy_of_its_keys_on_cuda(layout, quantize, monkeypatch):
    """SnapKV scores a decode step from the attention its query paid to every kept key: what the
    step adds to the peak device memory stays below a float32 copy of a layer's kept keys (the
    scoring converts `KEY_BLOCK` keys at a time and reads an INT8 store through its scales; before,
    it held the float32 copy and, for INT8, the dequantized keys and values too)."""
    from sparsekv.cache import attention as attn_mod

    monkeypatch.setattr(attn_mod, "KEY_BLOCK", 256)
    model = tiny_model("llama").to(CUDA, torch.bfloat16)
    cfg = EvictionConfig(budget=0.5, layout=layout, max_length=8300, quantize=quantize,
                         prefill_chunk=1024, evict_slack=4, rerank_every=0)
    cache = SparseKVCache(model, cfg, "snapkv")
    tok = model(input_ids=_ids(4, 8192), cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
    pos = torch.full((4, 1), 8192, device=CUDA)
    tok = model(input_ids=tok, position_ids=pos, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
    layer = cache.layers[cache.budgeted_layers[0]]
    float_keys = layer.keys.numel() * 4
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model(input_ids=tok, position_ids=pos + 1, cache=cache, logits_to_keep=1)
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated() - base
    cache.close()
    # the dynamic layout's store grows by concatenations: a new copy of a layer's keys (then of
    # its values) while the old one is alive
    store = layer.keys.numel() * (1 if quantize else 2) if layout == "dynamic" else 0
    assert grown < float_keys // 2 + store, (grown, float_keys, store)
