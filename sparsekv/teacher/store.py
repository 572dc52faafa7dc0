"""The teacher store: compute the frozen model's side of training once, train many heads from it.

A store is a folder of shards, each holding, for `shard_size` token sequences of one length,
everything a head's training step reads from the frozen model:

- `input_ids`, `attention_mask` `(rows, length)` int64 / uint8 (which sequences these are);
- `hidden.<l>` `(rows, length, hidden)`: the self_attn inputs of each of the head's input layers
  `l`, in bfloat16 (default), int8 with one float32 scale per token (`hidden_scale.<l>` `(rows,
  length)`, absmax / 127) or the model's own dtype ("model");
- the raw teacher statistics every recipe combines its target from, per layer, `(rows, kv_heads,
  length)` float32, 0 on padding: `questions.<l>` (attention received from the sequence's own
  later queries, `sparsekv.teacher.statistics.attention_received`), `reconstruction.<l>` (from the
  queries of a teacher-forced repeat of the sequence) and `kvzip_plus.<l>` (KVzap's statistic on
  that pass, before its log; see `sparsekv.teacher.reconstruction`). One pass over
  `sequence + repeat prompt + copy` per row gives all three (and the hidden states, read at
  positions < m, where causal attention makes them exactly a forward over the sequence alone).

What is stored is fixed by the *statistic* settings (`stat`, `normalize`, `exclude_self`,
`min_distance`: they change the per-layer numbers); how layers, heads and signals are mixed
(`decay`, `cross_layer`, `source_layers`, `cross_head`, `signal`, `reconstruction_weight`,
`kind`) is applied when a row is read (`combine_targets`, the formulas of
`training_targets`), so one store serves every mix of targets.

Files. `store.json` (written once, atomically) holds the settings: the model (`model_identity`:
base id, shape, dtype and `sparsekv.cache.state.model_fingerprint`), the text (whatever the
builder passes: dataset, build options, packing, length, and a digest of every token block), the
statistic settings, the layers of each statistic, the repeat prompt's ids, the head's input
layers, the hidden dtype and the shard size; their sha256 is the store's fingerprint. Shard `s`
(`shard-00000.safetensors`, ...) holds rows `s * shard_size ..` of the build order and is written
with `sparsekv.io.atomic_path`, so a kill loses at most the shard being written. Its metadata
carries the store fingerprint, its first row, the sha256 of each row's bytes (all of its tensors'
slices, in name order) and a shard checksum (the sha256 of those). A shard that does not parse,
belongs to another fingerprint or holds fewer rows than it should is incomplete: `build(resume=
True)` rebuilds it, readers skip it with a warning. A row whose bytes do not match its checksum is
refused (`StoreError`) when it is read; `verify()` reads them all.

Opening a store for training (`TeacherStore.check`) compares its settings with the run's (model,
length, statistic settings, layers) and refuses a difference by name (`model.fingerprint`,
`target.stat`, ...). Training from a store (`dataset: store:PATH` in a training config) never
runs the base model: `StoreTeacher` reads each row's tensors and combines its target.

Command line (reads a training config; the text is that config's dataset, built if missing):

    python -m sparsekv.teacher.store build --config configs/train/gemma3-270m-store.yaml \\
        --out stores/gemma3-270m-2k --sequences 2500 --length 2048 --resume
    python -m sparsekv.teacher.store info stores/gemma3-270m-2k
    python -m sparsekv.teacher.store verify stores/gemma3-270m-2k
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sparsekv.io import atomic_path, write_atomic

FORMAT = 1
STORE_FILE = "store.json"
SIGNALS = ("questions", "reconstruction", "kvzip_plus")
HIDDEN_DTYPES = ("bfloat16", "int8", "model")
STAT_FIELDS = ("stat", "normalize", "exclude_self", "min_distance")
DATASET_PREFIX = "store:"

__all__ = [
    "StoreError",
    "StoreSpec",
    "StoreTeacher",
    "TeacherStore",
    "build_store",
    "combine_targets",
    "compute_row",
    "model_identity",
    "target_settings",
]


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
    return sha256_of(
        _bytes(input_ids.to(torch.int64)), _bytes(attention_mask.to(torch.int64))
    )


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
) -> dict[str, Any]:
    """The statistic settings a store is built with, from a `TargetConfig`: its `STAT_FIELDS`,
    the `signals` stored, the layers of each (questions: `question_layers`, default every
    full-attention layer plus whatever `target` reads; reconstruction: every full-attention layer;
    kvzip_plus: the head's `layers`) and the repeat prompt's ids (None for questions only)."""
    from sparsekv.teacher.statistics import source_layers

    bad = [s for s in signals if s not in SIGNALS]
    if bad or not signals:
        raise ValueError(f"signals={list(signals)!r} must be a non-empty list of: {', '.join(SIGNALS)}")
    full = [i for i, t in enumerate(layer_types) if t == "full_attention"] or list(
        range(len(layer_types))
    )
    if question_layers is None:
        needed = {s for i in layers for s in source_layers(i, target, layer_types)}
        question_layers = sorted(set(full) | needed)
    repeat = any(s != "questions" for s in signals)
    if repeat and not repeat_prompt_ids:
        raise ValueError("the reconstruction and kvzip_plus signals need repeat_prompt_ids")
    sliding = [i for i in layers if layer_types[i] != "full_attention"]
    if repeat and sliding:
        raise ValueError(
            f"layers {sliding} slide: the repeat pass's signals are read on full-attention layers "
            "only; store signals=questions for them"
        )
    out: dict[str, Any] = {k: getattr(target, k) for k in STAT_FIELDS}
    out["signals"] = [s for s in SIGNALS if s in signals]
    out["question_layers"] = sorted(int(i) for i in question_layers) if "questions" in signals else []
    out["reconstruction_layers"] = full if "reconstruction" in signals else []
    out["kvzip_plus_layers"] = sorted(int(i) for i in layers) if "kvzip_plus" in signals else []
    out["repeat_prompt_ids"] = [int(t) for t in repeat_prompt_ids] if repeat else None
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


# ---------------------------------------------------------------------- computing one row


@torch.no_grad()
def repeat_received(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    hidden: torch.Tensor | None,
    o_weight: torch.Tensor | None,
    *,
    scaling: float,
    softcap: float | None = None,
    num_kv_groups: int,
    block_size: int = 512,
    stat: str = "mass",
    normalize: str = "none",
    reconstruction: bool = True,
    kvzip_plus: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The repeated copy's two statistics from one softmax per block: `(reconstruction,
    kvzip_plus)`, each `(batch, kv_heads, seq)` float32 or None when not asked for.

    Equal (to float rounding) to `attention_received(query, key, stat=stat, normalize=normalize,
    exclude_self=False, ...)` and `kvzip_plus_received(query, key, value, hidden, o_weight, ...)`
    of `sparsekv.teacher`, which compute the same logits and softmax once each: query `(batch,
    heads, q, head_dim)` are the copy's queries at positions `seq - q ..`, causal, no window, no
    padding. Extra memory O(batch x heads x block x seq)."""
    from sparsekv.teacher.reconstruction import _value_output_norms

    b, hq, q_len, d = query.shape
    _, hk, n, _ = key.shape
    g = num_kv_groups
    if hq != hk * g:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} do not match")
    offset = n - q_len
    dev = query.device
    out_r = torch.zeros(b, hk, n, dtype=torch.float32, device=dev) if reconstruction else None
    out_z = torch.zeros(b, hk, n, dtype=torch.float32, device=dev) if kvzip_plus else None
    per_query = normalize in ("length", "uniform") and stat == "mass"
    count = torch.zeros(n, dtype=torch.float32, device=dev) if reconstruction and per_query else None
    if kvzip_plus:
        wov = _value_output_norms(value, o_weight, g).view(b, hk, g, 1, n)
        inv_h = 1.0 / hidden.float().norm(dim=-1).clamp_min(1e-12)  # (b, q)
    kf = key.float()
    positions = torch.arange(n, device=dev)
    for s in range(0, q_len, block_size):
        e = min(s + block_size, q_len)
        hi = offset + e
        qpos = positions[offset + s : hi]
        allowed = positions[None, :hi] <= qpos[:, None]  # (B, K)
        qb = query[:, :, s:e].float().reshape(b, hk, g * (e - s), d)
        logits = torch.matmul(qb, kf[:, :, :hi].transpose(-1, -2)).mul_(scaling)
        logits = logits.view(b, hk, g, e - s, hi)
        if softcap is not None:
            logits.div_(softcap).tanh_().mul_(softcap)
        logits.masked_fill_(~allowed, torch.finfo(torch.float32).min)
        probs = torch.softmax(logits, dim=-1)
        del logits
        probs.masked_fill_(~allowed, 0.0)
        if kvzip_plus:
            z = probs * inv_h[:, None, None, s:e, None]
            z.mul_(wov[..., :hi])
            out_z[:, :, :hi] = torch.maximum(out_z[:, :, :hi], z.amax(dim=(2, 3)))
            del z
        if reconstruction:
            if normalize == "uniform":
                probs.mul_(allowed.sum(-1).to(torch.float32)[:, None])
            a = probs.sum(2)  # (b, hk, B, K)
            if stat == "mass":
                out_r[:, :, :hi] += a.sum(-2)
            else:
                out_r[:, :, :hi] = torch.maximum(out_r[:, :, :hi], a.amax(-2))
            if count is not None:
                count[:hi] += allowed.sum(0).to(torch.float32)
            del a
        del probs
    if count is not None:
        c = count.view(1, 1, n)
        out_r = torch.where(c > 0, out_r / c.clamp_min(1.0), torch.zeros_like(out_r))
    return out_r, out_z


