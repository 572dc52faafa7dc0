"""The training run: frozen base model + gating head, accelerate, checkpoints, resume, Hub export.

This module owns the order of events of `train.py`: parse the config, set up accelerate and the
run folder, load the frozen base model, build the data, create the adapter's gating head and its
optimizer, resume from the newest checkpoint, train (one frozen teacher forward per micro-batch
under `torch.no_grad`, gradients only in the head), log, checkpoint, train the optional LoRA
after the head (a `lora:` section), write `final/` and push to the Hub. The pieces it composes
live elsewhere: teacher targets (sparsekv.teacher.statistics), the head (sparsekv.scoring.head), the loss
(sparsekv.teacher.losses), the adapter format (sparsekv.scoring.adapter), the data order (train.data), the
checkpoint layout (train.checkpoint) and the LoRA co-adaptation (train.lora, which also runs a
LoRA alone for a saved adapter under `lora.adapter`). Settings that would stop a run later (another
model than the checkpoint's, `cpu` under DeepSpeed) are `RunError`s: one line, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from train import checkpoint as ckpt
from train.config import TrainConfig, dump_yaml, field_docs, load_config
from train.data import BlockDataset, load_texts, select_samples, tokenize_blocks
from train.models import load_model

_T0 = time.perf_counter()  # process start, for the wall time printed at the end


def _peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB (ru_maxrss is KiB on Linux, bytes on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024

USAGE = """\
python train.py --config configs/train/<name>.yaml [key=value ...] [--push_to_hub user/repo]
accelerate launch [--config_file configs/accelerate/<name>.yaml] train.py --config ... [key=value ...]

