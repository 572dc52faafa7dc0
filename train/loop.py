"""`train.py`'s command line: `--config PATH [key=value ...] [--push_to_hub REPO]` into a validated
`TrainConfig`, then one run (`train.trainer.Trainer`), or a LoRA alone for a saved adapter
(`train.lora`, under `lora.adapter`). A `RunError` (a setting that would stop the run later) is
printed as one line with exit status 2.

Where the rest lives: the order of events of a run (`train.trainer`), the objective
(`train.objective`: teacher targets from sparsekv.teacher, the head from sparsekv.scoring.head,
the loss from sparsekv.teacher.losses), accelerate and DeepSpeed (`train.distributed`), the run
folder, data and schedule (`train.run`), metrics (`train.metrics`), checkpoints
(`train.checkpoint`), the config and its per-key help (`train.config`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sparsekv.configfile import field_docs
from train.config import TrainConfig, load_config
from train.run import RunError
from train.trainer import Trainer

USAGE = """\
python train.py --config configs/train/<name>.yaml [key=value ...] [--push_to_hub user/repo]
accelerate launch [--config_file configs/accelerate/<name>.yaml] train.py --config ... [key=value ...]

Overrides: any config key (max_steps=50 output_dir=checkpoints/x seed=1 resume=never) and nested
target./loss./build./inference./lora. keys (loss.kl_weight=0.5). Values are read as YAML (null =
None). With lora.adapter=DIR only a LoRA is trained, for that adapter (train/lora.py)."""


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """`--config PATH [key=value ...] [--push_to_hub REPO]` -> validated `TrainConfig`."""
    docs = field_docs(TrainConfig)
    epilog = "config keys:\n" + "\n".join(f"  {k:<20} {v}" for k, v in docs.items())
    p = argparse.ArgumentParser(
        prog="train.py",
        usage=USAGE,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="YAML file under configs/train/")
    p.add_argument("--push_to_hub", metavar="REPO", help="push the final adapter to this Hub repo")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args(argv)
    if args.config is None:  # a run without a config would silently train the defaults
        p.error("--config is required (a YAML file, e.g. configs/train/tiny-cpu.yaml)")
    overrides = list(args.overrides)
    if args.push_to_hub:
        overrides.append(f"push_to_hub={args.push_to_hub}")
    try:
        return load_config(args.config, overrides)
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Entry point of train.py: returns the run summary (step, parameter counts, final path)."""
    cfg = parse_args(argv)
    if cfg.lora and cfg.lora.get("adapter"):  # only a LoRA, for an adapter trained before
        from train.lora import train_for_adapter

        return train_for_adapter(cfg)
    try:
        trainer = Trainer(cfg)
    except RunError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return trainer.fit()


if __name__ == "__main__":  # python -m train.loop --config ...
    main(sys.argv[1:])