@torch.no_grad()
def compute_row(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    settings: dict[str, Any],
    layers: Sequence[int],
    block_size: int = 512,
) -> dict[str, torch.Tensor]:
    """The stored tensors of one row: `(length,)` ids and mask in, name -> tensor out (statistics
    `(kv_heads, length)` float32 with 0 on padding, `hidden.<l>` `(length, hidden)` in the
    model's dtype). `settings` is `target_settings(...)`. One frozen forward: over the real tokens
    `c`, or over `c + repeat prompt + copy` when a repeat signal is stored."""
    from sparsekv.models.families import model_shape, text_config
    from sparsekv.teacher.forward import layer_scaling, teacher_forward
    from sparsekv.teacher.reconstruction import reconstruction_layout
    from sparsekv.teacher.statistics import attention_received

    shape = model_shape(model)
    n = input_ids.shape[-1]
    valid = attention_mask.to(torch.bool).cpu()
    context = input_ids.cpu()[valid].tolist()
    m = len(context)
    if m == 0:
        raise ValueError("a row without real tokens cannot be stored")
    q_layers = set(settings["question_layers"])
    r_layers = set(settings["reconstruction_layers"])
    z_layers = set(settings["kvzip_plus_layers"])
    if r_layers or z_layers:
        bos = getattr(text_config(model), "bos_token_id", None)
        ids, copy_start = reconstruction_layout(context, settings["repeat_prompt_ids"], bos)
    else:
        ids, copy_start = context, None
    got: dict[str, torch.Tensor] = {}

    def compute(module, layer, query, key, value, hidden, kwargs):
        common = {
            "scaling": layer_scaling(module, kwargs),
            "softcap": kwargs.get("softcap"),
            "num_kv_groups": query.shape[1] // key.shape[1],
            "block_size": block_size,
        }
        if layer in q_layers:
            got[f"questions.{layer}"] = attention_received(
                query[:, :, :m],
                key[:, :, :m],
                stat=settings["stat"],
                sliding_window=kwargs.get("sliding_window"),
                normalize=settings["normalize"],
                exclude_self=settings["exclude_self"],
                min_distance=settings["min_distance"],
                **common,
            )
        if layer in r_layers or layer in z_layers:  # one softmax serves both
            r, z = repeat_received(
                query[:, :, copy_start:],
                key,
                value,
                hidden[:, copy_start:],
                module.o_proj.weight,
                stat=settings["stat"],
                normalize=settings["normalize"],
                reconstruction=layer in r_layers,
                kvzip_plus=layer in z_layers,
                **common,
            )
            if r is not None:
                got[f"reconstruction.{layer}"] = r[..., :m]
            if z is not None:
                got[f"kvzip_plus.{layer}"] = z[..., :m]

    device = next(model.parameters()).device
    hidden = teacher_forward(
        model,
        torch.tensor([ids], dtype=torch.long, device=device),
        None,
        compute,
        layers=sorted(q_layers | r_layers | z_layers),
        hidden_layers=list(layers),
    )
    where = valid.nonzero().squeeze(-1)
    out: dict[str, torch.Tensor] = {
        "input_ids": input_ids.detach().to("cpu", torch.int64).clone(),
        "attention_mask": valid.to(torch.uint8),
    }
    for name, stat in got.items():
        full = torch.zeros(shape.num_kv_heads, n, dtype=torch.float32)
        full[:, where] = stat[0].float().cpu()
        out[name] = full
    for i in layers:
        h = hidden[i][0, :m].cpu()
        full = h.new_zeros(n, h.shape[-1])
        full[where] = h
        out[f"hidden.{i}"] = full
    return out


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


