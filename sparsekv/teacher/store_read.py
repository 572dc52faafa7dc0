"""A teacher store opened for reading: its complete shards, rows checked against their
checksums, its settings compared with a run's (`TeacherStore`), and the teacher a training run
reads targets from (`StoreTeacher`).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from sparsekv.teacher.store_format import (
    _MISSING,
    DATASET_PREFIX,
    FORMAT,
    SIGNALS,
    STORE_FILE,
    StoreError,
    StoreSpec,
    _flatten,
    _row_digests,
    _show,
    decode_hidden,
    differences,
    example_key,
    needed_settings,
    sha256_of,
    shard_name,
)
from sparsekv.teacher.store_rows import combine_targets


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
        try:
            saved = json.loads(f.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise StoreError(
                f"{f}: not valid JSON ({e}); the store's settings are lost: rebuild it with "
                "python -m sparsekv.teacher.store build into a new folder"
            ) from None
        if not isinstance(saved, dict):
            raise StoreError(f"{f}: holds a JSON {type(saved).__name__}, not an object (the "
                             "store's settings as build writes them); rebuild the store")
        missing = [k for k in StoreSpec.__dataclass_fields__ if k not in saved]
        if missing and saved.get("format") == FORMAT:
            raise StoreError(f"{f}: missing key(s) {missing} (a store.json has "
                             f"{', '.join(StoreSpec.__dataclass_fields__)}); edited by hand? "
                             "rebuild the store")
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
        self.skipped: list[tuple[Path, str]] = []
        """Shard files found but not complete (torn, of another store, ...) and why."""
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
                self.skipped.append((p, self.last_problem))
                continue
            self._meta[index] = meta
            done.append(index)
        return done

    def rows(self) -> list[tuple[int, int]]:
        return [(s, r) for s in self.complete for r in range(len(self._meta[s]["rows"]))]

    def __len__(self) -> int:
        return sum(len(self._meta[s]["rows"]) for s in self.complete)

    # -------------------------------------------------------------- reading

    def read_row(
        self, shard: int, row: int, names: Sequence[str] | None = None
    ) -> dict[str, torch.Tensor]:
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
        """Read and check every row of every complete shard; returns the rows checked. A shard
        file that is not complete, a missing shard below a complete one, or no complete shard
        at all is a StoreError naming them (`build --resume` rebuilds them)."""
        if self.skipped:
            bad = "; ".join(f"{p.name} {why}" for p, why in self.skipped)
            raise StoreError(f"{self.path}: damaged shard(s): {bad}; delete them and rebuild "
                             f"with build --resume --out {self.path}")
        if not self.complete:
            raise StoreError(f"{self.path} holds no complete shard: nothing to verify; build "
                             f"it with build --resume --out {self.path}")
        gaps = sorted(set(range(max(self.complete))) - set(self.complete))
        if gaps:
            names = ", ".join(self.shard_path(i).name for i in gaps[:5])
            raise StoreError(f"{self.path}: shard(s) {names} missing below complete ones (removed, "
                             f"or not built yet); build them with build --resume --out {self.path}")
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
            self._index = {example_key(i, m): addr for i, m, addr in zip(ids, mask, self.rows())}
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
            have = stored["target"].get(key) or []
            missing = sorted(set(tgt.pop(key)) - set(have))
            if missing:
                hint = " (build a store with --signals ...,probe)" if key == "probe_layers" else ""
                problems.append(
                    f"target.{key}: needs {missing}, the store has {have or 'none'}{hint}"
                )
        if tgt:
            wanted["target"] = tgt
        flat = _flatten(stored)
        for name in differences(stored, wanted):
            have = flat.get(name, _MISSING)
            shown = "nothing" if have is _MISSING else _show(have)
            problems.append(
                f"{name}: the store has {shown}, {what} {_show(_flatten(wanted)[name])}"
            )
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
            ("probe_layers", "probe"),
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
        targets = combine_targets(
            stats, t["attention_mask"], self.target, self.layers, self.layer_types
        )
        hidden = {i: decode_hidden(t, i) for i in self.layers}
        return targets, hidden

    def __call__(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        rows = [self.row(i, m) for i, m in zip(input_ids, attention_mask)]
        device = input_ids.device
        targets = {i: torch.stack([r[0][i] for r in rows]).to(device) for i in self.layers}
        hidden = {i: torch.stack([r[1][i] for r in rows]).to(device) for i in self.layers}
        return targets, hidden


def store_dataset_path(dataset: str) -> str | None:
    """The store folder of a `dataset: store:PATH` training setting, else None."""
    return dataset[len(DATASET_PREFIX) :] if dataset.startswith(DATASET_PREFIX) else None
