"""SparseKVCache behaviour: equivalence, exactness against a masked reference, memory freed."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import masked_reference, run_prefill_chunked, run_sparse

from sparsekv import EvictionConfig, SparseKVCache, policies

HEURISTICS = [p for p in policies.available() if p != "learned"]
LEARNED = ["learned", "learned+blend"]
"""The learned policy on a freshly initialized (random) adapter: the head alone, and blended
with observed attention (which makes the cache track attention at prefill and re-ranks)."""


def _policy(name: str, model):
    """A policy by name; the learned variants get a fresh random adapter for `model`, KVzip a
    character-level encoder for its repeat prompt (the tiny models have 128 ids)."""
    if name == "kvzip":
        return policies.get("kvzip", encode=lambda text: [3 + ord(c) % 120 for c in text])
    if name not in LEARNED:
        return name
    from sparsekv.scoring.adapter import ScorerAdapter

    adapter = ScorerAdapter.for_model(model)
    return adapter.policy(blend=0.5, kernel_size=3) if name == "learned+blend" else adapter.policy()


def _ids(b=1, n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (b, n), generator=g)


def _left_padded(b=3, n=36, seed=1):
    ids = _ids(b, n, seed)
    mask = torch.ones(b, n, dtype=torch.long)
    for i in range(1, b):
        pad = 5 * i
        ids[i, :pad] = 0
        mask[i, :pad] = 0
    return ids, mask


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_full_budget_generates_like_dynamic_cache(family, impl):
    model = tiny_model(family, impl)
    for ids, mask in [(_ids(), None), _left_padded()]:
        kw = {} if mask is None else {"attention_mask": mask}
        ref = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, **kw)
        for name in HEURISTICS + LEARNED:
            cache = SparseKVCache(model, EvictionConfig(budget=1.0, rerank_every=2), _policy(name, model))
            out = model.generate(ids, cache=cache, max_new_tokens=6, do_sample=False, pad_token_id=0, **kw)
            assert torch.equal(out, ref), (family, impl, name)


def test_sampling_matches_dynamic_cache_with_full_budget():
    model = tiny_model("llama")
    ids = _ids()
    torch.manual_seed(3)
    ref = model.generate(ids, max_new_tokens=8, do_sample=True, top_k=20)
    torch.manual_seed(3)
    cache = SparseKVCache(model, EvictionConfig(budget=1.0), "h2o")
    out = model.generate(ids, cache=cache, max_new_tokens=8, do_sample=True, top_k=20)
    assert torch.equal(out, ref)


def _max_error(logits, ref, steps, mask=None):
    err, s = 0.0, 0
    for j, q in enumerate(steps):
        e = s + q
        rows = slice(None) if mask is None else mask[:, e - 1].bool()
        err = max(err, (logits[j][rows, -1] - ref[rows, e - 1]).abs().max().item())
        s = e
    return err


@pytest.mark.parametrize("name", ["h2o", "snapkv", "pyramidkv", "tova", "knorm", "random", "streaming", *LEARNED])
def test_logits_equal_masked_full_attention(family, name):
    model = tiny_model(family)
    ids = _ids(2, 60)
    steps = [40] + [1] * 20
    cfg = EvictionConfig(budget=0.3, recent_window=4, sink_tokens=2, rerank_every=5, evict_slack=2)
    cache = SparseKVCache(model, cfg, _policy(name, model))
    logits, snaps = run_sparse(model, cache, ids, steps)
    ref = masked_reference(model, ids, steps, snaps, cache.budgeted_layers)
    assert _max_error(logits, ref, steps) < 1e-4
    # The test can fail: the full cache's logits differ once entries were evicted.
    full = model(input_ids=ids).logits
    assert (full[:, -1] - logits[-1][:, -1]).abs().max() > 1e-3


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_chunked_steps_and_left_padding_match_reference(impl):
    model = tiny_model("gemma3", impl)
    ids, mask = _left_padded(3, 48)
    steps = [16, 16, 8] + [1] * 8
    cfg = EvictionConfig(budget=0.4, recent_window=4, sink_tokens=2, rerank_every=3, evict_slack=1)
    cache = SparseKVCache(model, cfg, "h2o")
    logits, snaps = run_sparse(model, cache, ids, steps, attention_mask=mask)
    ref = masked_reference(model, ids, steps, snaps, cache.budgeted_layers, attention_mask=mask)
    assert _max_error(logits, ref, steps, mask) < 1e-4
    # Padding never displaces a real token: a padded row keeps as many real entries as fit.
    for i in cache.budgeted_layers:
        pos = cache.layers[i].positions
        real = (pos >= 0).sum(-1)
        assert (real == pos.shape[-1]).all() or (real == (mask.sum(-1)[:, None])).all()


@pytest.mark.parametrize("name", ["h2o", "learned+blend"])
@pytest.mark.parametrize("chunk", [1, 7])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_prefill_chunk_path_matches_masked_reference(chunk, padded, name):
    """The cache chunking the prompt itself (`prefill_chunk=`), also one token at a time on a
    left-padded batch, where padding must be marked although each step has one token."""
    model = tiny_model("gemma3")
    ids, mask = _left_padded(3, 30) if padded else (_ids(2, 30), None)
    cfg = EvictionConfig(budget=0.4, recent_window=3, sink_tokens=2, rerank_every=2, evict_slack=1,
                         prefill_chunk=chunk)
    cache = SparseKVCache(model, cfg, _policy(name, model))
    logits, snaps, steps = run_prefill_chunked(model, cache, ids, decode=4, attention_mask=mask)
    assert len(steps) > 5 and steps[-4:] == [1, 1, 1, 1]
    ref = masked_reference(model, ids, steps, snaps, cache.budgeted_layers, attention_mask=mask)
    assert _max_error(logits, ref, steps, mask) < 1e-4
    if padded:  # the padding of each row is marked, never kept in place of a real token
        kept = cache.layers[3].positions
        for row in (1, 2):
            assert not ((kept[row] >= 0) & (kept[row] < 5 * row)).any()


@pytest.mark.parametrize("fam", ["llama", "gemma3"])
def test_prefill_chunk_1_generate_on_a_left_padded_batch_equals_the_full_cache(fam):
    model = tiny_model(fam)
    ids, mask = _left_padded(3, 20)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    for chunk in (1, 3):
        cache = SparseKVCache(model, EvictionConfig(budget=1.0, prefill_chunk=chunk), "h2o")
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=5, do_sample=False,
                             pad_token_id=0)
        assert torch.equal(out, ref), chunk


def test_kept_entries_are_exactly_the_top_scores():
    model = tiny_model("llama")
    cfg = EvictionConfig(budget=0.25, sink_tokens=3, recent_window=5)
    cache = SparseKVCache(model, cfg, "knorm")
    ids = _ids(2, 80)
    layer = cache.layers[1]
    captured = {}
    original = layer.evict

    def spy(capacity):
        captured["scores"] = layer.scores.clone()
        captured["positions"] = layer.positions.clone()
        original(capacity)

    layer.evict = spy
    model(input_ids=ids, cache=cache)
    scores, positions = captured["scores"], captured["positions"]
    kept = layer.positions
    assert kept.shape[-1] == 20
    for b in range(2):
        for h in range(kept.shape[1]):
            protected = set(range(3)) | set(range(75, 80))
            rest = [p for p in range(80) if p not in protected]
            order = sorted(rest, key=lambda p: -scores[b, h, (positions[b, h] == p).nonzero()[0, 0]].item())
            expected = protected | set(order[: 20 - len(protected)])
            assert set(kept[b, h].tolist()) == expected
    # Heads choose their own tokens.
    assert not torch.equal(kept[:, 0], kept[:, 1])


def test_kv_bytes_counts_tensors_and_drops():
    model = tiny_model("llama")
    ids = _ids(1, 512)
    full = SparseKVCache(model, EvictionConfig(budget=1.0), "full")
    model(input_ids=ids, cache=full)
    sparse = SparseKVCache(model, EvictionConfig(budget=0.25), "snapkv")
    model(input_ids=ids, cache=sparse)
    for cache in (full, sparse):
        expected = sum(lay.keys.numel() * lay.keys.element_size() * 2 for lay in cache.layers)
        assert cache.kv_bytes() == expected
    assert full.layer_lengths() == [512] * 4
    assert sparse.layer_lengths() == [128] * 4
    assert sparse.kv_bytes() == full.kv_bytes() // 4
    assert sparse.tokens_seen() == 512


@pytest.mark.parametrize("name, per_entry", [("snapkv", 8 + 4), ("learned", 8 + 4 + 4)])
def test_memory_bytes_counts_the_bookkeeping_beside_the_kv(name, per_entry):
    """`memory_bytes()`: the KV bytes, plus per kept entry and KV head an int64 position, a
    float32 score and, for a policy that tracks the attention entries receive between re-ranks
    (the learned policy blending it in), a float32 observed sum."""
    from sparsekv import ScorerAdapter

    model = tiny_model("llama")
    policy = ScorerAdapter.for_model(model).policy(blend=0.5) if name == "learned" else name
    cache = SparseKVCache(model, EvictionConfig(budget=0.25), policy)
    model(input_ids=_ids(2, 512), cache=cache)
    mem = cache.memory_bytes()
    kv_heads = model.config.num_key_value_heads
    entries = 2 * kv_heads * sum(cache.layer_lengths())  # every layer is budgeted here
    assert mem["kv"] == cache.kv_bytes()
    assert mem["bookkeeping"] == entries * per_entry
    assert mem["total"] == mem["kv"] + mem["bookkeeping"]
    cache.close()


def test_gemma_budget_applies_to_full_layers_only():
    model = tiny_model("gemma3")
    cache = SparseKVCache(model, EvictionConfig(budget=0.25, recent_window=8), "snapkv")
    model(input_ids=_ids(1, 200), cache=cache)
    lengths = cache.layer_lengths()
    assert lengths[3] == 50  # the full-attention layer
    assert lengths[:3] == [31, 31, 31]  # sliding layers as transformers keeps them (window 32)


def test_pyramid_schedule_keeps_more_in_shallow_layers():
    model = tiny_model("llama")
    cache = SparseKVCache(model, EvictionConfig(budget=0.3, schedule="pyramid", recent_window=8), "snapkv")
    model(input_ids=_ids(1, 200), cache=cache)
    lengths = cache.layer_lengths()
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1]
    assert abs(sum(lengths) - 4 * 60) <= 4
    assert SparseKVCache(model, EvictionConfig(budget=0.3), "pyramidkv").budgets() != {}


def test_prefill_chunk_bounds_peak_memory():
    model = tiny_model("llama")
    ids = _ids(1, 600)
    cfg = EvictionConfig(budget=64, prefill_chunk=50, recent_window=8)
    cache = SparseKVCache(model, cfg, "snapkv")
    peaks = []
    layer = cache.layers[0]
    original = layer.update

    def spy(k, v, *a, **kw):
        out = original(k, v, *a, **kw)
        peaks.append(cache.layers[0].keys.shape[-2])
        return out

    layer.update = spy
    out = model(input_ids=ids, cache=cache)
    assert out.logits.shape[1] == 50  # the last chunk
    assert len(peaks) == 12 and max(peaks) <= 64 + 50
    assert cache.tokens_seen() == 600 and cache.layer_lengths() == [64] * 4
    per_entry = 2 * 2 * 16 * 4  # K and V, 2 heads, head_dim 16, float32
    assert cache.kv_bytes() == 4 * 64 * per_entry
    # The measured peak: at most budget + chunk in every layer, and above the steady state.
    assert 4 * 64 * per_entry < cache.peak_kv_bytes() <= 4 * (64 + 50) * per_entry
    # generate() goes through the same hook and keeps producing tokens.
    cache2 = SparseKVCache(model, cfg, "snapkv")
    gen = model.generate(ids, cache=cache2, max_new_tokens=4, do_sample=False)
    assert gen.shape[1] == 604


def test_decode_is_incremental_with_slack_and_reranks():
    model = tiny_model("llama")
    cfg = EvictionConfig(budget=0.5, recent_window=2, sink_tokens=1, rerank_every=4, evict_slack=3)
    cache = SparseKVCache(model, cfg, "h2o")
    ids = _ids(1, 40)
    model(input_ids=ids, cache=cache)
    assert cache.layer_lengths()[0] == 20
    lengths = []
    for t in range(8):
        model(input_ids=ids[:, t : t + 1], cache=cache)
        lengths.append(cache.layer_lengths()[0])
    cap = [-(-(41 + t) // 2) for t in range(8)]
    assert lengths[3] == cap[3] and lengths[7] == cap[7]  # re-ranks at steps 4 and 8
    assert all(n <= c + 3 for n, c in zip(lengths, cap))
    assert lengths[1] > cap[1]  # incremental: within the slack nothing is evicted


def test_unsupported_things_fail_loudly():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="unknown policy 'nope'; known policies: .*full, h2o"):
        SparseKVCache(model, EvictionConfig(budget=0.5), "nope")
    cache = SparseKVCache(model, EvictionConfig(budget=0.25, recent_window=2), "snapkv")
    model(input_ids=_ids(1, 64), cache=cache)
    with pytest.raises(RuntimeError, match="crop"):
        cache.crop(-2)
    beams = SparseKVCache(model, EvictionConfig(budget=0.5), "snapkv")
    with pytest.raises(ValueError, match="num_beams > 1: beam search is not supported"):
        model.generate(_ids(1, 20), cache=beams, num_beams=2, max_new_tokens=3)
    assert beams.tokens_seen() == 0  # refused before the prefill ran, not at the first reorder
    # the same cache then serves a greedy call: the refusal left nothing behind
    out = model.generate(_ids(1, 20), cache=beams, max_new_tokens=3, min_new_tokens=3,
                         do_sample=False)
    assert out.shape[1] == 23
    # a static layout refuses it the same way
    static = SparseKVCache(model, EvictionConfig(budget=0.5, layout="static", max_length=64,
                                                 recent_window=4), "snapkv")
    with pytest.raises(ValueError, match="num_beams > 1"):
        model.generate(_ids(1, 20), cache=static, num_beams=3, do_sample=True, max_new_tokens=3)
    assert static.tokens_seen() == 0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"budget": 0.0}, "budget"),
        ({"budget": 1.5}, "budget"),
        ({"budget": 0}, "budget"),
        ({"budget": "half"}, "budget"),
        ({"budget": 0.3, "schedule": "zigzag"}, "schedule"),
        ({"budget": 0.3, "schedule": [0.2, 1.2]}, "schedule"),
        ({"budget": 0.3, "rerank_every": -1}, "rerank_every"),
        ({"budget": 0.3, "prefill_chunk": 0}, "prefill_chunk"),
        ({"budget": 0.3, "quantize": "int4"}, "quantize"),
        ({"budget": 0.3, "pyramid_slope": 1.0}, "pyramid_slope"),
        ({"budget": 0.3, "schedule": [True, True]}, "schedule"),
        ({"budget": 0.3, "pyramid_slope": True}, "pyramid_slope"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EvictionConfig(**kwargs)


@pytest.mark.parametrize(
    "name, kwargs, words",
    [
        ("snapkv", {"window": 2.5}, "window=2.5 must be an int >= 1"),
        ("pyramidkv", {"window": True}, "window=True must be an int"),
        ("snapkv", {"kernel_size": 4}, "kernel_size=4 must be an odd int"),
        ("random", {"seed": "x"}, "seed='x' must be an int"),
        ("random", {"seed": 1.5}, "seed=1.5 must be an int"),
        ("learned", {"adapter": None}, "adapter=None must be a ScorerAdapter, an adapter folder"),
        ("learned", {"adapter": 3}, "adapter=3 must be"),
        ("learned", {"adapter": ""}, "adapter='' must name"),
        ("h2o", {"window": 3}, r"policy 'h2o' takes no argument\(s\) \['window'\]; allowed: none"),
        ("snapkv", {"windw": 3}, r"\['windw'\]; allowed: window, kernel_size"),
    ],
)
def test_policy_arguments_are_checked_naming_the_argument(name, kwargs, words):
    with pytest.raises(ValueError, match=words):
        policies.get(name, **kwargs)


def _valid_arguments(name: str) -> dict:
    from sparsekv.scoring.adapter import ScorerAdapter

    if name == "learned":
        return {"adapter": ScorerAdapter.for_model(tiny_model("llama"))}
    if name == "kvzip":
        return {"encode": lambda text: [3] * len(text)}
    return {}


@pytest.mark.parametrize("name", policies.available())
def test_every_policy_argument_refuses_a_wrong_type(name):
    """Every keyword of every registered policy: an object of no expected type is a ValueError
    that names the argument (in `policies.get`, not later in a forward)."""
    import inspect

    from sparsekv.policies.base import _REGISTRY

    base = _valid_arguments(name)
    policies.get(name, **base)  # the valid arguments build it
    params = [p for p in inspect.signature(_REGISTRY[name]).parameters if p not in ("self",)]
    for arg in params:
        with pytest.raises(ValueError, match=f"{arg}="):
            policies.get(name, **{**base, arg: object()})


def test_explicit_schedule_length_is_checked():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="4 budgeted layers"):
        SparseKVCache(model, EvictionConfig(budget=0.3, schedule=[0.5, 0.2]), "snapkv")
    cfg = EvictionConfig(budget=0.3, schedule=[0.8, 0.5, 0.3, 0.1], recent_window=4, sink_tokens=2)
    cache = SparseKVCache(model, cfg, "snapkv")
    model(input_ids=_ids(1, 100), cache=cache)
    assert cache.layer_lengths() == [80, 50, 30, 10]


def test_hooks_are_removed_on_close():
    model = tiny_model("llama")
    cache = SparseKVCache(model, EvictionConfig(budget=0.5, prefill_chunk=8), "snapkv")
    assert model._forward_pre_hooks
    cache.close()
    assert not model._forward_pre_hooks


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from(FAMILIES),
    n=st.integers(8, 48),
    budget=st.one_of(st.floats(0.05, 1.0), st.integers(2, 40), st.just("1tok")),
    schedule=st.sampled_from(["uniform", "pyramid"]),
    chunk=st.integers(3, 20),
    decode=st.integers(0, 6),
    rerank=st.integers(0, 4),
    name=st.sampled_from(["h2o", "snapkv", "tova", "knorm", "random"]),
)
def test_property_random_configs_match_masked_reference(family, n, budget, schedule, chunk, decode, rerank, name):
    model = _cached_model(family)
    ids = _ids(1, n + decode, seed=n)
    steps = [chunk] * (n // chunk) + ([n % chunk] if n % chunk else []) + [1] * decode
    cfg = EvictionConfig(budget=budget, schedule=schedule, rerank_every=rerank, sink_tokens=1,
                         recent_window=2, evict_slack=1)
    cache = SparseKVCache(model, cfg, name)
    logits, snaps = run_sparse(model, cache, ids, steps)
    ref = masked_reference(model, ids, steps, snaps, cache.budgeted_layers)
    assert _max_error(logits, ref, steps) < 1e-4


_MODELS: dict = {}


def _cached_model(family):
    if family not in _MODELS:
        _MODELS[family] = tiny_model(family)
    return _MODELS[family]


@pytest.mark.parametrize("dtype, ratio", [(torch.bfloat16, 0.57), (torch.float32, 0.32)])
def test_int8_halves_bytes_and_stays_close(dtype, ratio):
    model = tiny_model("llama").to(dtype)
    ids = _ids(2, 200)
    results = {}
    for quantize in (None, "int8"):
        cache = SparseKVCache(model, EvictionConfig(budget=0.3, quantize=quantize), "snapkv")
        model(input_ids=ids, cache=cache)
        steps = [model(input_ids=ids[:, i : i + 1], cache=cache).logits for i in range(8)]
        results[quantize] = (cache.kv_bytes(), torch.cat(steps, 1).float(), cache.layer_lengths())
    (b16, l16, n16), (b8, l8, n8) = results[None], results["int8"]
    assert n16 == n8
    # int8 entries + one scale per token and head (head_dim 16 here; 256 on gemma: ~0.51).
    assert b8 / b16 <= ratio
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert (l8 - l16).abs().max() < tol


def test_int8_round_trip_error_bound():
    from sparsekv.cache import dequantize, quantize

    x = torch.randn(2, 3, 50, 64)
    q, s = quantize(x)
    assert q.dtype == torch.int8 and s.shape == (2, 3, 50, 1)
    err = (dequantize(q, s) - x).abs()
    assert (err <= s / 2 + 1e-6).all()


class _FakeAdapter:
    """Scores a token by the first feature of its attention input (a stand-in for a head)."""

    def __init__(self, kv_heads=2):
        self.kv_heads = kv_heads
        self.calls = []

    def score_layer(self, layer_idx, hidden_states):
        self.calls.append((layer_idx, tuple(hidden_states.shape)))
        return hidden_states[..., 0][:, None, :].expand(-1, self.kv_heads, -1)


def test_learned_policy_reads_attention_inputs():
    model = tiny_model("llama")
    adapter = _FakeAdapter()
    cfg = EvictionConfig(budget=0.25, sink_tokens=0, recent_window=0)
    cache = SparseKVCache(model, cfg, policies.get("learned", adapter=adapter))
    captured = {}
    hook = model.model.layers[2].input_layernorm.register_forward_hook(
        lambda m, a, out: captured.setdefault("h", out)
    )
    ids = _ids(1, 64)
    model(input_ids=ids, cache=cache)
    hook.remove()
    assert (2, (1, 64, 64)) in adapter.calls
    expected = captured["h"][0, :, 0].topk(16).indices.sort().values
    assert torch.equal(cache.layers[2].positions[0, 0], expected)
    cache.close()


def test_learned_blend_uses_observed_attention_at_rerank():
    model = tiny_model("llama")
    cfg = EvictionConfig(budget=0.3, rerank_every=2)
    learned = policies.get("learned", adapter=_FakeAdapter(), blend=0.5)
    assert learned.tracks_observed and learned.attention_queries == "window"
    cache = SparseKVCache(model, cfg, learned)
    ids = _ids(1, 50)
    model(input_ids=ids[:, :40], cache=cache)
    for t in range(40, 44):
        model(input_ids=ids[:, t : t + 1], cache=cache)
    layer = cache.layers[0]
    assert layer.observed is not None and layer.observed.shape == layer.positions.shape
    with pytest.raises(ValueError, match="blend"):
        policies.get("learned", adapter=_FakeAdapter(), blend=2.0)


@pytest.mark.parametrize("fam", ["llama", "gemma3"])
def test_fork_from_recorded_prefill_equals_live_prefill(fam):
    model = tiny_model(fam)
    ids, mask = _left_padded(2, 60)
    base = SparseKVCache(model, EvictionConfig(budget=1.0), "full", record=("all", "window", "last"))
    model(input_ids=ids, attention_mask=mask, cache=base)
    candidates = [(n, {}) for n in HEURISTICS if n != "full"]
    candidates += [("learned", {"adapter": _FakeAdapter(), "blend": 0.0}),
                   ("learned", {"adapter": _FakeAdapter(), "blend": 0.5})]
    for name, kw in candidates:
        for quantize in (None, "int8"):
            cfg = EvictionConfig(budget=0.3, schedule="pyramid", recent_window=4, sink_tokens=2, quantize=quantize)
            live = SparseKVCache(model, cfg, policies.get(name, **kw) if kw else _policy(name, model))
            model(input_ids=ids, attention_mask=mask, cache=live)
            forked = base.fork(cfg, policies.get(name, **kw) if kw else _policy(name, model))
            for i in live.budgeted_layers:
                a, b = live.layers[i], forked.layers[i]
                assert torch.equal(a.positions, b.positions), (name, i)
                assert torch.allclose(a.scores, b.scores, atol=1e-5, equal_nan=True), (name, i)
            assert live.kv_bytes() == forked.kv_bytes() and live.layer_lengths() == forked.layer_lengths()
            nxt = torch.full((2, 1), 7)
            m2 = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
            la = model(input_ids=nxt, attention_mask=m2, cache=live).logits
            lb = model(input_ids=nxt, attention_mask=m2, cache=forked).logits
            assert torch.allclose(la, lb, atol=1e-5), name
    with pytest.raises(ValueError, match="window of 8"):
        base.fork(EvictionConfig(budget=0.3), policies.get("snapkv", window=8))
    with pytest.raises(ValueError, match="needs the 'full' policy"):
        SparseKVCache(model, EvictionConfig(budget=0.3), "snapkv", record=("all",))


def test_learned_blend_max_keeps_what_either_signal_ranks_high():
    """blend_mode="max" is a union: the head's needle (A) and the window's pick (B) both outrank a
    token that both rate fairly well (C); a weighted average ("mix") prefers C to both."""
    from sparsekv.policies.base import ScoreContext

    n, A, B, C = 12, 2, 7, 9
    prior = torch.zeros(1, 1, n)
    prior[..., A], prior[..., C] = 6.0, 3.5
    attn = torch.full((1, 1, n), 0.01)
    attn[..., B], attn[..., C] = 0.8, 0.2

    class Fixed:
        def score_layer(self, layer_idx, hidden_states):
            return prior.clone()

    ctx = ScoreContext(layer_idx=0, phase="prefill", keys=torch.zeros(1, 1, n, 4), values=torch.zeros(1, 1, n, 4),
                       positions=torch.arange(n).view(1, 1, n), num_new=n, tokens_seen=n, attention=attn,
                       hidden_states=torch.zeros(1, n, 8))
    top2 = {}
    for mode in ("mix", "max"):
        s = policies.get("learned", adapter=Fixed(), blend=0.5, blend_mode=mode).score(ctx)
        top2[mode] = set(s[0, 0].topk(2).indices.tolist())
    assert top2["max"] == {A, B}
    assert C in top2["mix"]
    with pytest.raises(ValueError, match="blend_mode"):
        policies.get("learned", adapter=Fixed(), blend=0.5, blend_mode="union")


def _fixed_prior_prefill(n: int, flagged: list[int]):
    """A scorer that returns a fixed prior (a mild preference for early tokens, 5.0 at `flagged`)
    and the prefill context of `n` new tokens it scores."""
    from sparsekv.policies.base import ScoreContext

    prior = -torch.arange(n, dtype=torch.float32).view(1, 1, n) / 100
    prior[..., flagged] = 5.0

    class Fixed:
        def score_layer(self, layer_idx, hidden_states):
            return prior.clone()

    ctx = ScoreContext(layer_idx=0, phase="prefill", keys=torch.zeros(1, 1, n, 4), values=torch.zeros(1, 1, n, 4),
                       positions=torch.arange(n).view(1, 1, n), num_new=n, tokens_seen=n,
                       hidden_states=torch.zeros(1, n, 8))
    return Fixed, ctx


def test_learned_kernel_size_keeps_the_neighbours_of_a_flagged_token():
    n, needle = 16, 8
    Fixed, ctx = _fixed_prior_prefill(n, [needle])
    plain = policies.get("learned", adapter=Fixed()).score(ctx)
    pooled = policies.get("learned", adapter=Fixed(), kernel_size=3).score(ctx)
    assert set(plain[0, 0].topk(3).indices.tolist()) == {needle, 0, 1}
    assert set(pooled[0, 0].topk(3).indices.tolist()) == {needle - 1, needle, needle + 1}
    with pytest.raises(ValueError, match="kernel_size"):
        policies.get("learned", adapter=Fixed(), kernel_size=4)


def test_fill_spans_fills_gaps_between_high_scores_and_leaves_the_flanks():
    from sparsekv.policies.base import fill_spans

    x = torch.tensor([[[0.0, 5, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 3, 0]]])
    # reach 4: the gap 1..5 (both ends within 4) is raised to the lower end (4); 8-9 see 4 on
    # the left within 4 and 3 on the right within 4; 6-7 and 10-11 have a side without a peak
    assert fill_spans(x, 4)[0, 0].tolist() == [0, 5, 4, 4, 4, 4, 0, 0, 3, 3, 0, 0, 3, 0]
    assert fill_spans(x, 8)[0, 0].tolist() == [0, 5, 4, 4, 4, 4, 3, 3, 3, 3, 3, 3, 3, 0]
    assert torch.equal(fill_spans(x, 0), x) and torch.equal(fill_spans(x, 1), x)  # no gap of 0
    # -inf stays -inf at the ends (nothing on one side), batch and heads are independent
    y = torch.tensor([[[float("-inf"), 1.0, float("-inf"), 2.0]], [[2.0, 0.0, 0.0, 1.0]]])
    assert fill_spans(y, 2).tolist() == [[[float("-inf"), 1.0, 1.0, 2.0]], [[2.0, 1.0, 1.0, 1.0]]]
    # peaks: only entries at or above the row's quantile are gap ends; the small bumps of the tail
    # (1, 0, 1) are left alone at 0.85 and filled without it
    z = torch.tensor([[[0.0, 5, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 3, 0, 1, 0, 1, 0]]])
    assert fill_spans(z, 4)[0, 0, 13:].tolist() == [1, 1, 1, 1, 0]
    assert fill_spans(z, 4, peaks=0.85)[0, 0].tolist() == [0, 5, 4, 4, 4, 4, 0, 0, 3, 3, 0, 0, 3, 0, 1, 0, 1, 0]


def test_learned_span_fill_keeps_a_run_whose_ends_the_head_flags():
    Fixed, ctx = _fixed_prior_prefill(40, [10, 30])  # the two ends of a 21-token run (a UUID, say)
    run = set(range(10, 31))
    plain = policies.get("learned", adapter=Fixed()).score(ctx)
    filled = policies.get("learned", adapter=Fixed(), span_fill=20).score(ctx)
    assert not run <= set(plain[0, 0].topk(21).indices.tolist())  # the head alone keeps the ends
    assert set(filled[0, 0].topk(21).indices.tolist()) == run
    assert filled[..., :10].max() < 1 and filled[..., 31:].max() < 1  # outside the run: background
    # each token of the run needs a flagged end within `span_fill` on both sides: 16 leaves the
    # three tokens next to each end (more than 16 from the other end) as they were
    short = policies.get("learned", adapter=Fixed(), span_fill=16).score(ctx)
    assert set(short[0, 0].topk(15).indices.tolist()) == {10, 30, *range(14, 27)}
    assert short[..., 11:14].max() < 1
    for bad in (-1, 1.5, True, 5000):
        with pytest.raises(ValueError, match="span_fill"):
            policies.get("learned", adapter=Fixed(), span_fill=bad)
    for bad in (-0.1, 1.0, "0.9", True):
        with pytest.raises(ValueError, match="span_peaks"):
            policies.get("learned", adapter=Fixed(), span_fill=16, span_peaks=bad)


def test_learned_head_layer_first_scores_every_layer_from_the_first_layers_inputs():
    from types import SimpleNamespace

    model = tiny_model("llama")  # 4 layers, all budgeted
    adapter = _FakeAdapter()
    adapter.config = SimpleNamespace(layers=[0, 1, 2, 3])
    cfg = EvictionConfig(budget=0.25, sink_tokens=0, recent_window=0)
    pol = policies.get("learned", adapter=adapter, head_layer="first")
    captured = {}
    hook = model.model.layers[0].input_layernorm.register_forward_hook(lambda m, a, out: captured.setdefault("h", out))
    cache = SparseKVCache(model, cfg, pol)
    ids = _ids(1, 64)
    model(input_ids=ids, cache=cache)
    hook.remove()
    assert adapter.calls == [(0, (1, 64, 64))] * 4  # layer 0's head, layer 0's inputs, for all
    expected = captured["h"][0, :, 0].topk(16).indices.sort().values
    for i in range(4):
        assert torch.equal(cache.layers[i].positions[0, 0], expected)
    # decoding: each new token is scored once per layer from layer 0's input of that token
    model(input_ids=_ids(1, 1), cache=cache)
    assert adapter.calls[-4:] == [(0, (1, 1, 64))] * 4
    # a fork of a recorded prefill keeps what the live prefill kept
    base = SparseKVCache(model, EvictionConfig(budget=1.0), "full", record=("window",))
    model(input_ids=ids, cache=base)
    forked = base.fork(cfg, policies.get("learned", adapter=adapter, head_layer="first"))
    for i in range(4):
        assert torch.equal(forked.layers[i].positions[0, 0], expected)
    for c in (cache, base, forked):
        c.close()
    with pytest.raises(ValueError, match="head_layer"):
        policies.get("learned", adapter=adapter, head_layer="last")
