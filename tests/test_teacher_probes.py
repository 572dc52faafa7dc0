"""The retrieval-probe target (sparsekv.teacher.probes and the store's probe signal) on tiny random
models: spans and layout, the stored statistic against eager attention, one pass or two giving
the same numbers, the mix in `combine_targets`, refusals by name, and wordings disjoint from the
evaluation's."""

from __future__ import annotations

import re

import pytest
import torch

from sparsekv.teacher import store as ts
from sparsekv.teacher.config import TargetConfig
from sparsekv.teacher.probes import PROBE_PROMPTS, probe_layout, probe_spans


def test_spans_are_deterministic_disjoint_and_inside_the_sequence():
    ctx = list(range(100, 300))
    a = probe_spans(ctx, count=6, cue=5, answer=7, seed=3)
    assert a == probe_spans(ctx, count=6, cue=5, answer=7, seed=3)
    assert a != probe_spans(ctx, count=6, cue=5, answer=7, seed=4)
    assert len(a) == 6 and all(e - s == 12 and s >= 4 and e <= len(ctx) for s, e in a)
    assert all(a[i][1] <= a[i + 1][0] for i in range(len(a) - 1))
    assert probe_spans(ctx[:15], count=6, cue=5, answer=7) == []  # nothing fits
    assert len(probe_spans(ctx[:40], count=6, cue=5, answer=7)) == 3  # only three slots
    with pytest.raises(ValueError, match="probe cue=0 must be an int >= 1"):
        probe_spans(ctx, count=2, cue=0, answer=3)


def test_layout_queries_predict_the_answer_tokens():
    ctx = list(range(1000, 1200))
    prompts = [[1, 2, 3], [4, 5]]
    lay = probe_layout(ctx, prompts, count=4, cue=3, answer=5, seed=0)
    assert lay.ids[: len(ctx)] == ctx and len(lay.query_positions) == 4 * 5
    answers = [t for s, e in lay.spans for t in ctx[s + 3 : e]]
    assert [lay.ids[q + 1] for q in lay.query_positions] == answers
    # each probe is a prompt, then the span's cue: the token before each answer run is the cue's last
    firsts = lay.query_positions[::5]
    assert [lay.ids[q] for q in firsts] == [ctx[s + 2] for s, _ in lay.spans]
    with pytest.raises(ValueError, match="prompts must be a non-empty list"):
        probe_layout(ctx, [], count=1, cue=1, answer=1)


def _tiny():
    from sparsekv.models.loading import load_model

    return load_model("tiny:llama", seed=0, attn_implementation="eager").model


def _settings(model, signals, probe=None):
    from sparsekv.models.families import model_shape

    types = model_shape(model).layer_types
    prompts = [[7, 8, 9, 10], [11, 12, 13]]
    return ts.target_settings(
        TargetConfig(stat="max"),
        types,
        [0, 1],
        [21, 22, 23],
        signals,
        probe_prompt_ids=prompts,
        probe=probe or {"count": 3, "cue": 4, "answer": 6},
    )


def test_probe_statistic_equals_eager_attention_and_one_pass_equals_two():
    """probe.<l> = max over the answer queries of the attention (summed over the group's query
    heads) each context token receives: against eager attention weights of a forward over
    `context + probes`. Stored with the repeat signals (a second pass) it is the same."""
    from sparsekv.teacher.store_rows import compute_row

    model = _tiny()
    g = torch.Generator().manual_seed(0)
    n, m = 96, 90
    ids = torch.randint(3, model.config.vocab_size, (n,), generator=g)
    mask = torch.ones(n, dtype=torch.long)
    mask[m:] = 0
    s1 = _settings(model, ["questions", "probe"])
    s2 = _settings(model, list(ts.SIGNALS))
    one = compute_row(model, ids, mask, s1, [0, 1], block_size=8)
    two = compute_row(model, ids, mask, s2, [0, 1], block_size=8)
    layers = s1["probe_layers"]
    assert layers == list(range(model.config.num_hidden_layers))
    for layer in layers:
        torch.testing.assert_close(one[f"probe.{layer}"], two[f"probe.{layer}"])
        torch.testing.assert_close(one[f"questions.{layer}"], two[f"questions.{layer}"])
    torch.testing.assert_close(one["hidden.0"], two["hidden.0"])
    pr = s1["probe"]
    lay = probe_layout(ids[:m].tolist(), pr["prompt_ids"], count=3, cue=4, answer=6, seed=0)
    with torch.no_grad():
        out = model(torch.tensor([lay.ids]), output_attentions=True)
    kv = model.config.num_key_value_heads
    for layer in layers:
        att = out.attentions[layer][0].float()  # (heads, q, k)
        a = att[:, lay.query_positions, :m]
        a = a.view(kv, -1, len(lay.query_positions), m).sum(1).amax(1)  # (kv, m)
        got = one[f"probe.{layer}"]
        assert got.shape == (kv, n) and (got[:, m:] == 0).all()
        torch.testing.assert_close(got[:, :m], a, rtol=1e-4, atol=1e-5)
        assert a.amax() > 0


