"""Round 2, surface "eval cli": `sparsekv eval` command lines (`sparsekv.cli.main([...])` in
process, exit code judged) with mistakes round 1 (eval/bad_inputs/eval_cli.py) does not try:
the usual shorthands of numbers (4k, 30%), names in the wrong case, flags that contradict each
other (--resume with --overwrite, --report-only with a grid, --ingest without --source), grid
YAML files whose policies, budgets, lengths, protocols or task options are of the wrong shape,
and --out / --resume / --ingest / --report-only onto the wrong kind of path."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

from eval.bad_inputs.eval_cli import GRID, _grid, cli
from eval.bad_inputs.framework import _CACHE, TMP, Verdict, _n, add2

EV = "eval cli"


def _out() -> str:
    _n[0] += 1
    return str(TMP / f"eval2-{_n[0]}")


def flag(name, names, *argv, **replace):
    add2(EV, "flags", name, names,
         (lambda a=argv, r=replace: cli("eval", *_grid(**r), *a, "--out", _out())), cli=True)


flag("--lengths 4k (shorthand)", ("length", "4k"), lengths="4k")
flag("--budget 30% (a percentage)", ("budget", "30%"), budget="30%")
flag("--tasks Passkey (capitalised)", ("passkey", "task"), tasks="Passkey")
flag("--policy SnapKV (capitalised)", ("snapkv", "polic"), policy="SnapKV")
flag("--policy snapkv,h2o,snapkv (one twice)", ("snapkv", "label", "twice", "duplicate"),
     policy="snapkv,h2o,snapkv")
flag("--budget 0.3tok (a fraction as tokens)", ("budget", "0.3tok"), budget="0.3tok")
flag("--protocol aware with --policy snapkv@protocols=agnostic", ("protocol", "snapkv"),
     protocol="aware", policy="snapkv@protocols=agnostic")
flag("--policy snapkv@budgets=0.3+1.5", ("budget", "1.5"), policy="snapkv@budgets=0.3+1.5")
flag("--device cuda on a machine without a GPU", ("device", "cuda"), "--device", "cuda")


def _lengths_twice():
    """--lengths 128,128: refused, merged with a note, or merged silently (each sample once);
    silent when every sample runs twice."""
    out = _out()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli("eval", *_grid(lengths="128,128"), "--out", out)
    if rc != 0:
        return rc
    rows = [json.loads(x) for x in Path(out, "results.jsonl").read_text().splitlines()]
    if len(rows) == 2:
        return Verdict("clear", "the length ran once (2 rows: full, snapkv)")
    return Verdict("silent", f"the length ran twice: {len(rows)} rows for 2 slots")


add2(EV, "flags", "--lengths 128,128 (one length twice)", ("length", "128", "twice"),
     _lengths_twice, cli=True)


def _out_a_file():
    p = TMP / f"eval2-file-{_n[0]}.txt"
    _n[0] += 1
    p.write_text("my notes\n")
    rc = cli("eval", *GRID, "--out", str(p))
    if p.is_file() and p.read_text() == "my notes\n":
        return rc
    return Verdict("data loss", f"exit {rc}: the file given as --out is gone or changed")


add2(EV, "paths", "--out an existing file", ("--out", "out", ".txt"), _out_a_file, cli=True)


def _finished() -> str:
    if "eval2-run" not in _CACHE:
        out = str(TMP / "eval2-finished")
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            rc = cli("eval", *GRID, "--out", out)
        assert rc == 0, rc
        _CACHE["eval2-run"] = out
    _n[0] += 1
    copy = str(TMP / f"eval2-copy-{_n[0]}")
    shutil.copytree(_CACHE["eval2-run"], copy)
    return copy


add2(EV, "paths", "--resume --overwrite together onto a finished run",
     ("--resume", "--overwrite", "resume", "overwrite"),
     lambda: cli("eval", *GRID, "--resume", "--overwrite", "--out", _finished()), cli=True,
     warn_ok=True)  # a documented pair (--help): saying what it keeps and reruns is the answer


def _report_with_grid() -> Verdict:
    """--report-only with grid flags: the report reads the rows; a --budget given with it is
    either refused or ignored with a word, never silently."""
    out = _finished()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli("eval", "--report-only", "--budget", "0.5", "--out", out)
    msg = err.getvalue().strip()
    if rc == 2 and "budget" in msg.lower():
        return Verdict("clear", msg.splitlines()[-1])
    if rc == 0 and "budget" in msg.lower():
        return Verdict("clear", f"warned: {msg.splitlines()[-1]}")
    if rc == 0:
        return Verdict("silent", "--budget 0.5 with --report-only ignored without a word")
    return Verdict("unclear", f"exit {rc}: {msg[-300:]}")


add2(EV, "paths", "--report-only with --budget 0.5 (a grid flag)", ("budget", "report-only"),
     _report_with_grid)


def _rows_file(text: str) -> str:
    p = TMP / f"eval2-ingest-{_n[0]}.jsonl"
    _n[0] += 1
    p.write_text(text)
    return str(p)


def _row_text() -> str:
    rows = Path(_finished(), "results.jsonl").read_text().splitlines()
    return rows[-1] + "\n"


add2(EV, "paths", "--ingest without --source", ("--source", "source"),
     lambda: cli("eval", "--out", _finished(), "--ingest", _rows_file(_row_text())), cli=True)
add2(EV, "paths", "--ingest a folder (the other run's folder, not its results.jsonl)",
     ("--ingest", "folder", "results.jsonl"),
     lambda: cli("eval", "--out", _finished(), "--ingest", _finished(), "--source", "other"),
     cli=True)
add2(EV, "paths", "--ingest its own results.jsonl", ("--ingest", "results.jsonl", "same"),
     lambda: (lambda o: cli("eval", "--out", o, "--ingest", str(Path(o) / "results.jsonl"),
                            "--source", "kvpress"))(_finished()), cli=True)
add2(EV, "paths", "--resume --out a results.jsonl file (not its folder)",
     ("--out", "results.jsonl", "folder"),
     lambda: cli("eval", *GRID, "--resume", "--out", str(Path(_finished()) / "results.jsonl")),
     cli=True)


# ---------------------------------------------------------------------------------------------
# grid YAML files
# ---------------------------------------------------------------------------------------------
BASE_YAML = ("model: tiny:llama", "tasks: [passkey]", "lengths: [128]", "samples: 1",
             "protocols: [agnostic]", "threads: 1")


def grid_yaml(name, names, text, warn_ok=False):
    def run():
        _n[0] += 1
        p = TMP / f"eval2-grid-{_n[0]}.yaml"
        own = {line.split(":", 1)[0] for line in text.splitlines()}
        base = [x for x in BASE_YAML if x.split(":", 1)[0] not in own]
        p.write_text("".join(x + "\n" for x in base) + text)
        return cli("eval", "--config", str(p), "--no-progress", "--out", _out())
    add2(EV, "grid yaml", name, names, run, cli=True, warn_ok=warn_ok)


grid_yaml("policies: a mapping entry without 'policy'", ("policy", "name"),
          "budgets: [0.3]\npolicies: [{name: snapkv}]\n")
grid_yaml("policies: a YAML mapping (policy: options) not a list", ("policies", "snapkv"),
          "budgets: [0.3]\npolicies: {snapkv: {window: 16}}\n")
grid_yaml("policies: [{policy: snapkv, budgets: [0.3, 2.0]}]", ("budget", "2.0"),
          "budgets: [0.3]\npolicies: [{policy: snapkv, budgets: [0.3, 2.0]}]\n")
grid_yaml("budget: 0.3 and budgets: [0.5] both", ("budget", "budgets"),
          "budget: 0.3\nbudgets: [0.5]\npolicies: [snapkv]\n")
grid_yaml("lengths: [128.5]", ("length", "128.5"), "lengths: [128.5]\nbudgets: [0.3]\n"
          "policies: [snapkv]\n")
grid_yaml("protocols: 'agnostic, awre' (a typo inside one string)", ("protocol",),
          "protocols: 'agnostic, awre'\nbudgets: [0.3]\npolicies: [snapkv]\n")
grid_yaml("task_options for a task that is not in tasks", ("task_options", "multikey"),
          "budgets: [0.3]\npolicies: [snapkv]\ntask_options: {multikey: {num_keys: 2}}\n",
          warn_ok=True)
grid_yaml("shared_prefill: 'no' (a string)", ("shared_prefill",),
          "budgets: [0.3]\npolicies: [snapkv]\nshared_prefill: 'no'\n")
grid_yaml("samples: 1.0 (a float)", ("samples",),
          "budgets: [0.3]\npolicies: [snapkv]\nsamples: 1.0\n")
grid_yaml("eviction: {sink_tokens: '4'} (a string)", ("sink_tokens",),
          "budgets: [0.3]\npolicies: [snapkv]\neviction: {sink_tokens: '4'}\n")


def _yaml_budget_exponent():
    """`budgets: [3e-1]`: PyYAML reads 3e-1 as a string."""
    _n[0] += 1
    p = TMP / f"eval2-grid-{_n[0]}.yaml"
    p.write_text("model: tiny:llama\ntasks: [passkey]\nlengths: [128]\nsamples: 1\n"
                 "protocols: [agnostic]\nthreads: 1\npolicies: [snapkv]\nbudgets: [3e-1]\n")
    out = _out()
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        rc = cli("eval", "--config", str(p), "--no-progress", "--out", out)
    if rc != 0:
        return rc
    budgets = {json.loads(x)["budget"] for x in Path(out, "results.jsonl").read_text().splitlines()}
    if 0.3 in budgets:
        return Verdict("clear", f"budgets [3e-1] ran as 0.3 (rows' budgets {sorted(budgets)})")
    return Verdict("silent", f"budgets [3e-1] ran as {sorted(budgets)}")


add2(EV, "grid yaml", "budgets: [3e-1] (PyYAML reads a string)", ("budget", "3e-1"),
     _yaml_budget_exponent, cli=True)
