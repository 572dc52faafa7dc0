"""What a teacher store is on disk: its settings (`StoreSpec`, `target_settings`), digests and
shard names, how hidden states are encoded, and the statistic settings a training run needs
(`needed_settings`). See `sparsekv.teacher.store` for the whole picture; this module reads and
writes nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

FORMAT = 1
STORE_FILE = "store.json"
SIGNALS = ("questions", "reconstruction", "kvzip_plus", "probe")
PROBE_DEFAULTS = {"count": 8, "cue": 8, "answer": 16, "seed": 0, "sink": 4}
"""Probes per sequence, cue and answer tokens per probe, the span generator's seed, and the
positions at the start no span starts in (`sparsekv.teacher.probes`)."""
HIDDEN_DTYPES = ("bfloat16", "int8", "model")
STAT_FIELDS = ("stat", "normalize", "exclude_self", "min_distance")
DATASET_PREFIX = "store:"


class StoreError(ValueError):
    """A store that cannot serve this use: other settings (named), a damaged row, no rows."""


def sha256_of(*parts: bytes) -> str:
    """sha256 of `parts`, each prefixed by its length (so no two splits of the bytes collide)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()


def _bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def example_key(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> str:
    """sha256 of one row's `(length,)` token ids and mask (as int64), the row's address."""
    ids = input_ids.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
    mask = attention_mask.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
    return sha256_of(ids, mask)


def blocks_digest(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> str:
    """sha256 of every `(num_blocks, length)` token block and mask, in order: the text's identity."""
    return sha256_of(_bytes(input_ids.to(torch.int64)), _bytes(attention_mask.to(torch.int64)))


def model_identity(model: nn.Module, base_id: str) -> dict[str, Any]:
    """What identifies the frozen model: its id, shape, dtype and `model_fingerprint` (a digest of
    the first budgeted layer's key and value projections: tiny random models share an id and a
    shape but not their weights)."""
    from sparsekv.cache.state import model_fingerprint
    from sparsekv.models.families import model_shape

    return {
        "base_id": base_id,
        "shape": model_shape(model).to_dict(),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "fingerprint": model_fingerprint(model),
    }


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): d}