Overrides: any config key (max_steps=50 output_dir=checkpoints/x seed=1 resume=never) and nested
target./loss./build./inference./lora. keys (loss.kl_weight=0.5). Values are read as YAML (null =
None). With lora.adapter=DIR only a LoRA is trained, for that adapter (train/lora.py)."""


class RunError(ValueError):
    """A setting, or the state of the run folder, that stops a run before it trains (another
    model than the checkpoint's, DeepSpeed dropped by `cpu`, a damaged metrics log): `train.py`
    prints it without a traceback and exits with status 2."""


# ---------------------------------------------------------------------- command line


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


# ---------------------------------------------------------------------- objective


class LayerwiseHead(nn.Module):
    """The gating head as the training engine sees it: hidden states in, logits out, as tuples.

    `forward(*hidden)` takes `(batch, seq, hidden)` per layer of `layers` and returns
    `(batch, kv_heads, seq)` per layer, in the same order. Tuples rather than the head's
    int-keyed dicts, because DeepSpeed ZeRO-3's module hooks only understand tensors, tuples and
    string-keyed outputs. Parameters are the head's own (`head.*`); nothing is copied.
    """

    def __init__(self, head: nn.Module, layers: list[int]):
        super().__init__()
        self.head = head
        self.layers = list(layers)

    def forward(self, *hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.head.forward_layer(i, h) for i, h in zip(self.layers, hidden))


@dataclass
class Objective:
    """Teacher targets from the frozen model (cached per example when `cache` is set), head
    predictions, the configured loss averaged over layers."""

    target: Any  # sparsekv.teacher.statistics.TargetConfig
    loss: Any  # sparsekv.teacher.losses.LossConfig
    layers: list[int]
    block_size: int = 512
    repeat_prompt_ids: list[int] | None = None
    """Tokens of sparsekv.policies.reconstruction.REPEAT_PROMPT (reconstruction signals only)."""
    cache: Any = None  # train.targets.TargetCache | None

    def __post_init__(self) -> None:
        from train.targets import TeacherTargets

        self.teacher = TeacherTargets(
            self.target, self.layers, self.block_size, self.repeat_prompt_ids, self.cache
        )

    def __call__(
        self,
        model: nn.Module,
        head: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """`input_ids`, `attention_mask` `(batch, seq)` -> (scalar loss, metrics).

        `head` is a `LayerwiseHead` over `self.layers` (possibly wrapped by accelerate).
        """
        from sparsekv.teacher.losses import compute_loss

        hits = self.cache.hits if self.cache is not None else 0
        with torch.no_grad():
            targets, hidden = self.teacher(model, input_ids, attention_mask)
        preds = head(*(hidden[i] for i in self.layers))  # the head computes in float32
        valid = attention_mask.bool()
        total, metrics = 0.0, {}
        for layer, pred in zip(self.layers, preds):
            loss, m = compute_loss(pred, targets[layer], valid, self.loss, self.target.log_scale)
            total = total + loss
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + v / len(self.layers)
            metrics[f"recall/layer{layer}"] = m["recall"]
        if self.cache is not None:  # share of this micro-batch's rows read from the cache
            metrics["teacher_cached"] = (self.cache.hits - hits) / input_ids.shape[0]
        return total / len(self.layers), metrics


# ---------------------------------------------------------------------- setup


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear 0->1 over `warmup` steps, cosine 1->min_ratio until `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


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


def prepare_run_dir(cfg: TrainConfig, acc) -> None:
    """Create the run folder and save the resolved config beside the checkpoints."""
    run_dir = cfg.run_dir
    if cfg.resume == "never" and ckpt.step_dirs(run_dir):  # every process stops, none waits
        raise SystemExit(
            f"output_dir={str(run_dir)!r} already holds checkpoints; pass resume=auto to "
            "continue that run or choose another output_dir"
        )
    check_resume_model(cfg)  # before config.yaml is rewritten
    if acc.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.clean_leftovers(run_dir)
        header = (
            f"Resolved config of run {cfg.run_name!r}; rerun with:\n"
            f"  python train.py --config {run_dir / 'config.yaml'}"
        )
        tmp = run_dir / ".config.yaml.tmp"
        tmp.write_text(dump_yaml(cfg, header))
        tmp.replace(run_dir / "config.yaml")
    acc.wait_for_everyone()


def resume_path(cfg: TrainConfig) -> Path | None:
    """The checkpoint a run continues from: the newest complete step-N/ under `resume=auto`, the
    given folder, or None (`resume=never`, or nothing saved yet)."""
    if cfg.resume == "never":
        return None
    return ckpt.latest(cfg.run_dir) if cfg.resume == "auto" else Path(cfg.resume)


def check_resume_model(cfg: TrainConfig) -> None:
    """Resuming a checkpoint trained on another base model is an error, raised before anything
    is written or loaded (the head would be loaded onto a model it was not trained for)."""
    path = resume_path(cfg)
    if path is None or not (path / ckpt.TRAINER_STATE).is_file():
        return
    was = ckpt.read_json(path / ckpt.TRAINER_STATE).get("config", {}).get("model")
    if was is not None and was != cfg.model:
        raise RunError(
            f"resume: {path} was trained on model={was!r} but this run loads model={cfg.model!r}; "
            "resume with the same model, or start a new run (another output_dir, or resume=never "
            "in an empty one)"
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


def build_data(cfg: TrainConfig, tokenizer, acc) -> BlockDataset:
    """Token blocks of the configured dataset (built once by the main process if missing)."""

    def build(path: Path) -> None:
        from data.build import build_file

        build_file(path, cfg.build_config())

    with acc.main_process_first():
        texts = load_texts(
            cfg.dataset,
            cfg.text_field,
            cfg.dataset_split,
            cfg.dataset_config,
            cfg.max_documents,
            build=build if acc.is_main_process else None,
        )
    ids, mask = tokenize_blocks(tokenizer, texts, cfg.seq_len, cfg.packing)
    ids, mask = select_samples(ids, mask, cfg.max_samples, cfg.seed)
    return BlockDataset(ids, mask, cfg.seed)


def build_adapter(cfg: TrainConfig, model: nn.Module, base_id: str):
    from sparsekv.scoring.adapter import ScorerAdapter

    return ScorerAdapter.for_model(
        model,
        layers=cfg.layers,
        kind=cfg.head,
        hidden=cfg.head_hidden,
        target=cfg.target_config(),
        base_model_id=base_id,
        **cfg.inference_kwargs(),
    )


def build_objective(
    cfg: TrainConfig, model: nn.Module, tokenizer, base_id: str, layers
) -> Objective:
    """The run's `Objective`: the repeat prompt tokenized for reconstruction signals, and the
    on-disk teacher cache when `teacher_cache` is set."""
    from sparsekv.policies.reconstruction import REPEAT_PROMPT
    from train.targets import TargetCache, model_identity

    target = cfg.target_config()
    prompt = None
    if target.signal != "questions":
        prompt = list(tokenizer([REPEAT_PROMPT], add_special_tokens=False)["input_ids"][0])
    cache = None
    if cfg.teacher_cache is not None:
        cache = TargetCache(
            cfg.teacher_cache,
            target=target.to_dict(),
            layers=layers,
            repeat_prompt_ids=prompt,
            model=model_identity(model, base_id),
        )
    return Objective(target, cfg.loss_config(), list(layers), cfg.teacher_block_size, prompt, cache)


# Keys that may change between a run and its resumption without changing what it computes.
RESUME_FREE_KEYS = {
    "max_steps",
    "inference",
    "resume",
    "push_to_hub",
    "hub_private",
    "save_every",
    "keep_last",
    "log_every",
    "log_with",
    "progress_bar",
    "output_dir",
    "run_name",
    "num_threads",
    "teacher_cache",
    "lora",  # trained after the head, not checkpointed: it never enters a step-N/ folder
}


def changed_keys(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Config keys whose value differs from the checkpoint's, ignoring `RESUME_FREE_KEYS`."""
    return sorted(
        k for k in current if k not in RESUME_FREE_KEYS and saved.get(k, current[k]) != current[k]
    )


def count_parameters(module: nn.Module, trainable: bool | None = None) -> int:
    """Parameters of `module` (full sizes also under DeepSpeed ZeRO-3, which empties `.data`)."""
    return sum(
        getattr(p, "ds_numel", p.numel())
        for p in module.parameters()
        if trainable is None or p.requires_grad == trainable
    )


# ---------------------------------------------------------------------- metrics


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
    """The rows of a `metrics.jsonl`. A torn last line (the run was killed while writing it) is
    dropped; a damaged line anywhere else is an error naming the file and the line."""
    lines = path.read_text().splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict):
            if i == len(lines) - 1:
                print(f"warning: {path}: dropped its torn last line {line[:50]!r}", file=sys.stderr)
                break
            raise RunError(
                f"{path}: line {i + 1} is not a JSON object ({line[:60]!r}); repair or delete that "
                "line to resume the run"
            )
        rows.append(row)
    return rows


