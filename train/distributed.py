"""accelerate and DeepSpeed set-up for a run: the `Accelerator` a config asks for, what the
launch gives (processes, ZeRO stage), and gathering ZeRO-3 parameters for export.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from train.config import TrainConfig
from train.run import RunError


def make_accelerator(cfg: TrainConfig):
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin, ProjectConfiguration

    log_with = cfg.log_with
    if log_with == "auto":
        from accelerate.utils import is_tensorboard_available

        log_with = "tensorboard" if is_tensorboard_available() else "none"
    # accelerate picks CPU DDP (gloo) for a torchrun-style launch only when asked for the CPU;
    # without CUDA there is nothing else to run on, so ask (unless DeepSpeed runs the show:
    # `cpu=True` would make accelerate drop its DeepSpeed plugin without a word).
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1
    deepspeed = _launched_with_deepspeed()
    if deepspeed and cfg.cpu:
        raise RunError(
            "cpu=true with an accelerate config that names DeepSpeed would run plain CPU training "
            "without DeepSpeed; set cpu=false (DeepSpeed then runs on the CPU by itself when there "
            "is no GPU: configs/accelerate/deepspeed_zero2_cpu.yaml) or launch without DeepSpeed"
        )
    if deepspeed and multi and not torch.cuda.is_available():
        raise RunError(
            "DeepSpeed on the CPU runs one process here (several CPU processes under DeepSpeed "
            "fail with a world-size mismatch); launch with --num_processes 1 "
            "(configs/accelerate/deepspeed_zero2_cpu.yaml) or use configs/accelerate/ddp_cpu.yaml"
        )
    cpu = cfg.cpu or (multi and not torch.cuda.is_available())
    _warn_single_cpu_launch()
    project = ProjectConfiguration(project_dir=str(cfg.run_dir), logging_dir=str(cfg.run_dir))
    # A plugin (not gradient_accumulation_steps=) so that the train config, not the environment,
    # decides the accumulation.
    acc = Accelerator(
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=cfg.grad_accum),
        project_config=project,
        log_with=None if log_with == "none" else log_with,
        cpu=cpu,
    )
    ds = acc.state.deepspeed_plugin if acc.distributed_type.name == "DEEPSPEED" else None
    if ds is not None:
        # No dataloader is prepared, so DeepSpeed learns the micro-batch size from here.
        ds.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.batch_size
        gas = ds.deepspeed_config.get("gradient_accumulation_steps", "auto")
        if gas not in ("auto", cfg.grad_accum):
            raise ValueError(
                f"grad_accum={cfg.grad_accum} but the DeepSpeed config sets gradient_accumulation_steps="
                f"{gas}; leave it out of the accelerate config (grad_accum decides)"
            )
        ds.deepspeed_config["gradient_accumulation_steps"] = cfg.grad_accum
    return acc


def _launched_with_deepspeed() -> bool:
    """True when `accelerate launch` was given a config (or flag) that names DeepSpeed."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true", "yes")


def describe_distributed(acc, engine: nn.Module | None = None) -> dict[str, Any]:
    """How the run is distributed, for the log, trainer_state.json and the final summary:
    accelerate's distributed type, the ZeRO stage under DeepSpeed, processes, device and the
    class that wraps the head (`DeepSpeedEngine` under DeepSpeed)."""
    out: dict[str, Any] = {
        "distributed_type": acc.distributed_type.name,
        "num_processes": acc.num_processes,
        "device": str(acc.device),
    }
    if acc.distributed_type.name == "DEEPSPEED":
        out["zero_stage"] = acc.state.deepspeed_plugin.zero_stage
    if engine is not None:
        out["engine"] = type(engine).__name__
    return out


def _warn_single_cpu_launch() -> None:
    """`accelerate launch --cpu --num_processes N` starts N processes only through MPI."""
    launched_for_many = (
        "MASTER_ADDR" in os.environ and os.environ.get("ACCELERATE_USE_CPU") == "True"
    )
    if launched_for_many and "WORLD_SIZE" not in os.environ and "PMI_SIZE" not in os.environ:
        print(
            "warning: accelerate launch --cpu started a single process (it needs MPI for more); "
            "for CPU data parallelism use: accelerate launch --config_file "
            "configs/accelerate/ddp_cpu.yaml train.py ...",
            file=sys.stderr,
        )


@contextmanager
def outside_zero3(acc) -> Iterator[None]:
    """Build the frozen base model whole, even under DeepSpeed ZeRO-3.

    accelerate registers its DeepSpeed config with transformers, which then creates every model
    inside `deepspeed.zero.Init` (parameters partitioned, to be gathered by a DeepSpeed engine).
    The base model never enters an engine, so it is built with the registration lifted.
    """
    plugin = acc.state.deepspeed_plugin if acc.distributed_type.name == "DEEPSPEED" else None
    if plugin is None:
        yield
        return
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()
