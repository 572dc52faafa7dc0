"""Bad-input cases of one surface: the eval CLI (`sparsekv.cli.main([...])` in process, stderr captured)."""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path

from eval.bad_inputs.framework import _CACHE, TMP, _n, adapter_dir, add
from eval.bad_inputs.train_config import yaml_file

# ---------------------------------------------------------------------------------------------
# surface 4: the eval CLI
# ---------------------------------------------------------------------------------------------
EV = "eval cli"
GRID = ["--model", "tiny:llama", "--policy", "snapkv", "--budget", "0.3", "--tasks", "passkey",
        "--lengths", "128", "--samples", "1", "--protocol", "agnostic", "--threads", "1",
        "--no-progress"]


def cli(*argv: str) -> int:
    from sparsekv.cli import main
    return main(list(argv))


def _out() -> str:
    _n[0] += 1
    return str(TMP / f"eval-{_n[0]}")


def _grid(**replace: str) -> list[str]:
    g = list(GRID)
    for flag, val in replace.items():
        flag = "--" + flag.replace("_", "-")
        g[g.index(flag) + 1] = val
    return g


def ev_flag(name, names, *argv, **replace):
    add(EV, "flags", name, names,
        (lambda a=argv, r=replace: cli("eval", *_grid(**r), *a, "--out", _out())), cli=True)


ev_flag("--tasks passkey,needle", "needle", tasks="passkey,needle")
ev_flag("--tasks ''", "task", tasks="")
ev_flag("--policy magic", "magic", policy="magic")
ev_flag("--policy ''", "polic", policy="")
ev_flag("--policy snapkv@window", "window", policy="snapkv@window")
ev_flag("--policy snapkv@window=0", "window", policy="snapkv@window=0")
ev_flag("--policy snapkv@bogus=1", "bogus", policy="snapkv@bogus=1")
ev_flag("--policy snapkv@schedule=zigzag", "schedule", policy="snapkv@schedule=zigzag")
ev_flag("--policy learned:/nonexistent", "/nonexistent", policy="learned:/nonexistent")
ev_flag("--budget 1.5", "budget", budget="1.5")
ev_flag("--budget abc", "budget", budget="abc")
ev_flag("--budget 0", "budget", budget="0")
ev_flag("--budget -0.3", "budget", budget="-0.3")
ev_flag("--budget nan", "budget", budget="nan")
ev_flag("--budget ''", "budget", budget="")
ev_flag("--budget 0.3,,0.5", "budget", budget="0.3,,0.5")
ev_flag("--protocol blind", "protocol", protocol="blind")
ev_flag("--lengths 12", "length", lengths="12")
ev_flag("--lengths abc", "length", lengths="abc")
ev_flag("--lengths -128", "length", lengths="-128")
ev_flag("--samples 0", "samples", samples="0")
ev_flag("--samples -1", "samples", samples="-1")
ev_flag("--samples abc", "samples", samples="abc")
ev_flag("--threads 0", "threads", threads="0")
ev_flag("--seed abc", "seed", "--seed", "abc")
ev_flag("--workers 0", "workers", "--workers", "0")
ev_flag("--workers -2", "workers", "--workers", "-2")
ev_flag("--dtype float8", "dtype", "--dtype", "float8")
ev_flag("--attn flash", ("attn", "attn_implementation"), "--attn", "flash")
ev_flag("--model tiny:gpt2", ("model", "gpt2"), model="tiny:gpt2")
ev_flag("--model /nonexistent", ("model", "/nonexistent"), model="/nonexistent/model")
ev_flag("--eviction rerank_every=-1", "rerank_every", "--eviction", "rerank_every=-1")
ev_flag("--eviction bogus=1", "bogus", "--eviction", "bogus=1")
ev_flag("--eviction garbage", "eviction", "--eviction", "garbage")
ev_flag("--eviction budget=0.3", ("budget", "eviction"), "--eviction", "budget=0.3")
ev_flag("--eviction layout=paged", "layout", "--eviction", "layout=paged")
ev_flag("--eviction prefill_chunk=0", "prefill_chunk", "--eviction", "prefill_chunk=0")
ev_flag("--adapter /nonexistent", "/nonexistent", "--adapter", "/nonexistent/adapter")
ev_flag("--bogus-flag", "bogus", "--bogus-flag")
ev_flag("--source without --ingest", ("source", "ingest"), "--source", "kvpress")
add(EV, "flags", "--report-only on an empty folder", ("report", "results", "folder", "rows"),
    lambda: cli("eval", "--report-only", "--out", _out()), cli=True)
