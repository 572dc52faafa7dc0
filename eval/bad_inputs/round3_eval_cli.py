"""Round 3, surface "eval cli": command lines rounds 1 and 2 (eval_cli.py, round2_eval_cli.py) do
not try: `sparsekv model-info` / `eval --model` given an adapter's folder, policy specs and
`--eviction` lists with a key twice or a list value, `--list` beside grid flags, and the two
diagnostics that read a finished grid, `eval/seed_spread.py` and `eval/kept_spans.py`, asked
for a budget, protocol, sample count, thread count or file the grid does not have. A case is
clear only when the message names the flag and what it may be (`allowed`)."""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path

from eval.bad_inputs.eval_cli import GRID, _grid, cli
from eval.bad_inputs.framework import _CACHE, TMP, Verdict, _n, adapter_dir, add3

EV = "eval cli"


def _out() -> str:
    _n[0] += 1
    return str(TMP / f"eval3-{_n[0]}")


def flag(name, names, *argv, allowed=(), **replace):
    add3(EV, "flags", name, names,
         (lambda a=argv, r=replace: cli("eval", *_grid(**r), *a, "--out", _out())), cli=True,
         allowed=allowed)


# ---------------------------------------------------------------------------------------------
# an adapter's folder where a model is expected
# ---------------------------------------------------------------------------------------------
add3(EV, "flags", "model-info --model <an adapter folder>", ("adapter", "--model"),
     lambda: cli("model-info", "--model", str(adapter_dir())), cli=True,
     allowed=("--adapter", "learned:"))
add3(EV, "flags", "eval --model <an adapter folder>", ("adapter", "--model"),
     lambda: cli("eval", *_grid(model=str(adapter_dir())), "--out", _out()), cli=True,
     allowed=("--adapter", "learned:"))
add3(EV, "flags", "model-info --model tiny:llama --dtype int8", ("dtype", "int8"),
     lambda: cli("model-info", "--model", "tiny:llama", "--dtype", "int8"), cli=True,
     allowed=("float32",))

# ---------------------------------------------------------------------------------------------
# specs and --eviction lists
# ---------------------------------------------------------------------------------------------
flag("--policy snapkv@window=8@window=16 (an option twice)", ("window",),
     allowed=("twice", "once"), policy="snapkv@window=8@window=16")
flag("--eviction sink_tokens=2,sink_tokens=4 (a key twice)", ("sink_tokens",),
     "--eviction", "sink_tokens=2,sink_tokens=4", allowed=("twice", "once"))
flag("--eviction schedule=[0.5,0.5] (a list of two for four layers)", ("schedule",),
     "--eviction", "schedule=[0.5,0.5]", allowed=("layer",))
flag("--eviction 'schedule=pyramid;budget=0.3' (a semicolon)", ("eviction", "schedule"),
     "--eviction", "schedule=pyramid;budget=0.3", allowed=("allowed", "KEY=VALUE", "pyramid"))
flag("--policy snapkv@label= (an empty label)", ("label",), allowed=("label=NAME", "non-empty"),
     policy="snapkv@label=")


def _learned_context():
    from eval.bad_inputs.round3_api import saved_ctx
    return cli("eval", *_grid(policy=f"learned:{saved_ctx()}"), "--out", _out())


add3(EV, "flags", "--policy learned:<a saved context's folder>", ("learned", "context",
                                                                   "config.json"),
     _learned_context, cli=True, allowed=("adapter",))


