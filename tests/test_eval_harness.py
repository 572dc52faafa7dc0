"""The evaluation harness end to end on a tiny random model: files, rows, reproducibility,
peer rows, and clear errors for bad configs."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import yaml

from sparsekv.cli import main
from sparsekv.evaluation.config import EvalConfig, parse_policy

ROOT = Path(__file__).resolve().parents[1]
TIMING = {"prefill_s", "decode_s", "decode_tok_s", "peak_rss_mb", "fork_s"}
GRID = ["--model", "tiny:llama", "--policy", "snapkv,h2o", "--budget", "0.3", "--tasks", "passkey,ppl",
        "--lengths", "512", "--samples", "2", "--seed", "3", "--threads", "1", "--no-progress"]


def _rows(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "results.jsonl").read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("eval") / "run"
    assert main(["eval", *GRID, "--out", str(out)]) == 0
    return out


def test_end_to_end_writes_every_output(run_dir):
    for name in ("results.jsonl", "summary.csv", "summary.md", "config.yaml", "prompts.jsonl",
                 "quality_agnostic_512.png", "quality_aware_512.png", "kl_agnostic_512.png", "kl_aware_512.png"):
        assert (run_dir / name).is_file() and (run_dir / name).stat().st_size > 0, name
    rows = _rows(run_dir)
    # passkey: 2 samples x 2 protocols x (full + 2 policies); ppl: 2 samples x agnostic x 3.
    assert len(rows) == 2 * 2 * 3 + 2 * 1 * 3
    assert {r["policy"] for r in rows} == {"full", "snapkv", "h2o"}
    assert all(r["error"] is None for r in rows)
    ref = {(r["sample_id"], r["protocol"]): r for r in rows if r["policy"] == "full"}
    for r in rows:
        full = ref[(r["sample_id"], r["protocol"])]
        if r["policy"] == "full":
            assert r["kl"] == 0.0 and r["budget"] == 1.0
            continue
        assert r["kv_bytes_compressed"] < 0.5 * full["kv_bytes_compressed"]
        assert r["kl"] is not None and r["kl"] >= 0.0
        assert r["prefill_s"] > 0 and r["peak_rss_mb"] > 0
        if r["task"] == "ppl":
            assert r["ppl"] > 1 and 0 <= r["top1"] <= 1
        else:
            assert len(r["output_ids"]) >= 1 and r["score"] in (0.0, 1.0)
    with open(run_dir / "summary.csv") as f:
        summary = list(csv.DictReader(f))
    assert len(summary) == 3 * 2 + 3  # passkey x 2 protocols + ppl, each full + 2 policies
    assert {s["kv_frac"] for s in summary if s["policy"] == "full"} == {"1.0"}
    md = (run_dir / "summary.md").read_text()
    assert "## Protocol: agnostic, 512 tokens" in md and "## Protocol: aware, 512 tokens" in md
    assert "snapkv @ 0.3" in md and "full cache" in md
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["budgets"] == [0.3] and cfg["environment"]["torch_threads"] == 1
    prompts = [json.loads(x) for x in (run_dir / "prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 4 and prompts[0]["protocols"] == ["agnostic", "aware"]
    assert prompts[-1]["task"] == "ppl" and prompts[-1]["protocols"] == ["agnostic"]


def test_same_seed_same_prompts_and_numbers(run_dir, tmp_path):
    again = tmp_path / "again"
    assert main(["eval", *GRID, "--out", str(again)]) == 0
    assert (again / "prompts.jsonl").read_text() == (run_dir / "prompts.jsonl").read_text()
    a, b = _rows(run_dir), _rows(again)
    assert [{k: v for k, v in r.items() if k not in TIMING} for r in a] == [
        {k: v for k, v in r.items() if k not in TIMING} for r in b
    ]


def test_budget_one_matches_the_full_cache(tmp_path):
    out = tmp_path / "b1"
    args = ["eval", "--model", "tiny:gemma3", "--policy", "snapkv", "--budget", "1.0", "--tasks", "passkey,gen",
            "--lengths", "256", "--samples", "1", "--threads", "1", "--no-progress", "--out", str(out)]
    assert main(args) == 0
    rows = _rows(out)
    ref = {(r["sample_id"], r["protocol"]): r for r in rows if r["policy"] == "full"}
    for r in rows:
        if r["policy"] == "snapkv":
            full = ref[(r["sample_id"], r["protocol"])]
            assert r["output_ids"] == full["output_ids"]
            assert r["kv_bytes_compressed"] == full["kv_bytes_compressed"]
            assert r["kl_mean"] < 1e-6 and r["agreement"] == 1.0


def test_dump_prompts_and_ingest_peer_rows(run_dir, tmp_path, capsys):
    dump = tmp_path / "dump"
    assert main(["eval", *GRID, "--out", str(dump), "--dump-prompts"]) == 0
    assert (dump / "prompts.jsonl").read_text() == (run_dir / "prompts.jsonl").read_text()
    assert not (dump / "results.jsonl").exists()

    # A peer writes rows for the same prompts: one right answer, one wrong, one crash.
    prompts = [json.loads(x) for x in (run_dir / "prompts.jsonl").read_text().splitlines()]
    pk = [p for p in prompts if p["task"] == "passkey"]
    peer = [
        {"sample_id": pk[0]["sample_id"], "task": "passkey", "length": 512, "protocol": "agnostic",
         "policy": "kvpress:snapkv", "budget": 0.3, "output": f" {pk[0]['answer']}.", "kl": 0.5,
         "kv_bytes_compressed": 1000},
        {"sample_id": pk[1]["sample_id"], "task": "passkey", "length": 512, "protocol": "agnostic",
         "policy": "kvpress:snapkv", "budget": 0.3, "output": " 0.", "kl": 0.7, "kv_bytes_compressed": 1000},
        {"sample_id": pk[0]["sample_id"], "task": "passkey", "length": 512, "protocol": "agnostic",
         "policy": "kvpress:knorm", "budget": 0.3, "error": "RuntimeError: mask size mismatch"},
    ]
    rows_file = tmp_path / "peer.jsonl"
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in peer))
    work = tmp_path / "work"
    work.mkdir()
    for name in ("results.jsonl", "prompts.jsonl", "config.yaml"):
        (work / name).write_text((run_dir / name).read_text())
    assert main(["eval", "--out", str(work), "--ingest", str(rows_file), "--source", "kvpress"]) == 0
    rows = _rows(work)
    assert len(rows) == len(_rows(run_dir)) + 3
    got = {(r["policy"], r["sample_id"]): r for r in rows if r["source"] == "kvpress"}
    assert got[("kvpress:snapkv", pk[0]["sample_id"])]["score"] == 1.0
    assert got[("kvpress:snapkv", pk[1]["sample_id"])]["score"] == 0.0
    assert got[("kvpress:knorm", pk[0]["sample_id"])]["score"] == 0.0
    with open(work / "summary.csv") as f:
        peer_sum = [s for s in csv.DictReader(f) if s["source"] == "kvpress"]
    by = {s["policy"]: s for s in peer_sum}
    assert by["kvpress:snapkv"]["score"] == "0.5" and by["kvpress:knorm"]["errors"] == "1"
    assert "kvpress:snapkv @ 0.3" in (work / "summary.md").read_text()
    # Ingesting the same rows again replaces them instead of duplicating.
    assert main(["eval", "--out", str(work), "--ingest", str(rows_file), "--source", "kvpress"]) == 0
    assert len(_rows(work)) == len(rows)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"sample_id": "nope", "task": "passkey"}) + "\n")
    assert main(["eval", "--out", str(work), "--ingest", str(bad)]) == 2
    assert "missing field(s)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tasks", "passkey,needle"], "unknown task 'needle'; known tasks: passkey, multikey"),
        (["--policy", "snapkv,magic"], "unknown policy 'magic'"),
        (["--budget", "1.5"], "a float budget is a fraction in (0, 1]"),
        (["--budget", "abc"], "budget 'abc' is not a number"),
        (["--protocol", "blind"], "allowed values: agnostic, aware"),
        (["--lengths", "12"], "lengths are >= 64 tokens"),
        (["--policy", "snapkv@window"], "must be KEY=VALUE"),
        (["--policy", "snapkv@schedule=zigzag"], "schedule='zigzag' is not supported"),
        (["--model", "tiny:gpt2"], "allowed: llama, qwen2"),
        (["--eviction", "rerank_every=-1"], "rerank_every=-1 must be an int >= 0"),
        (["--adapter", "/nonexistent/adapter"], "policy 'learned:/nonexistent/adapter'"),
    ],
)
def test_bad_flags_give_clear_errors(argv, message, tmp_path, capsys):
    assert main(["eval", "--model", "tiny:llama", "--out", str(tmp_path / "x"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "x").exists()


def test_malformed_config_files_give_clear_errors(tmp_path, capsys):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("tasks: [passkey\nbudgets: 0.3\n")
    assert main(["eval", "--config", str(bad_yaml)]) == 2
    assert "is not valid YAML" in capsys.readouterr().err
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("model: tiny:llama\ntask_list: [passkey]\nout: x\n")
    assert main(["eval", "--config", str(unknown)]) == 2
    err = capsys.readouterr().err
    assert "unknown eval config field(s) ['task_list']" in err and "allowed: out, model" in err
    bad_task = tmp_path / "task.yaml"
    bad_task.write_text("model: tiny:llama\ntasks: [passkey, haystack]\nout: x\n")
    assert main(["eval", "--config", str(bad_task)]) == 2
    assert "unknown task 'haystack'" in capsys.readouterr().err
    opts = tmp_path / "opts.yaml"
    opts.write_text("model: tiny:llama\ntask_options: {multikey: {keys: 3}}\nout: x\n")
    assert main(["eval", "--config", str(opts)]) == 2
    assert "allowed: num_keys, digits, max_new_tokens" in capsys.readouterr().err
    assert main(["eval", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_flags_override_the_config_file(tmp_path):
    import argparse

    from sparsekv.evaluation.cli import add_eval_parser, resolve_config

    path = tmp_path / "c.yaml"
    path.write_text("model: tiny:llama\npolicies: [snapkv]\nbudgets: [0.1, 0.2]\nsamples: 4\n"
                    "eviction: {rerank_every: 4}\nout: a\n")
    parser = argparse.ArgumentParser()
    add_eval_parser(parser.add_subparsers())
    args = parser.parse_args(["eval", "--config", str(path), "--samples", "2", "--adapter", "ckpt/x",
                              "--eviction", "recent_window=32"])
    cfg = resolve_config(args)
    assert cfg.samples == 2 and cfg.budgets == [0.1, 0.2]
    assert cfg.policies == ["snapkv", "learned:ckpt/x"]
    assert cfg.eviction == {"rerank_every": 4, "recent_window": 32}


def test_policy_spec_syntax():
    p = parse_policy("learned:checkpoints/run/final@blend=0.5@schedule=pyramid@rerank_every=4@label=mine")
    assert p.name == "learned:checkpoints/run/final" and p.label == "mine"
    assert p.policy_kwargs == {"blend": 0.5}
    assert p.eviction == {"schedule": "pyramid", "rerank_every": 4}
    q = parse_policy({"policy": "snapkv", "window": 16, "recent_window": 32})
    assert q.policy_kwargs == {"window": 16} and q.eviction == {"recent_window": 32}
    assert parse_policy("h2o").label == "h2o"
    with pytest.raises(ValueError, match="needs an adapter"):
        parse_policy("learned")
    with pytest.raises(ValueError, match="labels must be unique"):
        EvalConfig(model="tiny:llama", policies=["snapkv", "snapkv"])
    # per-method budgets: an ablation at one budget inside a grid of several
    assert parse_policy("snapkv@budgets=0.3").budgets == (0.3,)
    assert parse_policy("h2o@budgets=0.1+0.5").budgets == (0.1, 0.5)
    assert parse_policy({"policy": "tova", "budgets": [0.2, 64]}).budgets == (0.2, 64)
    assert parse_policy("tova").budgets is None
    with pytest.raises(ValueError, match="budget"):
        parse_policy("snapkv@budgets=0.1+lots")
    cfg = EvalConfig(model="tiny:llama", policies=["snapkv", "h2o@rerank_every=4@budgets=0.3@label=h2o-r4"],
                     budgets=[0.1, 0.3], tasks=["passkey"], protocols=["agnostic"], samples=1)
    assert [cfg.budgets_of(p) for p in cfg.policy_specs] == [[0.1, 0.3], [0.3]]
    from sparsekv.evaluation.running.plan import method_keys

    assert method_keys(cfg, "agnostic") == {("full", "1.0"), ("snapkv", "0.1"), ("snapkv", "0.3"), ("h2o-r4", "0.3")}


def test_per_method_protocols_parse_and_share_a_label_across_protocols():
    from sparsekv.evaluation.running.plan import grid_size, method_keys

    assert parse_policy("snapkv@protocols=aware").protocols == ("aware",)
    assert parse_policy({"policy": "h2o", "protocols": ["agnostic", "aware"]}).protocols == ("agnostic", "aware")
    assert parse_policy("h2o").protocols is None
    with pytest.raises(ValueError, match="allowed values: agnostic, aware"):
        parse_policy("snapkv@protocols=blind")
    # one label, one method per protocol
    both = ["snapkv@window=8@protocols=agnostic@label=s", "snapkv@window=16@protocols=aware@label=s", "h2o"]
    cfg = EvalConfig(model="tiny:llama", policies=both, budgets=[0.3], tasks=["passkey", "ppl"], samples=1)
    assert method_keys(cfg, "agnostic") == method_keys(cfg, "aware") == {("full", "1.0"), ("s", "0.3"), ("h2o", "0.3")}
    assert [cfg.budgets_of(p, "aware") for p in cfg.policy_specs] == [[], [0.3], [0.3]]
    with pytest.raises(ValueError, match="unique within a protocol.*under aware"):
        EvalConfig(model="tiny:llama", policies=["snapkv@label=s", "h2o@protocols=aware@label=s"])
    with pytest.raises(ValueError, match="runs under none of the grid's protocols"):
        EvalConfig(model="tiny:llama", policies=["snapkv@protocols=aware"], protocols=["agnostic"])
    only_aware = EvalConfig(model="tiny:llama", policies=["snapkv", "h2o@protocols=aware"], budgets=[0.3],
                            tasks=["passkey"], samples=1)
    from types import SimpleNamespace

    one = [SimpleNamespace(task="passkey", metadata={"n_tokens": 100})]
    assert grid_size(only_aware, one) == (2 + 3, 500)  # agnostic: full + snapkv; aware: + h2o


def test_a_method_per_protocol_runs_only_there_and_resumes(tmp_path):
    out = tmp_path / "per-protocol"
    args = ["eval", "--model", "tiny:llama", "--budget", "0.3", "--tasks", "passkey", "--lengths", "256",
            "--samples", "1", "--threads", "1", "--no-progress", "--out", str(out), "--policy",
            "snapkv@window=8@protocols=agnostic@label=s,snapkv@window=16@protocols=aware@label=s"]
    assert main(args) == 0
    rows = _rows(out)
    assert sorted((r["protocol"], r["policy"], r["policy_spec"]) for r in rows) == [
        ("agnostic", "full", "full"), ("agnostic", "s", "snapkv@window=8@protocols=agnostic@label=s"),
        ("aware", "full", "full"), ("aware", "s", "snapkv@window=16@protocols=aware@label=s"),
    ]
    assert "## Protocol: aware" in (out / "summary.md").read_text()
    assert main([*args, "--resume"]) == 0  # every group complete: nothing reruns
    assert _rows(out) == rows


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "eval").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    cfg = EvalConfig.from_yaml(path)
    assert cfg.out and cfg.tasks and cfg.policy_specs
    assert path.read_text().startswith("#")  # opens with how to run it


def test_shared_prefill_matches_live_prefill(tmp_path):
    """Forking one recorded prefill per prompt gives the rows that prefilling every run gives
    (live runs use transformers' DynamicCache as the reference)."""
    common = ["eval", "--model", "tiny:gemma3", "--policy", "h2o,snapkv,tova,knorm,snapkv@window=8",
              "--budget", "0.25", "--tasks", "passkey,ppl", "--lengths", "256", "--samples", "1",
              "--threads", "1", "--no-progress"]
    assert main([*common, "--out", str(tmp_path / "shared")]) == 0
    assert main([*common, "--out", str(tmp_path / "live"), "--live-prefill"]) == 0
    shared, live = _rows(tmp_path / "shared"), _rows(tmp_path / "live")
    assert len(shared) == len(live) == (2 + 1) * 6
    assert [r["prefill_shared"] for r in shared if r["policy"] != "snapkv@window=8"] == [True] * 15
    assert {r["prefill_shared"] for r in live} == {False}
    for a, b in zip(shared, live):
        assert (a["sample_id"], a["protocol"], a["policy"]) == (b["sample_id"], b["protocol"], b["policy"])
        assert a["output_ids"] == b["output_ids"], a["policy"]
        assert a["kv_bytes_compressed"] == b["kv_bytes_compressed"] and a["kv_bytes_end"] == b["kv_bytes_end"]
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-3, abs=1e-7), a["policy"]
        if a["task"] == "ppl":
            assert a["nll"] == pytest.approx(b["nll"], rel=1e-5)


