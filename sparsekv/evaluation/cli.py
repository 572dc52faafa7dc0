"""`sparsekv eval`: the command line of the evaluation harness (flags, YAML config, peers).

    sparsekv eval --policy snapkv,h2o,learned:checkpoints/run/final@blend=0.5 \\
        --budget 0.1,0.2,0.3,0.5 --tasks passkey,multikey,qa,ppl --lengths 1024,4096 \\
        --protocol agnostic,aware --samples 20 --seed 0 --out results/x
    sparsekv eval --config configs/eval/default-4k.yaml --samples 5      # flags override the file
    sparsekv eval --adapter checkpoints/run/final --budget 0.3 --out results/y  # vs all baselines
    sparsekv eval --config configs/eval/default-4k.yaml --dump-prompts     # prompts only
    sparsekv eval --config configs/eval/default-4k.yaml --resume         # continue, or grow the grid
    sparsekv eval --out results/x --ingest peer_rows.jsonl --source kvpress  # add a peer's rows
    sparsekv eval --out results/x --report-only --readme-plots learned snapkv streaming
    sparsekv eval --list                                                    # tasks and policies

Rows are never dropped: a run into a folder that holds rows needs --resume (keep them, run only
what is missing) or --overwrite (rerun the grid, replacing its own rows only); a folder is locked
while a run writes into it. Every error is one line on stderr (exit 2 for a bad input).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

BASELINES = ("streaming", "h2o", "snapkv", "pyramidkv", "tova", "knorm", "random")


GRID_FLAGS = (
    ("policies", "--policy"), ("adapter", "--adapter"), ("budgets", "--budget"),
    ("tasks", "--tasks"), ("lengths", "--lengths"), ("protocols", "--protocol"),
    ("samples", "--samples"), ("seed", "--seed"), ("model", "--model"), ("dtype", "--dtype"),
    ("attn_implementation", "--attn"), ("device", "--device"), ("eviction", "--eviction"),
    ("threads", "--threads"), ("workers", "--workers"), ("resume", "--resume"),
    ("overwrite", "--overwrite"), ("live_prefill", "--live-prefill"),
    ("dump_prompts", "--dump-prompts"),
)
"""Flags that shape a grid run (argparse dest, flag): --report-only and --ingest run no grid."""


def add_eval_parser(sub) -> argparse.ArgumentParser:
    """Register the `eval` subcommand on an argparse subparsers object."""
    p = sub.add_parser(
        "eval",
        help="evaluate KV policies: tasks x lengths x policies x budgets x protocols",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="YAML file with the grid (configs/eval/*.yaml); flags override it")
    p.add_argument("--policy", "--policies", dest="policies",
                   help="comma-separated policy specs NAME[:ARG][@KEY=VALUE]... e.g. "
                        "snapkv,h2o@rerank_every=4,learned:DIR@blend=0.5 (the full cache always runs)")
    p.add_argument("--adapter", action="append", default=[],
                   help="a trained scorer folder or Hub id; shortcut for --policy learned:DIR. Without "
                        f"--policy it is compared with every baseline ({', '.join(BASELINES)})")
    p.add_argument("--budget", "--budgets", dest="budgets",
                   help="comma-separated budgets, as in the API (EvictionConfig.budget): fractions "
                        "in (0, 1] (1.0 = the whole context), token counts >= 2, or counts spelled "
                        "Ntok such as 1tok or 512tok (a bare 1 and floats above 1 are refused)")
    p.add_argument("--tasks", "--task", dest="tasks", help="comma-separated task names (see --list)")
    p.add_argument("--lengths", "--length", dest="lengths", help="comma-separated prompt lengths in tokens")
    p.add_argument("--protocol", "--protocols", dest="protocols", help="agnostic, aware or agnostic,aware")
    p.add_argument("--samples", type=int, help="samples per task and length")
    p.add_argument("--seed", type=int, help="seed of the task generators")
    p.add_argument("--out", help="output folder")
    p.add_argument("--model", help="'default' (gemma-3-270m), 'tiny:<family>' or a local model folder")
    p.add_argument("--dtype", help="float32, bfloat16 or float16")
    p.add_argument("--attn", dest="attn_implementation", help="sdpa or eager")
    p.add_argument("--device", help="cpu (default), cuda or cuda:<index>")
    p.add_argument("--eviction", help="EvictionConfig fields for every policy, e.g. "
                                      "schedule=pyramid,rerank_every=16,recent_window=64")
    p.add_argument("--threads", type=int, help="torch threads (per worker)")
    p.add_argument("--workers", type=int, help="processes sharing the grid (default 1; 2 uses both cores of a 2-core box)")
    p.add_argument("--resume", action="store_true",
                   help="keep every row already in --out (whatever grid wrote it) and run only the runs "
                        "this grid still misses; refuses if a label of the grid ran another spec or adapter there")
    p.add_argument("--overwrite", action="store_true",
                   help="rerun this grid into an --out that holds rows, each new row replacing the row of "
                        "its slot (sample, protocol, label, budget); rows outside the grid are kept. With "
                        "--resume: rerun only the missing runs and those another spec or adapter wrote")
    p.add_argument("--live-prefill", action="store_true",
                   help="prefill every run itself instead of forking one shared prefill per prompt "
                        "(true per-method prefill time and peak KV bytes; much slower)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--dump-prompts", action="store_true",
                   help="write prompts.jsonl and config.yaml into --out and stop (for peer runs)")
    p.add_argument("--ingest", metavar="ROWS.jsonl",
                   help="add result rows produced elsewhere (same row format) to --out and rewrite the reports")
    p.add_argument("--source", help="with --ingest: the name of the rows' producer (e.g. kvpress)")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite the summary and plots of --out, or of the folder --config names in out: "
                        "(folding in what a stopped run finished); takes no grid flag")
    p.add_argument("--readme-plots", nargs="+", metavar="SERIES",
                   help="also draw readme_<protocol>_<length>.png for 1-6 methods, named as in the tables "
                        "(e.g. --readme-plots learned snapkv pyramidkv streaming): retrieval share with its "
                        "95%% bootstrap interval and mean KL against the budget, n in the title")
    p.add_argument("--list", action="store_true", help="list tasks and policies, then exit")
    p.set_defaults(func=run_eval_command)
    return p


def _parse_eviction(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    from sparsekv.evaluation.config import _scalar

    out: dict[str, Any] = {}
    items, depth, cur = [], 0, ""
    for ch in text:  # commas inside [...] belong to a list value (schedule=[0.3,0.5,...])
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth <= 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    for item in items:
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise ValueError(f"--eviction item {item!r} must be KEY=VALUE (e.g. schedule=pyramid "
                             "or schedule=[0.3,0.5])")
        k, v = item.split("=", 1)
        if k.strip() in out:
            raise ValueError(f"--eviction {k.strip()} is given twice ({text!r}); give each key once")
        out[k.strip()] = _scalar(v.strip())
    return out


def resolve_config(args: argparse.Namespace):
    """The `EvalConfig` of a command line: the YAML file (if any), then the flags over it."""
    from sparsekv.evaluation.config import EvalConfig

    overrides: dict[str, Any] = {
        k: getattr(args, k)
        for k in ("out", "model", "dtype", "attn_implementation", "device", "tasks", "lengths", "policies",
                  "budgets", "protocols", "samples", "seed", "threads", "workers")
        if getattr(args, k, None) is not None
    }
    if getattr(args, "live_prefill", False):
        overrides["shared_prefill"] = False
    ev = _parse_eviction(args.eviction)
    if ev is not None:
        overrides["eviction"] = ev
    if args.config:
        from sparsekv.configfile import read_yaml_mapping

        data = read_yaml_mapping(args.config, "--config")
        if "eviction" in overrides and isinstance(data.get("eviction"), dict):
            overrides["eviction"] = {**data["eviction"], **overrides["eviction"]}
        for single, plural in (("budget", "budgets"), ("policy", "policies"), ("protocol", "protocols"),
                               ("length", "lengths")):
            if single in data and plural in overrides:
                data.pop(single)
        data.update(overrides)
    else:
        data = overrides
    if args.adapter:
        base = data.get("policies")
        if base is None:
            base = list(BASELINES)
        elif isinstance(base, str):
            base = [x for x in base.split(",") if x.strip()]
        data["policies"] = list(base) + [f"learned:{a}" for a in args.adapter]
    return EvalConfig.from_dict(data)


def _list() -> int:
    from sparsekv.evaluation.tasks import TASKS
    from sparsekv.policies import available

    print("tasks:")
    for t in TASKS.values():
        opts = ", ".join(f"{k}={v}" for k, v in t.defaults.items())
        print(f"  {t.name:<11} {t.metric:<11} {'/'.join(t.protocols):<15} {t.doc}" + (f" [{opts}]" if opts else ""))
    print("policies: " + ", ".join(available()) + "  (learned:<adapter dir or hub id>)")
    return 0


def one_line(e: BaseException) -> str:
    """An error's message on one line (a YAML or JSON error's text spans several)."""
    return " ".join(str(e).split()) or type(e).__name__


def run_eval_command(args: argparse.Namespace) -> int:
    """`sparsekv eval`: every error is one line on stderr, never a traceback: a bad input (a
    ValueError, or an OSError such as a folder that cannot be written) exits 2 through
    `sparsekv.cli.main`; anything else is printed as one line with its type and exits 1
    (`SPARSEKV_TRACEBACK=1` re-raises it, for a bug report)."""
    try:
        return _command(args)
    except (ValueError, OSError) as e:
        raise ValueError(one_line(e)) from None
    except Exception as e:
        if os.environ.get("SPARSEKV_TRACEBACK"):
            raise
        print(f"sparsekv: error: {type(e).__name__}: {one_line(e)} (SPARSEKV_TRACEBACK=1 shows "
              "where it was raised)", file=sys.stderr)
        return 1


def _command(args: argparse.Namespace) -> int:
    from sparsekv.evaluation.rows.folder import check_out_folder
    from sparsekv.evaluation.running import runner

    if args.list:
        given = [f for f in ("config", "policies", "budgets", "tasks", "lengths", "protocols",
                             "samples", "out", "model", "eviction", "ingest")
                 if getattr(args, f, None) not in (None, [], False)] + (["adapter"] if args.adapter else [])
        if given:
            raise ValueError(
                f"--list lists the tasks and policies and runs nothing: leave out "
                f"{', '.join('--' + g.replace('_', '-') for g in given)} (they would not be read)"
            )
        return _list()
    if args.readme_plots is not None and not 1 <= len(args.readme_plots) <= 6:
        raise ValueError(f"--readme-plots takes 1 to 6 method names, got {len(args.readme_plots)}")
    if args.source is not None and not args.ingest:
        raise ValueError("--source names the producer of --ingest rows; give --ingest ROWS.jsonl with it")
    if args.ingest or args.report_only:
        what = "--ingest" if args.ingest else "--report-only"
        given = [flag for dest, flag in GRID_FLAGS if getattr(args, dest) not in (None, False, [])]
        if given:
            raise ValueError(
                f"{what} reads the rows already in --out and runs nothing: {', '.join(given)} "
                f"would change a grid it does not run; leave {'it' if len(given) == 1 else 'them'} "
                f"out (or run the grid without {what})"
            )
        if args.out is None and args.config is not None:  # the grid's own folder
            from sparsekv.configfile import read_yaml_mapping

            args.out = read_yaml_mapping(args.config, "--config").get("out")
        if args.out is None:
            raise ValueError(
                "--ingest and --report-only need --out (the evaluation folder), or a --config "
                "whose out: names it"
            )
        out = check_out_folder(args.out)
        if args.ingest and not (out / "prompts.jsonl").exists():
            raise ValueError(f"{out} holds no prompts.jsonl: run the grid (or --dump-prompts) there first")
        if not args.ingest and not (out / "results.jsonl").exists() and not list(out.glob("results.part-*.jsonl")):
            raise ValueError(f"{out} holds no results.jsonl: nothing to report")
        if args.ingest:
            n = runner.ingest_rows(out, args.ingest, source=args.source)
            print(f"added {n} rows from {args.ingest} to {out / 'results.jsonl'}")
        else:
            from sparsekv.evaluation.reports.tables import write_reports
            from sparsekv.evaluation.rows.folder import FolderLock
            from sparsekv.evaluation.rows.store import merge_parts

            with FolderLock(out):
                n = merge_parts(out)
                if n:
                    print(f"folded {n} finished rows of a stopped run into {out / 'results.jsonl'}")
                write_reports(out, args.readme_plots)
        print(f"wrote {out / 'summary.md'}, {out / 'summary.csv'} and plots")
        return 0
    cfg = resolve_config(args)
    if cfg.out is None:
        raise ValueError("no output folder: give --out DIR (or out: in the config)")
    check_out_folder(cfg.out)  # before any model loads
    if args.dump_prompts:
        from sparsekv.evaluation.rows.folder import (
            FolderLock,
            check_same_setup,
            read_config,
            write_config,
            write_prompts,
        )
        from sparsekv.evaluation.rows.identity import check_identity
        from sparsekv.evaluation.rows.store import folder_rows
        from sparsekv.evaluation.running.models import load_model
        from sparsekv.evaluation.running.plan import build_samples

        out = Path(cfg.out)
        _, codec = load_model(cfg.model, cfg.dtype, cfg.attn_implementation, seed=cfg.seed)  # the codec only
        samples = build_samples(cfg, codec)
        with FolderLock(out):
            rows = folder_rows(out)
            if rows:  # the prompts of a folder's rows are never replaced by other prompts
                check_same_setup(out, cfg)
                check_identity(rows, cfg, out, samples, read_config(out))
            write_prompts(samples, cfg, out / "prompts.jsonl", keep_others=True)
            if not rows:  # a folder with rows keeps the config they were run with
                write_config(out, cfg)
        print(f"wrote {len(samples)} prompts to {out / 'prompts.jsonl'}")
        return 0
    out = runner.run_eval(cfg, progress=not args.no_progress, resume=args.resume, overwrite=args.overwrite,
                          readme_series=args.readme_plots)
    print(f"results in {out}: results.jsonl, summary.csv, summary.md, quality_*.png, kl_*.png, config.yaml",
          file=sys.stderr)
    print((out / "summary.md").read_text())
    return 0
