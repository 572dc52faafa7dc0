"""The run folder and what a run is built from: `RunError` (a setting that stops a run before it
trains: one line, exit status 2), the folder and resume checks, the data, a fresh adapter, the
LR schedule (linear warm-up, cosine to a floor that holds after `schedule_steps`).
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Any

from torch import nn

from train import checkpoint as ckpt
from train.config import TrainConfig, dump_yaml
from train.data import BlockDataset, config_texts, select_samples, tokenize_blocks


class RunError(ValueError):
    """A setting, or the state of the run folder, that stops a run before it trains (another
    model than the checkpoint's, DeepSpeed dropped by `cpu`, a damaged metrics log): `train.py`
    prints it without a traceback and exits with status 2."""


def lr_schedule(optimizer, warmup: int, total: int, min_ratio: float):
    """The LR schedule of a run: transformers' `get_cosine_with_min_lr_schedule_with_warmup`
    (linear warm-up, cosine from the peak down to `min_ratio` at `total`), read so that the
    0-based step `s` trains at
      (s + 1) / warmup during warm-up (the first step at lr / warmup, step warmup - 1 at the
      peak), transformers' value at step s from `warmup` to `total`, `min_ratio` after `total`.
    transformers' own indexing would train step 0 at lr 0 with every warm-up step one behind,
    and rise again after `total`, where `schedule_steps` needs the floor to hold (a run extended
    past it); the shipped recipes' learning rates, hence their results, stay as trained.
    Returns a `torch.optim.lr_scheduler.LambdaLR`."""
    from torch.optim.lr_scheduler import LambdaLR
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    # a cosine of at least one step (a run shorter than its warm-up drops to the floor after it)
    end = max(total, warmup + 1)
    lrs = [g["lr"] for g in optimizer.param_groups]
    theirs = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, warmup, end, min_lr_rate=min_ratio
    ).lr_lambdas[0]
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        g["lr"] = lr  # as it was before transformers' scheduler set its step 0
    return LambdaLR(optimizer, partial(_at_step, theirs, warmup, end))


def _at_step(theirs, warmup: int, end: int, step: int) -> float:
    return theirs(step + 1 if step < warmup else min(step, end))


def prepare_run_dir(cfg: TrainConfig, acc) -> None:
    """Create the run folder and save the resolved config beside the checkpoints."""
    run_dir = cfg.run_dir
    for folder in (run_dir, *run_dir.parents):  # the first that exists must be a folder
        if folder.exists():
            if not folder.is_dir():
                where = "is" if folder == run_dir else f"lies under {str(folder)!r}, which is"
                raise RunError(
                    f"output_dir={str(run_dir)!r} {where} a file, not a folder; choose a new "
                    "folder or a run folder for output_dir"
                )
            break
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
    """Resuming a checkpoint trained on another base model or another head (`head`,
    `head_hidden`) is an error, and so is a damaged trainer_state.json: raised before anything
    is written or loaded (the head would not fit the model or the saved weights)."""
    path = resume_path(cfg)
    if path is None:
        return
    if not (path / ckpt.TRAINER_STATE).is_file():
        if cfg.resume == "auto":  # ckpt.latest only returns complete folders
            return
        raise RunError(
            f"resume={cfg.resume!r}: {path} is not a complete step-N checkpoint (no "
            f"{ckpt.TRAINER_STATE}); allowed: auto, never or a step-N folder of a run"
        )
    saved = read_trainer_state(path)
    was = saved.get("config", {})
    keys = ["model", "head"] + (["head_hidden"] if cfg.head != "linear" else [])
    for key in keys:  # "linear" has no hidden layer: its width changes nothing
        before, now = was.get(key), getattr(cfg, key)
        if before is not None and before != now:
            raise RunError(
                f"resume: {path} was trained with {key}={before!r} but this run has "
                f"{key}={now!r}; resume with {key}={before!r}, or start a new run (another "
                "output_dir, or resume=never in an empty one)"
            )


def read_trainer_state(path: Path) -> dict[str, Any]:
    """`path`/trainer_state.json, checked: a JSON object with int `step`, `samples_seen` and
    `tokens_seen`; anything else is a `RunError` naming the file."""
    file = path / ckpt.TRAINER_STATE
    older = [str(p) for _, p in ckpt.step_dirs(path.parent) if p != path]
    hint = f"resume={older[-1]} (the newest other checkpoint)" if older else "resume=never"
    try:
        state = ckpt.read_json(file)
    except ValueError as e:
        raise RunError(f"resume: damaged checkpoint: {e}; resume with {hint}") from None
    bad = (
        ["(not a JSON object)"]
        if not isinstance(state, dict)
        else [k for k in ("step", "samples_seen", "tokens_seen")
              if isinstance(state.get(k), bool) or not isinstance(state.get(k), int)]
    )
    if bad or not isinstance(state.get("config", {}), dict):
        what = ", ".join(bad) or "config"
        raise RunError(f"resume: {file} is damaged (no valid {what}); resume with {hint}")
    return state


def check_layers(cfg: TrainConfig, model: nn.Module) -> None:
    """`layers` must be full-attention layers of `model`: the cache budgets only those (a
    sliding-window layer keeps its window), so a head on a sliding layer trains and then fails
    at generate. A `RunError` names the sliding and the allowed layers."""
    if cfg.layers is None:
        return
    from sparsekv.models.families import model_shape

    shape = model_shape(model)
    full = shape.full_layers
    sliding = [i for i in range(shape.num_layers) if i not in full]
    outside = [i for i in cfg.layers if i >= shape.num_layers]
    slid = [i for i in cfg.layers if i in sliding]
    if outside or slid:
        what = (
            f"names layer(s) {outside} but model={cfg.model!r} has {shape.num_layers} layers"
            if outside
            else f"names sliding-window layer(s) {slid} of model={cfg.model!r} (its sliding "
            f"layers: {sliding}), which the cache never budgets"
        )
        raise RunError(
            f"layers={cfg.layers} {what}; allowed: the full-attention layers {full} (any of "
            "them, or layers=null for all)"
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

    name = f"dataset={cfg.dataset!r}"
    try:
        with acc.main_process_first():
            texts = config_texts(cfg, build=acc.is_main_process)
        warn = partial(print, "warning:", file=sys.stderr) if acc.is_main_process else None
        ids, mask = tokenize_blocks(tokenizer, texts, cfg.seq_len, cfg.packing, name, warn)
    except (ValueError, OSError) as e:  # each names its file, line or the dataset
        named = "dataset=" in str(e) or str(Path(cfg.dataset)) in str(e)
        raise RunError(str(e) if named else f"{name}: {e}") from None
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
