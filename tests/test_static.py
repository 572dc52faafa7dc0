"""The static-capacity layout (`EvictionConfig(layout="static")`): the same kept set and the same
logits as the default layout at every step, for every policy; fixed buffers that are never
reallocated while decoding; clear errors when a step does not fit; a compiled decode step.

The step-by-step comparisons run the tiny models in float64: the static layout attends over all
its slots (empty ones masked) where the default layout attends over the kept entries only, so
the sums run in another order, and in float32 two scores within rounding of each other at the
budget boundary (a near-tie, e.g. two key norms) may be ranked either way. The float32 tests
compare what a user sees: the generated tokens and logits within 1e-5."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from reference import run_sparse

from sparsekv import EvictionConfig, ScorerAdapter, SparseKVCache, policies
from sparsekv.cache.layer import _PER_ENTRY
from sparsekv.cache.slots import ENTRY_NAMES, slot_count
from sparsekv.cache.static import finish_steps, slots_per_layer
from sparsekv.policies.base import _REGISTRY

SMALL = dict(
    budget=0.3, recent_window=4, sink_tokens=2, rerank_every=5, evict_slack=2, prefill_chunk=16
)


def _ids(b=2, n=72, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (b, n), generator=g)


def _left_padded(b=3, n=48, seed=1):
    ids = _ids(b, n, seed)
    mask = torch.ones(b, n, dtype=torch.long)
    for i in range(1, b):
        ids[i, : 5 * i] = 0
        mask[i, : 5 * i] = 0
    return ids, mask


def _policy(name: str, model):
    if name.startswith("learned"):  # an untrained head (the same for both layouts): random but real scores
        with torch.random.fork_rng():
            torch.manual_seed(0)
            adapter = ScorerAdapter.for_model(model)
        if name == "learned0":  # blend 0: decode steps are scored inside the forward
            return adapter.policy(blend=0.0, recency=0.5, kernel_size=3, span_fill=2)
        return adapter.policy(blend=0.5, head_layer="first", kernel_size=3)
    return policies.get(name)


def _unsupported(name: str) -> str | None:
    """Why policy `name` does not run on the static layout, or None."""
    if getattr(_REGISTRY[name], "scores_after_prefill", False):
        return "a repeat pass (KVzip) appends a repeat prompt and restores layers from snapshots"
    return None


def _pair(model, name, **kw):
    """The same policy and settings on both layouts."""
    out = []
    for layout in ("dynamic", "static"):
        cfg = EvictionConfig(**{**SMALL, "max_length": 128, **kw, "layout": layout})
        out.append(SparseKVCache(model, cfg, _policy(name, model)))
    return out


def _assert_same_steps(model, ids, steps, name, mask=None, tol=1e-10, **kw):
    """Step both layouts through `ids`; after every step the kept positions (the kept set, in
    the same order) are equal and the logits within `tol`. Returns the static cache."""
    dyn, sta = _pair(model, name, **kw)
    ld, sd = run_sparse(model, dyn, ids, steps, mask)
    ls, ss = run_sparse(model, sta, ids, steps, mask)
    evicted = False
    for j in range(len(steps)):
        for i in dyn.budgeted_layers:
            assert torch.equal(sd[j][i], ss[j][i]), (name, j, i)
            evicted |= sd[j][i].shape[-1] < sum(steps[: j + 1])
        err = (ld[j][:, -1] - ls[j][:, -1]).abs().max().item()
        assert err < tol, (name, j, err)
    assert evicted or not dyn.policy.evicts, "the test must evict"
    dyn.close()
    return sta


@pytest.mark.parametrize("name", policies.available())
def test_every_policy_keeps_the_same_set_and_logits(family, name):
    if _unsupported(name):
        pytest.skip(_unsupported(name))
    model = tiny_model(family).double()
    steps = [40] + [1] * 24  # prefill in chunks of 16, then decode with evictions and re-ranks
    sta = _assert_same_steps(model, _ids(), steps, name)
    sta.close()


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("name", ["learned0", "streaming"])
def test_arrivals_scored_in_the_forward_keep_the_same_set_and_logits(family, name, quantize):
    """Policies with `score_arrival` (the learned one without blending, StreamingLLM): the static
    layout scores each decode step inside the forward and only decides evictions after it."""
    model = tiny_model(family).double()
    steps = [40] + [1] * 24
    sta = _assert_same_steps(model, _ids(), steps, name, quantize=quantize)
    for i in sta.budgeted_layers:  # every decode step of every budgeted layer took that path
        assert sta.layers[i].arrivals_in_forward == 24, i
        assert sta.layers[i]._mapped, i  # its evictions left the keys and values in their slots
    sta.close()


def test_evictions_leave_the_kept_keys_in_their_slots():
    """With decode steps scored in the forward, an eviction gathers only per-entry scalars: every
    kept entry's key and value stay in the slot they were written to, freed slots take the next
    tokens, and reading `keys` (in the kept order) gives the kept entries' keys."""
    model = tiny_model("llama").double()
    cfg = EvictionConfig(**{**SMALL, "max_length": 128, "layout": "static"})
    cache = SparseKVCache(model, cfg, _policy("learned0", model))
    ids = _ids(2, 64)
    model(input_ids=ids[:, :40], cache=cache)
    layer = cache.layers[cache.budgeted_layers[0]]
    written = {}  # (position, batch, head) -> (slot, key), as first seen
    for t in range(40, 64):
        model(input_ids=ids[:, t : t + 1], cache=cache)
        buf = layer._slots.buf
        where = buf["slot_of"][:, :, : layer.stored()].long()
        pos = layer.positions
        for b in range(2):
            for h in range(pos.shape[1]):
                for i in range(pos.shape[-1]):
                    p, slot = int(pos[b, h, i]), int(where[b, h, i])
                    key = buf["keys"][b, h, slot]
                    if (p, b, h) in written:  # never moved since it was first seen there
                        assert written[(p, b, h)][0] == slot, (t, p)
                        assert torch.equal(written[(p, b, h)][1], key), (t, p)
                    else:
                        written[(p, b, h)] = (slot, key.clone())
                    assert layer._valid[b, h, slot]
        assert int(layer._valid.sum()) == 2 * pos.shape[1] * pos.shape[-1]  # nothing else attended
    assert layer._mapped and layer.evicted
    expected = buf["keys"].gather(2, where[..., None].expand(-1, -1, -1, buf["keys"].shape[-1]))
    assert torch.equal(layer.keys, expected)  # read in the kept order: put back in that order
    assert not layer._mapped and torch.equal(buf["keys"][:, :, : layer.stored()], expected)
    cache.close()


