"""The run folder and what a run is built from: `RunError` (a setting that stops a run before it
trains: one line, exit status 2), the folder and resume checks, the data, a fresh adapter, the
LR schedule (linear warm-up, cosine to a floor that holds after `schedule_steps`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from torch import nn

from train import checkpoint as ckpt
from train.config import TrainConfig, dump_yaml
from train.data import BlockDataset, load_texts, select_samples, tokenize_blocks


class RunError(ValueError):
    """A setting, or the state of the run folder, that stops a run before it trains (another
    model than the checkpoint's, DeepSpeed dropped by `cpu`, a damaged metrics log): `train.py`
    prints it without a traceback and exits with status 2."""


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear 0->1 over `warmup` steps, cosine 1->min_ratio until `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


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


def open_store(cfg: TrainConfig):
    """The teacher store of a `dataset: store:PATH` run, or None; a store of sequences of
    another length than `seq_len` is a `RunError`."""
    from sparsekv.teacher.store import StoreError, TeacherStore, store_dataset_path

    path = store_dataset_path(cfg.dataset)
    if path is None:
        return None
    try:
        store = TeacherStore(path)
    except StoreError as e:
        raise RunError(f"dataset={cfg.dataset!r}: {e}") from None
    if store.spec.length != cfg.seq_len:
        raise RunError(
            f"dataset={cfg.dataset!r} holds sequences of {store.spec.length} tokens but "
            f"seq_len={cfg.seq_len}; set seq_len={store.spec.length}"
        )
    if not store.complete:
        raise RunError(f"dataset={cfg.dataset!r}: the store holds no complete shard yet")
    return store


def build_data(cfg: TrainConfig, tokenizer, acc) -> BlockDataset:
    """Token blocks of the configured dataset (built once by the main process if missing), or
    the complete rows of a `store:PATH` dataset in their build order."""
    store = open_store(cfg)
    if store is not None:
        ids, mask = store.token_blocks()
        ids, mask = select_samples(ids, mask, cfg.max_samples, cfg.seed)
        return BlockDataset(ids, mask, cfg.seed)

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
