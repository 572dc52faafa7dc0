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
    return importlib.import_module("eval.peers.kvpress.run_presses")


peer = _load_peer()


def peer_module(name: str):
    """A module of the peer run beside run_presses.py (its folder is on sys.path once loaded)."""
    import importlib

    return importlib.import_module(name)


def _prompts(tmp_path: Path, tasks=("passkey", "ppl", "gen"), length=256) -> Path:
    from sparsekv.evaluation.config import EvalConfig
    from sparsekv.evaluation.running.runner import build_samples, write_prompts
    from sparsekv.evaluation.tasks.codec import AsciiCodec

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
    from sparsekv.evaluation.running.runner import ROW_FIELDS

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
    # continuations run in the full-layers mode too: their tokens are fed causally, one by one
    assert len(full_ppl) == 2 * 2
    assert len(runs) == len(refs) + len(refs) * 2 * 2
    assert plan.skipped() == {}
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
    from sparsekv.evaluation.reports.tables import summarize
    from sparsekv.evaluation.running.runner import ROW_FIELDS, read_rows

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
    assert by[("ppl-256-0", "snapkv-full")]["kl"] > 0  # continuations run in both modes

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
    from sparsekv.evaluation.running.runner import ROW_FIELDS

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
    assert "4 samples, 20 runs" in out.stderr and "snapkv-full 4" in out.stderr
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


def _gate_rows(n: int, wrong: int = 0):
    ours, theirs = [], []
    for i in range(n):
        ids = [5, 6, 7, i]
        ours.append(
            {
                "sample_id": f"s{i}",
                "protocol": "aware",
                "policy": "full",
                "output_ids": ids,
                "output": " x",
            }
        )
        got = ids + [9, 9] if i >= wrong else [5, 6, 0, i]  # the pipeline decodes further
        theirs.append(
            {
                "sample_id": f"s{i}",
                "protocol": "aware",
                "policy": "no-press",
                "output_ids": got,
                "output": " y",
            }
        )
    return theirs, ours


def test_gate_passes_only_when_the_peer_reproduces_our_full_cache():
    gate = peer_module("kvp_gate")
    theirs, ours = _gate_rows(40, wrong=2)  # 38 of 40 agree: 95%
    v = gate.compare(theirs, ours)
    assert v["passed"] and v["compared"] == 40 and v["agree"] == 38
    assert [m["sample_id"] for m in v["mismatches"]] == ["s0", "s1"]
    theirs, ours = _gate_rows(40, wrong=3)  # 92.5%
    v = gate.compare(theirs, ours)
    assert not v["passed"] and "37 of 40" in v["reason"]
    theirs, ours = _gate_rows(10)  # all agree, but too few prompts to judge
    v = gate.compare(theirs, ours)
    assert not v["passed"] and "at least 40" in v["reason"]
    assert gate.compare(theirs, ours, min_prompts=10)["passed"]
    with pytest.raises(ValueError, match="threshold"):
        gate.compare(theirs, ours, threshold=0)