@pytest.mark.parametrize("op", ["repeat", "select"])
def test_batch_operations_after_slot_mapped_evictions_match_the_dynamic_layout(op):
    model = tiny_model("llama").double()
    ids = _ids(2, 60)
    dyn, sta = _pair(model, "learned0")
    logits = []
    for cache in (dyn, sta):
        model(input_ids=ids[:, :40], cache=cache)
        for t in range(40, 50):
            model(input_ids=ids[:, t : t + 1], cache=cache)
        if op == "repeat":
            cache.batch_repeat_interleave(2)
            more = ids[:, 50:].repeat_interleave(2, 0)
        else:
            cache.batch_select_indices(torch.tensor([1]))
            more = ids[1:, 50:]
        out = [model(input_ids=more[:, j : j + 1], cache=cache).logits for j in range(more.shape[1])]
        logits.append(torch.cat(out, 1))
    layer = sta.layers[sta.budgeted_layers[0]]
    assert layer._mapped  # evictions after the batch operation went on without moving entries
    assert torch.equal(dyn.layers[dyn.budgeted_layers[0]].positions, layer.positions)
    assert (logits[0] - logits[1]).abs().max() < 1e-10
    dyn.close()
    sta.close()


def test_a_policy_without_score_arrival_is_scored_after_the_forward():
    model = tiny_model("llama").double()
    sta = _assert_same_steps(model, _ids(), [40] + [1] * 8, "knorm")
    assert all(sta.layers[i].arrivals_in_forward == 0 for i in sta.budgeted_layers)
    sta.close()


