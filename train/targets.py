"""Teacher targets for training, computed once per example and cached on disk.

This module owns the on-disk cache of teacher results (`TargetCache`) and `TeacherTargets`, the
callable the training objective asks for `(targets, hidden)` of a micro-batch. The teacher forward
(and for reconstruction signals the repeat pass, about twice the tokens) is the expensive part of
a step; the head is tiny. With a cache folder, each example's targets and head inputs are written
after its first visit and read on every later epoch, so many epochs (KVzap trains ~15) cost about
one teacher pass per example.

One file per example: `<folder>/<fingerprint[:16]>/<example[:32]>.safetensors` holding
`target.<layer>` `(kv_heads, seq)` float32 and `hidden.<layer>` `(seq, hidden)` (the model's dtype)
for every budgeted layer, written atomically (temp file + rename). `example` is the sha256 of the
row's token ids and attention mask; `fingerprint` the sha256 of everything else the result
depends on: the target definition (`TargetConfig.to_dict()`), the budgeted layers, the repeat
prompt's ids, the model's identity (base id, shape, dtype and a digest of its first parameter
tensor) and this module's `FORMAT`. Changing any of them reads from another folder: nothing
stale is ever served. (`min_distance`, the decode-time option, is part of the target; its default
0 is left out of the key so that targets cached before the option existed are still found.) The teacher block size is left out (it changes nothing but rounding).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sparsekv.teacher.store import sha256_of

FORMAT = 1


class NonFiniteTeacher(ValueError):
    """Teacher targets or head inputs holding NaN or inf at a valid position: training on them
    would turn the head's weights into NaN. `what` ("targets" or "head inputs"), `layer`, and
    `rows`, the batch rows concerned; the trainer names the step and the samples."""

    def __init__(self, what: str, layer: int, rows: list[int]):
        self.what, self.layer, self.rows = what, layer, rows
        super().__init__(f"the teacher's {what} of layer {layer} hold NaN or inf in batch rows {rows}")


def check_finite(
    targets: dict[int, torch.Tensor],
    hidden: dict[int, torch.Tensor],
    attention_mask: torch.Tensor,
    layers: Sequence[int],
) -> None:
    """Raise `NonFiniteTeacher` for the first layer whose targets `(batch, kv_heads, seq)` or
    head inputs `(batch, seq, hidden)` are not finite where `attention_mask` `(batch, seq)` is set
    (padding is never trained on, whatever it holds)."""
    valid = attention_mask.bool()
    for i in layers:
        for what, t, where in (
            ("targets", targets[i], valid[:, None, :]),
            ("head inputs", hidden[i], valid[:, :, None]),
        ):
            bad = (~torch.isfinite(t) & where.to(t.device)).flatten(1).any(1)
            if bad.any():
                raise NonFiniteTeacher(what, i, bad.nonzero().flatten().tolist())


def model_identity(model: nn.Module, base_id: str) -> dict[str, Any]:
    """What identifies the frozen model for the cache: its id, shape, dtype and a digest of its
    first parameter tensor (tiny random models share an id but not their weights)."""
    from sparsekv.models.families import model_shape

    first = next(model.parameters()).detach().float().cpu().contiguous()
    return {
        "base_id": base_id,
        "shape": model_shape(model).to_dict(),
        "dtype": str(next(model.parameters()).dtype),
        "weights": sha256_of(first.numpy().tobytes()),
    }


class TargetCache:
    """Per-example teacher results under `folder`, keyed as the module docstring says.

    `hits` and `misses` count rows served from disk and rows computed since creation, `damaged`
    the files found damaged (and computed again).
    """

    def __init__(
        self,
        folder: str | Path,
        *,
        target: dict[str, Any],
        layers: Sequence[int],
        repeat_prompt_ids: Sequence[int] | None,
        model: dict[str, Any],
    ):
        self.layers = [int(i) for i in layers]
        target = dict(target)
        if target.get("min_distance") == 0:
            # the default: keyed as before the option existed (same targets, same folder)
            del target["min_distance"]
        spec = {
            "format": FORMAT,
            "target": target,
            "layers": self.layers,
            "repeat_prompt_ids": None if repeat_prompt_ids is None else list(repeat_prompt_ids),
            "model": model,
        }
        self.fingerprint = sha256_of(json.dumps(spec, sort_keys=True).encode())
        self.folder = Path(folder) / self.fingerprint[:16]
        self.hits = 0
        self.misses = 0
        self.damaged = 0

    @staticmethod
    def example_key(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> str:
        """sha256 of one row's `(seq,)` token ids and mask."""
        ids = input_ids.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
        mask = attention_mask.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
        return sha256_of(ids, mask)

    def path(self, key: str) -> Path:
        return self.folder / f"{key[:32]}.safetensors"

    def load(
        self, key: str, seq_len: int | None = None
    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]] | None:
        """`(targets, hidden)` of one row (layer -> `(kv_heads, seq)`, `(seq, hidden)`), or None
        when it is not cached. A damaged file (truncated, unreadable, another row's, a missing
        tensor, another `seq_len`) is reported once on stderr, counted in `damaged`, and read
        as a miss, so the row is computed again and its file rewritten."""
        from safetensors import SafetensorError, safe_open

        p = self.path(key)
        if not p.is_file():
            return None
        try:
            with safe_open(str(p), framework="pt") as f:
                meta = f.metadata() or {}
                t = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            return self._damaged(p, f"unreadable: {' '.join(str(e).split())}")
        if meta.get("fingerprint") != self.fingerprint or meta.get("example") != key:
            return self._damaged(p, "it was written for another row or target")
        names = [f"{kind}.{i}" for kind in ("target", "hidden") for i in self.layers]
        missing = [n for n in names if n not in t]
        if missing:
            return self._damaged(p, f"no tensor {missing[0]}")
        for n in names:
            dims, seq = (2, -1) if n.startswith("target") else (2, 0)
            if t[n].dim() != dims or (seq_len is not None and t[n].shape[seq] != seq_len):
                return self._damaged(p, f"{n} has shape {tuple(t[n].shape)}")
        return (
            {i: t[f"target.{i}"] for i in self.layers},
            {i: t[f"hidden.{i}"] for i in self.layers},
        )

    def _damaged(self, path: Path, why: str) -> None:
        self.damaged += 1
        print(
            f"warning: teacher_cache entry {path} is damaged ({why}); computing it again",
            file=sys.stderr,
        )
        return None

    def save(
        self, key: str, targets: dict[int, torch.Tensor], hidden: dict[int, torch.Tensor]
    ) -> None:
        """Write one row's results atomically (another process may write the same row: the last
        rename wins, with identical content)."""
        from safetensors.torch import save_file

        self.folder.mkdir(parents=True, exist_ok=True)
        tensors = {f"target.{i}": targets[i].detach().cpu().contiguous() for i in self.layers}
        tensors.update({f"hidden.{i}": hidden[i].detach().cpu().contiguous() for i in self.layers})
        from sparsekv.io import atomic_path

        with atomic_path(self.path(key)) as tmp:
            save_file(tensors, str(tmp), metadata={"fingerprint": self.fingerprint, "example": key})


