"""The folder a `CompressedContext` is saved in (`context.safetensors` + `context.json`): written
atomically, recovered after a killed save, and read back with every part checked.

- `write_folder(final, tensors, meta, exchange)`: the files are written and fsynced into a
  temporary sibling (`.NAME.tmp-PID-...`), which takes the old folder's place in one atomic
  exchange (`exchange`, Linux `renameat2(RENAME_EXCHANGE)`; elsewhere two renames, the old folder
  aside as `.NAME.old-PID-...` between them).
- `recover(path)`: what a killed save left: the aside folder moved back when the path is
  missing, temporaries of saves whose process is gone removed. `write_folder` and `read_meta`
  call it.
- `read_meta(folder)`: `context.json`, an object with every field the format has, each of its
  type; `read_tensors(folder, meta)`: the tensors, their digest (`tensors_sha256`) as recorded,
  keys and values finite.
- `check_layers(meta, tensors, shape, path)`: every layer's tensors there, of the shapes the
  model and the recorded counts give.

Every refusal is a ValueError (FileNotFoundError for a folder that holds no context) naming the
file, the field or tensor, and what was expected. The compressed context itself (what it holds,
asking it) lives in `sparsekv.serving.compressed`.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sparsekv.io import fsync_path, pid_alive

FORMAT_VERSION = 1
TENSORS_FILE = "context.safetensors"
META_FILE = "context.json"
DIGEST_KEY = "tensors_sha256"
"""The `context.json` field holding the digest of every tensor of `context.safetensors`."""
KV_SUFFIXES = (".keys", ".values", ".key_scale", ".value_scale")
META_FIELDS = {
    "format_version": int,
    "config": dict,
    "policy": dict,
    "model_shape": dict,
    "model_fingerprint": str,
    "dtype": str,
    "num_tokens": int,
    "layers": list,
}
"""The fields of `context.json` a context cannot be read without, and their JSON types."""
_JSON_NAMES = {int: "integer", dict: "object", list: "list", str: "string"}
_COUNTERS = {"seen": int, "decode_steps": int, "evicted": bool, "has_padding": bool}


# ---------------------------------------------------------------------- integrity


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of every tensor (name, dtype, shape, bytes; sorted by name), as adapters hash
    theirs (`sparsekv.scoring.files.tensors_digest`)."""
    from sparsekv.scoring.files import tensors_digest

    return tensors_digest(tensors)


def _check_tensors(tensors: dict[str, torch.Tensor], recorded: Any, path: Path) -> None:
    """Refuse tensors that are not those `context.json` was written with (the digest it records:
    damaged bytes, another context's file beside it) or keys / values that are not finite.
    Contexts written before the digest existed are checked for finiteness only."""
    if recorded is not None and recorded != _digest(tensors):
        raise ValueError(
            f"{path} does not match {path.parent / META_FILE}: its tensors' digest differs from "
            f"the {DIGEST_KEY} recorded there (damaged bytes, or another context's tensors); "
            "compress and save the context again"
        )
    for name, t in sorted(tensors.items()):
        if name.endswith(KV_SUFFIXES) and t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(
                f"{path}: tensor {name} holds non-finite values (NaN or inf); a context's keys "
                "and values are finite: compress and save the context again"
            )


_DTYPES = ("float32", "bfloat16", "float16", "float64")
"""The dtypes a context's keys and values are saved in (the model's)."""