def test_learned_adapter_runs_in_the_grid(tmp_path):
    import torch

    from sparsekv import ScorerAdapter
    from sparsekv.evaluation.running.models import load_model

    model, _ = load_model("tiny:llama")
    torch.manual_seed(0)
    adapter_dir = ScorerAdapter.for_model(model, hidden=8).save_pretrained(tmp_path / "adapter")
    out = tmp_path / "learned"
    argv = ["eval", "--model", "tiny:llama", "--adapter", str(adapter_dir),
            "--policy", f"snapkv,learned:{adapter_dir}@blend=0.5@label=learned-blend", "--budget", "0.3",
            "--tasks", "passkey", "--lengths", "256", "--samples", "1", "--protocol", "agnostic",
            "--threads", "1", "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    rows = _rows(out)
    assert [r["policy"] for r in rows] == ["full", "snapkv", "learned-blend", f"learned:{adapter_dir}"]
    assert all(r["error"] is None and r["prefill_shared"] for r in rows)
    assert all(r["kv_bytes_compressed"] < rows[0]["kv_bytes_compressed"] for r in rows[1:])


def _key(r: dict) -> tuple:
    return (r["sample_id"], r["protocol"], r["policy"], str(r["budget"]))


def _measured(r: dict) -> dict:
    return {k: v for k, v in r.items() if k not in TIMING}


def test_two_workers_give_the_rows_of_one(run_dir, tmp_path):
    out = tmp_path / "w2"
    assert main(["eval", *GRID, "--workers", "2", "--out", str(out)]) == 0
    one, two = _rows(run_dir), _rows(out)
    assert not list(out.glob("results.part-*"))
    assert sorted(map(_key, one)) == sorted(map(_key, two))
    by_key = {_key(r): _measured(r) for r in one}
    for r in two:
        assert _measured(r) == by_key[_key(r)], _key(r)
    assert yaml.safe_load((out / "config.yaml").read_text())["workers"] == 2


def test_resume_keeps_every_finished_row_and_runs_only_the_missing_ones(run_dir, tmp_path, capsys):
    out = tmp_path / "res"
    small = [a if a != "2" else "1" for a in GRID]  # --samples 1
    assert main(["eval", *small, "--out", str(out)]) == 0
    first = {_key(r): r for r in _rows(out)}
    # an interrupted later run left a part file with one unfinished group (its reference row only)
    stray = dict(next(r for r in _rows(run_dir) if r["sample_id"].endswith("-1") and r["policy"] == "full"))
    stray["prefill_s"] = 9999.5  # a mark no real run has
    (out / "results.part-0.jsonl").write_text(json.dumps(stray) + "\n")
    first[_key(stray)] = stray
    assert main(["eval", *GRID, "--resume", "--out", str(out)]) == 0
    rows = _rows(out)
    assert sorted(map(_key, rows)) == sorted(map(_key, _rows(run_dir)))  # complete, no duplicates
    for r in rows:
        if _key(r) in first:  # kept as they were, timings included: not rerun
            assert r == first[_key(r)]
        else:
            assert r["prefill_s"] > 0
    assert not list(out.glob("results.part-*"))
    # a grid that changes what earlier rows mean refuses to resume, naming the field
    capsys.readouterr()
    assert main(["eval", *[a if a != "3" else "4" for a in GRID], "--resume", "--out", str(out)]) == 2
    assert "with seed=3, this grid has seed=4" in capsys.readouterr().err
    relabel = [a if a != "snapkv,h2o" else "snapkv@window=4@label=snapkv,h2o" for a in GRID]
    assert main(["eval", *relabel, "--resume", "--out", str(out)]) == 2
    assert "label 'snapkv' meant 'snapkv'" in capsys.readouterr().err
    assert _rows(out) == rows


def test_at_a_glance_averages_shares_of_the_full_cache_and_counts_lowest_kl():
    from sparsekv.evaluation.reports.tables import glance, method_order, summarize

    def row(task, sid, policy, budget, score, kl, spec=None):
        return {"source": "sparsekv", "task": task, "length": 512, "protocol": "agnostic", "sample_id": sid,
                "policy": policy, "policy_spec": spec or policy, "budget": budget, "score": score, "kl": kl,
                "kv_bytes_compressed": 100}

    rows = []
    for i in range(2):
        # an ablation of `a` (same policy, another setting) with the lowest KL everywhere: it does
        # not take `a`'s lowest-KL counts, but it is another policy's variant for `b`
        rows += [row(t, f"{t[0]}{i}", "a, ablation", 0.3, 0.0, 0.05, spec="a@window=4")
                 for t in ("passkey", "multikey", "vartrack")]
        rows += [row("passkey", f"p{i}", "full", 1.0, 1.0, 0.0), row("multikey", f"m{i}", "full", 1.0, 1.0, 0.0),
                 row("vartrack", f"v{i}", "full", 1.0, 0.0, 0.0)]
        rows += [row("passkey", f"p{i}", "a", 0.3, 1.0, 0.1), row("multikey", f"m{i}", "a", 0.3, float(i), 0.5),
                 row("vartrack", f"v{i}", "a", 0.3, 0.0, 0.2)]
        rows += [row("passkey", f"p{i}", "b", 0.3, 0.0, 0.3), row("multikey", f"m{i}", "b", 0.3, 0.0, 0.4),
                 row("vartrack", f"v{i}", "b", 0.3, 0.0, 0.1)]
    ss = summarize(rows)
    idx = {(s["source"], s["policy"], s["budget"], s["task"]): s for s in ss}
    lines = glance(ss, ["passkey", "multikey", "vartrack"], method_order(ss), idx)
    cells = [[x.strip() for x in ln.strip("|").split("|")] for ln in "\n".join(lines).splitlines() if "@" in ln]
    table = {c[0]: c[1:] for c in cells}
    # a: passkey 100%, multikey 50% (vartrack: the full cache scores 0, left out) -> 75%
    # with its 95% bootstrap interval: passkey stays 100%, multikey resamples to 0/50/100%.
    # KL where the full cache is right: passkey 0.1, multikey 0.5 (vartrack: never right) -> 0.3
    # the mean KL with its 95% interval over samples (each sample's KL is the same in both here)
    assert table["a @ 0.3"][:4] == ["75% (50-100%)", "0.267 (0.267-0.267)", "0.3", "1/3"]
    assert table["b @ 0.3"][:4] == ["0% (0-0%)", "0.267 (0.267-0.267)", "0.35", "0/3"]  # 2/3 without the ablation
    assert table["a, ablation @ 0.3"][:4] == ["0% (0-0%)", "0.05 (0.05-0.05)", "0.05", "3/3"]
    assert "variants of one policy" in lines[-2]
    assert "averaged over passkey, multikey" in lines[-2]


def test_kl_where_the_full_cache_is_right_leaves_out_its_wrong_answers():
    """A method that moves the model off a wrong full-cache answer has a large KL on that sample;
    `kl_right` averages only the samples the full cache answers right (question tasks only)."""
    from sparsekv.evaluation.reports.tables import summarize

    def row(task, sid, policy, score, kl):
        return {"source": "sparsekv", "task": task, "length": 512, "protocol": "aware", "sample_id": sid,
                "policy": policy, "budget": 1.0 if policy == "full" else 0.1, "score": score, "kl": kl,
                "kv_bytes_compressed": 100}

    rows = [row("passkey", "p0", "full", 1.0, 0.0), row("passkey", "p1", "full", 0.0, 0.0),
            row("passkey", "p2", "full", 1.0, 0.0), row("passkey", "p0", "m", 1.0, 0.02),
            row("passkey", "p1", "m", 1.0, 0.9), row("passkey", "p2", "m", 0.0, 0.04),
            row("ppl", "q0", "full", 1.0, 0.0), row("ppl", "q0", "m", 1.0, 0.3)]
    got = {(s["task"], s["policy"]): s for s in summarize(rows)}
    m = got[("passkey", "m")]
    assert abs(m["kl"] - 0.32) < 1e-9 and abs(m["kl_right"] - 0.03) < 1e-9 and m["n_right"] == 2
    assert math.isnan(got[("ppl", "m")]["kl_right"]) and got[("ppl", "m")]["n_right"] == 0  # not a question task


def test_side_by_side_puts_both_protocols_and_every_budget_of_a_method_in_one_row():
    from sparsekv.evaluation.reports.tables import side_by_side, summarize

    def row(protocol, sid, policy, budget, score, kl):
        return {"source": "sparsekv", "task": "passkey", "length": 512, "protocol": protocol, "sample_id": sid,
                "policy": policy, "budget": budget, "score": score, "kl": kl, "kv_bytes_compressed": 100}

    rows = []
    for pr in ("agnostic", "aware"):
        for i in range(2):
            rows += [row(pr, f"p{i}", "full", 1.0, 1.0, 0.0), row(pr, f"p{i}", "a", 0.1, float(i), 0.5),
                     row(pr, f"p{i}", "a", 0.3, 1.0, 0.25)]
        rows.append(row(pr, "p0", "ablation", 0.3, 0.0, 1.0))
    rows.append(row("agnostic", "p1", "ablation", 0.3, 0.0, 1.0))  # aware: the ablation ran on p0 only
    lines = "\n".join(side_by_side(summarize(rows))).splitlines()
    assert lines[0] == "## Side by side, 512 tokens"
    cells = {c[0]: c[1:] for c in ([x.strip() for x in ln.strip("|").split("|")] for ln in lines if ln.startswith("| "))}
    assert cells["method"][0] == "agnostic: retrieval share @ 0.1 / 0.3" and cells["method"][3].startswith("aware")
    assert cells["method"][2] == "agnostic: KL where full is right @ 0.1 / 0.3"
    assert cells["a"] == ["50% / 100%", "0.5 / 0.25", "0.5 / 0.25", "50% / 100%", "0.5 / 0.25", "0.5 / 0.25"]
    assert cells["ablation"] == ["- / 0%", "- / 1", "- / 1", "- / 0%", "- / 1", "- / 1"]


def test_report_only_needs_the_rows_not_the_prompts(run_dir, tmp_path, capsys):
    """A folder rebuilt from committed rows (results.jsonl + config.yaml) reports as the original."""
    import shutil

    out = tmp_path / "rows-only"
    out.mkdir()
    for name in ("config.yaml", "results.jsonl"):
        shutil.copy(run_dir / name, out / name)
    assert main(["eval", "--out", str(out), "--report-only"]) == 0
    assert (out / "summary.md").read_text() == (run_dir / "summary.md").read_text()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["eval", "--out", str(empty), "--report-only"]) == 2
    assert "holds no results.jsonl" in capsys.readouterr().err


