"""The whole default pipeline in one command: train a scorer for gemma-3-270m on the CPU, then
evaluate it against every baseline, writing the tables and the plots.

    python eval/run_default.py                         # train (~19 min) + evaluate (samples: 2)
    python eval/run_default.py --samples 5 --out results/default-s5
    python eval/run_default.py --skip-train --adapter checkpoints/gemma3-270m-sparsekv

Stage 1 runs `python train.py --config configs/train/gemma3-270m-cpu.yaml` into
`checkpoints/<run>/` (resumes if interrupted: `resume=auto`). Stage 2 runs
`sparsekv eval --config configs/eval/default-4k.yaml --adapter checkpoints/<run>/final`, which
writes results.jsonl, summary.csv, summary.md and the PNG plots into `--out`. Each stage shows
its own progress bar with an ETA; the estimate printed first comes from the timings measured on
2 CPU cores and recorded in the two config files.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN_CONFIG = "configs/train/gemma3-270m-cpu.yaml"
EVAL_CONFIG = "configs/eval/default-4k.yaml"
# Measured on 2 CPU cores (see the config headers): training ~17 min; evaluation per sample
# index at 4K tokens with one shared prefill per prompt (configs/eval/default-4k.yaml).
TRAIN_MINUTES = 19
EVAL_MINUTES_PER_SAMPLE = 14


def run(cmd: list[str]) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="gemma3-270m-run", help="training run name under checkpoints/")
    p.add_argument("--samples", type=int, default=2, help="samples per task for the evaluation")
    p.add_argument("--out", default="results/default-4k", help="evaluation output folder")
    p.add_argument("--skip-train", action="store_true", help="evaluate an existing adapter")
    p.add_argument("--adapter", default=None, help="adapter to evaluate (default: the run's final/)")
    args = p.parse_args(argv)
    if args.samples < 1:
        raise SystemExit(f"--samples={args.samples}: must be >= 1")
    adapter = args.adapter or f"checkpoints/{args.run}/final"
    eta = (0 if args.skip_train else TRAIN_MINUTES) + EVAL_MINUTES_PER_SAMPLE * args.samples
    print(f"default pipeline: about {eta} minutes on 2 CPU cores "
          f"({'no training' if args.skip_train else f'training ~{TRAIN_MINUTES} min'}, "
          f"evaluation ~{EVAL_MINUTES_PER_SAMPLE} min per sample index x {args.samples})", flush=True)
    t0 = time.perf_counter()
    if not args.skip_train:
        run([sys.executable, "train.py", "--config", TRAIN_CONFIG, f"output_dir=checkpoints/{args.run}",
             "resume=auto"])
    if not (ROOT / adapter / "adapter_config.json").is_file():
        raise SystemExit(f"--adapter {adapter}: no adapter_config.json there")
    run([sys.executable, "-m", "sparsekv.cli", "eval", "--config", EVAL_CONFIG, "--adapter", adapter,
         "--samples", str(args.samples), "--out", args.out])
    print(f"done in {(time.perf_counter() - t0) / 60:.1f} min: table {args.out}/summary.md, "
          f"plots {args.out}/*.png, rows {args.out}/results.jsonl", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