add(EV, "flags", "--readme-plots without --report-only", ("readme-plots", "readme plot"),
    lambda: cli("eval", *GRID, "--readme-plots", "x", "--out", _out()), cli=True)
add(EV, "flags", "model-info --model /nonexistent", ("model", "/nonexistent"),
    lambda: cli("model-info", "--model", "/nonexistent/model"), cli=True)
add(EV, "flags", "model-info --dtype float8", ("dtype", "float8"),
    lambda: cli("model-info", "--model", "tiny:llama", "--dtype", "float8"), cli=True)


def ev_config(name, names, text):
    def run():
        p = yaml_file(text)
        return cli("eval", "--config", str(p), "--out", _out())
    add(EV, "config file", name, names, run, cli=True)


ev_config("config: YAML syntax error", ("yaml",), "tasks: [passkey\nbudgets: 0.3\n")
ev_config("config: unknown key", "task_list", "model: tiny:llama\ntask_list: [passkey]\n")
ev_config("config: unknown task", "haystack", "model: tiny:llama\ntasks: [passkey, haystack]\n")
ev_config("config: bad task option", ("keys", "task_options"),
          "model: tiny:llama\ntask_options: {multikey: {keys: 3}}\n")
ev_config("config: budgets a string", "budget", "model: tiny:llama\nbudgets: lots\n")
ev_config("config: eviction a list", "eviction", "model: tiny:llama\neviction: [1, 2]\n")
ev_config("config: samples -3", "samples", "model: tiny:llama\nsamples: -3\n")
ev_config("config: a list", ("mapping", "config"), "- a\n- b\n")
add(EV, "config file", "config: missing file", ("missing.yaml",),
    lambda: cli("eval", "--config", str(TMP / "missing.yaml")), cli=True)


def ev_ingest(name, names, text):
    def run():
        p = TMP / f"ingest-{_n[0]}.jsonl"
        _n[0] += 1
        p.write_text(text)
        return cli("eval", "--out", _finished_run(), "--ingest", str(p), "--source", "kvpress")
    add(EV, "ingest", name, names, run, cli=True)


ev_ingest("ingest: not JSON", ("ingest", ".jsonl", "line"), "{not json\n")
ev_ingest("ingest: row without keys", ("ingest", ".jsonl", "line", "task"), '{"a": 1}\n')
add(EV, "ingest", "ingest: missing file", ("missing.jsonl",),
    lambda: cli("eval", "--out", _finished_run(), "--ingest", str(TMP / "missing.jsonl")), cli=True)


def _finished_run() -> str:
    """A folder holding one finished tiny grid (built once; copied by the cases)."""
    if "run" not in _CACHE:
        out = str(TMP / "finished")
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            rc = cli("eval", *GRID, "--out", out)
        assert rc == 0, rc
        _CACHE["run"] = out
    _n[0] += 1
    copy = str(TMP / f"run-copy-{_n[0]}")
    shutil.copytree(_CACHE["run"], copy)
    return copy


add(EV, "rows", "a fresh run into a folder with rows", ("--resume", "--overwrite", "rows"),
    lambda: cli("eval", *GRID, "--out", _finished_run()), cli=True)
add(EV, "rows", "--resume onto another model's rows", ("model", "qwen3"),
    lambda: cli("eval", *_grid(model="tiny:qwen3"), "--resume", "--out", _finished_run()),
    cli=True)
add(EV, "rows", "--overwrite onto another model's rows", ("model", "qwen3"),
    lambda: cli("eval", *_grid(model="tiny:qwen3"), "--overwrite", "--out", _finished_run()),
    cli=True)
add(EV, "rows", "--resume with another seed", ("seed",),
    lambda: cli("eval", *GRID, "--seed", "9", "--resume", "--out", _finished_run()), cli=True)


def _locked():
    from sparsekv.evaluation.rows.folder import FolderLock
    out = _finished_run()
    with FolderLock(out):
        return cli("eval", *_grid(budget="0.5"), "--resume", "--out", out)


add(EV, "rows", "a folder locked by another run", ("lock", "busy", "pid"), _locked, cli=True)


def _torn_rows():
    out = _finished_run()
    with open(Path(out) / "results.jsonl", "a") as f:
        f.write('{"sample_id": "x", "task": "pa')
    return cli("eval", *_grid(budget="0.5"), "--resume", "--out", out)


add(EV, "rows", "--resume with a torn last row (dropped with a note)", ("results.jsonl", "torn"),
    _torn_rows, cli=True, warn_ok=True)
add(EV, "rows", "--policy learned:<gemma3 head> on tiny:llama", ("model", "gemma"),
    lambda: cli("eval", *_grid(policy=f"learned:{adapter_dir('gemma3')}"), "--out", _out()),
    cli=True)