def test_a_stopped_grid_exits_130_without_a_traceback(monkeypatch, tmp_path):
    from sparsekv.evaluation.running import runner

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_eval", stopped)
    assert main(["eval", *GRID, "--out", str(tmp_path / "stopped")]) == 130


def test_share_interval_brackets_the_share_and_narrows_with_more_samples():
    from sparsekv.evaluation.reports.tables import share_interval

    assert share_interval([[(1.0, 1.0)] * 5]) == (1.0, 1.0)
    # a method that answers 60% of the prompts the full cache answers (all of them)
    small = [[(float(i % 5 < 3), 1.0) for i in range(10)]]
    large = [[(float(i % 5 < 3), 1.0) for i in range(100)]]
    lo_s, hi_s = share_interval(small)
    lo_l, hi_l = share_interval(large)
    assert lo_s < 0.6 < hi_s and lo_l < 0.6 < hi_l
    assert hi_l - lo_l < 0.5 * (hi_s - lo_s)  # ~1/sqrt(10) as wide
    assert 0.45 < lo_l < 0.55 and 0.65 < hi_l < 0.75  # 0.6 +- 1.96 * sqrt(0.24 / 100)
    assert share_interval([[(1.0, 1.0)] * 5], seed=1) == share_interval([[(1.0, 1.0)] * 5], seed=1)