# ---------------------------------------------------------------------- targets from a row


def combine_targets(
    stats: dict[str, torch.Tensor],
    valid: torch.Tensor,
    target,
    layers: Sequence[int],
    layer_types: Sequence[str],
) -> dict[int, torch.Tensor]:
    """The training target of each of `layers` for one row, `(kv_heads, length)`, from its stored
    statistics (name -> `(kv_heads, length)`) and `(length,)` mask: exactly what
    `sparsekv.teacher.reconstruction.training_targets` computes from the model (distributions over
    the real tokens; kvzip_plus: log scores, 0 on padding)."""
    from sparsekv.teacher.statistics import cumulative_targets

    def group(prefix: str) -> dict[int, torch.Tensor]:
        return {
            int(k.split(".", 1)[1]): v[None].float()
            for k, v in stats.items()
            if k.startswith(prefix + ".")
        }

    valid = valid.to(torch.bool)
    if target.kind == "kvzip_plus":
        z = group("kvzip_plus")
        tiny = torch.finfo(torch.float32).tiny
        return {
            i: torch.where(valid, z[i][0].clamp_min(tiny).log(), torch.zeros_like(z[i][0]))
            for i in layers
        }
    if target.signal == "questions":
        t = cumulative_targets(group("questions"), layers, target, layer_types)
        return {i: t[i][0] for i in layers}
    r = cumulative_targets(group("reconstruction"), layers, target, layer_types, full_only=True)
    if target.signal == "both":
        w = target.reconstruction_weight
        q = cumulative_targets(group("questions"), layers, target, layer_types)
        r = {i: (1.0 - w) * q[i] + w * r[i] for i in layers}
    return {i: r[i][0] for i in layers}


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
    return need