def test_gate_command_line_and_torn_rows(tmp_path):
    theirs, ours = _gate_rows(40, wrong=5)
    a, b = tmp_path / "kvpress.jsonl", tmp_path / "results.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in theirs) + '{"sample_id": "s4')  # torn
    b.write_text("".join(json.dumps(r) + "\n" for r in ours))
    out = subprocess.run(
        [
            sys.executable,
            str(PEER / "kvp_gate.py"),
            "--peer",
            str(a),
            "--reference",
            str(b),
            "--out",
            str(tmp_path / "gate.json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 1 and "FAILED" in out.stdout
    verdict = json.loads((tmp_path / "gate.json").read_text())
    assert verdict["compared"] == 40 and verdict["agree"] == 35 and not verdict["passed"]


def test_resume_cuts_a_torn_last_row(tmp_path):
    rows = peer_module("kvp_rows")
    path = tmp_path / "kvpress.jsonl"
    good = {"policy": "no-press", "budget": 1.0, "protocol": "aware", "sample_id": "a"}
    path.write_text(json.dumps(good) + "\n" + '{"policy": "snapkv-full", "bud')
    assert rows.resume_keys(path) == {("no-press", "1.0", "aware", "a")}
    assert path.read_text() == json.dumps(good) + "\n"  # the next row starts on its own line
    path.write_text("not json\n" + json.dumps(good) + "\n")
    with pytest.raises(ValueError, match=":1 is not a JSON row"):
        rows.resume_keys(path)


# kvpress's transformers (5.2) takes `past_key_values=`, which 5.24 deprecates for `cache=`
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_questions_are_fed_causally_when_only_full_layers_are_compressed():
    """The peer's decoding wrapper on a cache whose full-attention layer was compressed while
    the sliding ones were not: the question goes in one token at a time (positions continuing
    the context), and every position's logits equal a plain token-by-token reference."""
    from transformers import DynamicCache

    from sparsekv.models.tiny import tiny_model

    kp = peer_module("kvp_pipeline")
    model = tiny_model("gemma3")
    types = model.config.get_text_config().layer_types
    g = torch.Generator().manual_seed(1)
    ctx = torch.randint(0, 128, (1, 64), generator=g)
    q = torch.randint(0, 128, (1, 5), generator=g)

    def compressed():
        c = DynamicCache(config=model.config)
        with torch.no_grad():
            model.model(input_ids=ctx, past_key_values=c)
        for i, t in enumerate(types):
            if t == "full_attention":
                keep = torch.arange(0, 64, 2)
                c.layers[i].keys = c.layers[i].keys[:, :, keep]
                c.layers[i].values = c.layers[i].values[:, :, keep]
        return c

    seen = []

    def pipeline_answer(question_ids, cache, context_length, max_new_tokens):
        seen.append((question_ids.shape[1], context_length))
        pos = torch.arange(context_length, context_length + question_ids.shape[1])[None]
        with torch.no_grad():
            return model(input_ids=question_ids, past_key_values=cache, position_ids=pos).logits[0]

    runner = object.__new__(kp.KVPressRunner)
    runner.torch, runner.model, runner.layer_types = torch, model, types
    runner.metrics, runner._rec = peer.load_harness_metrics(), {}
    runner._pipeline_answer = pipeline_answer
    cache = compressed()
    assert runner._uneven(cache)
    last = runner._generate_answer(q, cache, 64, 1)[-1]
    assert seen == [(1, 68)] and runner._rec["fed_one_by_one"]
    assert runner._rec["lengths"] == [c.keys.shape[-2] for c in compressed().layers]
    ref = compressed()
    with torch.no_grad():
        for i in range(5):
            want = model(
                input_ids=q[:, i : i + 1],
                past_key_values=ref,
                position_ids=torch.tensor([[64 + i]]),
            ).logits[0, -1]
    assert torch.allclose(last, want, atol=1e-6)
    assert cache.get_seq_length() == ref.get_seq_length() == 69


def test_the_committed_gate_subset_pairs_every_prompt_with_our_full_cache():
    """`run.sh --gate` compares kvpress's no-press rows on `gate-prompts.jsonl.gz` with
    `gate-reference.jsonl.gz`: every prompt x protocol must have our full cache's row there."""
    import gzip

    gate = peer_module("kvp_gate")
    prompts = [json.loads(x) for x in gzip.open(PEER / "gate-prompts.jsonl.gz", "rt")]
    ref = gate.read_jsonl(PEER / "gate-reference.jsonl.gz")
    want = {(p["sample_id"], proto) for p in prompts for proto in p["protocols"]}
    assert len(want) >= gate.MIN_PROMPTS
    assert {(r["sample_id"], r["protocol"]) for r in ref if r["policy"] == "full"} == want
    assert all(r["output_ids"] for r in ref)
