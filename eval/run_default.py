"""The whole default pipeline in one command: train the quick recipe for gemma-3-270m on the
CPU (60 sequences of 1,024 tokens: the head shipped before issue 34, now
`checkpoints/gemma3-270m-sparsekv-quick`; the shipped head's store recipe needs a teacher store
of ~4 h, docs/teacher-store.md), then run the generalize grid (the headline grid:
evaluation-only text, every task family, both protocols, the new head against the heuristics
and the peers), writing the table and plots.

    python eval/run_default.py                          # train + the grid, 2 samples at 1K, quick
    python eval/run_default.py --skip-train             # the grid with the shipped adapter
    python eval/run_default.py --samples 30 --length 4096 --budgets 0.1,0.2,0.3 --resume
                                                        # the full grid of generalize-4k.yaml

Stage 1 trains `configs/train/gemma3-270m-cpu.yaml` (the quick recipe) into
`checkpoints/<run>/` (resumes if interrupted: `resume=auto`). Stage 2 runs
`configs/eval/generalize-4k.yaml` with the shipped head replaced by the new one, on the config's
seed: by default 2 samples per task at 1,024 tokens and budget 0.3 (measured 23 min 52 s on 2
idle cores, 6.1 min of them training and ~17.7 min the grid's 504 runs; at 2,048 tokens 35 min
40 s; `--length`, `--budgets`, `--samples`, `--seed` give the full grid). The config used is written next to the results as
`pipeline-eval.yaml`; results.jsonl, summary.csv, summary.md and the PNG plots go into `--out`
(without `--resume` the grid reruns with `--overwrite`: its rows in `--out` are replaced, any
other rows there kept). Each stage shows a progress bar with an ETA; the estimate printed first
comes from timings measured on 2 CPU cores (the constants below).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import yaml

from sparsekv.io import write_atomic
from sparsekv.scoring.files import CONFIG_NAME, LEGACY_CONFIG_NAME

ROOT = Path(__file__).resolve().parents[1]
TRAIN_CONFIG = "configs/train/gemma3-270m-cpu.yaml"
EVAL_CONFIG = "configs/eval/generalize-4k.yaml"
SHIPPED = "checkpoints/gemma3-270m-sparsekv"
# Estimates for 2 idle CPU cores, from the default job measured on this project's 2-core VM:
# 2026-12-04 at 1,024 tokens (23 min 52 s wall: training 6.1 min, the grid's 504 runs at budget
# 0.3, 2 samples, ~17.7 min, i.e. 8.85 min per sample) and 2026-12-03 at 2,048 tokens (35 min 40
# s: training 8.3 min, the grid 27 min, 13.5 min per sample). A sample's minutes at one budget
# are a fixed part (model loading, decoding, the short runs) plus a part growing as
# length^1.3 (prefill), fitted to those two points; each further budget adds as much again.
TRAIN_MINUTES = 6
EVAL_FIXED_MINUTES_PER_SAMPLE = 5.7
EVAL_PREFILL_MINUTES_PER_SAMPLE_4K = 19.3


def run(cmds: list[list[str]]) -> None:
    """Run the commands side by side; fail if any fails."""
    procs = []
    for cmd in cmds:
        print("$ " + " ".join(cmd), flush=True)
        procs.append(subprocess.Popen(cmd, cwd=ROOT))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a stage failed (exit codes {codes}); rerun the same command to resume it")


def eval_config(adapter: str, samples: int, out: str, length: int = 1024,
                budgets: list[float] | None = None, seed: int | None = None) -> dict:
    """generalize-4k.yaml with the shipped head (`learned:` + SHIPPED) replaced by `adapter`, and
    the grid sized by `samples`, `length`, `budgets` and `seed` (None: the config's)."""
    cfg = yaml.safe_load((ROOT / EVAL_CONFIG).read_text())
    swap = {f"learned:{SHIPPED}": f"learned:{adapter}"}
    cfg["policies"] = [
        {**p, "policy": swap.get(p["policy"], p["policy"])} if isinstance(p, dict) else swap.get(p, p)
        for p in cfg["policies"]
    ]
    cfg["samples"], cfg["out"], cfg["lengths"] = samples, out, [length]
    if budgets is not None:
        cfg["budgets"] = list(budgets)
    if seed is not None:
        cfg["seed"] = seed
    return cfg


def estimate_minutes(train: bool, samples: int, length: int, budgets: int) -> float:
    """Minutes on 2 idle cores, from the measured figures above (prefill cost ~ length^1.3)."""
    one_budget = EVAL_FIXED_MINUTES_PER_SAMPLE + EVAL_PREFILL_MINUTES_PER_SAMPLE_4K * (length / 4096) ** 1.3
    per_sample = one_budget * (1 + budgets) / 2
    return (TRAIN_MINUTES if train else 0) + per_sample * samples


def _budgets(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--budgets {text!r}: must be comma-separated fractions, e.g. 0.1,0.3") from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise SystemExit(f"--budgets {text!r}: each budget must be a fraction in (0, 1]")
    return values


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="gemma3-270m-run", help="training run name under checkpoints/")
    p.add_argument("--samples", type=int, default=2, help="samples per task for the evaluation")
    p.add_argument("--length", type=int, default=1024, help="context length in tokens (the headline: 4096)")
    p.add_argument("--budgets", default="0.3", help="comma-separated budgets (the headline: 0.1,0.2,0.3)")
    p.add_argument("--seed", type=int, help="evaluation seed (default: the config's report seed)")
    p.add_argument("--out", default="results/default-pipeline", help="evaluation output folder")
    p.add_argument("--skip-train", action="store_true", help="evaluate the shipped adapter instead")
    p.add_argument("--resume", action="store_true",
                   help="keep the finished rows already in --out and run only the missing ones (without it, "
                        "the grid reruns and replaces its own rows in --out; other rows there are kept)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.samples < 1:
        raise SystemExit(f"--samples={args.samples}: must be >= 1")
    if args.length < 256:
        raise SystemExit(f"--length={args.length}: must be >= 256 tokens")
    budgets = _budgets(args.budgets)
    adapter = SHIPPED if args.skip_train else f"checkpoints/{args.run}/final"
    eta = estimate_minutes(not args.skip_train, args.samples, args.length, len(budgets))
    print(f"default pipeline: about {eta:.0f} minutes on 2 idle CPU cores "
          f"({'no training' if args.skip_train else f'training ~{TRAIN_MINUTES} min'}, then "
          f"{EVAL_CONFIG} with {args.samples} samples per task at {args.length} tokens, budgets "
          f"{budgets}; up to 2-3x longer when other jobs share the cores)", flush=True)
    t0 = time.perf_counter()
    if not args.skip_train:
        run([[sys.executable, "train.py", "--config", TRAIN_CONFIG, "resume=auto",
              f"output_dir=checkpoints/{args.run}"]])
    if not any((ROOT / adapter / n).is_file() for n in (CONFIG_NAME, LEGACY_CONFIG_NAME)):
        raise SystemExit(f"adapter {adapter}: no {CONFIG_NAME} (or format-1 {LEGACY_CONFIG_NAME}) there")
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "pipeline-eval.yaml"
    cfg = eval_config(adapter, args.samples, args.out, args.length, budgets, args.seed)
    write_atomic(cfg_path, yaml.safe_dump(cfg, sort_keys=False))
    run([[sys.executable, "-m", "sparsekv.cli", "eval", "--config", str(cfg_path),
          "--resume" if args.resume else "--overwrite"]])
    print(f"done in {(time.perf_counter() - t0) / 60:.1f} min: table {args.out}/summary.md, "
          f"plots {args.out}/*.png, rows {args.out}/results.jsonl", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