def test_report_only_folds_in_the_finished_groups_of_a_stopped_run(run_dir, tmp_path):
    import shutil

    out = tmp_path / "stopped"
    out.mkdir()
    for name in ("config.yaml", "prompts.jsonl"):
        shutil.copy(run_dir / name, out / name)
    rows = _rows(run_dir)
    cut = next(i for i, r in enumerate(rows) if r["sample_id"].endswith("-1") and r["task"] == "ppl")
    lines = [json.dumps(r) for r in rows[: cut + 1]]  # the last group has its reference row only
    (out / "results.part-0.jsonl").write_text("\n".join(lines[::2]) + "\n")
    (out / "results.part-1.jsonl").write_text("\n".join(lines[1::2]) + "\n")
    assert main(["eval", "--out", str(out), "--report-only"]) == 0
    kept = _rows(out)
    assert not list(out.glob("results.part-*")) and (out / "summary.md").is_file()
    assert "samples per task and length: 1-2 (the grid asks for 2: a stopped run" in (out / "summary.md").read_text()
    assert sorted(map(_key, kept)) == sorted(map(_key, rows[: cut + 1]))  # every finished row, none dropped


def test_kill_stops_the_workers_and_keeps_their_finished_groups(tmp_path):
    """`kill PID` (SIGTERM) on a 2-worker grid: the workers stop, every finished row lands in
    results.jsonl, no part file is left, and --resume completes the grid without rerunning any."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "killed"
    argv = [a if a != "2" else "30" for a in GRID]  # --samples 30: long enough to interrupt
    cmd = [sys.executable, "-m", "sparsekv.cli", "eval", *argv, "--workers", "2", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and sum(1 for p in out.glob("results.part-*.jsonl") for _ in open(p)) < 12:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "stopped:" in err, err[-2000:]
    assert not list(out.glob("results.part-*")) and "rerun with --resume" in err
    kept = {_key(r): r for r in _rows(out)}
    assert len(kept) >= 12
    assert main(["eval", *argv, "--resume", "--out", str(out)]) == 0
    rows = _rows(out)
    assert len(rows) == len({_key(r) for r in rows}) == 30 * (2 * 3 + 3)
    assert all(r == kept[_key(r)] for r in rows if _key(r) in kept)  # not rerun