def _check_meta(meta: Any, path: Path) -> dict[str, Any]:
    """`context.json` as read: an object with every field of `META_FIELDS`, of its type, and a
    list of layer objects; returns it."""
    if not isinstance(meta, dict):
        raise ValueError(  # noqa: TRY004  (a damaged file, as every other refusal here)
            f"{path}: holds a JSON {type(meta).__name__}, not an object (the mapping of fields "
            "`CompressedContext.save` writes); compress and save the context again"
        )
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: format_version={meta.get('format_version')!r}; this "
            f"sparsekv reads compressed contexts of format {FORMAT_VERSION}"
        )
    missing = [k for k in META_FIELDS if k not in meta]
    if missing:
        raise ValueError(
            f"{path}: no {', '.join(repr(k) for k in missing)} (a saved context has the fields "
            f"{', '.join(META_FIELDS)}); compress and save the context again"
        )
    for key, kind in META_FIELDS.items():
        v = meta[key]
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise ValueError(f"{path}: {key}={v!r} must be a JSON {_JSON_NAMES[kind]}")
    if meta["num_tokens"] < 1:
        raise ValueError(f"{path}: num_tokens={meta['num_tokens']!r} must be >= 1")
    for i, m in enumerate(meta["layers"]):
        where = f"{path}: layers[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("kind"), str):
            raise ValueError(f"{where}={m!r} must be an object with a 'kind'")  # noqa: TRY004
        if not isinstance(m.get("empty"), bool):
            raise ValueError(f"{where}: empty={m.get('empty')!r} must be true or false")  # noqa: TRY004
        if m["empty"]:
            continue
        need = {"kept": int, **(_COUNTERS if m["kind"] == "evicting" else {})}
        for key, kind in need.items():
            v = m.get(key)
            if not isinstance(v, kind) or (kind is int and (isinstance(v, bool) or v < 0)):
                what = "true or false" if kind is bool else "an int >= 0"
                raise ValueError(f"{where}: {key}={v!r} must be {what}")
    kept = [0 if m["empty"] else m["kept"] for m in meta["layers"]]
    if "kept" in meta and meta["kept"] != kept:
        raise ValueError(
            f"{path}: kept={meta['kept']!r} does not match its layers' records ({kept}): the "
            "file was edited; compress and save the context again"
        )
    if meta["dtype"] not in _DTYPES:
        raise ValueError(
            f"{path}: dtype={meta['dtype']!r}; a saved context holds keys and values in one of "
            f"{', '.join(_DTYPES)}"
        )
    spec = meta["policy"]
    if spec.get("kind") not in ("name", "adapter", "policy") or not isinstance(
        spec.get("name"), str
    ):
        raise ValueError(
            f"{path}: policy={spec!r} must record its kind ('name', 'adapter' or 'policy') and name"
        )
    spec.setdefault("repr", spec["name"])
    return meta


def check_layers(meta: dict[str, Any], tensors: dict[str, torch.Tensor], shape: Any, path: Path) -> None:
    """Every non-empty layer of `meta` has its tensors, of the shapes the model (`shape`, a
    `ModelShape`) and the recorded `kept` give; no tensor belongs to no layer."""
    heads, dim = shape.num_kv_heads, shape.head_dim
    int8 = meta["config"].get("quantize") == "int8"
    expected: dict[str, tuple[tuple[int, ...], bool]] = {}  # name -> (shape, required)
    for i, m in enumerate(meta["layers"]):
        if m["empty"]:
            continue
        n = m["kept"]
        kv = (1, heads, n, dim)
        expected[f"layers.{i}.keys"] = expected[f"layers.{i}.values"] = (kv, True)
        if m["kind"] == "evicting":
            expected[f"layers.{i}.positions"] = ((1, heads, n), True)
            expected[f"layers.{i}.scores"] = expected[f"layers.{i}.observed"] = ((1, heads, n), False)
            if int8:
                scale = ((1, heads, n, 1), True)
                expected[f"layers.{i}.key_scale"] = expected[f"layers.{i}.value_scale"] = scale
    expected["first_valid"] = ((1,), False)
    for name, (want, required) in expected.items():
        t = tensors.get(name)
        if t is None:
            if required:
                raise ValueError(
                    f"{path}: no tensor {name}, which {META_FILE} says the context holds; "
                    "compress and save the context again"
                )
            continue
        if tuple(t.shape) != want:
            raise ValueError(
                f"{path}: tensor {name} has shape {tuple(t.shape)}, expected {want} (batch 1, "
                f"the model's {heads} KV heads, the {want[2] if len(want) > 2 else 1} entries "
                f"{META_FILE} records, head_dim {dim}); compress and save the context again"
            )
        if name.endswith(".positions") and t.is_floating_point():
            raise ValueError(f"{path}: tensor {name} holds {t.dtype} values; positions are integers")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise ValueError(
            f"{path}: tensors {extra} belong to no layer {META_FILE} records; compress and save "
            "the context again"
        )


# ---------------------------------------------------------------------- atomic folders

_IN_PROGRESS: set[str] = set()
"""Names of the temporary and aside folders of this process's saves now running."""