def _flat_hparams(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat_hparams(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


# ---------------------------------------------------------------------- trainer


@dataclass
class TrainState:
    """What besides tensors a checkpoint records: optimizer steps taken and samples consumed."""

    step: int = 0
    samples_seen: int = 0
    tokens_seen: int = 0


class Trainer:
    """One run. `fit()` trains from the current state up to `cfg.max_steps`."""

    def __init__(self, cfg: TrainConfig):
        from accelerate.utils import set_seed

        self.cfg = cfg
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        self.acc = make_accelerator(cfg)
        if cfg.lora and self.acc.num_processes > 1:
            raise RunError("lora: the LoRA co-adaptation runs in one process; launch with one")
        set_seed(cfg.seed)
        prepare_run_dir(cfg, self.acc)
        with outside_zero3(self.acc):
            self.model, tok, self.base_id = load_model(
                cfg.model, cfg.dtype, cfg.attn_implementation, cfg.seed, self.acc.device
            )
        self.data = build_data(cfg, tok, self.acc)
        self.tokenizer = tok
        self.adapter = build_adapter(cfg, self.model, self.base_id)
        self.adapter.head.to(self.acc.device).train()
        layers = self.adapter.config.layers
        self.objective = build_objective(cfg, self.model, tok, self.base_id, layers)
        opt = torch.optim.AdamW(
            self.adapter.head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay
        )
        total = cfg.schedule_steps or cfg.max_steps
        fn = partial(
            warmup_cosine, warmup=cfg.warmup_steps, total=total, min_ratio=cfg.min_lr_ratio
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(opt, fn)
        layerwise = LayerwiseHead(self.adapter.head, self.objective.layers)
        self.head, self.optimizer = self.acc.prepare(layerwise, opt)
        self.distributed = describe_distributed(self.acc, self.head)
        self.acc.print("distributed: " + ", ".join(f"{k}={v}" for k, v in self.distributed.items()))
        self.state = TrainState()
        self.resume()
        self.metrics = MetricsLog(self.acc, cfg, self.state.step)

    # -------------------------------------------------------------- one optimizer step

    def train_step(self) -> dict[str, float]:
        cfg, acc = self.cfg, self.acc
        sums: dict[str, float] = {}
        tokens = 0
        for _ in range(cfg.grad_accum):
            ids, mask = self.data.batch(
                self.state.samples_seen, cfg.batch_size, acc.process_index, acc.num_processes
            )
            self.state.samples_seen += cfg.batch_size * acc.num_processes
            ids, mask = ids.to(acc.device), mask.to(acc.device)
            with acc.accumulate(self.head):
                loss, m = self.objective(self.model, self.head, ids, mask)
                acc.backward(loss)
                if acc.sync_gradients and cfg.grad_clip is not None:
                    norm = acc.clip_grad_norm_(self.head.parameters(), cfg.grad_clip)
                    if norm is not None:  # None under DeepSpeed, which clips in its engine
                        m["grad_norm"] = float(norm)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            for k, v in {**m, "loss": loss.item()}.items():
                sums[k] = sums.get(k, 0.0) + v / cfg.grad_accum
            tokens += int(mask.sum())
        self.scheduler.step()
        self.state.step += 1
        return self._reduce(sums, tokens)

    def _reduce(self, sums: dict[str, float], tokens: int) -> dict[str, float]:
        """Average metrics over processes; count tokens over processes."""
        keys = sorted(sums)
        t = torch.tensor([sums[k] for k in keys] + [float(tokens)], device=self.acc.device)
        t = self.acc.reduce(t, reduction="sum")
        n = self.acc.num_processes
        out = {k: float(t[i]) / n for i, k in enumerate(keys)}
        out["tokens"] = int(t[-1])
        self.state.tokens_seen += out["tokens"]
        return out

    # -------------------------------------------------------------- loop

    def fit(self) -> dict[str, Any]:
        from tqdm.auto import tqdm

        cfg = self.cfg
        bar = tqdm(
            total=cfg.max_steps,
            initial=self.state.step,
            desc=cfg.run_name,
            dynamic_ncols=True,
            disable=not (self.acc.is_main_process and cfg.progress_bar),
        )
        while self.state.step < cfg.max_steps:
            lr = self.scheduler.get_last_lr()[0]  # the rate this step trains with
            t0 = time.perf_counter()
            m = self.train_step()
            dt = time.perf_counter() - t0
            m.update(
                lr=lr,
                tokens_per_s=m["tokens"] / dt,
                step_time_s=dt,
                samples_seen=self.state.samples_seen,
            )
            if self.state.step % cfg.log_every == 0 or self.state.step == cfg.max_steps:
                self.metrics.log(self.state.step, m)
            bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{m['tokens_per_s']:.0f}")
            bar.update(1)
            if cfg.save_every and self.state.step % cfg.save_every == 0:
                self.save()
        bar.close()
        return self.finish()

    # -------------------------------------------------------------- checkpoints

    def save(self) -> Path:
        """Write step-N/ atomically: adapter, optimizer, scheduler, per-process RNG, trainer state."""
        acc, run_dir = self.acc, self.cfg.run_dir
        final = run_dir / ckpt.step_dir_name(self.state.step)
        tmp = ckpt.begin(final) if acc.is_main_process else ckpt.tmp_path(final)
        acc.wait_for_everyone()
        if self._deepspeed:  # the engine owns the (partitioned) optimizer state
            acc.save_state(str(tmp / "deepspeed"))
        adapter = self._export_adapter()
        ckpt.save_state_dict(ckpt.rng_state(), tmp / f"rng_state_{acc.process_index}.safetensors")
        if acc.is_main_process:
            adapter.save_pretrained(tmp / "adapter")
            if not self._deepspeed:
                ckpt.save_state_dict(self.optimizer.state_dict(), tmp / "optimizer.safetensors")
            ckpt.write_json(self.scheduler.state_dict(), tmp / "scheduler.json")
        acc.wait_for_everyone()
        if acc.is_main_process:  # written last: its presence marks the folder complete
            ckpt.write_json(self._trainer_state(), tmp / ckpt.TRAINER_STATE)
            ckpt.commit(final)
            ckpt.prune(run_dir, self.cfg.keep_last)
        acc.wait_for_everyone()
        return final

    def _trainer_state(self) -> dict[str, Any]:
        return {
            **self.state.__dict__,
            "world_size": self.acc.num_processes,
            "distributed": self.distributed,
            "trainable_parameters": count_parameters(self.adapter.head, trainable=True),
            "base_parameters": count_parameters(self.model),
            "config": self.cfg.to_dict(),
        }

    @property
    def _deepspeed(self) -> bool:
        return self.acc.distributed_type.name == "DEEPSPEED"

    def _export_adapter(self):
        """The adapter with full head weights (gathered first under DeepSpeed ZeRO-3)."""
        if not self._deepspeed:
            return self.adapter
        state = self.acc.get_state_dict(self.head)  # collective under ZeRO-3; LayerwiseHead keys
        adapter = build_adapter(self.cfg, self.model, self.base_id)
        if self.acc.is_main_process:
            weights = {k.removeprefix("head."): v.float().cpu() for k, v in state.items()}
            adapter.head.load_state_dict(weights)
        return adapter

    def resume(self) -> None:
        cfg = self.cfg
        if cfg.resume == "never":
            return
        path = resume_path(cfg)
        if path is None:
            return
        if not (path / ckpt.TRAINER_STATE).is_file():
            raise FileNotFoundError(
                f"resume={cfg.resume!r}: {path} is not a complete step-N checkpoint"
            )
        self.load(path)

    def load(self, path: Path) -> None:
        from sparsekv.scoring.adapter import ScorerAdapter

        acc = self.acc
        saved_adapter = ScorerAdapter.from_pretrained(str(path / "adapter"))
        try:  # another model (or other layers) is an error here, not in load_state_dict
            saved_adapter.check_compatible(self.model)
        except ValueError as e:
            raise RunError(f"resume: {path}: {e}") from None
        if saved_adapter.config.layers != self.adapter.config.layers:
            raise RunError(
                f"resume: {path} has heads on layers {saved_adapter.config.layers} but this run "
                f"puts them on {self.adapter.config.layers}; resume with the same layers"
            )
        if self._deepspeed:
            acc.load_state(str(path / "deepspeed"))
        else:
            self.adapter.head.load_state_dict(saved_adapter.head.state_dict())
            self.optimizer.load_state_dict(ckpt.load_state_dict(path / "optimizer.safetensors"))
        self.scheduler.load_state_dict(ckpt.read_json(path / "scheduler.json"))
        rng = path / f"rng_state_{acc.process_index}.safetensors"
        if rng.exists():  # absent when resuming with more processes than were saved
            ckpt.set_rng_state(ckpt.load_state_dict(rng))
        saved = ckpt.read_json(path / ckpt.TRAINER_STATE)
        self.state = TrainState(saved["step"], saved["samples_seen"], saved["tokens_seen"])
        changed = changed_keys(saved.get("config", {}), self.cfg.to_dict())
        if changed:
            acc.print(
                f"warning: resuming with another {', '.join(changed)} than the checkpoint "
                "was trained with: the run will differ from an uninterrupted one"
            )
        acc.print(
            f"resumed from {path} at step {self.state.step} (sample {self.state.samples_seen})"
        )

    # -------------------------------------------------------------- end of run

    def co_adapt(self, adapter):
        """Train the `lora:` section's LoRA for the finished head (train/lora.py); returns
        (`LoraWeights`, metrics)."""
        from train import lora as co

        lcfg = self.cfg.lora_config()
        texts = load_texts(self.cfg.dataset, self.cfg.text_field, self.cfg.dataset_split,
                           self.cfg.dataset_config, self.cfg.max_documents)
        train_blocks, eval_blocks = co.lora_blocks(lcfg, texts, self.tokenizer)
        return co.train_lora(self.model, adapter, lcfg, train_blocks, eval_blocks, self.cfg.seed,
                             self.cfg.run_dir / co.LORA_METRICS)

    def finish(self) -> dict[str, Any]:
        """Write final/ (the adapter, its card carrying the config and last metrics); push it."""
        acc, cfg = self.acc, self.cfg
        adapter = self._export_adapter()
        n, base = count_parameters(self.adapter.head, True), count_parameters(self.model)
        summary = {
            "step": self.state.step,
            "trainable_parameters": n,
            "base_parameters": base,
            "final": str(cfg.run_dir / "final"),
            "distributed": self.distributed,
            "last_metrics": self.metrics.last() if acc.is_main_process else {},
        }
        if acc.is_main_process:
            for k, v in cfg.inference_kwargs().items():  # may change on resume: not a training key
                setattr(adapter.config, k, v)
            adapter.config.uses.update(cfg.inference_uses())
            adapter.config.training_config = {
                "config": cfg.to_dict(),
                "result": {
                    k: summary[k]
                    for k in ("step", "trainable_parameters", "base_parameters", "distributed")
                    + ("last_metrics",)
                },
            }
            lora = None
            if cfg.lora_config() is not None:  # after the head, with its final settings
                lora, summary["lora"] = self.co_adapt(adapter)
                adapter.config.training_config["result"]["lora"] = summary["lora"]
            adapter.save_pretrained(cfg.run_dir / "final", lora=lora)  # atomic (temp + rename)
            if cfg.push_to_hub:
                info = adapter.push_to_hub(
                    cfg.push_to_hub,
                    private=cfg.hub_private,
                    commit_message=f"sparsekv {cfg.run_name}: step {self.state.step}",
                )
                acc.print(
                    f"pushed the final adapter to {getattr(info, 'commit_url', cfg.push_to_hub)}"
                )
        acc.wait_for_everyone()
        acc.end_training()
        summary["wall_s"] = round(time.perf_counter() - _T0, 1)
        summary["peak_rss_mb"] = round(_peak_rss_mb(), 1)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            summary["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        gpu = f", peak GPU memory {summary['peak_gpu_mb']:.0f} MiB" if "peak_gpu_mb" in summary else ""
        acc.print(
            f"done: {self.state.step} steps; trainable parameters {n} "
            f"({100 * n / base:.3f}% of the base model's {base}); adapter in {summary['final']}\n"
            f"wall time {summary['wall_s'] / 60:.1f} min ({summary['wall_s']:.1f} s, model loading included), "
            f"peak memory (RSS) {summary['peak_rss_mb'] / 1024:.2f} GiB{gpu}"
        )
        return summary


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
