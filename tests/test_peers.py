"""The query-agnostic peers as policies (KVzip, Expected Attention): exact against slow per-head
references written from the formulas (PEERS.md), the repeat pass leaves the cache as it was,
fork equals a live prefill, and budget 1.0 changes nothing."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from sparsekv import EvictionConfig, SparseKVCache, policies
from sparsekv.evaluation.tasks.codec import AsciiCodec
from sparsekv.models.families import attention_modules
from sparsekv.policies.reconstruction import repeat_ids

PEER_FAMILIES = ("llama", "qwen3", "gemma3")
CODEC = AsciiCodec()
N = 70  # context tokens: > the tiny Gemma's window (32); repeat chunks of 24, 24 and 22
CHUNK = 24


def _model(family: str, dtype=torch.float64):
    # Gemma 3 with query_pre_attn_scalar != head_dim, so the layer's own scaling is exercised.
    extra = {"query_pre_attn_scalar": 8} if family == "gemma3" else {}
    return tiny_model(family, **extra).to(dtype)


def _policy(name: str):
    if name == "kvzip":
        return policies.get("kvzip", encode=CODEC.encode, chunk=CHUNK)
    return policies.get(name)


def _ids(n: int = N, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def _config(budget: float = 0.3) -> EvictionConfig:
    return EvictionConfig(budget=budget, sink_tokens=4, recent_window=8)


# ---- slow references --------------------------------------------------------------------------
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def _layer_qkv(model, ids: torch.Tensor, layer: int):
    """One plain forward over `ids` (no cache); the layer's post-RoPE q, k, v `(heads, n, d)`, its
    pre-RoPE q, and the rotary embedding, rebuilt from the attention input by hand."""
    mod = attention_modules(model)[layer]
    seen = {}

    def hook(module, args, kwargs):
        seen["h"] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        seen["pe"] = kwargs["position_embeddings"]

    handle = mod.register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    handle.remove()
    h, (cos, sin), d = seen["h"][0], seen["pe"], mod.head_dim
    with torch.no_grad():
        q = mod.q_proj(h).view(h.shape[0], -1, d).transpose(0, 1)
        k = mod.k_proj(h).view(h.shape[0], -1, d).transpose(0, 1)
        v = mod.v_proj(h).view(h.shape[0], -1, d).transpose(0, 1)
        if hasattr(mod, "q_norm"):
            q, k = mod.q_norm(q), mod.k_norm(k)
    cos, sin = cos[0], sin[0]
    def rot(x):
        return x * cos + _rotate_half(x) * sin

    return rot(q), rot(k), v, q


def _scaling(model) -> float:
    cfg = model.config
    return cfg.query_pre_attn_scalar**-0.5 if cfg.model_type.startswith("gemma3") else cfg.head_dim**-0.5


def kvzip_reference(model, ids: torch.Tensor, layer: int, sinks: int = 4) -> torch.Tensor:
    """`(kv_heads, n)`: per chunk, one forward over context + repeat; for each KV head, query head
    of its group and repeat query, the softmax over [sinks outside the chunk, chunk, repeat up to
    the query]; the score of a chunk entry is its maximum."""
    n = ids.shape[1]
    kvh = model.config.num_key_value_heads
    groups = model.config.num_attention_heads // kvh
    scores = torch.zeros(kvh, n, dtype=torch.float64)
    for rep, s, e in repeat_ids(ids[0].tolist(), CODEC.encode, CHUNK):
        q, k, _, _ = _layer_qkv(model, torch.tensor([ids[0].tolist() + rep]), layer)
        for g in range(kvh):
            for j in range(groups):
                for t in range(len(rep)):
                    cols = list(range(min(sinks, s))) + list(range(s, e)) + list(range(n, n + t + 1))
                    logits = _scaling(model) * (k[g, cols] @ q[g * groups + j, n + t])
                    p = torch.softmax(logits, 0)[min(sinks, s) : min(sinks, s) + e - s]
                    scores[g, s:e] = torch.maximum(scores[g, s:e], p)
    return scores


def expected_attention_reference(model, ids: torch.Tensor, layer: int, sinks: int = 4,
                                 future: int = 512) -> torch.Tensor:
    """`(kv_heads, n)`: kvpress's formula, one query head at a time."""
    n = ids.shape[1]
    _, k, v, q_pre = _layer_qkv(model, ids, layer)
    kvh, d = k.shape[0], k.shape[-1]
    groups = q_pre.shape[0] // kvh
    inner = model.model
    pos = torch.arange(n, n + future)[None]
    x = torch.zeros(1, dtype=torch.float64)
    if model.config.model_type.startswith("gemma3"):
        cos, sin = inner.rotary_emb(x, pos, model.config.layer_types[layer])
    else:
        cos, sin = inner.rotary_emb(x, pos)
    P = torch.zeros(d, d, dtype=torch.float64)
    P[: d // 2, d // 2 :], P[d // 2 :, : d // 2] = -torch.eye(d // 2), torch.eye(d // 2)
    R = torch.stack([torch.diag(c) + torch.diag(s_) @ P for c, s_ in zip(cos[0], sin[0])]).mean(0)
    scale = _scaling(model)
    out = torch.zeros(kvh, n, dtype=torch.float64)
    for g in range(kvh):
        for j in range(groups):
            qs = q_pre[g * groups + j, sinks:]
            mu = qs.mean(0)
            sigma = (qs - mu).T @ (qs - mu) / qs.shape[0]
            mu, sigma = R @ mu, R @ sigma @ R.T
            z = torch.stack([scale * mu @ k[g, i] + scale**2 / 2 * k[g, i] @ sigma @ k[g, i] for i in range(sinks, n)])
            out[g, sinks:] += torch.softmax(z, 0) / groups
    return out * v.norm(dim=-1)


def _expected_kept(scores: torch.Tensor, capacity: int, n: int, cfg: EvictionConfig) -> list[list[int]]:
    kept = []
    for row in scores:
        row = row.clone()
        pos = torch.arange(n)
        row[(pos < cfg.sink_tokens) | (pos >= n - cfg.recent_window)] = float("inf")
        kept.append(sorted(row.topk(capacity).indices.tolist()))
    return kept


REFERENCES = {"kvzip": kvzip_reference, "expected_attention": expected_attention_reference}


# ---- tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", PEER_FAMILIES)
@pytest.mark.parametrize("name", ["kvzip", "expected_attention"])
def test_kept_set_matches_slow_reference(family, name):
    model = _model(family)
    ids, cfg = _ids(), _config()
    cache = SparseKVCache(model, cfg, _policy(name))
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    for idx in cache.budgeted_layers:
        layer = cache.layers[idx]
        expected = _expected_kept(REFERENCES[name](model, ids, idx), layer.capacity(), N, cfg)
        assert layer.positions[0].tolist() == expected, f"layer {idx}"
        assert layer.keys.shape[-2] < N  # something was evicted


@pytest.mark.parametrize("family", PEER_FAMILIES)
@pytest.mark.parametrize("name", ["kvzip", "expected_attention"])
def test_budget_one_generates_like_full_cache(family, name):
    model = _model(family, torch.float32)
    ids = _ids(48, seed=1)
    outs = []
    for policy in ("full", _policy(name)):
        cache = SparseKVCache(model, EvictionConfig(budget=1.0), policy)
        outs.append(model.generate(ids, cache=cache, max_new_tokens=12, do_sample=False)[0].tolist())
    assert outs[0] == outs[1]


def test_budget_one_with_left_padding_generates_like_full_cache():
    model = _model("gemma3", torch.float32)
    ids = _ids(48, seed=2, batch=2)
    ids[1, :10] = 0
    mask = (ids != 0).long()
    outs = []
    for policy in ("full", _policy("kvzip")):
        cache = SparseKVCache(model, EvictionConfig(budget=1.0), policy)
        outs.append(model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=8,
                                   do_sample=False).tolist())
    assert outs[0] == outs[1]


