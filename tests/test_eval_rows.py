"""Rows are never dropped (issue 16.2, 16.6): a fresh run refuses a folder with rows, --resume
keeps every row whatever the new grid, --overwrite replaces only its own slots, adapters are told
apart by their fingerprint, one run per folder at a time, torn lines and config writes survive
a kill. Tiny random model, one or two samples: each case runs in seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sparsekv.cli import main

GRID = [
    "--model",
    "tiny:llama",
    "--policy",
    "snapkv,h2o",
    "--tasks",
    "passkey",
    "--lengths",
    "256",
    "--samples",
    "1",
    "--seed",
    "3",
    "--protocol",
    "agnostic",
    "--threads",
    "1",
    "--no-progress",
]
TIMING = ("prefill_s", "decode_s", "decode_tok_s", "peak_rss_mb", "fork_s")


def _rows(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "results.jsonl").read_text().splitlines() if x.strip()]


def _key(r: dict) -> tuple:
    return (r["source"], r["sample_id"], r["protocol"], r["policy"], str(r["budget"]))


def _grid(budgets: str, samples: str = "1") -> list[str]:
    args = [a if a != "1" else samples for a in GRID]
    return ["eval", *args, "--budget", budgets]


@pytest.fixture
def peer_rows(tmp_path) -> Path:
    def write(out: Path) -> Path:
        sid = json.loads((out / "prompts.jsonl").read_text().splitlines()[0])["sample_id"]
        path = tmp_path / "peer.jsonl"
        path.write_text(
            json.dumps(
                {
                    "sample_id": sid,
                    "task": "passkey",
                    "length": 256,
                    "protocol": "agnostic",
                    "policy": "kvpress:snapkv",
                    "budget": 0.3,
                    "output": " 0.",
                }
            )
            + "\n"
        )
        return path

    return write


def test_a_fresh_run_into_a_folder_with_rows_refuses_and_keeps_them(tmp_path, capsys, peer_rows):
    out = tmp_path / "x"
    assert main([*_grid("0.3"), "--out", str(out)]) == 0
    assert (
        main(["eval", "--out", str(out), "--ingest", str(peer_rows(out)), "--source", "kvpress"])
        == 0
    )
    before = (out / "results.jsonl").read_text()
    capsys.readouterr()
    assert main([*_grid("0.3"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "already holds 4 result rows" in err and "--resume" in err and "--overwrite" in err
    assert (out / "results.jsonl").read_text() == before  # ingested peer row included
    assert main([*_grid("0.3"), "--out", str(out), "--resume", "--overwrite"]) == 0
    assert (out / "results.jsonl").read_text() == before  # nothing missing, nothing conflicting
    capsys.readouterr()
    assert main([*_grid("0.3"), "--out", str(out), "--overwrite", "--model", "tiny:qwen3"]) == 2
    err = capsys.readouterr().err
    assert "holds rows run with model='tiny:llama', this grid has model='tiny:qwen3'" in err
    assert (out / "results.jsonl").read_text() == before


def test_overwrite_replaces_the_grids_slots_and_keeps_every_other_row(
    tmp_path, peer_rows, monkeypatch
):
    from sparsekv.evaluation.running import execute

    out = tmp_path / "x"
    assert main([*_grid("0.1,0.3"), "--out", str(out)]) == 0
    assert (
        main(["eval", "--out", str(out), "--ingest", str(peer_rows(out)), "--source", "kvpress"])
        == 0
    )
    old = {_key(r): r for r in _rows(out)}
    real = execute.Runner.run_group

    def marked(self, *a, **k):  # every row of the second run carries a mark no real row has
        for row in real(self, *a, **k):
            yield {**row, "peak_rss_mb": 99999.5}

    monkeypatch.setattr(execute.Runner, "run_group", marked)
    assert main([*_grid("0.3"), "--out", str(out), "--overwrite"]) == 0
    rows = _rows(out)
    assert [_key(r) for r in rows] == list(old)  # no slot lost, none doubled, in place
    rerun = [r for r in rows if r["source"] == "sparsekv" and str(r["budget"]) in ("0.3", "1.0")]
    assert len(rerun) == 3 and all(r["peak_rss_mb"] == 99999.5 for r in rerun)  # really rerun
    assert all(old[_key(r)]["peak_rss_mb"] != 99999.5 for r in rerun)
    kept = [r for r in rows if r["source"] == "kvpress" or str(r["budget"]) == "0.1"]
    assert kept == [
        r for r in old.values() if r["source"] == "kvpress" or str(r["budget"]) == "0.1"
    ]


def test_resume_with_another_budget_list_keeps_the_other_budgets_rows(tmp_path, peer_rows):
    out = tmp_path / "x"
    assert main([*_grid("0.1,0.3"), "--out", str(out)]) == 0
    assert (
        main(["eval", "--out", str(out), "--ingest", str(peer_rows(out)), "--source", "kvpress"])
        == 0
    )
    old = _rows(out)
    assert main([*_grid("0.5"), "--out", str(out), "--resume"]) == 0
    rows = _rows(out)
    assert rows[: len(old)] == old  # every earlier row, unchanged and in place
    assert sorted(str(r["budget"]) for r in rows[len(old) :]) == [
        "0.5",
        "0.5",
    ]  # snapkv, h2o at 0.5


def test_growing_the_budget_list_runs_only_the_new_rows(tmp_path, monkeypatch):
    from sparsekv.evaluation.running import execute

    out = tmp_path / "x"
    assert main([*_grid("0.3", samples="2"), "--out", str(out)]) == 0
    old = {_key(r): r for r in _rows(out)}
    ran = []
    real = execute.Runner.run_policy

    def counting(self, sample, protocol, spec, budget, *a, **k):
        ran.append((sample.sample_id, spec.label, budget))
        return real(self, sample, protocol, spec, budget, *a, **k)

    monkeypatch.setattr(execute.Runner, "run_policy", counting)
    assert main([*_grid("0.1,0.3", samples="2"), "--out", str(out), "--resume"]) == 0
    assert sorted(x[1:] for x in ran) == [
        ("h2o", 0.1),
        ("h2o", 0.1),
        ("snapkv", 0.1),
        ("snapkv", 0.1),
    ]
    rows = _rows(out)
    assert len(rows) == len(old) + 4
    assert all(r == old[_key(r)] for r in rows if _key(r) in old)  # timings included: not rerun


def _adapter(path: Path, shift: float = 0.0, uses: dict | None = None) -> Path:
    import torch

    from sparsekv import ScorerAdapter
    from sparsekv.evaluation.running.models import load_model

    model, _ = load_model("tiny:llama")
    torch.manual_seed(0)
    adapter = ScorerAdapter.for_model(model, hidden=8, uses=uses)
    with torch.no_grad():
        for p in adapter.head.parameters():
            p.add_(shift)
    return adapter.save_pretrained(path)


def test_changed_adapter_weights_at_one_path_are_another_method(tmp_path, capsys):
    from sparsekv.evaluation.reports.tables import summarize

    path = _adapter(tmp_path / "adapter")
    out = tmp_path / "x"
    grid = [*_grid("0.3"), "--policy", f"snapkv,learned:{path}@label=learned", "--out", str(out)]
    assert main(grid) == 0
    first = _rows(out)
    hashes = {r["adapter_hash"] for r in first if r["policy"] == "learned"}
    assert len(hashes) == 1 and len(next(iter(hashes))) == 64
    assert {r["adapter_hash"] for r in first if r["policy"] != "learned"} == {None}
    _adapter(path, shift=0.5)  # retrained in place
    capsys.readouterr()
    assert main([*grid[:-2], "--samples", "2", "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert (
        "rows of 'learned'" in err
        and "ran adapter" in err
        and "never merged under one label" in err
    )
    assert _rows(out) == first  # nothing ran, nothing changed
    assert main([*grid, "--resume", "--overwrite"]) == 0  # replace the stale rows only
    rows = _rows(out)
    new = {r["adapter_hash"] for r in rows if r["policy"] == "learned"}
    assert len(new) == 1 and new != hashes
    assert [r for r in rows if r["policy"] != "learned"] == [
        r for r in first if r["policy"] != "learned"
    ]
    # rows of two adapters under one label (e.g. a folder from before the check) are two methods
    mixed = first + [{**r, "sample_id": "other"} for r in rows if r["policy"] == "learned"]
    names = {s["policy"] for s in summarize(mixed)}
    assert {f"learned [{h[:8]}]" for h in hashes | new} <= names and "learned" not in names


def test_a_changed_use_of_the_same_adapter_is_another_method(tmp_path, capsys):
    """The agnostic use's settings are not in the fingerprint (weights and "aware" settings are):
    rows record the settings each learned run resolved, and a resume refuses to merge rows of
    other settings under one label."""
    path = _adapter(tmp_path / "adapter")
    out = tmp_path / "x"
    grid = [*_grid("0.3"), "--policy", f"learned:{path}@use=agnostic@label=learned", "--out", str(out)]
    assert main(grid) == 0
    first = _rows(out)
    (mine,) = [r for r in first if r["policy"] == "learned"]
    assert mine["learned_settings"] == {
        "blend": 0.0, "blend_mode": "mix", "recency": 0.0, "kernel_size": 9,
        "head_layer": "own", "span_fill": 0, "span_peaks": 0.0, "span_words": 0,
    }
    assert {r["learned_settings"] for r in first if r["policy"] != "learned"} == {None}
    hash_before = mine["adapter_hash"]
    _adapter(path, uses={"agnostic": {"blend": 0.0, "kernel_size": 9, "span_fill": 16}})
    capsys.readouterr()
    assert main([*grid[:-2], "--samples", "2", "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "ran with other settings" in err and "span_fill: 0 -> 16" in err
    assert _rows(out) == first  # nothing ran, nothing changed
    # the same weights: the fingerprint alone could not tell the two apart
    from sparsekv import ScorerAdapter

    assert ScorerAdapter.from_pretrained(path).fingerprint() == hash_before


def test_rows_from_before_adapter_hashes_resume_as_the_current_adapter(tmp_path, capsys):
    path = _adapter(tmp_path / "adapter")
    out = tmp_path / "x"
    grid = [*_grid("0.3"), "--policy", f"learned:{path}@label=learned", "--out", str(out)]
    assert main(grid) == 0
    legacy = [{k: v for k, v in r.items() if k != "adapter_hash"} for r in _rows(out)]
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in legacy))
    capsys.readouterr()
    assert main([*grid, "--resume"]) == 0
    assert "rows of 'learned' (1) carry no adapter_hash" in capsys.readouterr().err
    assert _rows(out) == legacy


def _hold_lock(folder: Path) -> subprocess.Popen:
    code = (
        "import sys, time; from sparsekv.evaluation.rows.folder import FolderLock; "
        "FolderLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(120)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_two_runs_cannot_write_into_one_folder_and_a_dead_holders_lock_is_taken_over(
    tmp_path, capsys
):
    out = tmp_path / "x"
    holder = _hold_lock(out)
    try:
        assert main([*_grid("0.3"), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"in use by another sparsekv eval (pid {holder.pid}" in err
        assert not (out / "results.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    lock = out / ".sparsekv-eval.lock"
    assert json.loads(lock.read_text())["pid"] == holder.pid  # left behind by the killed holder
    assert main([*_grid("0.3"), "--out", str(out)]) == 0
    assert f"left by pid {holder.pid}" in capsys.readouterr().err and len(_rows(out)) == 3
    assert not lock.exists()  # released at the end


def test_a_torn_last_line_is_dropped_with_a_warning_and_the_rest_kept(tmp_path, capsys):
    out = tmp_path / "x"
    assert main([*_grid("0.3", samples="2"), "--out", str(out)]) == 0
    rows = _rows(out)
    lines = (out / "results.jsonl").read_text().splitlines(keepends=True)
    (out / "results.jsonl").write_text("".join(lines[:5]))
    (out / "results.part-1.jsonl").write_text(
        lines[5] + lines[-1][: len(lines[-1]) // 2]
    )  # killed mid-write
    capsys.readouterr()
    assert main([*_grid("0.3", samples="2"), "--out", str(out), "--resume"]) == 0
    assert "results.part-1.jsonl:2: dropped a torn last line" in capsys.readouterr().err
    again = _rows(out)
    assert again[:6] == rows[:6] and sorted(map(_key, again)) == sorted(map(_key, rows))
    (out / "results.jsonl").write_text(lines[0] + '{"sample_id": \n' + lines[1])
    assert main([*_grid("0.3", samples="2"), "--out", str(out), "--resume"]) == 2
    assert "results.jsonl:2 is not a JSON row" in capsys.readouterr().err


def test_config_yaml_is_written_atomically(tmp_path, monkeypatch):
    from sparsekv.evaluation.rows import folder

    out = tmp_path / "x"
    assert main([*_grid("0.3"), "--out", str(out)]) == 0
    before = (out / "config.yaml").read_text()

    def stop(fd):  # a stop after the new text went to the file, before it took the old one's place
        raise KeyboardInterrupt

    monkeypatch.setattr(folder.os, "fsync", stop)
    assert main([*_grid("0.1"), "--out", str(out), "--resume"]) == 130
    assert (out / "config.yaml").read_text() == before
    assert yaml.safe_load(before)["budgets"] == [0.3]
    assert not [p for p in os.listdir(out) if p.endswith(".tmp")]


def _children(pid: int) -> list[int]:
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(d.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_die_with_a_killed_parent(tmp_path):
    import signal
    import time

    out = tmp_path / "x"
    cmd = [
        sys.executable,
        "-m",
        "sparsekv.cli",
        *_grid("0.3", samples="40"),
        "--workers",
        "2",
        "--out",
        str(out),
    ]
    parent = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not any(
        p.stat().st_size for p in out.glob("results.part-*.jsonl")
    ):
        time.sleep(0.2)
    workers = _children(parent.pid)
    assert len(workers) >= 2, workers
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 5
    while time.time() < deadline and any(_alive(k) for k in workers):
        time.sleep(0.1)
    left = [k for k in workers if _alive(k)]
    for k in left:
        os.kill(k, signal.SIGKILL)
    assert not left, "workers outlived their killed parent"


def test_sigterm_with_one_worker_says_how_to_continue(tmp_path):
    import signal
    import time

    out = tmp_path / "x"
    cmd = [sys.executable, "-m", "sparsekv.cli", *_grid("0.3", samples="40"), "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not any(
        p.stat().st_size for p in out.glob("results.part-*.jsonl")
    ):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "stopped:" in err and "rerun with --resume" in err, err[
        -2000:
    ]
    assert _rows(out) and not list(out.glob("results.part-*"))


def test_the_device_is_part_of_the_setup(tmp_path, capsys):
    """`device` is validated, recorded with the rows, and rows of two devices never share a
    folder; a CUDA device that torch cannot see is refused by name."""
    import torch

    from sparsekv.evaluation.config import EvalConfig
    from sparsekv.evaluation.rows.folder import check_same_setup
    from sparsekv.evaluation.running.models import load_model

    with pytest.raises(ValueError, match="device='gpu'; allowed values: cpu, cuda, cuda:<index>"):
        EvalConfig(model="tiny:llama", device="gpu")
    out = tmp_path / "x"
    assert main([*_grid("0.3"), "--out", str(out)]) == 0
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["device"] == "cpu" and cfg["environment"]["device"] == "cpu"
    on_gpu = EvalConfig(**{k: v for k, v in cfg.items() if k not in ("environment", "policy_specs")}
                        | {"device": "cuda:0"})
    with pytest.raises(ValueError, match="device='cpu', this grid has device='cuda:0'"):
        check_same_setup(out, on_gpu)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA device"):
            load_model("tiny:llama", device="cuda")
        capsys.readouterr()
        assert main([*_grid("0.3"), "--out", str(tmp_path / "y"), "--device", "cuda"]) == 2
        assert "sees no CUDA device" in capsys.readouterr().err