# ---------------------------------------------------------------------- the folder


def _row_digests(tensors: dict[str, torch.Tensor], rows: int) -> list[str]:
    names = sorted(tensors)
    return [sha256_of(*(_bytes(tensors[k][r]) for k in names)) for r in range(rows)]


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


class TeacherStore:
    """A store folder opened for reading (and, by `build_store`, for writing).

    `spec` its `StoreSpec`; `complete` the indices of its complete shards (at opening);
    `rows()` the `(shard, row)` addresses of the complete rows in build order.
    """

    def __init__(self, path: str | Path, *, warn: Callable[[str], None] | None = None):
        self.path = Path(path)
        f = self.path / STORE_FILE
        if not f.is_file():
            raise StoreError(
                f"{self.path} is not a teacher store (no {STORE_FILE}); build one with "
                "python -m sparsekv.teacher.store build --config ... --out "
                f"{self.path}"
            )
        saved = json.loads(f.read_text(encoding="utf-8"))
        if saved.get("format") != FORMAT:
            raise StoreError(
                f"{f}: store format {saved.get('format')!r}; this sparsekv reads format {FORMAT}"
            )
        self.spec = StoreSpec(**{k: saved[k] for k in StoreSpec.__dataclass_fields__})
        self.fingerprint = self.spec.fingerprint
        if saved.get("fingerprint") not in (None, self.fingerprint):
            raise StoreError(f"{f}: its fingerprint does not match its settings (edited by hand?)")
        self._warn = warn or (lambda msg: print(f"[sparsekv] {msg}", file=sys.stderr))
        self._meta: dict[int, dict[str, Any]] = {}
        self._verified: set[tuple[int, int]] = set()
        self.complete = self._scan()
        self._index: dict[str, tuple[int, int]] | None = None

    # -------------------------------------------------------------- shards

    def shard_path(self, index: int) -> Path:
        return self.path / shard_name(index)

    def expected_rows(self, index: int, sequences: int | None = None) -> int:
        total = self.spec.text.get("sequences") if sequences is None else sequences
        start = index * self.spec.shard_size
        return max(0, min(self.spec.shard_size, int(total) - start))

    def shard_meta(self, index: int) -> dict[str, Any] | None:
        """The metadata of shard `index` when it is complete for this store, else None (a reason
        is kept in `self.last_problem`)."""
        from safetensors import safe_open

        p = self.shard_path(index)
        self.last_problem = None
        if not p.is_file():
            self.last_problem = "missing"
            return None
        try:
            with safe_open(str(p), "pt") as f:
                meta = f.metadata() or {}
                names = set(f.keys())
        except Exception as e:  # a torn file: safetensors raises its own error types
            self.last_problem = f"does not parse ({type(e).__name__}: {e})"
            return None
        if meta.get("fingerprint") != self.fingerprint:
            self.last_problem = "belongs to another store (fingerprint differs)"
            return None
        try:
            rows = json.loads(meta["rows_sha256"])
        except (KeyError, ValueError):
            self.last_problem = "has no row checksums"
            return None
        if sha256_of(*(r.encode() for r in rows)) != meta.get("sha256"):
            self.last_problem = "its shard checksum does not match its row checksums"
            return None
        if len(rows) != self.spec.shard_size and index != self._last_index():
            self.last_problem = f"holds {len(rows)} rows, not {self.spec.shard_size}"
            return None
        if "input_ids" not in names:
            self.last_problem = "holds no input_ids"
            return None
        return {"rows": rows, "names": sorted(names), "first": int(meta.get("first_row", -1))}

    def _last_index(self) -> int:
        total = int(self.spec.text.get("sequences", 0))
        return max(0, math.ceil(total / self.spec.shard_size) - 1)

    def _scan(self) -> list[int]:
        done = []
        for p in sorted(self.path.glob("shard-*.safetensors")):
            try:
                index = int(p.stem.split("-", 1)[1])
            except ValueError:
                continue
            meta = self.shard_meta(index)
            if meta is None:
                self._warn(f"{p} is incomplete and is skipped: it {self.last_problem}")
                continue
            self._meta[index] = meta
            done.append(index)
        return done

    def rows(self) -> list[tuple[int, int]]:
        return [(s, r) for s in self.complete for r in range(len(self._meta[s]["rows"]))]

    def __len__(self) -> int:
        return sum(len(self._meta[s]["rows"]) for s in self.complete)

    # -------------------------------------------------------------- reading

    def read_row(self, shard: int, row: int, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """The tensors of one row (`names`, default all), after checking the row's checksum the
        first time it is read (a mismatch raises `StoreError` naming the shard and the row)."""
        from safetensors import safe_open

        meta = self._meta.get(shard)
        if meta is None:
            raise StoreError(f"{self.shard_path(shard)} is not a complete shard of {self.path}")
        check = (shard, row) not in self._verified
        want = meta["names"] if check or names is None else list(names)
        with safe_open(str(self.shard_path(shard)), "pt") as f:
            tensors = {k: f.get_slice(k)[row : row + 1][0].clone() for k in want}
        if check:
            (digest,) = _row_digests({k: v[None] for k, v in tensors.items()}, 1)
            if digest != meta["rows"][row]:
                raise StoreError(
                    f"{self.shard_path(shard)}: row {row} does not match its checksum (stored "
                    f"{meta['rows'][row][:16]}..., read {digest[:16]}...): the file is damaged; "
                    f"delete it and rebuild with build --resume --out {self.path}"
                )
            self._verified.add((shard, row))
        if names is not None:
            tensors = {k: tensors[k] for k in names if k in tensors}
        return tensors

    def verify(self) -> int:
        """Read and check every row of every complete shard; returns the rows checked."""
        n = 0
        for s, r in self.rows():
            self._verified.discard((s, r))
            self.read_row(s, r, names=["input_ids"])
            n += 1
        return n

    def token_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(input_ids, attention_mask)` `(rows, length)` int64 of the complete rows, in order."""
        from safetensors import safe_open

        ids, mask = [], []
        for s in self.complete:
            with safe_open(str(self.shard_path(s)), "pt") as f:
                ids.append(f.get_tensor("input_ids").to(torch.int64))
                mask.append(f.get_tensor("attention_mask").to(torch.int64))
        if not ids:
            raise StoreError(f"{self.path} holds no complete shard yet")
        return torch.cat(ids), torch.cat(mask)

    def index(self) -> dict[str, tuple[int, int]]:
        """example key (`example_key`) -> `(shard, row)` of every complete row."""
        if self._index is None:
            ids, mask = self.token_blocks()
            self._index = {
                example_key(i, m): addr for i, m, addr in zip(ids, mask, self.rows())
            }
        return self._index

    # -------------------------------------------------------------- settings

    def check(self, wanted: dict[str, Any], what: str = "this run") -> None:
        """Refuse (`StoreError`) when the store's settings differ from `wanted` (a partial
        spec dict: `{"model": ..., "length": ..., "target": {...}}`), naming each setting.

        Layer lists in `wanted["target"]` and `wanted["layers"]` must be subsets of the store's."""
        stored = self.spec.to_dict()
        wanted = json.loads(json.dumps(wanted))  # tuples -> lists, as stored
        problems = []
        for key in ("layers",):
            if key in wanted:
                missing = sorted(set(wanted.pop(key)) - set(stored[key]))
                if missing:
                    problems.append(f"{key}: needs {missing}, the store has {stored[key]}")
        tgt = dict(wanted.pop("target", {}))
        for key in [k for k in tgt if k.endswith("_layers")]:
            missing = sorted(set(tgt.pop(key)) - set(stored["target"][key]))
            if missing:
                problems.append(
                    f"target.{key}: needs {missing}, the store has {stored['target'][key] or 'none'}"
                )
        if tgt:
            wanted["target"] = tgt
        flat = _flatten(stored)
        for name in differences(stored, wanted):
            have = flat.get(name, _MISSING)
            shown = "nothing" if have is _MISSING else _show(have)
            problems.append(f"{name}: the store has {shown}, {what} {_show(_flatten(wanted)[name])}")
        if problems:
            raise StoreError(
                f"the teacher store {self.path} was built with other settings than {what} uses; "
                "differs in " + "; ".join(problems)
            )

    def teacher(self, target, layers: Sequence[int]) -> StoreTeacher:
        return StoreTeacher(self, target, layers)

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.iterdir() if p.is_file())


class StoreTeacher:
    """`(model, input_ids, attention_mask) -> (targets, hidden)` read from a store, with the
    shapes of `train.targets.TeacherTargets` (layer -> `(batch, kv_heads, length)` float32 and
    layer -> `(batch, length, hidden)` float32); the model is not run (nor read)."""

    def __init__(self, store: TeacherStore, target, layers: Sequence[int]):
        self.store = store
        self.target = target
        self.layers = [int(i) for i in layers]
        self.layer_types = store.spec.model["shape"]["layer_types"]
        self.names = self._names()

    def _names(self) -> list[str]:
        need = needed_settings(self.target, self.layers, self.layer_types)
        names = ["attention_mask"]
        for key, prefix in (
            ("question_layers", "questions"),
            ("reconstruction_layers", "reconstruction"),
            ("kvzip_plus_layers", "kvzip_plus"),
        ):
            names += [f"{prefix}.{i}" for i in need.get(key, [])]
        for i in self.layers:
            names.append(f"hidden.{i}")
            if self.store.spec.hidden == "int8":
                names.append(f"hidden_scale.{i}")
        return names

    def row(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        key = example_key(input_ids, attention_mask)
        addr = self.store.index().get(key)
        if addr is None:
            raise StoreError(f"a training row is not in the teacher store {self.store.path}")
        t = self.store.read_row(*addr, names=self.names)
        stats = {k: v for k, v in t.items() if k.split(".")[0] in SIGNALS}
        targets = combine_targets(stats, t["attention_mask"], self.target, self.layers,
                                  self.layer_types)
        hidden = {i: decode_hidden(t, i) for i in self.layers}
        return targets, hidden

    def __call__(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        rows = [self.row(i, m) for i, m in zip(input_ids, attention_mask)]
        device = input_ids.device
        targets = {i: torch.stack([r[0][i] for r in rows]).to(device) for i in self.layers}
        hidden = {i: torch.stack([r[1][i] for r in rows]).to(device) for i in self.layers}
        return targets, hidden


# ---------------------------------------------------------------------- building


def _write_shard(path: Path, rows: list[dict[str, torch.Tensor]], spec: StoreSpec, first: int) -> None:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name in rows[0]:
        stacked = torch.stack([r[name] for r in rows])
        if name.startswith("hidden."):
            tensors.update(encode_hidden(name, stacked, spec.hidden))
        else:
            tensors[name] = stacked
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    digests = _row_digests(tensors, len(rows))
    meta = {
        "fingerprint": spec.fingerprint,
        "first_row": str(first),
        "rows_sha256": json.dumps(digests),
        "sha256": sha256_of(*(d.encode() for d in digests)),
    }
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)


def _remove_leftovers(path: Path) -> int:
    """Temporary files of shard writes cut short by a kill (atomic_path's `.shard-*.tmp`)."""
    n = 0
    for p in path.glob(".shard-*.tmp"):
        p.unlink(missing_ok=True)
        n += 1
    return n


def build_store(
    path: str | Path,
    model: nn.Module,
    spec: StoreSpec,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    block_size: int = 512,
    resume: bool = False,
    progress: bool = True,
    compute: Callable[..., dict[str, torch.Tensor]] = compute_row,
) -> dict[str, Any]:
    """Build (or with `resume`, complete) the store at `path` for the first
    `spec.text["sequences"]` rows of `input_ids`, `attention_mask` `(blocks, length)`.

    A folder that already holds a store is refused unless `resume`; with `resume`, a store of
    other settings is refused by name (`StoreError`), complete shards are kept, and every other
    shard (missing, torn, short, of another fingerprint) is computed again. Returns a summary:
    sequences, new ones, seconds, bytes."""
    from tqdm.auto import tqdm

    path = Path(path)
    total = int(spec.text["sequences"])
    if input_ids.shape[0] < total:
        raise StoreError(
            f"the text yields {input_ids.shape[0]} sequences of {spec.length} tokens, not "
            f"{total}: ask for fewer, or build more text (the config's build section)"
        )
    if input_ids.shape[1] != spec.length:
        raise ValueError(f"token blocks of {input_ids.shape[1]} tokens; the spec says {spec.length}")
    meta_file = path / STORE_FILE
    if meta_file.is_file():
        if not resume:
            raise StoreError(f"{path} already holds a teacher store; pass --resume to continue it")
        old = TeacherStore(path, warn=lambda msg: None)
        settings = spec.to_dict()
        stored = old.spec.to_dict()
        # the number of sequences may grow: everything else must match
        settings["text"] = {k: v for k, v in settings["text"].items() if k != "sequences"}
        stored["text"] = {k: v for k, v in stored["text"].items() if k != "sequences"}
        names = differences(stored, settings)
        if names:
            flat_s, flat_w = _flatten(stored), _flatten(settings)
            raise StoreError(
                f"{path} holds a teacher store built with other settings; differs in "
                + "; ".join(
                    f"{n}: the store has {_show(flat_s.get(n))}, this build {_show(flat_w[n])}"
                    for n in names
                )
            )
    path.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(path)
    payload = {**spec.to_dict(), "fingerprint": spec.fingerprint}
    write_atomic(meta_file, json.dumps(payload, indent=1, sort_keys=True) + "\n")
    store = TeacherStore(path, warn=lambda msg: None)
    shards = math.ceil(total / spec.shard_size)
    done = {s for s in store.complete if len(store._meta[s]["rows"]) == store.expected_rows(s)}
    have = sum(store.expected_rows(s) for s in done)
    t0 = time.perf_counter()
    new = 0
    bar = tqdm(total=total, initial=have, unit="seq", desc=f"teacher store {path.name}",
               dynamic_ncols=True, disable=not progress, smoothing=0.05)
    layers = spec.layers
    for s in range(shards):
        if s in done:
            continue
        first = s * spec.shard_size
        rows = []
        for r in range(first, first + store.expected_rows(s)):
            rows.append(compute(model, input_ids[r], attention_mask[r], spec.target, layers,
                                block_size))
            bar.update(1)
            new += 1
        _write_shard(store.shard_path(s), rows, spec, first)
    bar.close()
    seconds = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    return {"sequences": total, "new": new, "seconds": seconds, "bytes": size,
            "path": str(path)}


# ---------------------------------------------------------------------- the command line


def store_dataset_path(dataset: str) -> str | None:
    """The store folder of a `dataset: store:PATH` training setting, else None."""
    return dataset[len(DATASET_PREFIX):] if dataset.startswith(DATASET_PREFIX) else None


def text_blocks(cfg, tokenizer, length: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """A training config's token blocks of `length` tokens (its dataset, built if missing, cut
    with its packing) and the text settings they come from."""
    from train.data import load_texts, tokenize_blocks

    def build(path: Path) -> None:
        from data.build import build_file

        build_file(path, cfg.build_config())

    texts = load_texts(cfg.dataset, cfg.text_field, cfg.dataset_split, cfg.dataset_config,
                       cfg.max_documents, build=build)
    ids, mask = tokenize_blocks(tokenizer, texts, length, cfg.packing)
    text = {
        "dataset": cfg.dataset,
        "build": cfg.build,
        "text_field": cfg.text_field,
        "dataset_split": cfg.dataset_split,
        "dataset_config": cfg.dataset_config,
        "max_documents": cfg.max_documents,
        "packing": cfg.packing,
        "blocks": int(ids.shape[0]),
        "digest": blocks_digest(ids, mask),
    }
    return ids, mask, text


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _cmd_build(args) -> int:
    from sparsekv.policies.reconstruction import REPEAT_PROMPT
    from sparsekv.teacher.statistics import default_layers
    from train.config import load_config
    from train.models import load_model

    t_start = time.perf_counter()
    cfg = load_config(args.config, args.overrides)
    threads = args.threads if args.threads is not None else cfg.num_threads
    if threads is not None:
        torch.set_num_threads(threads)
    if store_dataset_path(cfg.dataset) is not None:
        raise StoreError("--config names a store as its dataset: a store is built from text")
    model, tok, base_id = load_model(cfg.model, cfg.dtype, cfg.attn_implementation, cfg.seed)
    from sparsekv.models.families import model_shape

    shape = model_shape(model)
    layers = list(cfg.layers or default_layers(model))
    signals = args.signals.split(",")
    prompt = None
    if any(s != "questions" for s in signals):
        prompt = list(tok([REPEAT_PROMPT], add_special_tokens=False)["input_ids"][0])
    settings = target_settings(cfg.target_config(), shape.layer_types, layers, prompt, signals)
    ids, mask, text = text_blocks(cfg, tok, args.length)
    text["sequences"] = int(args.sequences)
    spec = StoreSpec(
        model=model_identity(model, base_id),
        text=text,
        target=settings,
        layers=layers,
        hidden=args.hidden,
        length=args.length,
        shard_size=args.shard_size,
    )
    print(
        f"teacher store {args.out}: {args.sequences} of {text['blocks']} sequences of "
        f"{args.length} tokens from {cfg.dataset}; model {base_id}; hidden states of layers "
        f"{layers} ({args.hidden}); signals {', '.join(settings['signals'])}; "
        f"{args.shard_size} sequences per shard",
        flush=True,
    )
    out = build_store(args.out, model, spec, ids, mask, block_size=cfg.teacher_block_size,
                      resume=args.resume, progress=not args.no_progress)
    rate = out["new"] / out["seconds"] * 3600 if out["new"] and out["seconds"] > 0 else 0.0
    total_s = time.perf_counter() - t_start
    print(
        f"done: {out['sequences']} sequences in {args.out} ({out['new']} built now in "
        f"{out['seconds'] / 60:.1f} min, {rate:.0f} sequences/hour; {total_s / 60:.1f} min with "
        f"loading); size {_human(out['bytes'])} ({out['bytes'] / max(1, out['sequences']) / 2**20:.1f} "
        "MiB per sequence)",
        flush=True,
    )
    return 0


def _cmd_info(args) -> int:
    store = TeacherStore(args.path)
    spec = store.spec
    print(json.dumps({
        "path": str(store.path),
        "fingerprint": store.fingerprint,
        "sequences_complete": len(store),
        "sequences_planned": spec.text.get("sequences"),
        "shards_complete": len(store.complete),
        "bytes": store.size_bytes(),
        "size": _human(store.size_bytes()),
        "model": {k: v for k, v in spec.model.items() if k != "shape"},
        "length": spec.length,
        "layers": spec.layers,
        "hidden": spec.hidden,
        "target": {k: v for k, v in spec.target.items() if k != "repeat_prompt_ids"},
        "text": {k: v for k, v in spec.text.items() if k != "build"},
    }, indent=1))
    return 0


def _cmd_verify(args) -> int:
    store = TeacherStore(args.path)
    n = store.verify()
    print(f"{store.path}: {n} rows in {len(store.complete)} shards match their checksums")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sparsekv.teacher.store",
                                description=__doc__.split("\n\n", 1)[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build or continue a store from a training config")
    b.add_argument("--config", required=True, help="training YAML (configs/train/<name>.yaml)")
    b.add_argument("--out", required=True, help="the store folder (kept out of git)")
    b.add_argument("--sequences", type=int, required=True, help="sequences to store")
    b.add_argument("--length", type=int, default=2048, help="tokens per sequence (default 2048)")
    b.add_argument("--resume", action="store_true",
                   help="continue the store in --out (refused when its settings differ)")
    b.add_argument("--hidden", choices=HIDDEN_DTYPES, default="bfloat16",
                   help="dtype of the stored hidden states (default bfloat16; int8 = half)")
    b.add_argument("--signals", default=",".join(SIGNALS),
                   help=f"statistics to store, comma-separated (default {','.join(SIGNALS)})")
    b.add_argument("--shard-size", type=int, default=8, help="sequences per shard (default 8)")
    b.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: the config's num_threads)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument("overrides", nargs="*", metavar="key=value",
                   help="training config overrides (e.g. model=tiny:llama)")
    i = sub.add_parser("info", help="print a store's settings and size")
    i.add_argument("path")
    v = sub.add_parser("verify", help="check every stored row against its checksum")
    v.add_argument("path")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "build":
            if args.sequences < 1:
                raise StoreError(f"--sequences={args.sequences} must be >= 1")
            return _cmd_build(args)
        if args.command == "info":
            return _cmd_info(args)
        return _cmd_verify(args)
    except StoreError as e:
        print(f"sparsekv.teacher.store: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
