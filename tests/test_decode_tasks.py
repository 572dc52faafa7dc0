"""The decode-heavy tasks (issue 18): sample building, the token-by-token run and its metrics,
the grid's rows and resume. Tiny random models and synthetic text; no downloads."""

from __future__ import annotations

import json
import random

import pytest
import torch

from sparsekv import EvictionConfig, SparseKVCache
from sparsekv.evaluation.config import EvalConfig
from sparsekv.evaluation.running.decode import RerankClock, output_logits, run_decode, trace_sample
from sparsekv.evaluation.running.decode_grid import read_rows, run_decode_grid
from sparsekv.evaluation.tasks import TASKS, decode, make_sample, text
from sparsekv.evaluation.tasks.codec import AsciiCodec
from sparsekv.models.tiny import tiny_model

DECODE = ("decode_prose", "decode_code", "decode_steps", "decode_recall")


def _synthetic(kind: str) -> list[tuple[str, str]]:
    rng = random.Random(kind)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "paper", "engine", "garden", "signal"]
    docs = []
    for d in range(6):
        sents = [" ".join(rng.choice(words) for _ in range(rng.randrange(5, 12))).capitalize() + "."
                 for _ in range(120)]
        docs.append((f"{kind}:{d}", " ".join(sents)))
    return docs


@pytest.fixture(autouse=True)
def synthetic_text(monkeypatch, tmp_path):
    monkeypatch.setattr(text, "eval_texts", _synthetic, raising=False)
    monkeypatch.setenv("SPARSEKV_CACHE", str(tmp_path / "cache"))  # reference traces kept here


@pytest.fixture(scope="module")
def codec():
    return AsciiCodec()


def test_tasks_registered_with_decode_kind():
    for name in DECODE:
        assert TASKS[name].kind == decode.DECODE_KIND
        assert TASKS[name].protocols == ("agnostic",)


@pytest.mark.parametrize("task", DECODE[:3])
def test_decode_sample_layout(codec, task):
    s = make_sample(task, codec, 300, 0, seed=0, prompt_tokens=100, gen_tokens=7)
    assert s.context_ids[:1] == codec.bos_ids and len(s.context_ids) == 101
    assert len(s.target_ids) == 300 and s.max_new_tokens == 7
    assert s.metadata["n_tokens"] == 401
    again = make_sample(task, codec, 300, 0, seed=0, prompt_tokens=100, gen_tokens=7)
    assert again.target_ids == s.target_ids
    other = make_sample(task, codec, 300, 1, seed=0, prompt_tokens=100, gen_tokens=7)
    assert other.target_ids != s.target_ids


def test_decode_sample_rejects_bad_options(codec):
    with pytest.raises(ValueError, match="prompt_tokens"):
        make_sample("decode_prose", codec, 300, 0, prompt_tokens=513)
    with pytest.raises(ValueError, match="gen_tokens"):
        make_sample("decode_prose", codec, 300, 0, gen_tokens=-1)