def _state(cache: SparseKVCache) -> list:
    return [(layer.get_seq_length(), layer.keys, layer.values, getattr(layer, "positions", None))
            for layer in cache.layers]


@pytest.mark.parametrize("family", PEER_FAMILIES)
def test_repeat_pass_leaves_the_cache_as_it_was(family):
    model = _model(family, torch.float32)
    ids = _ids()
    caches = [SparseKVCache(model, EvictionConfig(budget=1.0), p) for p in ("full", _policy("kvzip"))]
    with torch.no_grad():
        for cache in caches:
            model(input_ids=ids, cache=cache, use_cache=True)
    full, kvzip = caches
    assert kvzip.layer_lengths() == full.layer_lengths()
    assert kvzip.tokens_seen() == full.tokens_seen() == kvzip.get_seq_length() == N
    for (n0, k0, v0, p0), (n1, k1, v1, p1) in zip(_state(full), _state(kvzip)):
        assert n0 == n1
        assert torch.equal(k0, k1) and torch.equal(v0, v1)  # bitwise, sliding layers included
        assert (p0 is None) == (p1 is None) and (p0 is None or torch.equal(p0, p1))
    # under a budget: the sliding layers and the true token count are untouched too
    small = SparseKVCache(model, _config(), _policy("kvzip"))
    with torch.no_grad():
        model(input_ids=ids, cache=small, use_cache=True)
    assert small.tokens_seen() == N
    for i, (layer, ref) in enumerate(zip(small.layers, full.layers)):
        assert layer.get_seq_length() == ref.get_seq_length() == N
        if i not in small.budgeted_layers:
            assert torch.equal(layer.keys, ref.keys) and torch.equal(layer.values, ref.values)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
