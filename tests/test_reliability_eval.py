"""Issue 36, the evaluation harness's part: rows carry what identifies them (seed, model, prompt
hash, setup) so that an edited, replaced or deleted config.yaml never lets a resume mix rows of two
grids; a repeated row is counted once; ingested rows are validated field by field and never
replace the harness's own; the eval CLI refuses an empty --out, an empty @label=, eviction settings
no run can use and an --out that is a file before any model loads, each error one line (the
reports' part: tests/test_reliability_eval_reports.py). Tiny random models, one sample: seconds
per case."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from sparsekv.cli import main

GRID = [
    "--model",
    "tiny:llama",
    "--policy",
    "snapkv",
    "--tasks",
    "passkey",
    "--lengths",
    "128",
    "--samples",
    "1",
    "--protocol",
    "agnostic",
    "--budget",
    "0.3",
    "--threads",
    "1",
    "--no-progress",
]


def _rows(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "results.jsonl").read_text().splitlines() if x.strip()]


def _write_rows(folder: Path, rows: list[dict]) -> None:
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A folder holding one finished tiny grid (seed 0); tests work on copies (`run`)."""
    out = tmp_path_factory.mktemp("grid") / "done"
    assert main(["eval", *GRID, "--seed", "0", "--out", str(out)]) == 0
    return out


@pytest.fixture
def run(finished, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    return copy


def _one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.startswith("sparsekv: error:")]
    assert len(lines) == 1, err
    return lines[0]


# ---- item 4: what identifies a row ------------------------------------------------------------
def test_rows_record_their_seed_model_prompt_hash_and_setup(run):
    from sparsekv.evaluation.rows.folder import read_prompts
    from sparsekv.evaluation.rows.identity import prompt_hash

    (sample,) = read_prompts(run / "prompts.jsonl")
    for r in _rows(run):
        assert r["seed"] == 0 and r["model"] == "tiny:llama"
        assert r["prompt_hash"] == prompt_hash(sample) and len(r["prompt_hash"]) == 64
        assert r["setup"] == {
            "dtype": "float32",
            "attn_implementation": "sdpa",
            "device": "cpu",
            "eviction": {},
            "task_options": {},
            "shared_prefill": True,
        }