def test_learned_score_arrival_is_what_score_gives_the_new_entry():
    model = tiny_model("llama")
    policy = _policy("learned0", model)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 1, model.config.hidden_size, generator=g)
    positions = torch.tensor([[[57]], [[-1]]]).expand(2, model.config.num_key_value_heads, 1)
    prev = torch.randn(2, positions.shape[1], 9, generator=g)
    ctx = policies.ScoreContext(
        layer_idx=0, phase="decode", keys=None, values=None,
        positions=torch.cat([torch.zeros(2, positions.shape[1], 9, dtype=torch.long), positions], -1),
        num_new=1, tokens_seen=58, prev_scores=prev, hidden_states=hidden,
    )
    full = policy.score(ctx)
    assert torch.equal(full[..., :9], prev)
    assert torch.equal(full[..., 9:], policy.score_arrival(0, hidden, positions))
    assert policies.get("snapkv").score_arrival(0, None, positions) is None  # reads attention


@pytest.mark.parametrize("name", ["snapkv", "h2o", "tova", "learned", "learned0"])
def test_left_padding_keeps_the_same_set_and_logits(name):
    model = tiny_model("llama").double()
    ids, mask = _left_padded()
    steps = [48] + [1] * 16
    mask = torch.cat([mask, torch.ones(3, 16, dtype=torch.long)], 1)
    ids = torch.cat([ids, _ids(3, 16, seed=5)], 1)
    rows = mask[:, 47].bool()
    dyn, sta = _pair(model, name)
    ld, sd = run_sparse(model, dyn, ids, steps, mask)
    ls, ss = run_sparse(model, sta, ids, steps, mask)
    for j in range(len(steps)):
        for i in dyn.budgeted_layers:
            assert torch.equal(sd[j][i], ss[j][i]), (name, j, i)
        assert (ld[j][rows, -1] - ls[j][rows, -1]).abs().max() < 1e-10, (name, j)
    kept = ss[-1][dyn.budgeted_layers[0]][2]  # row 2 starts with 10 pads: none kept as a token
    assert not ((kept >= 0) & (kept < 10)).any()


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("name", ["knorm", "learned0"])
def test_a_prompt_chunked_one_token_at_a_time_marks_its_padding(name, quantize):
    """`prefill_chunk=1` with left padding: after the first token every chunk takes the static
    layout's decode path, which must mark a pad as the default layout does (before: the pads were
    attended, logits off by ~0.09)."""
    model = tiny_model("llama").double()
    ids, mask = _left_padded(3, 24)
    ids = torch.cat([ids, _ids(3, 6, seed=4)], 1)
    mask = torch.cat([mask, torch.ones(3, 6, dtype=torch.long)], 1)
    steps = [24] + [1] * 6
    dyn, sta = _pair(model, name, prefill_chunk=1, quantize=quantize)
    ld, sd = run_sparse(model, dyn, ids, steps, mask)
    ls, ss = run_sparse(model, sta, ids, steps, mask)
    rows = mask[:, 23].bool()
    for j in range(len(steps)):
        for i in dyn.budgeted_layers:
            assert torch.equal(sd[j][i], ss[j][i]), (name, j, i)
        assert (ld[j][rows, -1] - ls[j][rows, -1]).abs().max() < 1e-10, (name, j)
    dyn.close()
    sta.close()


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("name", ["snapkv", "knorm", "pyramidkv", "learned0"])
def test_generate_gives_the_same_tokens_with_padding(name, quantize):
    """float32, what a user sees: the same tokens and logits within 1e-5."""
    model = tiny_model("llama")
    ids, mask = _left_padded()
    outs = {}
    for cache in _pair(model, name, quantize=quantize, rerank_every=4):
        out = model.generate(
            ids,
            attention_mask=mask,
            cache=cache,
            max_new_tokens=24,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        kept = {i: cache.layers[i].positions.clone() for i in cache.budgeted_layers}
        outs[cache.config.layout] = (
            out.sequences,
            torch.stack(out.logits),
            kept,
            cache.layer_lengths(),
        )
        cache.close()
    (sd, ld, kd, nd), (ss, ls, ks, ns) = outs["dynamic"], outs["static"]
    assert torch.equal(sd, ss)
    assert (ld - ls).abs().max() < 1e-5
    assert nd == ns and all(torch.equal(kd[i], ks[i]) for i in kd)
    assert max(nd) < ids.shape[1] + 24  # evicted while decoding


@pytest.mark.parametrize(
    "kw",
    [
        dict(budget=12),
        dict(budget=0.25, schedule="pyramid"),
        dict(quantize="int8"),
        dict(rerank_every=0),
        dict(evict_slack=0, static_slack=16),
    ],
)
def test_settings_keep_the_same_set(kw):
    model = tiny_model("mistral").double()
    sta = _assert_same_steps(model, _ids(), [40] + [1] * 20, "snapkv", **kw)
    sta.close()


def test_gemma_sliding_layers_stay_dynamic():
    model = tiny_model("gemma3").double()
    sta = _assert_same_steps(model, _ids(), [40] + [1] * 20, "h2o")
    assert list(slots_per_layer(sta)) == sta.budgeted_layers == [3]
    sta.close()


# ops that read a tensor's value on the host, or whose output shape depends on its values: each
# one a device-to-host synchronization on a GPU (`.item()`, `bool(t)`, `int(t)` and the Python
# comparisons on tensors reach `_local_scalar_dense`)
HOST_READS = {
    "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique_dim",
    "aten::_unique2", "aten::unique_consecutive", "aten::equal", "aten::is_nonzero",
    "aten::argwhere", "aten::nonzero_static",
}


def _host_reads(fn, where: str = "/sparsekv/") -> list[str]:
    """The file:line (the innermost frame under `where`) of every op in `HOST_READS` that `fn`
    dispatches: the CPU stand-in for tests/test_cuda.py's CUDA sync debug mode."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    sites = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name in HOST_READS:
                frames = [f for f in traceback.extract_stack() if where in f.filename]
                if frames:
                    sites.append(f"{Path(frames[-1].filename).name}:{frames[-1].lineno} {func._schema.name}")
            return func(*args, **(kwargs or {}))

    with Reads():
        fn()
    return sites


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("layout", ["dynamic", "static"])
@pytest.mark.parametrize("name", [*policies.available(), "learned0"])
def test_decode_steps_read_nothing_on_the_host(name, layout, quantize):
    """Decode steps, incremental evictions and re-ranks, with every policy on both layouts, with
    and without INT8, dispatch no op that reads a value on the host (checked on the CPU for
    what tests/test_cuda.py checks on a GPU: a compiled, graph-captured step must not sync)."""
    if layout == "static" and name in _REGISTRY and _unsupported(name):
        pytest.skip(_unsupported(name))
    model = tiny_model("llama")
    chunk = {"prefill_chunk": None} if name == "kvzip" else {}  # it repeats the whole prompt
    cfg = EvictionConfig(**{**SMALL, "max_length": 128, "layout": layout, "quantize": quantize, **chunk})
    policy = (
        policies.get(name, encode=lambda text: [3 + ord(c) % 120 for c in text])
        if name == "kvzip"
        else _policy(name, model)
    )
    cache = SparseKVCache(model, cfg, policy)
    tok = model(input_ids=_ids(2, 40), cache=cache).logits[:, -1:].argmax(-1)
    first = cache.budgeted_layers[0]
    seen = []

    def decode():
        t = tok
        for i in range(12):  # incremental evictions and two re-ranks
            pos = torch.full((2, 1), 40 + i)
            t = model(input_ids=t, position_ids=pos, cache=cache).logits[:, -1:].argmax(-1)
            seen.append(cache.layer_lengths()[first])

    sites = _host_reads(decode)
    assert not sites, sorted(set(sites))
    assert len(set(seen)) > 1 or not cache.policy.evicts  # it evicted while decoding
    # the check can fail: a host read under the given path is caught, with its line
    assert _host_reads(lambda: bool(cache.layers[first].positions.sum() > 0), "test_static")
    cache.close()


def test_buffers_are_allocated_once_and_kv_bytes_reports_them():
    model = tiny_model("llama")
    cfg = EvictionConfig(**SMALL, layout="static", max_length=100)
    cache = SparseKVCache(model, cfg, "snapkv")
    ids = _ids()
    tok = model(input_ids=ids, cache=cache).logits[:, -1:].argmax(-1)
    layer = cache.layers[0]
    slots = slot_count(cfg, layer.fraction)
    assert slots == 30 + 16  # ceil(0.3 * 100) + room for a 16-token chunk
    buffers = {n: t.data_ptr() for n, t in layer._slots.buf.items()}
    assert set(buffers) >= {"keys", "values", "positions", "scores"}
    expected = (
        len(cache.budgeted_layers) * 2 * (2 * 2 * slots * 16 * 4)
    )  # (K, V) x (b, h, slots, d) float32
    assert cache.kv_bytes() == expected
    lengths = []
    for _ in range(30):  # incremental evictions and 6 re-ranks
        tok = model(input_ids=tok, cache=cache).logits[:, -1:].argmax(-1)
        lengths.append(cache.layer_lengths()[0])
        assert cache.kv_bytes() == expected
        assert {n: t.data_ptr() for n, t in layer._slots.buf.items()} == buffers  # written in place
        assert layer._slots.buf["keys"].shape[2] == slots
    assert len(set(lengths)) > 1 and max(lengths) <= layer.capacity() + cfg.evict_slack
    pos = layer._slots.buf["positions"]
    n = layer.keys.shape[2]
    assert (pos[..., n:] == -1).all() and (pos[..., :n] >= 0).all()  # empty slots are masked by -1
    # the bookkeeping: per slot and KV head an int64 position, a float32 score, the int32 slot
    # map and free list, the bool mask of slots to attend; an int64 row start per (b, KV head)
    per_slot = 8 + 4 + 4 + 4 + 1
    mem = cache.memory_bytes()
    assert mem["kv"] == expected
    assert mem["bookkeeping"] == len(cache.budgeted_layers) * 2 * 2 * (slots * per_slot + 8)
    assert mem["total"] == mem["kv"] + mem["bookkeeping"]
    cache.close()


@pytest.mark.parametrize("name", ["snapkv", "learned0"])
def test_fork_into_the_static_layout_decodes_like_the_dynamic_fork(name):
    """`SparseKVCache.fork` from a recorded prefill, then decode steps: same set, same logits."""
    model = tiny_model("llama").double()
    ids = _ids(2, 48)
    base = SparseKVCache(model, EvictionConfig(budget=1.0), "full", record=("window",))
    model(input_ids=ids[:, :40], cache=base)
    got = {}
    for layout in ("dynamic", "static"):
        room = {"prefill_chunk": None, "static_slack": 40, "max_length": 128}
        cfg = EvictionConfig(**{**SMALL, **room, "layout": layout})
        forked = base.fork(cfg, _policy(name, model))
        logits = [model(input_ids=ids[:, i : i + 1], cache=forked).logits for i in range(40, 48)]
        got[layout] = (torch.cat(logits, 1), {i: forked.layers[i].positions.clone()
                                               for i in forked.budgeted_layers})
        if layout == "static" and name == "learned0":  # scored in the forward, slots left in place
            # (the first step after the fork appends like a prompt chunk: 7 of the 8 steps)
            assert all(forked.layers[i].arrivals_in_forward == 7 for i in forked.budgeted_layers)
            assert any(forked.layers[i]._mapped for i in forked.budgeted_layers)
    (ld, kd), (ls, ks) = got["dynamic"], got["static"]
    assert (ld - ls).abs().max() < 1e-10
    assert all(torch.equal(kd[i], ks[i]) for i in kd) and kd[0].shape[-1] < 48


def test_entry_names_match_the_cache():
    assert ENTRY_NAMES == _PER_ENTRY


def test_a_step_that_does_not_fit_fails_clearly():
    model = tiny_model("llama")
    cfg = EvictionConfig(budget=8, recent_window=4, sink_tokens=2, layout="static")
    cache = SparseKVCache(model, cfg, "snapkv")
    with pytest.raises(ValueError, match="prefill_chunk <= 9"):
        model(input_ids=_ids(1, 40), cache=cache)  # 8 + 9 slots, an unchunked 40-token prompt
    cache.close()
    cfg = EvictionConfig(budget=1.0, layout="static", max_length=24)
    cache = SparseKVCache(model, cfg, "full")
    tok = model(input_ids=_ids(1, 20), cache=cache).logits[:, -1:].argmax(-1)
    with pytest.raises(ValueError, match="max_length=24"):
        for _ in range(6):
            tok = model(input_ids=tok, cache=cache).logits[:, -1:].argmax(-1)
    assert cache.tokens_seen() == 24
    cache.close()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(budget=0.3, layout="paged"), "layout"),
        (dict(budget=0.3, layout="static"), "max_length"),
        (dict(budget=64, layout="static", max_length=0), "max_length"),
        (dict(budget=64, layout="static", prefill_chunk=32, static_slack=8), "static_slack"),
        (dict(budget=64, layout="static", static_slack=True), "static_slack"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EvictionConfig(**kwargs)
    assert EvictionConfig(
        **{**kwargs, "layout": "dynamic", "max_length": None, "static_slack": None}
    )


def test_config_round_trips_with_the_layout():
    cfg = EvictionConfig(budget=0.3, layout="static", max_length=4096, static_slack=64)
    assert EvictionConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_a_compiled_decode_step_writes_its_slots_in_place(quantize):
    """A compiled decode step on the slot-mapped path (learned policy, blend 0, after evictions)
    touches a layer's buffers only where it writes: no loop of the generated code runs over a
    whole key buffer. The writes are `index_copy_` on the buffers seen flat; a `scatter_` into a
    buffer that is a graph input compiles to a pass over the whole buffer every step (this test
    then finds a loop of the buffer's size; 339 ms a step for a 328 MB buffer on this project's
    CPU, where `index_copy_` takes 0.1 ms)."""
    import re

    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = tiny_model("llama")
    cfg = EvictionConfig(**{**SMALL, "max_length": 32_768, "layout": "static", "quantize": quantize})
    cache = SparseKVCache(model, cfg, _policy("learned0", model))
    tok = model(input_ids=_ids(1, 40), cache=cache).logits[:, -1:].argmax(-1)
    for t in range(6):  # eager decode steps with evictions: the slots are out of order
        tok = model(input_ids=tok, position_ids=torch.tensor([[40 + t]]), cache=cache).logits[:, -1:].argmax(-1)
    layer = cache.layers[cache.budgeted_layers[0]]
    assert layer._mapped
    step = torch.compile(model.forward, dynamic=False)
    _, code = run_and_get_code(lambda: step(input_ids=tok, position_ids=torch.tensor([[46]]), cache=cache))
    loops = [int(n) for n in re.findall(r"<static_cast<int64_t>\((\d+)L\)", "\n".join(code))]
    assert loops, "no loop bounds found in the generated code (has its format changed?)"
    assert max(loops) < layer._slots.buf["keys"].numel(), max(loops)
    finish_steps(cache)  # (the compiled bound method skips the module's forward hook)
    assert layer.arrivals_in_forward == 7  # the compiled step was scored in the forward too
    cache.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, quantize",
    [("snapkv", None), ("learned", None), ("learned", "int8"), ("learned0", None), ("learned0", "int8")],
)
def test_compiled_decode_step_generates_the_same_tokens(name, quantize):
    """`model.forward` compiled; decode steps pass `position_ids`, so the compiled graph sees
    fixed shapes only: scoring (or, for "learned0", only the eviction decisions) and eviction run
    eagerly after it (the forward hook). One graph, no graph break, no recompilation across 24
    steps with evictions and re-ranks."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("llama")
    ids = _ids(1, 40)
    toks = {}
    for compiled in (False, True):
        cfg = EvictionConfig(**SMALL, layout="static", max_length=128, quantize=quantize)
        cache = SparseKVCache(model, cfg, _policy(name, model))
        tok = model(input_ids=ids, cache=cache).logits[:, -1:].argmax(-1)  # prefill: eager
        if (
            compiled
        ):  # hooks stay outside: the module's __call__ runs them around the compiled forward
            model.forward = torch.compile(model.forward, dynamic=False)
        try:
            out = []
            for t in range(24):
                pos = torch.tensor([[40 + t]])
                tok = model(input_ids=tok, position_ids=pos, cache=cache).logits[:, -1:].argmax(-1)
                out.append(tok)
        finally:
            model.__dict__.pop("forward", None)  # back to the class's forward
        toks[compiled] = torch.cat(out, 1)
        cache.close()
    assert torch.equal(toks[False], toks[True])
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_bench_serving_dry_run_on_cpu(tmp_path, capsys):
    """eval/bench_serving.py end to end at a tiny shape: every mode, a batch searched by really
    running it under the (CPU-simulated) memory cap, measured tokens/s."""
    from eval import bench_serving

    out = tmp_path / "rows.json"
    assert bench_serving.main(["--tiny", "--lengths", "256", "--json", str(out)]) == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())}
    assert set(rows) == set(bench_serving.MODES)
    for r in rows.values():
        assert r["batch"] >= 1 and r["tok_s"] > 0 and r["length"] == 256
        assert r["fails_at"] is not None and r["fails_at"] > r["batch"]  # bracketed by real runs
    assert {r["attention"] for r in rows.values()} == {"packed"}  # baselines decode like the budget modes
    assert rows["0.3"]["kv_bytes_per_seq"] < 0.5 * rows["static"]["kv_bytes_per_seq"]
    assert rows["0.3+int8"]["kv_bytes_per_seq"] < 0.5 * rows["0.3"]["kv_bytes_per_seq"]
    assert rows["0.3+int8"]["batch"] > rows["0.3"]["batch"] > rows["static"]["batch"]
    # the learned policy (blend 0) scored every decode step of every budgeted layer in the forward
    assert rows["0.3"]["scored_in_forward"] == rows["0.3+int8"]["scored_in_forward"] == 1.0
    assert rows["static"]["scored_in_forward"] is None
    # the host time of the cache's work between steps, measured (not on the full-cache modes)
    assert 0 < rows["0.3"]["between_steps_ms"] < rows["0.3"]["ms_per_step"]
    assert rows["dynamic"]["between_steps_ms"] is None
    assert "| 256 | 0.3+int8 |" in capsys.readouterr().out