def _list_with_grid():
    """`--list` beside grid flags: it lists and exits; the flags are ignored (say so, or refuse)."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = cli("eval", "--list", "--model", "tiny:gpt2", "--budget", "7")
    if rc == 2 and any(w in err.getvalue() for w in ("--list", "model", "budget")):
        return Verdict("clear", err.getvalue().strip().splitlines()[-1])
    return Verdict("silent", f"exit {rc}: --list ran and the bad --model / --budget beside it "
                   "were not read")


add3(EV, "flags", "--list with --model tiny:gpt2 --budget 7 beside it", ("--list",),
     _list_with_grid)

# ---------------------------------------------------------------------------------------------
# eval/seed_spread.py and eval/kept_spans.py on a finished tiny grid
# ---------------------------------------------------------------------------------------------
DG = "diagnostics"


def finished() -> Path:
    """A finished tiny grid (snapkv at 0.3 beside the full cache, prompts dumped), copied."""
    if "r3-grid" not in _CACHE:
        out, dump = TMP / "r3-grid", TMP / "r3-grid-prompts"
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            rc = cli("eval", *GRID, "--out", str(out))
            rc2 = cli("eval", *GRID, "--dump-prompts", "--out", str(dump))
        assert rc == 0 and rc2 == 0, (rc, rc2)
        shutil.copy(dump / "prompts.jsonl", out / "prompts.jsonl")
        _CACHE["r3-grid"] = out
    copy = Path(_out())
    shutil.copytree(_CACHE["r3-grid"], copy)
    return copy


def seed_spread(*argv: str):
    from eval.seed_spread import main
    return main(["--out", str(finished()), *argv])


def _judged_spread(*argv: str):
    """seed_spread asked for what the grid lacks: refused naming the flag, or a table of
    nothing written (silent)."""
    def run():
        out = finished()
        from eval.seed_spread import main
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            main(["--out", str(out), *argv])
        body = text.getvalue()
        return Verdict("silent", f"exit 0, seeds.md written for {' '.join(argv)}: "
                       + " / ".join(x for x in body.splitlines() if x.startswith("| snapkv"))[:200])
    return run


add3(EV, DG, "seed_spread --budget 0.7 (not in the grid)", ("--budget", "0.7"),
     _judged_spread("--budget", "0.7"), allowed=("0.3",))
add3(EV, DG, "seed_spread --protocol aware (the grid ran agnostic only)", ("--protocol", "aware"),
     _judged_spread("--protocol", "aware"), allowed=("agnostic",))
add3(EV, DG, "seed_spread --budget nan", ("--budget", "nan"), _judged_spread("--budget", "nan"),
     allowed=("0.3", "(0, 1]"))
add3(EV, DG, "seed_spread --out <a missing folder>", ("--out", "results.jsonl"),
     lambda: __import__("eval.seed_spread", fromlist=["main"]).main(
         ["--out", str(TMP / "no-grid-here")]), allowed=("results.jsonl",))


def kept_spans(*argv: str, out: Path | None = None):
    from eval.kept_spans import main
    with contextlib.redirect_stdout(io.StringIO()) as text:
        rc = main(["--out", str(out or finished()), "--task", "passkey", "--label", "snapkv",
                   *argv])
    return Verdict("silent", f"exit {rc}: " + " / ".join(text.getvalue().splitlines()[:2])[:300])


add3(EV, DG, "kept_spans --budget 0.7 (not in the grid)", ("--budget", "0.7"),
     lambda: kept_spans("--budget", "0.7"), allowed=("0.3",))
add3(EV, DG, "kept_spans --samples 0", ("--samples",), lambda: kept_spans("--samples", "0"),
     allowed=(">= 1", "positive"))
add3(EV, DG, "kept_spans --samples -1", ("--samples",), lambda: kept_spans("--samples", "-1"),
     allowed=(">= 1", "positive"))
add3(EV, DG, "kept_spans --threads -1", ("--threads",), lambda: kept_spans("--threads", "-1"),
     allowed=(">= 1", "positive"))


def _no_prompts():
    out = finished()
    (out / "prompts.jsonl").unlink()
    return kept_spans(out=out)


add3(EV, DG, "kept_spans --out <a grid run without --dump-prompts>", ("prompts.jsonl",),
     _no_prompts, allowed=("--dump-prompts",))
add3(EV, DG, "kept_spans --label <a label not in the grid>", ("--label", "h2o"),
     lambda: __import__("eval.kept_spans", fromlist=["main"]).main(
         ["--out", str(finished()), "--task", "passkey", "--label", "h2o"]),
     allowed=("snapkv",))


def _torn_prompts():
    out = finished()
    p = out / "prompts.jsonl"
    p.write_text(p.read_text()[:-40])  # the last line cut short
    return kept_spans(out=out)


add3(EV, DG, "kept_spans: prompts.jsonl with a torn last line", ("prompts.jsonl",),
     _torn_prompts, warn_ok=True)


def _spread_rows_torn():
    """seed_spread on a results.jsonl whose middle row was hand-edited into bad JSON."""
    out = finished()
    p = out / "results.jsonl"
    lines = p.read_text().splitlines()
    lines[0] = lines[0][:-5]
    p.write_text("\n".join(lines) + "\n")
    from eval.seed_spread import main
    return main(["--out", str(out)])


add3(EV, DG, "seed_spread: results.jsonl with a bad first row", ("results.jsonl",),
     _spread_rows_torn, allowed=("line", ":1"))