def _exchange(a: Path, b: Path) -> bool:
    """Swap the folders `a` and `b` in one atomic step (Linux `renameat2(RENAME_EXCHANGE)`);
    False when this system or file system cannot (the caller then renames twice)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, f"cannot exchange {a} and {b}: {os.strerror(err)}")


def _leftover(name: str, base: str) -> str | None:
    """"tmp" or "old" when `name` is a temporary or aside folder of a save of `base` whose
    process is gone (or, in this process, is no longer running); else None."""
    for kind in ("tmp", "old"):
        prefix = f".{base}.{kind}-"
        if name.startswith(prefix):
            pid = name[len(prefix) :].split("-", 1)[0]
            if not pid.isdigit() or name in _IN_PROGRESS:
                return None
            if int(pid) != os.getpid() and pid_alive(int(pid)):
                return None
            return kind
    return None


def recover(path: str | os.PathLike) -> None:
    """Undo what a killed `save` of the context folder `path` left beside it: when `path` is
    missing and the old folder is aside (`.NAME.old-PID-...`, a kill between the two renames),
    it is moved back; the temporary and aside folders of saves whose process is gone are then
    removed. `save` and `load` call it; saves still running are left alone."""
    final = Path(path).expanduser()
    parent = final.parent
    if not parent.is_dir():
        return
    found = {"tmp": [], "old": []}
    for p in parent.iterdir():
        kind = _leftover(p.name, final.name)
        if kind is not None and p.is_dir() and not p.is_symlink():
            found[kind].append(p)
    if not final.exists():
        complete = [
            p for p in found["old"] if (p / META_FILE).is_file() and (p / TENSORS_FILE).is_file()
        ]
        if complete:
            back = max(complete, key=lambda p: p.stat().st_mtime)
            os.rename(back, final)
            fsync_path(parent)
            found["old"].remove(back)
    for p in found["tmp"] + found["old"]:
        shutil.rmtree(p, ignore_errors=True)


def write_folder(
    final: Path,
    tensors: dict[str, torch.Tensor],
    meta: dict[str, Any],
    exchange: Callable[[Path, Path], bool] = _exchange,
) -> Path:
    """Write `tensors` and `meta` (its digest added) into folder `final`, atomically: a complete
    folder or the previous one, never half of each. `exchange` swaps two folders atomically
    (or answers False: then two renames)."""
    from safetensors.torch import save_file

    recover(final)  # what a killed save left: the old folder back at `final`, temporaries gone
    if final.exists() and not (final / META_FILE).is_file():
        raise ValueError(
            f"path={str(final)!r} exists and is not a saved compressed context; choose a new folder"
        )
    meta = {**meta, DIGEST_KEY: _digest(tensors)}
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent))
    _IN_PROGRESS.add(tmp.name)
    try:
        os.chmod(tmp, 0o755)
        save_file(tensors, str(tmp / TENSORS_FILE), metadata={"format": "sparsekv-context"})
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        for name in (TENSORS_FILE, META_FILE):
            fsync_path(tmp / name)
        fsync_path(tmp)
        if not final.exists():
            os.rename(tmp, final)  # atomic: no folder, then the complete one
        elif not exchange(tmp, final):
            # no atomic exchange here: `final` moves aside to `.NAME.old-PID-...` for the
            # instant between the two renames; `recover` moves it back after a kill
            suffix = tmp.name.rsplit("-", 1)[-1]
            old = final.parent / f".{final.name}.old-{os.getpid()}-{suffix}"
            _IN_PROGRESS.add(old.name)
            try:
                os.rename(final, old)
                os.rename(tmp, final)
                fsync_path(final.parent)
                shutil.rmtree(old, ignore_errors=True)
            finally:
                _IN_PROGRESS.discard(old.name)
        fsync_path(final.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # after an exchange it holds the old context
        _IN_PROGRESS.discard(tmp.name)
    return final


def read_meta(folder: Path) -> dict[str, Any]:
    """`context.json` of a saved context folder, checked by `_check_meta` (after `recover`)."""
    try:
        recover(folder)  # what a killed save left (a read-only folder is read as it is)
    except OSError:
        pass
    meta_path, tensors_path = folder / META_FILE, folder / TENSORS_FILE
    if folder.is_file():
        raise ValueError(
            f"path={str(folder)!r} is a file; give the saved context's folder (the one holding "
            f"{META_FILE} and {TENSORS_FILE})"
        )
    if not meta_path.is_file() or not tensors_path.is_file():
        raise FileNotFoundError(
            f"path={str(folder)!r} is not a saved compressed context "
            f"(needs {META_FILE} and {TENSORS_FILE})"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{meta_path}: not valid JSON ({e})") from None
    return _check_meta(meta, meta_path)


def read_tensors(folder: Path, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of a saved context folder (on the CPU), checked against the digest `meta`
    records; keys and values finite."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / TENSORS_FILE
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: unreadable safetensors file ({e})") from None
    _check_tensors(tensors, meta.get(DIGEST_KEY), path)
    return tensors