def test_bench_serving_table_keeps_a_failed_search_out_of_the_ratios(capsys):
    """A mode where every probe past the eager batch-1 run ran out of memory has no speed to
    compare: the table says so instead of printing batch 1's tok/s as a ratio, and such a row is
    never the full-cache reference of the others."""
    import argparse

    from eval import bench_serving

    rows = [
        {"length": 8, "mode": "dynamic", "batch": 4, "fails_at": 5, "tok_s": 100.0, "ms_per_step": 40.0},
        {"length": 8, "mode": "static", "batch": 1, "fails_at": 3, "tok_s": 500.0, "probes": 3},
        {"length": 8, "mode": "0.3", "batch": 12, "fails_at": 14, "tok_s": 300.0, "ms_per_step": 40.0},
        {"length": 8, "mode": "0.3+int8", "batch": 1, "fails_at": 30, "tok_s": 20.0, "probes": 3},
    ]
    args = argparse.Namespace(
        shape="tiny", dtype="float32", memory_gib=1.0, new_tokens=3, compile="none", policy="learned", attention="packed"
    )
    bench_serving.print_table(rows, args)
    out = capsys.readouterr().out
    assert "| 8 | 0.3 | 0.0 | 12 | 14 | 40.0 | 300.0 | 3.00x |" in out  # against dynamic, not static's 500
    assert "| 8 | 0.3+int8 | 0.0 | 1 | 30 | - | - (no batch > 1 ran in 3 probes) | - |" in out
    assert "| 8 | dynamic | 0.0 | 4 | 5 | 40.0 | 100.0 | 1.00x |" in out


