"""The files of an evaluation folder other than its rows: the lock that keeps two runs out of
one folder, the check that a path can be one (`check_out_folder`), `prompts.jsonl` and
`config.yaml` (and the check that a grid may add rows to a folder written with another one).

The rows themselves (`results.jsonl`, the part files) belong to `store.py`; what a row records
of its setup, to `identity.py`.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from sparsekv.evaluation.config import EvalConfig
from sparsekv.evaluation.tasks import Sample
from sparsekv.io import write_atomic

LOCK_NAME = ".sparsekv-eval.lock"
# Fields of config.yaml that must match for a grid to add rows to a folder: they change what
# every row means. The rest (tasks, lengths, samples, policies, budgets, protocols, threads,
# workers) may differ between runs.
SETUP_FIELDS = (
    "model",
    "dtype",
    "attn_implementation",
    "device",
    "seed",
    "eviction",
    "task_options",
    "shared_prefill",
)


def check_out_folder(out: str | Path | None, flag: str = "--out") -> Path:
    """`out` as a Path, when it can be an evaluation folder: a non-empty path that is a folder
    or does not exist yet, with no file on the way to it. Raises ValueError naming `flag`
    otherwise (checked before any model loads)."""
    if out is None or not str(out).strip():
        raise ValueError(f"{flag}={'' if out is None else str(out)!r} is empty; give the evaluation "
                         "folder (a new folder, or one that holds a grid's rows)")
    path = Path(out)
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            what = "is a file" if p == path else f"is under {p}, which is a file"
            raise ValueError(f"{flag} {path} {what}; give a folder (a new one, or one that holds "
                             "a grid's rows)")
        if p.exists():
            break
    return path


class FolderBusyError(ValueError):
    """Another live process holds the folder's lock."""


class FolderLock:
    """An exclusive lock on an evaluation folder, held while a command writes into it.

    The lock is an OS file lock (`flock`; `msvcrt.locking` on Windows) on
    `<folder>/.sparsekv-eval.lock`, which also holds the holder's pid, host, start time and
    command line for the error message. The OS releases the lock when its process dies, however
    it dies, so the lock of a killed run is taken over by the next one (with a note naming the
    dead pid). Use as a context manager."""

    def __init__(self, folder: str | Path):
        self.path = Path(folder) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> FolderLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            if not _try_lock(fd):
                holder = _read_holder(fd)
                os.close(fd)
                who = (
                    (
                        f"pid {holder.get('pid')} on {holder.get('host')}, "
                        f"since {holder.get('started')}: {holder.get('command')}"
                    )
                    if holder
                    else "another process"
                )
                raise FolderBusyError(
                    f"{self.path.parent} is in use by another sparsekv eval ({who}); two runs "
                    "never write into one folder at once: wait for it, stop it, or use another "
                    "--out"
                )
            try:  # the holder before us may have removed the file between our open and our lock
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        old = _read_holder(fd)
        if old.get("pid") not in (None, os.getpid()):
            print(
                f"[sparsekv eval] took over the lock of {self.path.parent} left by pid "
                f"{old['pid']} ({old.get('command')}), which no longer holds it (the run "
                "ended, or the folder was copied from where it runs)",
                file=sys.stderr,
            )
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv),
        }
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(info).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:  # before unlocking: whoever locks the old file next sees it gone and opens a fresh one
            self.path.unlink(missing_ok=True)
        except OSError:  # Windows keeps open files
            pass
        os.close(self._fd)  # closing releases the lock
        self._fd = None

    def __enter__(self) -> FolderLock:  # noqa: PYI034  (Self needs Python 3.11)
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _try_lock(fd: int) -> bool:
    try:
        import fcntl
    except ImportError:  # Windows
        import msvcrt

        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = os.read(fd, 65536)
        return json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {}


# ---- prompts.jsonl: the grid's prompts, for peers and for ingesting their rows ---------------
def prompt_lines(samples: list[Sample], cfg: EvalConfig) -> list[dict[str, Any]]:
    """One dict per sample: the `Sample` fields (texts and token ids), the protocols it runs
    under, `prompt` (context + question as text) and `stop_at_newline` (answer tasks: decoding
    may stop after the first line, the only one scored). Peers read this to run the same prompts."""
    out = []
    for s in samples:
        d = s.to_dict()
        d["protocols"] = cfg.protocols_for(s.task)
        d["prompt"] = s.context + s.question
        d["stop_at_newline"] = s.kind == "answer"
        out.append(d)
    return out


def write_prompts(
    samples: list[Sample], cfg: EvalConfig, path: Path, keep_others: bool = False
) -> None:
    """Write prompts.jsonl (atomically). `keep_others`: prompts already in `path` whose sample_id
    is not among `samples` stay, first (a folder keeps every row it ever held, so their prompts)."""
    lines = prompt_lines(samples, cfg)
    if keep_others and Path(path).exists():
        mine = {d["sample_id"] for d in lines}
        old = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
        lines = [d for d in old if d["sample_id"] not in mine] + lines
    write_atomic(Path(path), "".join(json.dumps(d) + "\n" for d in lines))


def read_prompts(path: Path) -> list[Sample]:
    """The samples of a prompts.jsonl (its peer-only fields dropped)."""
    samples = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            for k in ("protocols", "prompt", "stop_at_newline"):
                d.pop(k, None)
            samples.append(Sample.from_dict(d))
    return samples


# ---- config.yaml --------------------------------------------------------------------------
def write_config(out: Path, cfg: EvalConfig, **extra: Any) -> None:
    """The resolved grid (every field, the parsed policy specs, and `extra` such as the
    environment) as `out`/config.yaml, written atomically."""
    resolved = {**cfg.to_dict(), "policy_specs": [p.to_dict() for p in cfg.policy_specs], **extra}
    write_atomic(Path(out) / "config.yaml", yaml.safe_dump(resolved, sort_keys=False))


def read_config(out: Path) -> dict[str, Any] | None:
    path = Path(out) / "config.yaml"
    if not path.exists():
        return None
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(
            f"{path} is not valid YAML ({e}); restore it from the run's copy or use another --out"
        ) from None
    return data if isinstance(data, dict) else None


def check_same_setup(out: Path, cfg: EvalConfig) -> None:
    """Refuse a grid whose model, dtype, attention, device, seed, eviction settings, task options
    or prefill mode differ from those of the rows already in `out` (its config.yaml)."""
    old = read_config(out)
    if not old:
        return
    new = cfg.to_dict()
    for k in SETUP_FIELDS:
        if k in old and old[k] != new[k]:
            raise ValueError(
                f"{out} holds rows run with {k}={old[k]!r}, this grid has {k}={new[k]!r}; rows of "
                "two settings never share a folder (neither --resume nor --overwrite mixes them): "
                "use another --out (or the same setting)"
            )