def test_combine_mixes_the_probe_target_and_skips_an_empty_one():
    from sparsekv.teacher.statistics import cumulative_targets

    types = ["full_attention"] * 2
    g = torch.Generator().manual_seed(1)
    stats = {
        f"{k}.{i}": torch.rand(2, 10, generator=g) for k in ("questions", "probe") for i in (0, 1)
    }
    valid = torch.ones(10, dtype=torch.bool)
    base = TargetConfig(stat="max", signal="questions")
    mixed = TargetConfig(stat="max", signal="questions", probe_weight=0.25)
    tb = ts.combine_targets(stats, valid, base, [0, 1], types)
    tm = ts.combine_targets(stats, valid, mixed, [0, 1], types)
    tp = cumulative_targets(
        {i: stats[f"probe.{i}"][None] for i in (0, 1)}, [0, 1], mixed, types, full_only=True
    )
    for i in (0, 1):
        torch.testing.assert_close(tm[i], 0.75 * tb[i] + 0.25 * tp[i][0])
        assert not torch.allclose(tm[i], tb[i])
    empty = {**stats, "probe.0": torch.zeros(2, 10), "probe.1": torch.zeros(2, 10)}
    te = ts.combine_targets(empty, valid, mixed, [0, 1], types)
    torch.testing.assert_close(te[0], tb[0])


def test_probe_settings_and_refusals_name_what_is_wrong():
    model = _tiny()
    with pytest.raises(ValueError, match="probe_weight=1.5 must be a number in"):
        TargetConfig(probe_weight=1.5)
    with pytest.raises(ValueError, match="needs kind='attention'"):
        TargetConfig(signal="reconstruction", kind="kvzip_plus", probe_weight=0.5)
    with pytest.raises(ValueError, match="probe settings \\['width'\\] are not known"):
        _settings(model, ["probe"], probe={"width": 3})
    with pytest.raises(ValueError, match="probe count=0 must be an int >= 1"):
        _settings(model, ["probe"], probe={"count": 0})
    # no probe signal: no probe keys, so the fingerprint of an older store stays what it was
    plain = _settings(model, ["questions", "reconstruction", "kvzip_plus"])
    assert not [k for k in plain if k.startswith("probe")]
    assert TargetConfig().to_dict() == TargetConfig.from_dict(TargetConfig().to_dict()).to_dict()
    assert "probe_weight" not in TargetConfig().to_dict()
    assert TargetConfig.from_dict(TargetConfig(probe_weight=0.3).to_dict()).probe_weight == 0.3
    from sparsekv.teacher.reconstruction import training_targets

    with pytest.raises(ValueError, match="probe target is read from a teacher store"):
        training_targets(
            model, torch.ones(1, 8, dtype=torch.long), target=TargetConfig(probe_weight=0.5)
        )


def test_a_store_without_probes_refuses_a_probe_target_by_name(tmp_path):
    store = ts.TeacherStore.__new__(ts.TeacherStore)
    store.path = tmp_path
    store.spec = ts.StoreSpec(
        model={}, text={}, target={"question_layers": [0, 1], "stat": "max"}, layers=[0, 1]
    )
    need = ts.needed_settings(
        TargetConfig(stat="max", probe_weight=0.5), [0, 1], ["full_attention"] * 2
    )
    assert need["probe_layers"] == [0, 1]
    with pytest.raises(
        ts.StoreError, match=r"target\.probe_layers: needs \[0, 1\], the store has none"
    ):
        store.check({"target": need})


def _pieces(text: str) -> list[str]:
    return [p.strip() for p in re.split(r"[:.\n]", text) if p.strip()]


def test_probe_wordings_are_disjoint_from_the_evaluation():
    """No stretch of >= 12 characters and no run of four words is shared with an evaluation
    wording (the rule training needles follow, tests/test_text_split.py)."""
    from sparsekv.evaluation.tasks import TEMPLATES as EVAL

    eval_text = "\n".join(EVAL).lower()
    words = lambda t: re.findall(r"[a-z']+", t.lower())  # noqa: E731
    grams = lambda t: {tuple(words(t)[i : i + 4]) for i in range(len(words(t)) - 3)}  # noqa: E731
    eval_grams = set().union(*map(grams, EVAL))
    for p in PROBE_PROMPTS:
        for piece in _pieces(p):
            for i in range(len(piece) - 11):
                assert piece[i : i + 12].lower() not in eval_text, (p, piece[i : i + 12])
        assert not grams(p) & eval_grams, p
    # the check can fail: an evaluation wording is caught
    assert grams(EVAL[0]) & eval_grams
