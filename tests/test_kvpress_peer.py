"""The kvpress peer run's contract with the harness, checked without kvpress installed.

`eval/peers/kvpress/run_presses.py` runs in its own environment (kvpress pins an older
transformers); here a fake press runner stands in for kvpress's pipeline, and the tests check
what both sides share: the prompts it reads, how each protocol splits a prompt, the row format
and metrics (the harness's own functions), and that its rows land in the harness's summary next to
the full-cache reference.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT / "eval" / "peers" / "kvpress"


def _load_peer():
    spec = importlib.util.spec_from_file_location(
        "kvpress_peer_run_presses", PEER / "run_presses.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


peer = _load_peer()


def _prompts(tmp_path: Path, tasks=("passkey", "ppl", "gen"), length=256) -> Path:
    from sparsekv.evaluation.codec import AsciiCodec
    from sparsekv.evaluation.config import EvalConfig
    from sparsekv.evaluation.runner import build_samples, write_prompts

    cfg = EvalConfig(
        model="tiny:gemma3",
        tasks=list(tasks),
        lengths=[length],
        samples=2,
        policies=["streaming"],
        budgets=[0.5],
    )
    path = tmp_path / "prompts.jsonl"
    write_prompts(build_samples(cfg, AsciiCodec()), cfg, path)
    return path


def test_row_fields_are_the_harness_fields():
    from sparsekv.evaluation.runner import ROW_FIELDS

    assert peer.harness_row_fields() == ROW_FIELDS


def test_harness_metrics_load_without_the_sparsekv_package():
    # The kvpress environment has no sparsekv: metrics.py must load from its file alone.
    code = (
        "import sys, importlib.util\n"
        "sys.modules['sparsekv'] = None  # any 'import sparsekv...' now fails\n"
        f"spec = importlib.util.spec_from_file_location('run_presses', {str(PEER / 'run_presses.py')!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['run_presses'] = m; spec.loader.exec_module(m)\n"
        "M = m.load_harness_metrics()\n"
        "print(M.score_answer('The pass key is 4 8 2 1 3.', '48213'), M.score_answer('no', ['a', 'no']))\n"
    )
    out = subprocess.run(
        check=False, args=[sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1.0", "0.5"]


def test_compression_ratio_and_budgets():
    assert peer.compression_ratio(0.3, 1000) == pytest.approx(0.7)
    assert peer.compression_ratio(1.0, 1000) == 0.0
    assert peer.compression_ratio(256, 1024) == pytest.approx(0.75)
    assert peer.compression_ratio(4096, 1024) == 0.0
    assert peer.parse_budgets("0.1, 0.5,512") == [0.1, 0.5, 512]
    for bad in ("0", "1.5", "-0.2", "x", ""):
        with pytest.raises(ValueError, match="budget"):
            peer.parse_budgets(bad)
    with pytest.raises(ValueError, match="allowed values"):
        peer.PressSpec("h2o", "all")
    with pytest.raises(ValueError, match="allowed values"):
        peer.PressSpec("snapkv", "sliding")


def test_split_prompt_per_protocol_and_kind(tmp_path):
    samples = {s["sample_id"]: s for s in peer.read_prompts(_prompts(tmp_path))}
    pk, ppl, gen = samples["passkey-256-0"], samples["ppl-256-0"], samples["gen-256-0"]
    assert pk["protocols"] == ["agnostic", "aware"] and ppl["protocols"] == ["agnostic"]

    ctx, q, n = peer.split_prompt(pk, "agnostic")  # the question follows the compressed context
    assert ctx == pk["context_ids"] and q == pk["question_ids"] and n == pk["max_new_tokens"]
    ctx, q, _ = peer.split_prompt(pk, "aware")  # the question is compressed too, but its last token
    assert ctx + q == pk["context_ids"] + pk["question_ids"] and len(q) == 1
    ctx, q, n = peer.split_prompt(ppl, "agnostic")  # teacher-forced continuation
    assert ctx == ppl["context_ids"] and q == ppl["target_ids"][:-1] and n == 1
    ctx, q, n = peer.split_prompt(gen, "agnostic")
    assert ctx + q == gen["context_ids"] and len(q) == 1 and n == gen["max_new_tokens"]


def test_plan_counts_and_skips(tmp_path):
    samples = peer.read_prompts(_prompts(tmp_path))  # 2 passkey, 2 ppl, 2 gen
    specs = [peer.PressSpec("snapkv", "all"), peer.PressSpec("snapkv", "full")]
    plan = peer.Plan(samples, specs, [0.2, 0.5], ["agnostic", "aware"])
    runs = plan.runs()
    refs = [r for r in runs if r[2] is None]
    # passkey runs under both protocols, ppl and gen under agnostic only
    assert len(refs) == 2 * 2 + 2 + 2
    full_ppl = [
        r for r in runs if r[2] is not None and r[2].layers == "full" and r[0]["task"] == "ppl"
    ]
    assert full_ppl == []  # the full-layers mode would leak teacher-forced targets
    assert len(runs) == len(refs) + len(refs) * 2 * 2 - 2 * 2  # minus ppl x full x 2 budgets
    assert plan.skipped() == {peer.CONTINUATION_LEAK: 4}
    # each reference comes before the runs that are compared with it
    for i, (s, p, spec, _) in enumerate(runs):
        if spec is not None:
            assert any(r[2] is None and r[0] is s and r[1] == p for r in runs[:i])


class FakeRunner:
    """Stands in for kvpress's pipeline: the reference answers right; snapkv answers right in
    the 'full' mode and wrong in 'all'; knorm crashes."""

    def __init__(self, vocab: int = 128):
        self.vocab = vocab
        self.calls = []

    def run(self, sample, protocol, spec, budget):
        self.calls.append(
            (sample["sample_id"], protocol, None if spec is None else spec.label, budget)
        )
        if spec is not None and spec.press == "knorm":
            raise RuntimeError("The size of tensor a (313) must match the size of tensor b (1020)")
        g = torch.Generator().manual_seed(len(sample["sample_id"]))
        if sample["kind"] == "continuation":
            steps = len(sample["target_ids"]) - 1
            logits = torch.randn(steps, self.vocab, generator=g)
            if spec is not None:
                logits = logits + 0.5 * torch.randn(steps, self.vocab, generator=g)
            return peer.RawRun([], "", torch.log_softmax(logits, -1), 1000, 1100, 0.5, 0.0, 10.0)
        right = spec is None or spec.layers == "full"
        text = f" {sample['answer']}." if right and isinstance(sample["answer"], str) else "no idea"
        ids = [ord(c) for c in text]
        logits = torch.full((len(ids), self.vocab), -5.0)
        logits[torch.arange(len(ids)), torch.tensor(ids)] = 5.0
        full = spec is None
        kv = 4000 if full else int(4000 * budget)
        return peer.RawRun(
            ids,
            text,
            torch.log_softmax(logits, -1),
            kv,
            kv + 50,
            0.25,
            0.5,
            12.0,
            extra={"layers": None if full else spec.layers},
        )


def test_fake_runner_rows_land_in_the_harness_summary(tmp_path):
    from sparsekv.evaluation import EvalConfig, ingest_rows, run_eval
    from sparsekv.evaluation import metrics as M
    from sparsekv.evaluation.report import summarize
    from sparsekv.evaluation.runner import ROW_FIELDS, read_rows

    out = tmp_path / "eval"
    run_eval(
        EvalConfig(
            out=str(out),
            model="tiny:gemma3",
            tasks=["passkey", "ppl"],
            lengths=[256],
            samples=1,
            policies=["streaming"],
            budgets=[0.5],
            protocols=["agnostic"],
        ),
        progress=False,
        report=False,
    )
    samples = peer.read_prompts(out / "prompts.jsonl")
    specs = [peer.PressSpec(p, m) for m in ("all", "full") for p in ("snapkv", "knorm")]
    plan = peer.Plan(samples, specs, [0.5], ["agnostic"])
    rows_path = tmp_path / "kvpress.jsonl"
    layer_types = ["sliding_attention"] * 3 + ["full_attention"]
    with open(rows_path, "w") as f:
        rows = peer.run_plan(
            plan,
            FakeRunner(),
            lambda r: f.write(json.dumps(r) + "\n"),
            ROW_FIELDS,
            M,
            layer_types,
            progress=False,
        )

    by = {(r["sample_id"], r["policy"]): r for r in rows}
    assert all(set(ROW_FIELDS) <= set(r) and r["source"] == "kvpress" for r in rows)
    ref = by[("passkey-256-0", "no-press")]
    assert (
        ref["score"] == 1.0
        and ref["kl"] == 0.0
        and ref["agreement"] == 1.0
        and ref["budget"] == 1.0
    )
    wrong, right = by[("passkey-256-0", "snapkv-all")], by[("passkey-256-0", "snapkv-full")]
    assert wrong["score"] == M.score_answer(wrong["output"], wrong["answer"]) == 0.0
    assert right["score"] == 1.0 and right["kl"] == pytest.approx(0.0, abs=1e-6)
    assert wrong["kl"] > 1.0 and wrong["prefix_match"] == 0
    assert right["kv_bytes_compressed"] == 2000 and right["decode_tok_s"] == round(
        (len(right["output_ids"]) - 1) / 0.5, 2
    )
    assert "PerLayerCompressionPress(SnapKVPress(compression_ratio=0.5)" in right["policy_spec"]
    crashed = by[("passkey-256-0", "knorm-full")]
    assert crashed["score"] == 0.0 and crashed["error"].startswith(
        "RuntimeError: The size of tensor a"
    )
    ppl = by[("ppl-256-0", "snapkv-all")]
    assert ppl["kl"] > 0 and ppl["ppl"] > 1 and 0 <= ppl["top1"] <= 1
    assert ("ppl-256-0", "snapkv-full") not in by  # skipped: continuation in the full-layers mode

    n = ingest_rows(out, rows_path, source="kvpress")
    assert n == len(rows)
    results = read_rows(out / "results.jsonl")
    assert {r["source"] for r in results} == {"sparsekv", "kvpress"}
    summary = {(s["source"], s["task"], s["policy"]): s for s in summarize(results)}
    s = summary[("kvpress", "passkey", "knorm-full")]
    assert s["errors"] == 1 and s["score"] == 0.0
    s = summary[("kvpress", "passkey", "snapkv-full")]
    # compared with the harness's own full-cache row on the same sample
    harness_full = next(r for r in results if r["policy"] == "full" and r["task"] == "passkey")
    assert s["kv_frac"] == pytest.approx(2000 / harness_full["kv_bytes_compressed"])
    md = (out / "summary.md").read_text()
    assert "snapkv-full @ 0.5" in md and "no-press @ 1.0" in md
    assert list(out.glob("quality_agnostic_256.png"))


def test_resume_skips_rows_already_written(tmp_path):
    from sparsekv.evaluation import metrics as M
    from sparsekv.evaluation.runner import ROW_FIELDS

    samples = [
        s
        for s in peer.read_prompts(_prompts(tmp_path, tasks=("passkey",)))
        if s["sample_id"].endswith("-0")
    ]
    plan = peer.Plan(samples, [peer.PressSpec("snapkv", "all")], [0.2, 0.5], ["agnostic"])
    first = peer.run_plan(plan, FakeRunner(), lambda r: None, ROW_FIELDS, M, progress=False)
    done = {peer.row_key(r) for r in first if r["budget"] != 0.5}
    runner = FakeRunner()
    rest = peer.run_plan(plan, runner, lambda r: None, ROW_FIELDS, M, progress=False, done=done)
    assert [(r["policy"], r["budget"]) for r in rest] == [("snapkv-all", 0.5)]
    # the reference is run again (not written) so that the remaining row still gets its KL
    assert [c[2] for c in runner.calls] == [None, "snapkv-all"] and rest[0]["kl"] is not None


def test_command_line_help_and_dry_run_need_no_kvpress(tmp_path):
    script = str(PEER / "run_presses.py")
    out = subprocess.run(
        check=False,
        args=[sys.executable, script, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        out.returncode == 0
        and "--prompts" in out.stdout
        and "PerLayerCompressionPress" in out.stdout
    )
    prompts = _prompts(tmp_path, tasks=("passkey", "ppl"))
    out = subprocess.run(
        check=False,
        args=[
            sys.executable,
            script,
            "--prompts",
            str(prompts),
            "--out",
            str(tmp_path / "r.jsonl"),
            "--budget",
            "0.3",
            "--presses",
            "snapkv,tova",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "4 samples, 16 runs" in out.stderr and "snapkv-full 2" in out.stderr
    out = subprocess.run(
        check=False,
        args=[
            sys.executable,
            script,
            "--prompts",
            str(prompts),
            "--out",
            str(tmp_path / "r.jsonl"),
            "--budget",
            "0.3",
            "--presses",
            "h2o",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "allowed values: snapkv" in out.stderr
    assert subprocess.run(check=False, args=["bash", "-n", str(PEER / "run.sh")]).returncode == 0
