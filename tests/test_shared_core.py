"""`EvictionConfig.shared_core`: the entries the first budgeted layer ranks highest are kept by
every budgeted layer, within each layer's own budget (the schedule's bytes unchanged)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_model

from sparsekv import EvictionConfig, SparseKVCache


def _ids(n: int, b: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (b, n), generator=g)


def _prefill(model, ids, **cfg):
    cache = SparseKVCache(model, EvictionConfig(**cfg), "knorm")
    first = cache.layers[0]
    seen = {}
    original = first.evict

    def spy(capacity):  # the first layer's scores and positions before it evicts
        seen["scores"], seen["positions"] = first.scores.clone(), first.positions.clone()
        original(capacity)

    first.evict = spy
    model(input_ids=ids, cache=cache)
    return cache, seen


def test_every_budgeted_layer_keeps_the_first_layers_best_entries():
    model = tiny_model("llama")
    n, sinks, recent = 400, 4, 8
    kw = dict(budget=0.3, schedule="pyramid", sink_tokens=sinks, recent_window=recent)
    cache, seen = _prefill(model, _ids(n, b=2), shared_core=0.1, **kw)
    plain, _ = _prefill(model, _ids(n, b=2), **kw)
    assert cache.layer_lengths() == plain.layer_lengths()  # the same bytes as the pyramid's
    assert cache.kv_bytes() == plain.kv_bytes()
    k = math.ceil(0.1 * n)
    scores, positions = seen["scores"], seen["positions"]
    protected = (positions < sinks) | (positions >= n - recent)
    for b in range(2):
        for h in range(scores.shape[1]):
            s = scores[b, h].masked_fill(protected[b, h], float("-inf"))
            core = set(positions[b, h, s.topk(k).indices].tolist())
            for layer in cache.layers:
                assert core <= set(layer.positions[b, h].tolist())
    # without the core the last layer loses some of them (the test can fail)
    last = plain.layers[-1].positions
    s = scores[0, 0].masked_fill(protected[0, 0], float("-inf"))
    assert not set(positions[0, 0, s.topk(k).indices].tolist()) <= set(last[0, 0].tolist())


def test_static_layout_keeps_what_the_dynamic_one_keeps():
    """Chunk by chunk (the static layout prefills in chunks), each chunk's core is kept; an
    entry that joins the core later may already be gone from a deeper layer."""
    model = tiny_model("llama")
    ids = _ids(400, b=2)
    kw = dict(budget=0.3, schedule="pyramid", recent_window=8, prefill_chunk=8, shared_core=0.1)
    dyn, _ = _prefill(model, ids, **kw)
    sta, _ = _prefill(model, ids, layout="static", max_length=512, **kw)
    plain, _ = _prefill(model, ids, **{**kw, "shared_core": 0.0})
    assert torch.equal(dyn.shared.core, sta.shared.core)
    same = [torch.equal(a.positions.sort(-1).values, b.positions.sort(-1).values)
            for a, b in zip(dyn.layers, sta.layers)]
    assert all(same)
    assert not all(torch.equal(a.positions, b.positions) for a, b in zip(dyn.layers, plain.layers))


def test_off_is_the_plain_schedule():
    model = tiny_model("qwen3")
    ids = _ids(300)
    a, _ = _prefill(model, ids, budget=0.3, schedule="pyramid", recent_window=8)
    b, _ = _prefill(model, ids, budget=0.3, schedule="pyramid", recent_window=8, shared_core=0.0)
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.positions, lb.positions)
    assert "shared_core" not in EvictionConfig(budget=0.3).to_dict()
    assert EvictionConfig.from_dict(EvictionConfig(budget=0.3, shared_core=0.05).to_dict()).shared_core == 0.05


def test_the_core_is_bounded_by_the_smallest_layers_room():
    model = tiny_model("llama")
    n = 400
    # pyramid at 0.3: the last layer keeps 0.15 x 400 = 60 entries, 4 + 48 of them protected
    cache, _ = _prefill(model, _ids(n), budget=0.3, schedule="pyramid", sink_tokens=4,
                        recent_window=48, shared_core=0.15)
    core = cache.shared.core
    assert core.sum(dim=-1).tolist() == [[60 - 4 - 48] * core.shape[1]]  # per KV head
    assert cache.layer_lengths()[-1] == 60


def test_decoding_keeps_the_core_through_reranks():
    model = tiny_model("gemma3")
    ids = _ids(300)
    cfg = EvictionConfig(budget=0.3, schedule="pyramid", recent_window=8, rerank_every=4, shared_core=0.1)
    cache = SparseKVCache(model, cfg, "h2o")
    out = model.generate(ids, cache=cache, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert out.shape[-1] == 312
    core = cache.shared.core
    assert core is not None and core.any()
    for layer in (cache.layers[i] for i in cache.budgeted_layers):
        kept = layer.positions[0, 0]
        kept = kept[(kept >= 0) & (kept < core.shape[-1])]
        assert core[0, 0, kept].sum() == core[0, 0].sum()


@pytest.mark.parametrize("value", [-0.1, 1.0, "0.1", True, float("nan")])
def test_bad_values_name_the_field(value):
    with pytest.raises(ValueError, match="shared_core"):
        EvictionConfig(budget=0.3, shared_core=value)


def test_a_core_larger_than_the_smallest_layer_is_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"shared_core=0.2 .*smallest budgeted layer.*0.15"):
        SparseKVCache(model, EvictionConfig(budget=0.3, schedule="pyramid", shared_core=0.2), "knorm")
