"""A sweep of bad inputs across sparsekv's surfaces (issue 16's target): each case feeds one bad
input and classifies what came back.

  clear   a ValueError / TypeError / FileNotFoundError / SystemExit, or a CLI exit 2, whose
          message names the parameter, flag, key or file (one of the case's `names`)
  unclear another exception type, or an accepted exception type whose message names nothing
  silent  accepted without error (or a CLI exit 0) where it should not be

Surfaces: api (EvictionConfig, SparseKVCache, policies.get, ScorerAdapter, compress*), adapter
files (damaged folders on disk), train config (train/config.py's load_config with YAML files and
key=value overrides, plus two short tiny runs), eval CLI (`sparsekv.cli.main([...])` in process,
stderr captured; fresh run into a folder with rows, --resume onto another model, locked folder).

Tiny random models only, one thread. Run:
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python eval/sweep_bad_inputs.py [--only SURFACE,...]
Writes docs/results/bad-inputs/{cases.json, summary.md}.

Round 2 (issue 36's target: other cases of the same breadth, none repeated from round 1):
    python eval/sweep_bad_inputs.py --round 2
runs eval/bad_inputs/round2_*.py (surfaces api, files, train, eval cli and kills; a fourth
outcome, "data loss") and writes docs/results/bad-inputs/{round2.json, round2.md}.

Round 3 (a third fresh sweep, none of rounds 1 and 2 repeated; a case is clear only when its
message also says what is allowed or what to do):
    python eval/sweep_bad_inputs.py --round 3
runs eval/bad_inputs/round3_*.py (the same five surfaces as round 2) and writes
docs/results/bad-inputs/{round3.json, round3.md}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

torch.set_num_threads(1)


from eval.bad_inputs import adapter_files, api, eval_cli, train_config  # noqa: E402,F401  (registers the cases, in this order)
from eval.bad_inputs.framework import (  # noqa: E402
    CASES,
    OUTCOMES,
    SURFACES,
    SURFACES2,
    SURFACES3,
    TMP,
    Case,
    Outcome,
    classify,
)

CASES.sort(key=lambda c: SURFACES.index(c.surface))  # api, adapter files, train config, eval cli

ROUND2_MODULES = ("round2_api", "round2_files", "round2_train", "round2_eval_cli",
                  "round2_kills")
"""Round 2's modules, one per surface of SURFACES2 (api, files, train, eval cli, kills)."""


ROUND3_MODULES = ("round3_api", "round3_files", "round3_train", "round3_eval_cli",
                  "round3_kills")
"""Round 3's modules, one per surface of SURFACES3."""
ROUNDS = {2: (ROUND2_MODULES, SURFACES2), 3: (ROUND3_MODULES, SURFACES3)}


def round_cases(n: int) -> list[Case]:
    """Round `n`'s cases (2 or 3; imported on demand, so round 1's list stays as it was)."""
    import importlib

    modules, surfaces = ROUNDS[n]
    for name in modules:
        importlib.import_module(f"eval.bad_inputs.{name}")
    cases = [c for c in CASES if c.round == n]
    return sorted(cases, key=lambda c: surfaces.index(c.surface))


def round2_cases() -> list[Case]:
    """Round 2's cases."""
    return round_cases(2)


# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated surfaces (api, 'adapter files', ...)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "bad-inputs"))
    ap.add_argument("--round", type=int, choices=(1, 2, 3), default=1,
                    help="1: the 365 cases of issue 16 (default); 2: issue 36's fresh sweep; "
                    "3: a third fresh sweep")
    ap.add_argument("--match", help="rounds 2 and 3: only cases whose name contains this text")
    args = ap.parse_args(argv)
    if args.round in ROUNDS:
        return main_round2(args)
    only = set(args.only.split(",")) if args.only else set(SURFACES)
    cases = [c for c in CASES if c.round == 1 and c.surface in only]
    results, seconds = run_cases(cases, width=7)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r.__dict__ for r in results]
    summary = summarize(results, seconds)
    (out / "cases.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "summary.md").write_text(summary)
    print(summary)
    shutil.rmtree(TMP, ignore_errors=True)
    return 0


def run_cases(cases: list, width: int) -> tuple[list, float]:
    """Classify each case, printing one progress line per case (outcome padded to `width`);
    returns the results and the seconds taken."""
    t0 = time.time()
    results = []
    for i, c in enumerate(cases):
        r = classify(c)
        results.append(r)
        print(f"[{i + 1}/{len(cases)}] {r.outcome:{width}s} {c.surface} / {c.name}", flush=True)
    return results, time.time() - t0


def main_round2(args) -> int:
    """Rounds 2 and 3 (`args.round`): run, write round<N>.json and round<N>.md."""
    import platform

    n = args.round
    only = set(args.only.split(",")) if args.only else set(ROUNDS[n][1])
    cases = [c for c in round_cases(n) if c.surface in only
             and (not args.match or args.match in c.name)]
    results, seconds = run_cases(cases, width=9)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = (f"{platform.machine()}, {os.cpu_count()} CPUs visible, Python "
               f"{platform.python_version()}, torch {torch.__version__}")
    counts = {k: sum(r.outcome == k for r in results) for k in OUTCOMES}
    doc = {"round": n, "command": f"python eval/sweep_bad_inputs.py --round {n}", "machine": machine,
           "seconds": round(seconds, 1), "n": len(results), "counts": counts,
           "cases": [r.__dict__ for r in results]}
    suffix = "" if not (args.only or args.match) else "-partial"
    from sparsekv.io import write_atomic

    write_atomic(out / f"round{n}{suffix}.json", json.dumps(doc, indent=1) + "\n")
    write_atomic(out / f"round{n}{suffix}.md", summarize_round2(results, seconds, machine, n))
    print(f"{len(results)} cases in {seconds:.0f} s: {counts}")
    shutil.rmtree(TMP, ignore_errors=True)
    return 0


def summarize_round2(results: list[Outcome], seconds: float, machine: str, n: int = 2) -> str:
    """round<n>.md (n = 2 or 3): the counts per surface and every case that is not clear."""
    title = {2: "round 2 (issue 36's target)", 3: "round 3 (a third fresh sweep)"}[n]
    before = ("round 1 (`eval/bad_inputs/{api,adapter_files,train_config,eval_cli}.py`)"
              if n == 2 else "rounds 1 and 2 (`eval/bad_inputs/{api,adapter_files,"
              "train_config,eval_cli}.py`, `eval/bad_inputs/round2_*.py`); a case is clear "
              "only when its message also says what is allowed or what to do")
    lines = [
        f"# Bad-input sweep, {title}",
        "",
        (f"`python eval/sweep_bad_inputs.py --round {n}` ({len(results)} cases, {seconds:.0f} s; "
         f"{machine}; tiny random models, one thread). Cases: "
         + ", ".join(f"`eval/bad_inputs/{m}.py`" for m in ROUNDS[n][0])
         + f", none repeated from {before}. Every case and its message: `round{n}.json`."),
        "",
        ("Outcomes: **clear** (ValueError / TypeError / FileNotFoundError / SystemExit or CLI "
         "exit 2 naming the parameter, flag, key or file, or a case-judged result that is "
         "right: for a kill, nothing lost and the rerun finished), **unclear** (another "
         "exception type, a raw traceback out of the CLI, or a message naming none of the "
         "case's words), **silent** (accepted where it should not be), **data loss** (a "
         "kill or failed write left files that no longer load, or rows / steps lost or "
         "repeated)."),
        "",
        "| surface | n | clear | unclear | silent | data loss |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    tot = dict.fromkeys(("n", *OUTCOMES), 0)
    for s in ROUNDS[n][1]:
        rs = [r for r in results if r.surface == s]
        if not rs:
            continue
        cnt = {k: sum(r.outcome == k for r in rs) for k in OUTCOMES}
        lines.append(f"| {s} | {len(rs)} | " + " | ".join(str(cnt[k]) for k in OUTCOMES) + " |")
        tot["n"] += len(rs)
        for k, v in cnt.items():
            tot[k] += v
    lines.append(f"| **all** | {tot['n']} | " + " | ".join(str(tot[k]) for k in OUTCOMES) + " |")
    share = tot["clear"] / tot["n"] if tot["n"] else math.nan
    met = share >= 0.95 and tot["silent"] == 0 and tot["data loss"] == 0
    lines += ["", (f"Share clear: **{100 * share:.1f}%** (target: >= 95%, no silent case, no "
                   f"data loss). {'Met.' if met else 'Not met yet.'}"), ""]
    bad = [r for r in results if r.outcome != "clear"]
    lines.append("## Cases that are not clear" if bad else "Every case is clear.")
    for r in bad:
        msg = r.message.replace("|", "\\|").replace("\n", " ")
        lines.append(f"- **{r.outcome}** · {r.surface} / {r.group} · `{r.name}` · "
                     f"{r.error_type or '-'}: {msg[:400]}")
    return "\n".join(lines) + "\n"


def summarize(results: list[Outcome], seconds: float) -> str:
    lines = [
        "# Bad-input sweep (issue 16's target)",
        "",
        (f"`python eval/sweep_bad_inputs.py` ({len(results)} cases, {seconds:.0f} s on a shared "
        "CPU, tiny random models). Outcome per case: **clear** (ValueError / TypeError / "
        "FileNotFoundError / SystemExit or CLI exit 2 whose message names the parameter, flag, "
        "key or file), **unclear** (another exception type, or a message naming none of them), "
        "**silent** (accepted). Every case and its message: `cases.json`."),
        "",
        "| surface | n | clear | unclear | silent |",
        "|---|---:|---:|---:|---:|",
    ]
    tot = {"n": 0, "clear": 0, "unclear": 0, "silent": 0}
    for s in SURFACES:
        rs = [r for r in results if r.surface == s]
        if not rs:
            continue
        cnt = {k: sum(r.outcome == k for r in rs) for k in ("clear", "unclear", "silent")}
        lines.append(f"| {s} | {len(rs)} | {cnt['clear']} | {cnt['unclear']} | {cnt['silent']} |")
        tot["n"] += len(rs)
        for k, v in cnt.items():
            tot[k] += v
    share = tot["clear"] / tot["n"] if tot["n"] else math.nan
    lines.append(f"| **all** | {tot['n']} | {tot['clear']} | {tot['unclear']} | {tot['silent']} |")
    lines += ["", f"Share clear: **{100 * share:.1f}%** (target: >= 95% and no silent case).", ""]
    lines += [
        ("Notes: an OSError (not FileNotFoundError) counts as unclear even when its message names "
        "the path, as the issue's definition asks. An exception that escapes `sparsekv.cli.main` "
        "is a raw traceback to the user, so unclear whatever it says. Inputs the library accepts "
        "by design are not swept: a missing local `.jsonl` dataset (built by data/build.py), an "
        "adapter config without `kind` (defaults to mlp and the weights must match), float16 "
        "adapter weights (read as float32), a negative eval `--seed`. A torn last line of "
        "`results.jsonl` on `--resume` is dropped with a note naming the file (issue 16's fix): "
        "that case counts as clear when the note is printed."),
        "",
    ]
    bad = [r for r in results if r.outcome != "clear"]
    lines.append("## Cases that are not clear" if bad else "Every case is clear.")
    for r in bad:
        msg = r.message.replace("|", "\\|").replace("\n", " ")
        lines.append(
            f"- **{r.outcome}** · {r.surface} / {r.group} · `{r.name}` · {r.error_type or '-'}: "
            f"{msg[:400]} (expected a message naming one of {r.names})"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
