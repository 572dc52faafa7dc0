"""`TrainConfig`: one training run, from a YAML file plus `key=value` overrides. Validation only.

Every field carries a docstring (shown by `python train.py --help`). `load_config` reads the
YAML, applies overrides (`max_steps=50`, nested `loss.kl_weight=0.5`), rejects unknown keys
with the list of known ones and checks each value's type; `__post_init__` checks ranges and
choices, naming the field and the allowed values. `TargetConfig` and `LossConfig` fields are
nested under `target:` and `loss:` and validated by those classes.
"""

from __future__ import annotations

import difflib
import math
import types
import typing
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from sparsekv.configfile import read_yaml_mapping
from train.overrides import apply_overrides

LOG_WITH = ("auto", "tensorboard", "none")
PACKING = ("pack", "pad", "fill")
HEAD_KINDS = ("mlp", "linear", "kvzap")
DTYPES = ("float32", "bfloat16", "float16")
ATTN = ("sdpa", "eager")
TINY_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")
DEFAULT_DATASET = "data/train.jsonl"


@dataclass
class TrainConfig:
    """A training run of the gating head on a frozen causal LM (see configs/train/*.yaml)."""

    # ------------------------------------------------------------------ run
    run_name: str | None = None
    """Name of the run (tracker name, Hub card); default: the config file's name without .yaml."""
    output_dir: str | None = None
    """Run folder for config.yaml, metrics.jsonl, step-N/ and final/; default checkpoints/<run_name>."""
    seed: int = 0
    """Seed for the head's initialization, the data order, tiny models and every RNG."""
    cpu: bool = False
    """Run on the CPU even where a GPU is present; multi-process runs then use DDP over gloo
    (without a GPU that happens anyway). Leave it false under an accelerate config that names
    DeepSpeed (an error: it would drop DeepSpeed); configs/accelerate/deepspeed_zero2_cpu.yaml
    runs DeepSpeed on a CPU machine by itself."""
    num_threads: int | None = None
    """CPU threads per process for torch (torch.set_num_threads); None = torch's default. 1 is
    fastest for tiny models and on busy machines, where extra threads spin-wait for each other."""
    # ------------------------------------------------------------------ model
    model: str = "default"
    """"default" (gemma-3-270m, offline), "tiny:<family>" (a tiny random model built in-process
    from the seed; family: llama, qwen2, qwen3, mistral, gemma3) or an HF folder / Hub id."""
    dtype: str = "float32"
    """dtype of the frozen base model: float32, bfloat16 or float16 (the head trains in float32
    unless the accelerate config sets mixed precision)."""
    attn_implementation: str = "sdpa"
    """Attention implementation of the base model: sdpa or eager."""
    # ------------------------------------------------------------------ head, target, loss
    layers: list[int] | None = None
    """Layers that get a gating head; default: the full-attention layers (all if none slide)."""
    head: str = "mlp"
    """Per-layer head: "mlp" (2-layer MLP), "linear" (both after a weightless RMSNorm) or "kvzap"
    (KVzap's Linear-GELU-Linear, no norm; see sparsekv.scoring.head)."""
    head_hidden: int = 64
    """Hidden width of the MLP head ("mlp" and "kvzap")."""
    target: dict = field(default_factory=dict)
    """Teacher target definition: fields of sparsekv.teacher.statistics.TargetConfig (empty = defaults)."""
    loss: dict = field(default_factory=dict)
    """Loss weights: fields of sparsekv.teacher.losses.LossConfig (empty = defaults)."""
    inference: dict = field(default_factory=dict)
    """The learned policy's defaults written into the adapter: `recency` (log-score bonus per
    1,000 positions, >= 0), `kernel_size` (odd max-pooling width of the head's scores), `blend`
    (weight of observed attention, [0, 1]), `blend_mode` (mix or max) and `head_layer` (own or
    first); see sparsekv.scoring.adapter.AdapterConfig. `uses` maps other uses ("agnostic", "decode") to
    their own settings (unset ones: the aware defaults). They do not change training."""
    teacher_block_size: int = 512
    """Queries per block when the teacher statistics are computed (memory O(block x seq))."""
    teacher_cache: str | None = None
    """Folder that keeps each example's teacher targets and head inputs after its first visit
    (safetensors, keyed by the example and the target config; see train/targets.py), so later
    epochs skip the teacher forward. None = compute them at every step."""
    # ------------------------------------------------------------------ data
    dataset: str = DEFAULT_DATASET
    """Local .jsonl/.json/.parquet file or folder, a saved `datasets` folder, or a `datasets`
    Hub name. A missing local .jsonl is built with data/build.py (see `build`). `store:PATH`
    trains from a teacher store (sparsekv.teacher.store, docs/teacher-store.md): its sequences,
    hidden states and teacher statistics are read from disk and the base model is never run; the
    store must match the model, `seq_len`, `layers` and the target's statistic settings (a
    difference is refused by name)."""
    dataset_config: str | None = None
    """Config name passed to datasets.load_dataset for Hub datasets."""
    dataset_split: str = "train"
    """Split to read from `datasets` datasets."""
    text_field: str = "text"
    """Column / JSON field holding the text."""
    build: dict = field(default_factory=dict)
    """Options of data/build.py's BuildConfig used when `dataset` is a missing .jsonl."""
    max_documents: int | None = None
    """Read at most this many documents (None = all)."""
    max_samples: int | None = None
    """Train on at most this many token blocks, drawn from all of them with the seed (None =
    all); an epoch is then max_samples samples (a small set visited for many epochs)."""
    seq_len: int = 512
    """Tokens per training sequence."""
    packing: str = "pack"
    """"pack": documents joined with EOS and cut into seq_len blocks (each opens with BOS);
    "pad": no sequence mixes documents; a long one continues in the next sequences and its last
    piece is right-padded, so a retrieval sample that fits one sequence is never cut apart;
    "fill": documents placed whole one after another, one that does not fit what is left of a
    sequence starting the next (so no sample that fits is cut, and sequences are not mostly
    padding where documents are short)."""
    batch_size: int = 1
    """Sequences per process per micro-step."""
    grad_accum: int = 1
    """Micro-steps per optimizer step."""
    # ------------------------------------------------------------------ optimization
    max_steps: int = 100
    """Optimizer steps to train for (a resumed run continues up to this step)."""
    lr: float = 1e-3
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 10
    """Linear warm-up steps from 0 to `lr`."""
    schedule_steps: int | None = None
    """Length of the cosine decay (warm-up included); None = max_steps. Fix it to extend a run
    with a larger max_steps without changing the learning rate of the steps already taken."""
    min_lr_ratio: float = 0.1
    """The cosine decays to lr * min_lr_ratio, then stays there."""
    grad_clip: float | None = 1.0
    """Clip the gradient norm to this value (None = no clipping). Under DeepSpeed the accelerate
    config's gradient_clipping applies instead."""
    # ------------------------------------------------------------------ logging, checkpoints
    log_every: int = 1
    """Write metrics every this many steps."""
    log_with: str = "auto"
    """Trackers besides metrics.jsonl: "auto" (TensorBoard if installed), "tensorboard", "none"."""
    progress_bar: bool = True
    """Show a tqdm progress bar (loss, tokens/s) on the main process."""
    save_every: int = 50
    """Write step-N/ every this many steps (0 = only final/)."""
    keep_last: int | None = 3
    """Keep only the newest this many step-N/ folders (None = keep all)."""
    resume: str = "auto"
    """"auto" (continue from the newest complete step-N/ in output_dir, else start fresh),
    "never" (start fresh; fails if output_dir already holds checkpoints) or a step-N/ path."""
    push_to_hub: str | None = None
    """Hub repo id (user/name) that receives the final adapter."""
    hub_private: bool = False
    """Create the Hub repo as private."""
    # ------------------------------------------------------------------ LoRA co-adaptation
    lora: dict = field(default_factory=dict)
    """Optional LoRA on the frozen model's attention projections, trained by KL distillation so
    the model reading its compressed cache matches the full cache: fields of
    train.lora.LoraTrainConfig (r, alpha, target_modules, layers, budget, steps, lr, context_len,
    continuation_len, adapter, ...). Empty = no LoRA. Saved in final/lora/ (a PEFT folder)."""

    def __post_init__(self) -> None:
        _choice("dtype", self.dtype, DTYPES)
        _choice("attn_implementation", self.attn_implementation, ATTN)
        _choice("head", self.head, HEAD_KINDS)
        _choice("packing", self.packing, PACKING)
        _choice("log_with", self.log_with, LOG_WITH)
        if self.model.startswith("tiny:"):
            _choice("model", self.model, tuple(f"tiny:{f}" for f in TINY_FAMILIES) + ("default",))
        if isinstance(self.seq_len, int) and not isinstance(self.seq_len, bool) and self.seq_len == 1:
            raise ValueError("seq_len=1 must be >= 2 (each sequence opens with BOS and needs at "
                             "least one token after it)")
        for name in (
            "head_hidden",
            "teacher_block_size",
            "seq_len",
            "batch_size",
            "grad_accum",
            "max_steps",
            "log_every",
        ):
            _at_least(name, getattr(self, name), 1)
        for name in ("seed", "warmup_steps", "save_every"):
            _at_least(name, getattr(self, name), 0)
        for name in ("keep_last", "schedule_steps", "max_documents", "max_samples", "num_threads"):
            if getattr(self, name) is not None:
                _at_least(name, getattr(self, name), 1)
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr!r} must be > 0")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay!r} must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio!r} must be in [0, 1]")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"grad_clip={self.grad_clip!r} must be > 0 or null")
        if self.layers is not None and (not self.layers or min(self.layers) < 0):
            raise ValueError(
                f"layers={self.layers!r} must be null or a non-empty list of ints >= 0"
            )
        if self.dataset.startswith("store:"):
            if not self.dataset[len("store:"):]:
                raise ValueError("dataset='store:' needs a folder: dataset=store:PATH")
            if self.teacher_cache is not None:
                raise ValueError(
                    "teacher_cache is for datasets of text; a store:PATH dataset already holds "
                    "the teacher's results: leave teacher_cache null"
                )
            if self.lora:
                raise ValueError(
                    "lora: the LoRA co-adaptation reads text; a store:PATH dataset holds token "
                    "blocks only: train the LoRA with lora.adapter=DIR and a text dataset"
                )
        if self.schedule_steps is not None and self.schedule_steps <= self.warmup_steps:
            raise ValueError(
                f"schedule_steps={self.schedule_steps} must be above warmup_steps="
                f"{self.warmup_steps}: the schedule warms up for warmup_steps, then its cosine "
                "reaches the floor at schedule_steps"
            )
        if self.warmup_steps > self.max_steps and self.schedule_steps is None:
            warnings.warn(
                f"warmup_steps={self.warmup_steps} is more than max_steps={self.max_steps}: the "
                f"run ends at {self.max_steps / self.warmup_steps:.0%} of its peak learning rate "
                "(lr) without reaching it; lower warmup_steps to reach it",
                UserWarning,
                stacklevel=3,
            )
        if self.run_name is not None and (
            Path(self.run_name).is_absolute() or ".." in Path(self.run_name).parts
        ):
            raise ValueError(
                f"run_name={self.run_name!r} must be a name inside checkpoints/ (no absolute path, "
                "no '..'); to write elsewhere set output_dir=PATH"
            )
        if self.teacher_cache is not None and Path(self.teacher_cache).is_file():
            raise ValueError(
                f"teacher_cache={self.teacher_cache!r} is a file; it must name a folder (created "
                "if missing) where teacher targets are cached, or be null"
            )
        if self.output_dir is not None and not str(self.output_dir).strip():
            raise ValueError(
                f"output_dir={self.output_dir!r} is empty (an unset shell variable?); give a "
                "folder, or leave it out for checkpoints/<run_name>"
            )
        if self.push_to_hub is not None and self.push_to_hub.count("/") != 1:
            raise ValueError(f"push_to_hub={self.push_to_hub!r} must be a repo id 'user/name'")
        self._check_nested()

    def _check_nested(self) -> None:
        """Build the nested configs once so that their own validation runs now."""
        self.target_config()
        self.loss_config()
        self.inference_kwargs()
        self.lora_config()
        if self.build:
            self.build_config()

    def target_config(self):
        from sparsekv.teacher.statistics import TargetConfig

        return _nested("target", TargetConfig, self.target)

    def inference_kwargs(self) -> dict[str, Any]:
        """`inference` checked against the adapter's policy defaults (AdapterConfig fields)."""
        from sparsekv.scoring.adapter import POLICY_DEFAULTS

        if not isinstance(self.inference, dict):
            raise ValueError(f"inference={self.inference!r} must be a mapping with keys {', '.join(POLICY_DEFAULTS)}")
        bad = sorted(set(self.inference) - set(POLICY_DEFAULTS) - {"uses"})
        if bad:
            allowed = ", ".join([*POLICY_DEFAULTS, "uses"])
            raise ValueError(f"inference has unknown key(s) {bad}; allowed: {allowed}")
        self.inference_uses()  # checks the aware settings too
        return {k: v for k, v in self.inference.items() if k != "uses"}

    def inference_uses(self) -> dict[str, dict[str, Any]]:
        """`inference.uses`: use name ("agnostic", "decode") -> the learned policy's settings that
        the adapter records for that use (unset ones take the aware defaults above); empty = the
        adapter's own defaults for those uses (see sparsekv.scoring.files)."""
        from sparsekv.policies.learned import check_settings
        from sparsekv.scoring.adapter import POLICY_DEFAULTS, AdapterConfig
        from sparsekv.scoring.adapter_config import check_uses

        defaults = {f.name: f.default for f in fields(AdapterConfig) if f.name in POLICY_DEFAULTS}
        aware = {k: v for k, v in self.inference.items() if k != "uses"}
        try:
            aware = check_settings(**{**defaults, **aware})
        except ValueError as e:
            raise ValueError(f"inference.{e}") from None
        uses = check_uses(self.inference.get("uses") or {}, aware, name="inference.uses")
        return {use: {**aware, **settings} for use, settings in uses.items()}

    def lora_config(self):
        """The `lora:` section as a `train.lora.LoraTrainConfig`, or None when it is empty."""
        if not self.lora:
            return None
        from train.lora_config import LoraTrainConfig

        return _nested("lora", LoraTrainConfig, self.lora)

    def loss_config(self):
        from sparsekv.teacher.losses import LossConfig

        return _nested("loss", LossConfig, self.loss)

    def build_config(self):
        from data.build import BuildConfig

        return _nested("build", BuildConfig, self.build)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir or Path("checkpoints") / (self.run_name or "run"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        known = [f.name for f in fields(cls)]
        for key in d:
            if key not in known:
                raise ValueError(_unknown(key, known))
        hints = typing.get_type_hints(cls)
        return cls(**{k: _coerce(k, v, hints[k]) for k, v in d.items()})


# ---------------------------------------------------------------------- validation helpers


def _choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed values: {', '.join(allowed)}")


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"{name}={value!r} must be an int >= {low}")