def test_resume_after_the_seed_in_config_yaml_was_edited_keeps_no_seed_0_rows_as_seed_5(
    run, capsys
):
    before = (run / "results.jsonl").read_text()
    cfg = run / "config.yaml"
    cfg.write_text(cfg.read_text().replace("\nseed: 0\n", "\nseed: 5\n"))
    assert main(["eval", *GRID, "--seed", "5", "--out", str(run), "--resume"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "seed=0 (recorded in the rows), this grid has seed=5" in err
    assert (run / "results.jsonl").read_text() == before
    # rows from before rows recorded it: the folder's prompts.jsonl tells their prompts apart
    legacy = [
        {k: v for k, v in r.items() if k not in ("seed", "model", "prompt_hash", "setup")}
        for r in _rows(run)
    ]
    _write_rows(run, legacy)
    assert main(["eval", *GRID, "--seed", "5", "--out", str(run), "--resume"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "run on other prompts than this grid builds" in err and "passkey-128-0" in err
    assert _rows(run) == legacy


def test_resume_with_another_model_after_config_yaml_was_deleted_or_replaced_is_refused(
    run, capsys
):
    before = (run / "results.jsonl").read_text()
    cfg = (run / "config.yaml").read_text()
    (run / "config.yaml").unlink()
    argv = ["eval", *GRID, "--model", "tiny:qwen3", "--out", str(run), "--resume"]
    assert main(argv) == 2
    err = _one_line(capsys.readouterr().err)
    assert "model='tiny:llama' (recorded in the rows), this grid has model='tiny:qwen3'" in err
    (run / "config.yaml").write_text(cfg.replace("model: tiny:llama", "model: tiny:qwen3"))
    assert main(argv) == 2  # a config.yaml of the other model: the rows still say llama
    assert "model='tiny:llama' (recorded in the rows)" in _one_line(capsys.readouterr().err)
    assert main([*argv, "--overwrite"]) == 2
    assert (run / "results.jsonl").read_text() == before


def test_rows_that_record_nothing_need_the_folders_config(run, capsys):
    legacy = [
        {k: v for k, v in r.items() if k not in ("seed", "model", "prompt_hash", "setup")}
        for r in _rows(run)
    ]
    _write_rows(run, legacy)
    assert main(["eval", *GRID, "--seed", "0", "--out", str(run), "--resume"]) == 0  # as before
    assert _rows(run) == legacy
    (run / "config.yaml").unlink()
    assert main(["eval", *GRID, "--seed", "0", "--out", str(run), "--resume"]) == 2
    assert "record neither their seed nor their model" in _one_line(capsys.readouterr().err)


def test_a_repeated_row_is_counted_once(run, capsys):
    from sparsekv.evaluation.rows.store import count_rows

    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
    (run / "results.jsonl").write_text("".join(lines + [lines[-1]]))  # appended twice
    assert count_rows(run) == len(lines)
    capsys.readouterr()
    assert main(["eval", "--out", str(run), "--report-only"]) == 0
    assert "1 duplicate rows repeat the slot" in capsys.readouterr().err
    with open(run / "summary.csv") as f:
        assert {s["n"] for s in csv.DictReader(f)} == {"1"}
    assert (
        main(["eval", *GRID, "--seed", "0", "--budget", "0.3,0.5", "--out", str(run), "--resume"])
        == 0
    )
    rows = _rows(run)
    slots = [(r["sample_id"], r["protocol"], r["policy"], str(r["budget"])) for r in rows]
    assert len(slots) == len(set(slots)) == 3


def _peer_row(run: Path, **fields) -> dict:
    sid = json.loads((run / "prompts.jsonl").read_text().splitlines()[0])["sample_id"]
    row = {
        "sample_id": sid,
        "task": "passkey",
        "length": 128,
        "protocol": "agnostic",
        "policy": "kvpress:snapkv",
        "budget": 0.3,
        "output": " 0.",
        "kl": 0.5,
    }
    row.update(fields)
    return row


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"source": "sparsekv"}, "source='sparsekv' is the harness itself"),
        ({"protocol": "blind"}, "protocol='blind'; allowed values for passkey: agnostic, aware"),
        ({"budget": "abc"}, "budget='abc' is not a number; allowed: a fraction in (0, 1]"),
        ({"budget": 1.5}, "budget=1.5 is out of range; allowed: a fraction in (0, 1]"),
        ({"score": 7.5}, "score=7.5 is out of range; allowed: a number in [0, 1]"),
        ({"task": "ppl"}, "task='ppl' contradicts sample_id 'passkey-128-0'"),
        ({"kl": "high"}, "kl='high' is not a number; allowed: a number >= 0"),
        (
            {"length": "long"},
            "length='long' is not the length of sample 'passkey-128-0'; allowed: 128",
        ),
        ({"seed": 5}, "seed=5 is not the seed of the prompts"),
    ],
)
def test_ingest_refuses_a_bad_row_naming_file_line_field_and_allowed_values(
    run, tmp_path, capsys, fields, message
):
    path = tmp_path / "peer.jsonl"
    path.write_text(json.dumps(_peer_row(run)) + "\n" + json.dumps(_peer_row(run, **fields)) + "\n")
    before = (run / "results.jsonl").read_text()
    assert main(["eval", "--out", str(run), "--ingest", str(path), "--source", "kvpress"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert f"--ingest {path}, line 2: " in err and message in err and "nothing was added" in err, (
        err
    )
    assert (run / "results.jsonl").read_text() == before
    assert main(["eval", "--out", str(run), "--report-only"]) == 0  # the folder still reports


def test_ingested_rows_never_replace_the_harness_rows(run, tmp_path, capsys):
    path = tmp_path / "peer.jsonl"
    path.write_text(json.dumps(_peer_row(run, policy="snapkv")) + "\n")
    assert main(["eval", "--out", str(run), "--ingest", str(path), "--source", "sparsekv"]) == 2
    assert "--source='sparsekv'" in _one_line(capsys.readouterr().err)
    own = _rows(run)
    assert main(["eval", "--out", str(run), "--ingest", str(path), "--source", "kvpress"]) == 0
    rows = _rows(run)
    assert rows[: len(own)] == own and rows[-1]["source"] == "kvpress"
    assert rows[-1]["seed"] == 0 and rows[-1]["prompt_hash"] == own[0]["prompt_hash"]
    # the same row twice in one file: one row
    path.write_text(2 * (json.dumps(_peer_row(run)) + "\n"))
    assert main(["eval", "--out", str(run), "--ingest", str(path), "--source", "kvpress"]) == 0
    assert len(_rows(run)) == len(own) + 2


def test_ingest_of_a_folder_or_an_empty_file_is_a_clear_error(run, tmp_path, capsys):
    assert main(["eval", "--out", str(run), "--ingest", str(tmp_path)]) == 2
    assert f"--ingest {tmp_path} is a folder; give the JSON-lines file" in _one_line(
        capsys.readouterr().err
    )
    (tmp_path / "empty.jsonl").write_text("\n")
    assert main(["eval", "--out", str(run), "--ingest", str(tmp_path / "empty.jsonl")]) == 2
    assert "holds no rows" in _one_line(capsys.readouterr().err)
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    assert main(["eval", "--out", str(run), "--ingest", str(tmp_path / "bad.jsonl")]) == 2
    assert "bad.jsonl, line 1: not a JSON row" in _one_line(capsys.readouterr().err)


# ---- item 6: the eval CLI's inputs, each error one line ------------------------------------------
def test_an_empty_out_is_refused_and_nothing_is_written_into_the_cwd(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["eval", *GRID, "--out", ""]) == 2
    assert "out='' is empty" in _one_line(capsys.readouterr().err)
    assert main(["eval", "--out", "", "--report-only"]) == 2
    assert "--out='' is empty" in _one_line(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []


def test_an_empty_label_is_refused_not_named_none(tmp_path, capsys):
    from sparsekv.evaluation.config import parse_policy

    assert main(["eval", *GRID, "--policy", "snapkv@label=", "--out", str(tmp_path / "x")]) == 2
    assert "option @label= has no value" in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="label=None; allowed: a non-empty name"):
        parse_policy({"policy": "snapkv", "label": None})
    assert parse_policy("snapkv@label=s64").label == "s64"


def test_eviction_settings_no_run_can_use_exit_2_before_running(tmp_path, capsys):
    out = tmp_path / "x"
    assert main(["eval", *GRID, "--eviction", "schedule=[0.5]", "--out", str(out)]) == 2
    err = _one_line(capsys.readouterr().err)
    assert (
        "--eviction" in err and "schedule has 1 entries but the model has 4 budgeted layers" in err
    )
    assert not (out / "results.jsonl").exists()
    assert main(["eval", *GRID, "--policy", "snapkv@schedule=[0.5]", "--out", str(out)]) == 2
    assert "policy 'snapkv@schedule=[0.5]'" in _one_line(capsys.readouterr().err)


def test_an_out_that_is_a_file_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    from sparsekv.evaluation.running import models

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load_model", no_loading)
    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    for out, what in ((afile, "is a file"), (afile / "sub", f"is under {afile}, which is a file")):
        for extra in ([], ["--dump-prompts"], ["--resume"]):
            assert main(["eval", *GRID, "--out", str(out), *extra]) == 2
            assert f"--out {out} {what}" in _one_line(capsys.readouterr().err)
    assert main(["eval", "--out", str(afile), "--report-only"]) == 2
    assert "is a file" in _one_line(capsys.readouterr().err)
    assert afile.read_text() == "mine\n"


def test_every_eval_error_is_one_line(run, monkeypatch, capsys):
    from sparsekv.evaluation.running import execute

    (run / "config.yaml").write_text("model: [tiny\n  seed: 0\n")  # a YAML error spans lines
    assert main(["eval", *GRID, "--seed", "0", "--out", str(run), "--resume"]) == 2
    assert "is not valid YAML" in _one_line(capsys.readouterr().err)

    def boom(self):
        raise RuntimeError("deep inside\n  a library")

    monkeypatch.setattr(execute.Runner, "plan", boom)
    assert main(["eval", *GRID, "--out", str(run.parent / "y")]) == 1
    assert "RuntimeError: deep inside a library" in _one_line(capsys.readouterr().err)

    def denied(self):
        raise PermissionError(13, "Permission denied", "/somewhere/results.jsonl")

    monkeypatch.setattr(execute.Runner, "plan", denied)
    assert main(["eval", *GRID, "--out", str(run.parent / "z")]) == 2
    assert "Permission denied: '/somewhere/results.jsonl'" in _one_line(capsys.readouterr().err)
