"""`Trainer`: one training run of the gating head on a frozen base model, from the current state
up to `max_steps`: train steps (one frozen teacher forward per micro-batch under
`torch.no_grad`, gradients only in the head), logging, atomic checkpoints with exact resume,
the optional LoRA after the head, `final/` and the Hub export.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from train import checkpoint as ckpt
from train.config import TrainConfig
from train.data import load_texts
from train.distributed import describe_distributed, make_accelerator, outside_zero3
from train.metrics import MetricsLog
from train.models import load_model
from train.objective import LayerwiseHead, build_objective, count_parameters
from train.run import (
    RunError,
    build_adapter,
    build_data,
    changed_keys,
    check_layers,
    lr_schedule,
    prepare_run_dir,
    read_trainer_state,
    resume_path,
)
from train.targets import NonFiniteTeacher

_T0 = time.perf_counter()  # process start, for the wall time printed at the end


def _peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB (ru_maxrss is KiB on Linux, bytes on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


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
        check_layers(cfg, self.model)  # before the data: a sliding layer is refused at once
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
        self.scheduler = lr_schedule(opt, cfg.warmup_steps, total, cfg.min_lr_ratio)
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
            position = self.state.samples_seen
            ids, mask = self.data.batch(
                position, cfg.batch_size, acc.process_index, acc.num_processes
            )
            self.state.samples_seen += cfg.batch_size * acc.num_processes
            ids, mask = ids.to(acc.device), mask.to(acc.device)
            with acc.accumulate(self.head):
                try:
                    loss, m = self.objective(self.model, self.head, ids, mask)
                except NonFiniteTeacher as e:
                    raise self._non_finite(e, position) from None
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

    def _non_finite(self, e: NonFiniteTeacher, position: int) -> RunError:
        """The step, the samples (positions in the data stream) and the dataset blocks whose
        teacher results are not finite: refused, never trained on."""
        first = position + self.acc.process_index * self.cfg.batch_size
        samples = [first + r for r in e.rows]
        blocks = [self.data.index(p) for p in samples]
        hint = (
            f"; dtype={self.cfg.dtype} may overflow: try dtype=float32"
            if self.cfg.dtype != "float32"
            else ""
        )
        return RunError(
            f"step {self.state.step + 1}: the teacher's {e.what} of layer {e.layer} hold NaN or "
            f"inf for sample(s) {samples} (block(s) {blocks} of dataset={self.cfg.dataset!r}); "
            f"refusing to train on them{hint}"
        )

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
            raise RunError(
                f"resume={cfg.resume!r}: {path} is not a complete step-N checkpoint"
            )
        self.load(path)

    def load(self, path: Path) -> None:
        """Continue from `path` (a step-N/ folder). A folder that does not fit this run (another
        model, layers or head; an optimizer state of other parameters) or a damaged file in it
        is a `RunError` naming the file, raised before any state is changed."""
        from sparsekv.scoring.adapter import ScorerAdapter

        acc = self.acc
        try:
            saved_adapter = ScorerAdapter.from_pretrained(str(path / "adapter"))
            saved_adapter.check_compatible(self.model)  # here, not in load_state_dict
        except (ValueError, OSError) as e:
            raise RunError(f"resume: {path}: {e}") from None
        if saved_adapter.config.layers != self.adapter.config.layers:
            raise RunError(
                f"resume: {path} has heads on layers {saved_adapter.config.layers} but this run "
                f"puts them on {self.adapter.config.layers}; resume with the same layers"
            )
        saved_head = {"head": saved_adapter.config.kind, "head_hidden": saved_adapter.config.hidden}
        for key, before in saved_head.items():
            if key == "head_hidden" and self.cfg.head == "linear":
                break  # a linear head has no hidden width
            if before != getattr(self.cfg, key):
                raise RunError(
                    f"resume: {path} holds a head with {key}={before!r} but this run has "
                    f"{key}={getattr(self.cfg, key)!r}; resume with {key}={before!r}"
                )
        saved = read_trainer_state(path)
        try:
            scheduler = ckpt.read_json(path / "scheduler.json")
            rng = path / f"rng_state_{acc.process_index}.safetensors"
            # absent when resuming with more processes than were saved
            rng_state = ckpt.load_state_dict(rng) if rng.exists() else None
            optimizer = None
            if not self._deepspeed:
                optimizer = ckpt.load_state_dict(path / "optimizer.safetensors")
        except (ValueError, OSError) as e:
            raise RunError(f"resume: damaged checkpoint: {e}; resume from another step-N folder") from None
        if optimizer is not None:
            names = [n for n, _ in self.adapter.head.named_parameters()]
            why = ckpt.optimizer_mismatch(optimizer, self.optimizer, names)
            if why is not None:
                raise RunError(
                    f"resume: {path / 'optimizer.safetensors'} does not fit this run's head: "
                    f"{why}; it belongs to another run"
                )
        if self._deepspeed:
            acc.load_state(str(path / "deepspeed"))
        else:
            self.adapter.head.load_state_dict(saved_adapter.head.state_dict())
            self.optimizer.load_state_dict(optimizer)
        self.scheduler.load_state_dict(scheduler)
        if rng_state is not None:
            ckpt.set_rng_state(rng_state)
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
            # what the head was trained on (a store may have grown since): blocks and real tokens
            "training_blocks": len(self.data),
            "training_tokens": int(self.data.attention_mask.sum()),
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
                    + ("training_blocks", "training_tokens", "last_metrics")
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