class TeacherTargets:
    """`(model, input_ids, attention_mask) -> (targets, hidden)` for the budgeted `layers`,
    through `cache` when one is given.

    Shapes as `sparsekv.teacher.reconstruction.training_targets`: layer -> `(batch, kv_heads,
    seq)` and layer -> `(batch, seq, hidden)`. Rows found in the cache are read; the others are
    computed together in one call and written.
    """

    def __init__(
        self,
        target,
        layers: Sequence[int],
        block_size: int = 512,
        repeat_prompt_ids: Sequence[int] | None = None,
        cache: TargetCache | None = None,
    ):
        self.target = target
        self.layers = list(layers)
        self.block_size = block_size
        self.repeat_prompt_ids = None if repeat_prompt_ids is None else list(repeat_prompt_ids)
        self.cache = cache

    def compute(
        self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        from sparsekv.teacher.reconstruction import training_targets

        return training_targets(
            model,
            input_ids,
            attention_mask,
            self.target,
            self.layers,
            self.block_size,
            repeat_prompt_ids=self.repeat_prompt_ids,
        )

    def __call__(
        self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        if self.cache is None:
            return self.compute(model, input_ids, attention_mask)
        cache, device = self.cache, input_ids.device
        keys = [cache.example_key(i, m) for i, m in zip(input_ids, attention_mask)]
        rows: list[tuple[dict, dict] | None] = [cache.load(k, input_ids.shape[1]) for k in keys]
        todo = [r for r, got in enumerate(rows) if got is None]
        cache.hits += len(keys) - len(todo)
        cache.misses += len(todo)
        if todo:
            t, h = self.compute(model, input_ids[todo], attention_mask[todo])
            try:  # never cached: a later epoch would read them back
                check_finite(t, h, attention_mask[todo], self.layers)
            except NonFiniteTeacher as e:
                raise NonFiniteTeacher(e.what, e.layer, [todo[r] for r in e.rows]) from None
            for j, r in enumerate(todo):
                rows[r] = ({i: t[i][j] for i in self.layers}, {i: h[i][j] for i in self.layers})
                cache.save(keys[r], *rows[r])
        targets = {i: torch.stack([row[0][i].to(device) for row in rows]) for i in self.layers}
        hidden = {i: torch.stack([row[1][i].to(device) for row in rows]) for i in self.layers}
        return targets, hidden