@pytest.mark.parametrize("name", ["kvzip", "expected_attention"])
def test_fork_equals_live_prefill(family, name):
    model = _model(family)
    ids, question, cfg = _ids(), _ids(6, seed=3), _config()
    live = SparseKVCache(model, cfg, _policy(name))
    rec = SparseKVCache(model, EvictionConfig(budget=1.0), "full", record=("last",))
    with torch.no_grad():
        model(input_ids=ids, cache=live, use_cache=True)
        model(input_ids=ids, cache=rec, use_cache=True)
        forked = rec.fork(cfg, _policy(name))
    assert forked.layer_lengths() == live.layer_lengths() and forked.tokens_seen() == N
    for a, b in zip(live.layers, forked.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        if hasattr(a, "positions"):
            assert torch.equal(a.positions, b.positions)
    with torch.no_grad():  # a question through each: the same logits and kept entries
        la = model(input_ids=question, cache=live, use_cache=True).logits
        lb = model(input_ids=question, cache=forked, use_cache=True).logits
    torch.testing.assert_close(la, lb)
    assert [layer.positions.tolist() for layer in live.layers if hasattr(layer, "positions")] == [
        layer.positions.tolist() for layer in forked.layers if hasattr(layer, "positions")
    ]


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_forks_of_one_prefill_run_the_repeat_once_and_equal_live_prefills(family):
    """Every budget's kvzip fork of one recorded prefill keeps what its own live prefill keeps,
    and only the first fork runs the repeat forward (the others reuse its attention); a policy
    with another chunk layout runs its own."""
    model = _model(family)
    ids = _ids()
    rec = SparseKVCache(model, EvictionConfig(budget=1.0), "full", record=("last",))
    calls = []
    hook = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with torch.no_grad():
            model(input_ids=ids, cache=rec, use_cache=True)
            calls.clear()
            for i, budget in enumerate((0.2, 0.3, 0.5)):
                cfg = _config(budget)
                forked = rec.fork(cfg, _policy("kvzip"))
                assert len(calls) == (-(-N // CHUNK) if i == 0 else 0), budget  # one per chunk
                calls.clear()
                live = SparseKVCache(model, cfg, _policy("kvzip"))
                model(input_ids=ids, cache=live, use_cache=True)
                calls.clear()
                assert forked.layer_lengths() == live.layer_lengths()
                for a, b in zip(live.layers, forked.layers):
                    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            rec.fork(_config(0.3), policies.get("kvzip", encode=CODEC.encode, chunk=CHUNK + 1))
            assert calls, "a different repeat_key must run its own repeat"
    finally:
        hook.remove()
    assert len(rec._repeat_memo) == 2
    rec.close()
    assert not rec._repeat_memo


def test_later_multi_token_step_is_repeated_and_older_scores_carried():
    model = _model("llama", torch.float32)
    cache = SparseKVCache(model, _config(), _policy("kvzip"))
    with torch.no_grad():
        model(input_ids=_ids(), cache=cache, use_cache=True)
        layer = cache.layers[0]
        before = dict(zip(layer.positions[0, 0].tolist(), layer.scores[0, 0].tolist()))
        model(input_ids=_ids(10, seed=4), cache=cache, use_cache=True)
    after = dict(zip(layer.positions[0, 0].tolist(), layer.scores[0, 0].tolist()))
    assert cache.tokens_seen() == N + 10 and all(layer.pending == 0 for layer in cache.layers[:1])
    assert all(after[p] == before[p] for p in after if p < N)
    assert all(0.0 < after[p] <= 1.0 for p in after if p >= N)


def test_kvzip_errors_name_what_is_missing():
    model = _model("llama", torch.float32)
    with pytest.raises(ValueError, match="prefill_chunk"):
        SparseKVCache(model, EvictionConfig(budget=0.5, prefill_chunk=16), _policy("kvzip"))
    with pytest.raises(ValueError, match="tokenizer=.*encode="):
        policies.get("kvzip")
    with pytest.raises(ValueError, match="chunk"):
        policies.get("kvzip", encode=CODEC.encode, chunk=0)
    cache = SparseKVCache(model, _config(), _policy("kvzip"))
    embeds = model.get_input_embeddings()(_ids(20))
    with pytest.raises(ValueError, match="input_ids"), torch.no_grad():
        model(inputs_embeds=embeds, cache=cache, use_cache=True)


def test_kvzip_accepts_a_hugging_face_style_tokenizer():
    class Tok:
        def encode(self, text, add_special_tokens=True):
            return ([1] if add_special_tokens else []) + CODEC.encode(text)

    pol = policies.get("kvzip", tokenizer=Tok())
    assert pol.repeat_inputs([5, 6, 7])[0][0] == CODEC.encode("\n\nRepeat the previous context exactly.") + [5, 6, 7]


def test_expected_attention_arguments_are_checked():
    with pytest.raises(ValueError, match="future_positions"):
        policies.get("expected_attention", future_positions=0)
    with pytest.raises(ValueError, match="epsilon"):
        policies.get("expected_attention", epsilon=-1.0)


def test_bench_prefill_writes_cost_columns(tmp_path, monkeypatch):
    import json

    from eval import bench_prefill as bench
    monkeypatch.setattr(bench, "prose_ids", lambda codec, length: _ids(length)[0].tolist())
    assert bench.main(["--model", "tiny:gemma3", "--length", "96", "--rounds", "1", "--policies",
                       "kvzip,expected_attention", "--out", str(tmp_path)]) == 0
    rows = {r["method"]: r for r in json.loads((tmp_path / "prefill.json").read_text())["rows"]}
    assert set(rows) == {"full", "kvzip", "expected_attention"}
    assert rows["full"]["prefill_ratio"] == 1.0 and rows["kvzip"]["prefill_ratio"] > 0
    assert rows["kvzip"]["peak_kv_mb"] >= rows["expected_attention"]["peak_kv_mb"]  # the repeat's entries
    assert all(r["scorer_params"] == 0 for r in rows.values())
    assert "| kvzip |" in (tmp_path / "prefill.md").read_text()


@pytest.mark.parametrize(("name", "family"), [("kvzip", "qwen3"), ("expected_attention", "gemma3")])
def test_left_padded_row_keeps_what_it_keeps_alone(name, family):
    """Padding is left out of the repeat and of the statistics: with generate-style position ids,
    a left-padded row keeps the same tokens as the same row prefilled alone. (Not KVzip on Gemma
    3: the padding inside a repeat chunk shortens its sliding windows; see `repeat_pass`.)"""
    model = _model(family)
    pad, b = 10, _ids(60, seed=5)
    ids = torch.cat([_ids(70, seed=6), torch.cat([torch.zeros(1, pad, dtype=torch.long), b], 1)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    policy = policies.get("kvzip", encode=CODEC.encode, chunk=128) if name == "kvzip" else _policy(name)
    cfg = EvictionConfig(budget=20, sink_tokens=4, recent_window=8)
    batch, alone = SparseKVCache(model, cfg, policy), SparseKVCache(model, cfg, policy)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=batch, use_cache=True)
        model(input_ids=b, cache=alone, use_cache=True)
    for idx in batch.budgeted_layers:
        padded, single = batch.layers[idx].positions[1], alone.layers[idx].positions[0]
        assert (padded - pad).tolist() == single.tolist()


def test_harness_builds_kvzip_with_its_codec_and_forks_both_peers():
    from sparsekv.evaluation.config import EvalConfig
    from sparsekv.evaluation.running.execute import Runner

    model = _model("gemma3", torch.float32)
    cfg = EvalConfig(model="tiny:gemma3", policies=["kvzip", "expected_attention"], budgets=[0.3],
                     tasks=["passkey"], samples=1)
    runner = Runner(model, CODEC, cfg)
    built = {spec.spec: runner.build_policy(spec) for spec in cfg.policy_specs}
    assert built["kvzip"].encode == CODEC.encode
    forks = runner.plan()
    assert all(forks.forkable[spec.spec] for spec in cfg.policy_specs)