def _unknown(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown config key {key!r}{hint}; known keys: {', '.join(known)}"


def _nested(name: str, cls: type, values: dict):
    known = [f.name for f in fields(cls)]
    for key in values:
        if key not in known:
            raise ValueError(_unknown(f"{name}.{key}", [f"{name}.{k}" for k in known]))
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: {e}") from None


_TYPE_WORDS = {
    int: "an int",
    float: "a number",
    str: "a string",
    bool: "true or false",
    dict: "a mapping",
}


def _type_name(tp: Any) -> str:
    return _TYPE_WORDS.get(tp, getattr(tp, "__name__", str(tp)))


def _coerce(name: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotation `tp` (int, float, str, bool, dict, list[int], X | None)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or value in ("none", "None")):
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(name, value, inner[0])
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
        dict: isinstance(value, dict),
    }
    if origin is list:
        if isinstance(value, list):
            return [_coerce(f"{name}[{i}]", v, args[0]) for i, v in enumerate(value)]
        raise ValueError(f"{name}={value!r} must be a list of {_type_name(args[0])}s")
    if not ok.get(tp, True):
        raise ValueError(f"{name}={value!r} must be {_type_name(tp)}")
    if tp is float and not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number")
    return float(value) if tp is float else value


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """Read a YAML config (or defaults when `path` is None) and apply overrides.

    Values that may be None also accept "none" (`keep_last: none`, `push_to_hub=none`).
    """
    d: dict[str, Any] = {}
    if path is not None:
        d = read_yaml_mapping(path, "--config")
        if not d:  # a run without settings would silently train the defaults
            raise ValueError(
                f"--config {str(path)!r} holds no settings (empty, or comments only); give at "
                "least the key model and dataset (see configs/train/tiny-cpu.yaml)"
            )
    d = apply_overrides(d, list(overrides))
    if d.get("run_name") is None:
        d["run_name"] = Path(path).stem if path is not None else "run"
    return TrainConfig.from_dict(d)


def dump_yaml(cfg: TrainConfig, header: str = "") -> str:
    """The resolved config as YAML (keys in field order), with an optional comment header."""
    body = yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=None)
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    return "\n".join(lines + [body]) if lines else body