def test_recall_positions_hold_the_facts(codec):
    s = make_sample("decode_recall", codec, 1100, 0, seed=0, prompt_tokens=64, gap=500)
    assert len(s.target_ids) == 1100
    facts = s.metadata["facts"]
    assert sorted(f["kind"] for f in facts) == ["definition", "name", "number"]
    for ps, f in zip(s.metadata["recall_positions"], facts):
        assert codec.decode([s.target_ids[p] for p in ps]).strip() == f["value"]
        assert f["distance"] >= 500
        # the fact is stated (in full) before it is referred to
        assert f["value"] in codec.decode(s.target_ids[: f["stated_at"] + 200])
    with pytest.raises(ValueError, match="too short for decode_recall"):
        make_sample("decode_recall", codec, 600, 0, prompt_tokens=64, gap=500)


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_output_logits_equal_the_models(family):
    model = tiny_model(family)
    if family == "gemma3":
        model.config.final_logit_softcapping = 3.0  # exercise the soft-capping path
    ids = torch.randint(3, 128, (1, 20))
    with torch.no_grad():
        want = model(input_ids=ids).logits[0]
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0]
    torch.testing.assert_close(output_logits(model, hidden), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_token_by_token_trace_equals_one_full_forward(codec, family):
    """With the full cache, the per-step hidden states give the logits of one forward over
    prompt + continuation (so the step loop feeds the right positions)."""
    model = tiny_model(family)
    s = make_sample("decode_prose", codec, 80, 0, prompt_tokens=40, gen_tokens=5)
    tr = trace_sample(model, SparseKVCache(model, EvictionConfig(budget=1.0), "full"), s)
    with torch.no_grad():
        full = model(input_ids=torch.tensor([s.context_ids + s.target_ids])).logits[0]
    n = len(s.context_ids)
    want = full[n : n + len(s.target_ids) - 1]  # predictions of target[1:]
    torch.testing.assert_close(output_logits(model, tr.hidden), want, atol=1e-4, rtol=1e-4)
    assert len(tr.output_ids) == 5 and len(tr.step_s) == len(s.target_ids)
    assert tr.output_ids[0] == int(full[-1].argmax())


def test_evicting_run_metrics(codec):
    model = tiny_model("gemma3")
    s = make_sample("decode_prose", codec, 600, 0, prompt_tokens=64, gen_tokens=8)
    ref_row, ref = run_decode(model, s, SparseKVCache(model, EvictionConfig(budget=1.0), "full"))
    assert ref_row["kl_mean"] == 0.0 and ref_row["agreement"] == 1.0
    cfg = EvictionConfig(budget=48, rerank_every=16, recent_window=16, sink_tokens=4, evict_slack=4)
    cache = SparseKVCache(model, cfg, "h2o")
    row, tr = run_decode(model, s, cache, ref)
    assert row["kl_mean"] > 0
    assert [w["start"] for w in row["windows"]] == [0, 256, 512]
    assert abs(sum(w["kl"] * (w["end"] - w["start"]) for w in row["windows"]) / 599 - row["kl_mean"]) < 0.05
    assert len(row["kl_curve"]) == 10  # ceil(599 / 64)
    # The budgeted layer (layer 3) holds at most budget + slack entries of 2 heads x 16 dims x 2 (K, V)
    per_token = 2 * 2 * 16 * 4
    assert max(p[2] for p in row["kv_curve"]) <= (48 + 4) * per_token
    assert ref_row["kv_curve"][-1][2] > 600 * per_token
    # One budgeted layer, one re-rank per 16 decode steps (continuation + generation)
    assert tr.reranks == (600 + 7) // 16 and row["rerank_every"] == 16
    assert row["rerank_s"] > 0 and 0 < row["rerank_pct"] < 100
    assert 0 <= row["agreement"] <= 1


def test_rerank_clock_counts_every_layer():
    model = tiny_model("llama")  # every layer is budgeted
    cache = SparseKVCache(model, EvictionConfig(budget=8, rerank_every=4, recent_window=2, sink_tokens=1), "tova")
    clock = RerankClock(cache)
    with torch.no_grad():
        model(input_ids=torch.randint(3, 128, (1, 12)), cache=cache)
        for _ in range(8):
            model(input_ids=torch.randint(3, 128, (1, 1)), cache=cache)
    assert clock.count == 4 * 2  # 4 layers x 2 re-ranks


def test_recall_scored_on_the_referring_tokens(codec):
    model = tiny_model("gemma3")
    s = make_sample("decode_recall", codec, 900, 0, prompt_tokens=32, gap=400, gen_tokens=0)
    _, ref = run_decode(model, s, SparseKVCache(model, EvictionConfig(budget=1.0), "full"))
    row, _ = run_decode(model, s, SparseKVCache(model, EvictionConfig(budget=64), "streaming"), ref)
    assert 0.0 <= row["recall_first"] <= 1.0 and row["score"] == row["recall"]
    assert row["new_tokens"] == 0


def test_grid_rows_resume_and_report(codec, tmp_path):
    cfg = EvalConfig(out=str(tmp_path / "g"), model="tiny:gemma3", tasks=["decode_prose"], lengths=[300],
                     policies=["h2o@rerank_every=0@label=h2o-r0", "tova@rerank_every=4@label=tova-r4"],
                     budgets=[48, 96], samples=1, protocols=["agnostic"],
                     task_options={"decode_prose": {"prompt_tokens": 40, "gen_tokens": 4}})
    model = tiny_model("gemma3")
    run_decode_grid(cfg, model, codec, progress=False)
    rows = read_rows(tmp_path / "g" / "results.jsonl")
    assert [(r["policy"], r["budget"]) for r in rows] == [
        ("full", 1.0), ("h2o-r0", 48), ("h2o-r0", 96), ("tova-r4", 48), ("tova-r4", 96)]
    assert [r["rerank_every"] for r in rows[1:]] == [0, 0, 4, 4]
    assert all(r["error"] is None for r in rows)
    run_decode_grid(cfg, model, codec, progress=False)  # complete: nothing reruns
    assert len(read_rows(tmp_path / "g" / "results.jsonl")) == 5
    summary = (tmp_path / "g" / "decode-summary.md").read_text()
    assert "decode_prose, budget 48 tokens" in summary and "tova-r4" in summary
    assert (tmp_path / "g" / "kl-position-decode_prose-48.png").exists()
    assert (tmp_path / "g" / "kv-position-48.png").exists()
    json.loads((tmp_path / "g" / "results.jsonl").read_text().splitlines()[1])
    # The reference trace is kept: a grown grid (another process with --only) reuses it, and the
    # KL of a rerun method is the same.
    assert len(list((tmp_path / "cache" / "decode-refs").glob("*.pt"))) == 1
    grown = EvalConfig(**{**cfg.to_dict(), "out": str(tmp_path / "g2")})
    run_decode_grid(grown, model, codec, progress=False, only={"tova-r4"})
    again = read_rows(tmp_path / "g2" / "results.jsonl")
    assert [r["policy"] for r in again] == ["full", "tova-r4", "tova-r4"]
    assert again[1]["kl_mean"] == pytest.approx(rows[3]["kl_mean"], rel=1e-6)


def test_sparsekv_eval_runs_decode_samples(tmp_path):
    """`sparsekv eval` hands decode samples to the decode run: its rows carry the per-window
    metrics and the re-rank interval, next to the harness's own fields."""
    from sparsekv.evaluation.running.runner import run_eval

    cfg = EvalConfig(out=str(tmp_path / "e"), model="tiny:gemma3", tasks=["decode_prose"], lengths=[300],
                     policies=["h2o@rerank_every=8@label=h2o-r8"], budgets=[48], samples=1,
                     protocols=["agnostic"], task_options={"decode_prose": {"prompt_tokens": 40, "gen_tokens": 4}})
    run_eval(cfg, progress=False)
    rows = read_rows(tmp_path / "e" / "results.jsonl")
    assert [r["policy"] for r in rows] == ["full", "h2o-r8"]
    assert rows[1]["rerank_every"] == 8 and rows[1]["kl_mean"] > 0 and len(rows[1]["windows"]) == 2
    assert rows[0]["kl_mean"] == 0.0 and rows[1]["new_tokens"] == 4
    assert (tmp_path / "e" / "decode-summary.md").exists()


def test_grid_rows_of_a_learned_method_carry_its_adapter_hash(codec, tmp_path):
    """The decode grid's rows come from the harness's row builder: a learned method's rows
    record its adapter's fingerprint, the heuristics' rows none."""
    from sparsekv.scoring.adapter import ScorerAdapter

    model = tiny_model("gemma3")
    adapter = ScorerAdapter.for_model(model)
    folder = adapter.save_pretrained(tmp_path / "head")
    cfg = EvalConfig(out=str(tmp_path / "g"), model="tiny:gemma3", tasks=["decode_prose"], lengths=[200],
                     policies=[f"learned:{folder}@rerank_every=8@label=learned-r8", "h2o@label=h2o-r16"],
                     budgets=[48], samples=1, protocols=["agnostic"],
                     task_options={"decode_prose": {"prompt_tokens": 40, "gen_tokens": 2}})
    run_decode_grid(cfg, model, codec, progress=False, report=False)
    rows = {r["policy"]: r for r in read_rows(tmp_path / "g" / "results.jsonl")}
    assert rows["learned-r8"]["adapter_hash"] == ScorerAdapter.from_pretrained(folder).fingerprint()
    assert rows["h2o-r16"]["adapter_hash"] is None and rows["full"]["adapter_hash"] is None
    assert rows["learned-r8"]["error"] is None


def test_rerank_study_pairs_each_interval_with_never(tmp_path):
    """The re-rank study groups labels that differ only in `-r<R>`, pairs each R with R=0 on the
    same samples, and leaves out a policy run at one R only."""
    from sparsekv.evaluation.reports.decode import (
        rerank_markdown,
        rerank_study,
        write_decode_report,
    )

    def row(label, r, sample, kl):
        return {"policy": label, "rerank_every": r, "sample_id": sample, "task": "decode_prose",
                "budget": 256, "kl_mean": kl, "rerank_pct": 0.1 * bool(r), "error": None}

    rows = [row("learned-r0", 0, "a", 0.10), row("learned-r0", 0, "b", 0.20),
            row("learned-r16", 16, "a", 0.05), row("learned-r16", 16, "b", 0.26),
            row("h2o-r16", 16, "a", 0.07)]
    study = rerank_study(rows)
    cell = study[("decode_prose", "256")]
    assert set(cell) == {"learned"}
    assert cell["learned"][16]["lower"] == (1, 2)
    assert cell["learned"][16]["vs_never"] == pytest.approx((0.05 + 0.26) / (0.10 + 0.20) - 1)
    assert "0.1550 (+3%, 1/2 lower)" in "\n".join(rerank_markdown(study))
    ref = {"policy": "full", "rerank_every": 16, "sample_id": "a", "task": "decode_prose", "budget": 1.0,
           "kl_mean": 0.0, "error": None}
    # two processes that shared the grid each wrote the full cache's row of sample a: one counts
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [ref, ref, *rows]))
    write_decode_report(tmp_path)
    text = (tmp_path / "decode-summary.md").read_text()
    assert "Re-rank study: decode_prose, budget 256" in text and "| full | - | 1 |" in text
    assert (tmp_path / "rerank-decode_prose.png").exists()