def differences(stored: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """The dotted names (`model.fingerprint`, `target.stat`) whose value in `wanted` differs from
    `stored` (names `wanted` lacks are not compared)."""
    s, w = _flatten(stored), _flatten(wanted)
    names = sorted(k for k in w if s.get(k, _MISSING) != w[k])
    # a whole sub-mapping that is missing shows up as its leaves; keep the names short
    return names


_MISSING = object()


def _show(v: Any) -> str:
    text = json.dumps(v) if not isinstance(v, str) else repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def target_settings(
    target,
    layer_types: Sequence[str],
    layers: Sequence[int],
    repeat_prompt_ids: Sequence[int] | None,
    signals: Sequence[str] = SIGNALS,
    question_layers: Sequence[int] | None = None,
    probe_prompt_ids: Sequence[Sequence[int]] | None = None,
    probe: dict[str, int] | None = None,
) -> dict[str, Any]:
    """The statistic settings a store is built with, from a `TargetConfig`: its `STAT_FIELDS`,
    the `signals` stored, the layers of each (questions: `question_layers`, default every
    full-attention layer plus whatever `target` reads; reconstruction: every full-attention layer;
    kvzip_plus: the head's `layers`; probe: every full-attention layer), the repeat prompt's ids
    (None for questions only) and, with the probe signal, `probe`: the tokenized recall prompts
    (`probe_prompt_ids`) and the `PROBE_DEFAULTS` settings (`probe` overrides them). A store
    without the probe signal has no probe keys at all (its fingerprint is what it was before the
    signal existed)."""
    from sparsekv.teacher.statistics import source_layers

    bad = [s for s in signals if s not in SIGNALS]
    if bad or not signals:
        raise ValueError(
            f"signals={list(signals)!r} must be a non-empty list of: {', '.join(SIGNALS)}"
        )
    full = [i for i, t in enumerate(layer_types) if t == "full_attention"] or list(
        range(len(layer_types))
    )
    if question_layers is None:
        needed = {s for i in layers for s in source_layers(i, target, layer_types)}
        question_layers = sorted(set(full) | needed)
    repeat = any(s in ("reconstruction", "kvzip_plus") for s in signals)
    if "probe" in signals and not probe_prompt_ids:
        raise ValueError("the probe signal needs probe_prompt_ids (the tokenized PROBE_PROMPTS)")
    if repeat and not repeat_prompt_ids:
        raise ValueError("the reconstruction and kvzip_plus signals need repeat_prompt_ids")
    sliding = [i for i in layers if layer_types[i] != "full_attention"]
    if (repeat or "probe" in signals) and sliding:
        raise ValueError(
            f"layers {sliding} slide: the repeat pass's and the probes' signals are read on "
            "full-attention layers only; store signals=questions for them"
        )
    out: dict[str, Any] = {k: getattr(target, k) for k in STAT_FIELDS}
    out["signals"] = [s for s in SIGNALS if s in signals]
    out["question_layers"] = (
        sorted(int(i) for i in question_layers) if "questions" in signals else []
    )
    out["reconstruction_layers"] = full if "reconstruction" in signals else []
    out["kvzip_plus_layers"] = sorted(int(i) for i in layers) if "kvzip_plus" in signals else []
    out["repeat_prompt_ids"] = [int(t) for t in repeat_prompt_ids] if repeat else None
    if "probe" in signals:
        settings = dict(PROBE_DEFAULTS)
        unknown = sorted(set(probe or {}) - set(PROBE_DEFAULTS))
        if unknown:
            raise ValueError(
                f"probe settings {unknown} are not known; allowed: {', '.join(PROBE_DEFAULTS)}"
            )
        settings.update(probe or {})
        for k, v in settings.items():
            if (
                isinstance(v, bool)
                or not isinstance(v, int)
                or v < (0 if k in ("seed", "sink") else 1)
            ):
                raise ValueError(
                    f"probe {k}={v!r} must be an int >= {0 if k in ('seed', 'sink') else 1}"
                )
        out["probe_layers"] = full
        out["probe"] = {**settings, "prompt_ids": [[int(t) for t in p] for p in probe_prompt_ids]}
    return out


@dataclass
class StoreSpec:
    """Everything a store's contents depend on (saved as `store.json`; see the module docstring)."""

    model: dict
    text: dict
    target: dict
    layers: list[int]
    hidden: str = "bfloat16"
    length: int = 2048
    shard_size: int = 8
    format: int = FORMAT

    def __post_init__(self) -> None:
        if self.hidden not in HIDDEN_DTYPES:
            raise ValueError(
                f"hidden={self.hidden!r} is not supported; allowed values: {', '.join(HIDDEN_DTYPES)}"
            )
        for name in ("length", "shard_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def fingerprint(self) -> str:
        """sha256 of the settings, the number of sequences left out (a store may grow)."""
        d = self.to_dict()
        d["text"] = {k: v for k, v in d["text"].items() if k != "sequences"}
        return sha256_of(json.dumps(d, sort_keys=True).encode())


def encode_hidden(name: str, h: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
    """`hidden.<l>` `(..., hidden)` as stored: bfloat16, int8 + a float32 scale per token
    (`hidden_scale.<l>`, absmax / 127), or unchanged ("model")."""
    if kind == "model":
        return {name: h}
    if kind == "bfloat16":
        return {name: h.to(torch.bfloat16)}
    f = h.float()
    scale = f.abs().amax(-1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(f / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return {name: q, name.replace("hidden.", "hidden_scale.", 1): scale}


def decode_hidden(tensors: dict[str, torch.Tensor], layer: int) -> torch.Tensor:
    """The float32 hidden states of `layer` from stored tensors (any `HIDDEN_DTYPES`)."""
    h = tensors[f"hidden.{layer}"]
    scale = tensors.get(f"hidden_scale.{layer}")
    if scale is not None:
        return h.float() * scale[..., None]
    return h.float()


def needed_settings(target, layers: Sequence[int], layer_types: Sequence[str]) -> dict[str, Any]:
    """What a store must hold to train heads on `layers` with `target`: the statistic settings,
    and per signal the layers it is read on (compared with `TeacherStore.check`)."""
    from sparsekv.teacher.statistics import source_layers

    need: dict[str, Any] = {}
    if target.kind == "kvzip_plus":
        return {"kvzip_plus_layers": sorted(set(layers))}
    need.update({k: getattr(target, k) for k in STAT_FIELDS})
    if target.signal in ("questions", "both"):
        need["question_layers"] = sorted(
            {s for i in layers for s in source_layers(i, target, layer_types)}
        )
    if target.signal in ("reconstruction", "both"):
        need["reconstruction_layers"] = sorted(
            {s for i in layers for s in source_layers(i, target, layer_types, full_only=True)}
        )
    if target.probe_weight:
        need["probe_layers"] = sorted(
            {s for i in layers for s in source_layers(i, target, layer_types, full_only=True)}
        )
    return need


def _row_digests(tensors: dict[str, torch.Tensor], rows: int) -> list[str]:
    names = sorted(tensors)
    return [sha256_of(*(_bytes(tensors[k][r]) for k in names)) for r in range(rows)]


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"