def test_bench_serving_search_sizes_the_batch_from_what_a_sequence_adds_to_the_peak(monkeypatch):
    """The first compiled probe comes from the peak growth between eager batches 1 and 2 (KV plus
    per-sequence transients), not from the KV bytes alone, which would overshoot and spend the
    probes on out-of-memory runs (what happened to INT8 on the H200)."""
    import argparse

    from eval import bench_serving

    gib = 2**30
    weights, kv, transient = 15 * gib, gib, 3 * gib  # a step needs 4 GiB per sequence at its peak
    tried = []

    def fake_probe(model, mode, ids, batch, args, compiled=True):
        tried.append((batch, compiled))
        peak = weights + batch * (kv + transient)
        if peak > args.memory_gib * gib:
            return None
        return {"mode": mode, "length": 8, "batch": batch, "kv_bytes_per_seq": kv,
                "kv_bytes": batch * kv, "peak_bytes": peak, "tok_s": float(batch)}

    monkeypatch.setattr(bench_serving, "probe", fake_probe)
    args = argparse.Namespace(memory_gib=80.0, probes=3)
    row = bench_serving.search(None, "0.3+int8", torch.zeros(1, 8), args, weights)
    assert tried[:3] == [(1, False), (2, False), (16, True)]  # (80 - 15) GiB / 4 GiB
    assert row["batch"] == 16 and row["batch_estimate"] == 16 and row["peak_bytes_per_seq"] == 4 * gib
    assert row["fails_at"] == 20  # the next probe up (+25%) did not fit


