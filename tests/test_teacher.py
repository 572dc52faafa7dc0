"""Teacher statistics against a naive reference built from eager attention probabilities."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import tiny_model

from sparsekv.models.families import model_shape
from sparsekv.teacher.statistics import (
    TargetConfig,
    attention_received,
    collect_attention_stats,
    cumulative_targets,
    source_layers,
    teacher_targets,
)

SEQ = 80  # longer than the tiny gemma3 sliding window (32)


def _inputs(padding: str = "left", seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (2, SEQ), generator=g)
    mask = torch.ones_like(ids)
    if padding == "left":
        mask[1, :7] = 0
    elif padding == "right":
        mask[1, -9:] = 0
    return ids, mask


def _reference(model, ids, mask, stat="mass", normalize="none", exclude_self=False, min_distance=0):
    """received[l] from the full (batch, heads, seq, seq) eager attention probabilities."""
    out = model(input_ids=ids, attention_mask=mask, output_attentions=True, use_cache=False)
    shape = model_shape(model)
    valid = mask.bool()
    n = ids.shape[1]
    pos = torch.arange(n)
    refs = {}
    for layer, probs in enumerate(out.attentions):
        b, heads, _, _ = probs.shape
        allowed = pos[None, :] <= pos[:, None]  # (query, key)
        if shape.layer_types[layer] == "sliding_attention":
            allowed = allowed & (pos[None, :] > pos[:, None] - shape.sliding_window)
        allowed = allowed[None] & valid[:, None, :]  # (batch, query, key)
        counted = allowed & valid[:, :, None]
        if exclude_self:
            counted = counted & ~torch.eye(n, dtype=torch.bool)[None]
        if min_distance:  # only queries i >= j + min_distance count for key j
            counted = counted & (pos[:, None] - pos[None, :] >= min_distance)[None]
        p = probs.double()
        if normalize == "uniform":
            p = p * allowed.sum(-1)[:, None, :, None]
        p = p.view(b, shape.num_kv_heads, heads // shape.num_kv_heads, n, n).sum(2)
        p = p * counted[:, None]
        r = p.sum(-2) if stat == "mass" else p.amax(-2)
        if normalize in ("length", "uniform") and stat == "mass":
            c = counted.sum(-2)[:, None].double()
            r = torch.where(c > 0, r / c.clamp_min(1), torch.zeros_like(r))
        refs[layer] = r.float()
    return refs


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("padding", ["left", "right"])
def test_received_equals_eager_reference(family, impl, padding):
    ref_model = tiny_model(family, "eager")
    model = tiny_model(family, impl)
    ids, mask = _inputs(padding)
    ref = _reference(ref_model, ids, mask)
    stats = collect_attention_stats(
        model, ids, mask, TargetConfig(normalize="none", exclude_self=False), block_size=16
    )
    assert sorted(stats.received) == [0, 1, 2, 3]
    for layer, r in ref.items():
        assert stats.received[layer].shape == (2, 2, SEQ)
        torch.testing.assert_close(stats.received[layer], r, atol=1e-5, rtol=0)
    # padding keys receive nothing
    assert (stats.received[0][~mask.bool()[:, None].expand(2, 2, SEQ)] == 0).all()


@pytest.mark.parametrize(
    "stat,normalize,exclude_self",
    [
        ("mass", "length", True),
        ("mass", "uniform", True),
        ("mass", "length", False),
        ("max", "none", True),
        ("max", "uniform", False),
    ],
)
def test_statistic_variants_match_reference(stat, normalize, exclude_self):
    model = tiny_model("gemma3", "eager")
    ids, mask = _inputs("left")
    ref = _reference(model, ids, mask, stat, normalize, exclude_self)
    cfg = TargetConfig(stat=stat, normalize=normalize, exclude_self=exclude_self)
    stats = collect_attention_stats(model, ids, mask, cfg, block_size=32)
    for layer, r in ref.items():
        # "uniform" multiplies probabilities by up to SEQ keys: compare relative to the scale
        torch.testing.assert_close(
            stats.received[layer], r, atol=1e-5 * max(1.0, r.abs().max().item()), rtol=0
        )


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize(
    "stat,normalize,exclude_self,min_distance",
    [
        ("mass", "length", True, 20),
        ("mass", "length", False, 20),  # min_distance >= 1 drops the self term anyway
        ("mass", "none", True, 40),  # > the tiny gemma3 window (32): its sliding layers get 0
        ("mass", "uniform", False, 5),
        ("max", "none", True, 20),
        ("mass", "length", False, 1),  # == exclude_self=True
    ],
)
def test_min_distance_matches_reference(family, stat, normalize, exclude_self, min_distance):
    model = tiny_model(family, "eager")
    ids, mask = _inputs("left")
    ref = _reference(model, ids, mask, stat, normalize, exclude_self, min_distance)
    cfg = TargetConfig(
        stat=stat, normalize=normalize, exclude_self=exclude_self, min_distance=min_distance
    )
    stats = collect_attention_stats(model, ids, mask, cfg, block_size=16)
    plain = collect_attention_stats(
        model, ids, mask, TargetConfig(stat=stat, normalize=normalize), block_size=16
    )
    for layer, r in ref.items():
        got = stats.received[layer]
        torch.testing.assert_close(got, r, atol=1e-5 * max(1.0, r.abs().max().item()), rtol=0)
        # the last min_distance positions have no query far enough after them
        assert (got[..., SEQ - min_distance :] == 0).all()
        if min_distance > 1:  # a different statistic from the prompt-time one
            assert not torch.allclose(got, plain.received[layer], atol=1e-4)
    if min_distance == 1:
        for layer in ref:
            torch.testing.assert_close(stats.received[layer], plain.received[layer])
    if family == "gemma3" and min_distance >= 32:  # window 32: no sliding query is that far
        shape = model_shape(model)
        for layer, kind in enumerate(shape.layer_types):
            if kind == "sliding_attention":
                assert (stats.received[layer] == 0).all()
            else:
                assert stats.received[layer].sum() > 0


def test_min_distance_length_counts_only_far_queries():
    """Uniform attention over n keys: query i gives 1/(i+1) to each key; with min_distance D the
    length-normalized statistic of key j is the mean of 1/(i+1) over i = j+D .. n-1."""
    n, d = 12, 4
    q = torch.zeros(1, 1, n, d)
    k = torch.randn(1, 1, n, d)
    for dist in (0, 1, 3):
        got = attention_received(
            q, k, scaling=1.0, num_kv_groups=1, normalize="length", min_distance=dist, block_size=5
        )
        exp = torch.zeros(n)
        for j in range(n):
            qs = [i for i in range(j + dist, n)]
            if qs:
                exp[j] = sum(1 / (i + 1) for i in qs) / len(qs)
        torch.testing.assert_close(got[0, 0], exp)


def test_min_distance_in_targets_and_validation():
    model = tiny_model("gemma3", "sdpa")
    ids, mask = _inputs("right")  # row 1: the last 9 positions are padding
    cfg = TargetConfig(min_distance=10)
    targets, _ = teacher_targets(model, ids, mask, cfg, block_size=32)
    t = targets[3]
    torch.testing.assert_close(t.sum(-1), torch.ones(2, 2))
    assert (t[0, :, SEQ - 10 :] == 0).all()
    assert (t[1, :, SEQ - 9 - 10 :] == 0).all()  # counted in real tokens' positions
    assert (t[1, :, : SEQ - 19] > 0).any()
    assert "queries >= 10 positions later" in cfg.describe()
    assert "excluding self-attention" in TargetConfig().describe()
    d = cfg.to_dict()
    assert d["min_distance"] == 10 and TargetConfig.from_dict(json.loads(json.dumps(d))) == cfg
    for bad in (-1, 2.5, True, "64", None):
        with pytest.raises(ValueError, match="min_distance"):
            TargetConfig(min_distance=bad)
    with pytest.raises(ValueError, match="min_distance"):
        zeros = torch.zeros(1, 1, 4, 2)
        attention_received(zeros, zeros, scaling=1.0, num_kv_groups=1, min_distance=-3)


def test_block_size_does_not_change_the_result():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 50, 8, generator=g)
    k = torch.randn(2, 3, 50, 8, generator=g)
    pad = torch.ones(2, 50, dtype=torch.bool)
    pad[0, :5] = False
    for stat, norm in (("mass", "none"), ("mass", "length"), ("max", "uniform")):
        kw = dict(
            scaling=0.3, softcap=5.0, num_kv_groups=2, stat=stat, key_padding=pad, normalize=norm
        )
        for window in (None, 12):
            for dist in (0, 9):
                results = [
                    attention_received(
                        q, k, block_size=bs, sliding_window=window, min_distance=dist, **kw
                    )
                    for bs in (1, 7, 50, 999)
                ]
                for r in results[1:]:
                    torch.testing.assert_close(r, results[0], atol=1e-6, rtol=1e-6)


def test_fewer_queries_than_keys_are_the_last_positions():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 30, 8, generator=g)
    k = torch.randn(1, 2, 30, 8, generator=g)
    full_logits = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(2, dim=1)) * 0.5
    full_logits = full_logits.masked_fill(
        ~torch.ones(30, 30, dtype=torch.bool).tril(), float("-inf")
    )
    probs = full_logits.softmax(-1).view(1, 2, 2, 30, 30).sum(2)
    expected = probs[:, :, -10:].sum(-2)
    got = attention_received(q[:, :, -10:], k, scaling=0.5, num_kv_groups=2, block_size=3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_forward_is_unchanged_and_implementation_restored():
    model = tiny_model("gemma3", "sdpa")
    ids, mask = _inputs("left")
    before = model(input_ids=ids, attention_mask=mask).logits
    collect_attention_stats(model, ids, mask)
    assert model.config._attn_implementation == "sdpa"
    after = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(before, after, atol=0, rtol=0)


def test_hidden_states_are_self_attn_inputs_and_hooks_removed():
    model = tiny_model("llama", "sdpa")
    ids, mask = _inputs("none")
    seen = {}
    layer = model.model.layers[2]
    h = layer.input_layernorm.register_forward_hook(
        lambda m, a, o: seen.setdefault("x", o.detach())
    )
    stats = collect_attention_stats(model, ids, mask, hidden_layers=[2])
    h.remove()
    assert list(stats.hidden_states) == [2]
    torch.testing.assert_close(stats.hidden_states[2], seen["x"], atol=0, rtol=0)
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_restores_implementation_after_an_error():
    model = tiny_model("llama", "eager")
    with pytest.raises(IndexError):
        collect_attention_stats(model, torch.full((1, 5), 10_000))  # token id out of range
    assert model.config._attn_implementation == "eager"
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_cumulative_target_formula():
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    g = torch.Generator().manual_seed(0)
    received = {i: torch.rand(1, 2, 6, generator=g) for i in range(4)}

    def dist(x):
        return x / x.sum(-1, keepdim=True)

    cfg = TargetConfig(decay=0.5)
    t = cumulative_targets(received, [1, 3], cfg, types)
    exp1 = (
        dist(received[1])
        + 0.5 * dist(received[2]).mean(1, keepdim=True)
        + 0.25 * dist(received[3]).mean(1, keepdim=True)
    ) / 1.75
    torch.testing.assert_close(t[1], exp1)
    torch.testing.assert_close(t[3], dist(received[3]))

    budgeted = TargetConfig(decay=0.5, source_layers="budgeted", cross_head="same")
    assert source_layers(1, budgeted, types) == [1, 3]
    t = cumulative_targets(received, [1], budgeted, types)
    torch.testing.assert_close(t[1], (dist(received[1]) + 0.5 * dist(received[3])) / 1.5)

    # all_budgeted: the last full layer borrows from the earlier one (distance 1 in full ranks)
    shared = TargetConfig(decay=0.5, source_layers="all_budgeted", cross_head="same")
    assert source_layers(3, shared, types) == [3, 1]
    t = cumulative_targets(received, [1, 3], shared, types)
    torch.testing.assert_close(t[3], (dist(received[3]) + 0.5 * dist(received[1])) / 1.5)
    torch.testing.assert_close(t[1], (dist(received[1]) + 0.5 * dist(received[3])) / 1.5)
    types6 = ["full_attention", "sliding_attention"] * 3  # full layers 0, 2, 4
    rec6 = {i: torch.rand(1, 2, 6, generator=g) for i in range(6)}
    assert source_layers(2, shared, types6) == [2, 0, 4]
    t = cumulative_targets(rec6, [2], shared, types6)  # both neighbours at full-rank distance 1
    torch.testing.assert_close(t[2], (dist(rec6[2]) + 0.5 * dist(rec6[0]) + 0.5 * dist(rec6[4])) / 2.0)

    per_layer = TargetConfig(cross_layer="per_layer")
    assert source_layers(1, per_layer, types) == [1]
    torch.testing.assert_close(
        cumulative_targets(received, [1], per_layer, types)[1], dist(received[1])
    )

    with pytest.raises(ValueError, match="needs statistics of layers"):
        cumulative_targets({1: received[1]}, [1], cfg, types)


def test_a_token_bright_in_one_layer_only_scores_lower_cumulatively():
    types = ["full_attention"] * 3
    flat = torch.full((1, 1, 4), 0.25)
    spike = torch.tensor([[[0.7, 0.1, 0.1, 0.1]]])
    received = {0: spike, 1: flat, 2: flat}
    per = cumulative_targets(received, [0], TargetConfig(cross_layer="per_layer"), types)[0]
    cum = cumulative_targets(received, [0], TargetConfig(), types)[0]
    assert cum[0, 0, 0] < per[0, 0, 0]


def test_teacher_targets_on_tiny_gemma3():
    model = tiny_model("gemma3", "sdpa")
    ids, mask = _inputs("left")
    targets, hidden = teacher_targets(model, ids, mask, block_size=32)
    assert list(targets) == [3] and list(hidden) == [3]  # the full-attention layer only
    assert targets[3].shape == (2, 2, SEQ) and hidden[3].shape == (2, SEQ, 64)
    torch.testing.assert_close(targets[3].sum(-1), torch.ones(2, 2))
    assert (targets[3][1, :, :7] == 0).all() and (targets[3] >= 0).all()


def test_target_config_validation_and_round_trip():
    cfg = TargetConfig(stat="max", decay=0.25, source_layers="budgeted")
    assert TargetConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    for kwargs, field in (
        ({"stat": "sum"}, "stat"),
        ({"cross_layer": "x"}, "cross_layer"),
        ({"decay": 1.5}, "decay"),
        ({"source_layers": "full"}, "source_layers"),
        ({"normalize": "log"}, "normalize"),
        ({"cross_head": "max"}, "cross_head"),
    ):
        with pytest.raises(ValueError, match=field):
            TargetConfig(**kwargs)
    with pytest.raises(ValueError, match="unknown TargetConfig"):
        TargetConfig.from_dict({"bogus": 1})


_MEMORY_SCRIPT = textwrap.dedent(
    """
    import resource, sys, torch
    n, mode = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    from sparsekv.teacher.statistics import attention_received
    q = torch.randn(1, 4, n, 256); k = torch.randn(1, 1, n, 256)  # gemma-3-270m's attention shape
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if mode == "blockwise":
        attention_received(q, k, scaling=256 ** -0.5, num_kv_groups=4, block_size=512)
    else:
        (torch.einsum("bhqd,bkd->bhqk", q, k[:, 0]) * 0.0625).softmax(-1).sum(-2)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
    """
)


@pytest.mark.slow
def test_extra_memory_grows_linearly():
    def extra(n, mode):
        out = subprocess.run(
            [sys.executable, "-c", _MEMORY_SCRIPT, str(n), mode],
            capture_output=True,
            text=True,
            check=True,
        )
        return int(out.stdout.strip())

    blockwise = {n: extra(n, "blockwise") for n in (1024, 2048, 4096)}
    naive_4k = extra(4096, "naive")
    print("extra bytes, blockwise:", blockwise, "naive n x n at 4096:", naive_4k)
    # doubling the length at most ~doubles the extra memory (quadratic would quadruple it)
    assert blockwise[4096] < 2.6 * blockwise[2048]
    assert blockwise[4096] < naive_4k / 4


@pytest.mark.parametrize("padding", ["left", None])
def test_blocked_teacher_attention_equals_one_sdpa_call(monkeypatch, padding):
    """The teacher's sdpa runs long masked forwards a query block at a time over only the keys
    the block may attend (`_blocked_sdpa`): every layer's input and every statistic the callback
    sees (queries, keys, values) are those of one sdpa call over all keys, on a sliding-window family with padding."""
    import transformers.integrations.sdpa_attention as sdpa_mod

    from sparsekv.teacher import forward as tf

    model = tiny_model("gemma3")
    ids, mask = _inputs(padding or "left")
    if padding is None:
        mask = None
    calls = []
    real = sdpa_mod.sdpa_attention_forward

    def counted(module, query, key, *args, **kwargs):
        calls.append((query.shape[2], key.shape[2]))
        return real(module, query, key, *args, **kwargs)

    monkeypatch.setattr(sdpa_mod, "sdpa_attention_forward", counted)

    def run(block):
        monkeypatch.setattr(tf, "QUERY_BLOCK", block)
        got = {}

        def compute(module, layer, query, key, value, hidden, kwargs):
            got[layer] = (query.clone(), key.clone(), value.clone())

        calls.clear()
        hidden = tf.teacher_forward(model, ids, mask, compute, layers=[0, 1, 2, 3],
                                    hidden_layers=[1, 2, 3])
        return hidden, got, list(calls)

    ref_h, ref_s, ref_calls = run(10**9)
    h, s, blocked = run(16)
    assert all(q == SEQ for q, _ in ref_calls)  # one call per layer
    # sliding layers: blocks of 16 queries over at most 16 + 31 keys; with padding the full
    # layer too is blocked (its mask is a tensor), each block over the keys up to its end
    assert any(q == 16 and k <= 47 for q, k in blocked)
    for layer in (1, 2, 3):
        torch.testing.assert_close(h[layer], ref_h[layer], atol=1e-5, rtol=1e-5)
    for layer in ref_s:
        for a, b in zip(s[layer], ref_s[layer]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
