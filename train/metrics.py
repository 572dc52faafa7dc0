"""The metrics log of a run: `metrics.jsonl` (one row per logged step, torn last line dropped on
resume) and accelerate's trackers (TensorBoard when installed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sparsekv.io import read_jsonl
from train.config import TrainConfig
from train.run import RunError


class MetricsLog:
    """`metrics.jsonl` (main process; rows after the resumed step are dropped) + accelerate trackers."""

    def __init__(self, acc, cfg: TrainConfig, start_step: int):
        self.acc = acc
        self.path = cfg.run_dir / "metrics.jsonl"
        if acc.is_main_process and self.path.exists():
            keep = [r for r in read_metrics(self.path) if r.get("step", 0) <= start_step]
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
            tmp.replace(self.path)
        if acc.log_with:
            acc.init_trackers("tensorboard", config=_flat_hparams(cfg.to_dict()))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.acc.is_main_process:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
        self.acc.log(metrics, step=step)

    def last(self) -> dict[str, Any]:
        rows = read_metrics(self.path) if self.path.exists() else []
        return rows[-1] if rows else {}


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a `metrics.jsonl` (`sparsekv.io.read_jsonl`: a torn last line, from a run killed
    while writing it, is dropped with a warning); a damaged line anywhere else is a `RunError`
    naming the file and the line."""
    try:
        return read_jsonl(path, what="JSON object")
    except ValueError as e:
        raise RunError(f"{e}, then resume the run") from None


def _flat_hparams(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat_hparams(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out