def test_bench_serving_resume_measures_only_what_the_file_lacks(tmp_path, monkeypatch):
    """A run cut short keeps its finished rows; `--resume` measures only the missing and failed
    (length, mode) pairs, keeps the rows it does not plan to measure, and refuses rows measured
    under another setup, naming the setting. Each write replaces the file whole."""
    from eval import bench_serving

    calls, failed = [], []

    def fake_search(model, mode, ids, args, weights):
        calls.append((ids.shape[1], mode))
        if mode == "0.3+int8" and not failed:  # the first run's last mode fails
            failed.append(mode)
            raise RuntimeError("a kernel that does not compile")
        return {"mode": mode, "length": ids.shape[1], "batch": 3, "fails_at": 4, "tok_s": 9.0}

    monkeypatch.setattr(bench_serving, "search", fake_search)
    out = tmp_path / "rows.json"
    base = ["--tiny", "--json", str(out), "--modes", "static,0.3,0.3+int8"]
    assert bench_serving.main([*base, "--lengths", "64"]) == 0  # then cut short, say
    assert calls == [(64, "static"), (64, "0.3"), (64, "0.3+int8")]
    assert "error" in json.loads(out.read_text())[-1]
    calls.clear()
    assert bench_serving.main([*base, "--lengths", "64,32", "--resume"]) == 0
    assert calls == [(64, "0.3+int8"), (32, "static"), (32, "0.3"), (32, "0.3+int8")]
    rows = json.loads(out.read_text())
    assert [(r["length"], r["mode"]) for r in rows] == [
        (64, "static"), (64, "0.3"), (64, "0.3+int8"), (32, "static"), (32, "0.3"), (32, "0.3+int8")
    ]
    assert all("error" not in r and r["setup"]["shape"] == "tiny" for r in rows)
    assert rows[0]["setup"]["policy"] is None and rows[1]["setup"]["policy"] == "learned"
    assert not [f for f in tmp_path.iterdir() if f.name.endswith(".tmp")]
    calls.clear()
    # a resume of one length measures nothing new and keeps the other length's rows
    assert bench_serving.main([*base, "--lengths", "32", "--resume"]) == 0
    assert calls == [] and len(json.loads(out.read_text())) == 6
    # another setup: stopped before anything runs, the file untouched
    before = out.read_text()
    with pytest.raises(SystemExit, match=r"new_tokens: 3 in the file, 5 now"):
        bench_serving.main([*base, "--lengths", "32", "--new-tokens", "5", "--resume"])
    with pytest.raises(SystemExit, match="--resume needs --json"):
        bench_serving.main(["--tiny", "--resume"])
    assert out.read_text() == before and calls == []


def test_bench_serving_keeps_the_other_modes_when_one_fails(tmp_path, monkeypatch, capsys):
    """A mode that fails with anything but out-of-memory (a kernel that does not compile, say)
    gets a row with its error; the modes after it still run and the table says why."""
    from eval import bench_serving

    real = bench_serving.search

    def failing(model, mode, *a, **k):
        if mode == "0.3+int8":
            raise RuntimeError("a kernel that does not compile\nsecond line")
        return real(model, mode, *a, **k)

    monkeypatch.setattr(bench_serving, "search", failing)
    out = tmp_path / "rows.json"
    assert bench_serving.main(["--tiny", "--lengths", "64", "--json", str(out)]) == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())}
    assert rows["0.3+int8"]["error"] == "RuntimeError: a kernel that does not compile"
    assert rows["dynamic"]["tok_s"] > 0  # ran after the failure
    assert "| 64 | 0.3+int8 | 0.0 | 0 | - | - | - (failed: RuntimeError: a kernel" in capsys.readouterr().out
