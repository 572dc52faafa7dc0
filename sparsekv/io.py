"""Files written so that a kill never leaves half of one: the one atomic writer and the one
JSON-lines reader of the project.

`atomic_path(path)` yields a unique temporary sibling of `path` for any writer (torch.save,
safetensors, a text file); when the block ends, the temporary file is flushed to disk and renamed
over `path` (readers, and a crash, see the old file or the new one, never part of it); on an
error it is removed and `path` is left as it was. `write_atomic` writes text or bytes that way.
`read_jsonl` reads rows and drops a torn last line (a write cut short by a kill) with a warning,
while a bad line before it is an error naming the file and the line. Nothing here knows what
the files hold.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "as_path", "atomic_path", "fsync_path", "only_a_path", "pid_alive", "read_jsonl", "write_atomic",
]


def as_path(value: Any, name: str) -> Path:
    """`value` (a str or an os.PathLike naming a path) as a Path, `~` expanded; anything else (None,
    a number, bytes) is a TypeError naming the argument `name` and what it may be."""
    if isinstance(value, bytes) or not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"{name}={value!r} must be a path: a str or an os.PathLike such as pathlib.Path "
            f"(a folder's name), got {type(value).__name__}"
        )
    path = os.fspath(value)
    if isinstance(path, bytes):
        raise TypeError(f"{name}={value!r} must be a path given as a str, not bytes")
    return Path(path).expanduser()


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's data, or a folder's entries (a rename into it), to disk. A file that cannot
    be flushed raises; a folder is best effort (some platforms cannot open or flush one)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if path.is_dir():
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


def only_a_path(name: str | os.PathLike) -> bool:
    """Whether a name can only be a path, never a Hugging Face Hub repo id ('name' or
    'namespace/name'): a PathLike, or a string that is absolute, starts with . or ~, holds a
    backslash, more than one '/' or ends with one. Used to say "does not exist" for a missing
    folder instead of a Hub error."""
    if not isinstance(name, str):
        return True
    return name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1 or name.endswith("/")


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (this process counts as running; a process of another user
    that cannot be signalled counts too): a temporary file named after a gone process is a
    killed write's."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


@contextmanager
def atomic_path(path: str | os.PathLike, mode: int = 0o644) -> Iterator[Path]:
    """A temporary path in `path`'s folder (created if missing), renamed over `path` when the
    block ends without an error, after its data reached the disk."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write `data` (text as UTF-8, or bytes) to `path` atomically; returns the path."""
    with atomic_path(path) as tmp:
        if isinstance(data, str):
            tmp.write_text(data, encoding="utf-8")
        else:
            tmp.write_bytes(data)
    return Path(path)


def read_jsonl(path: str | os.PathLike, what: str = "JSON row", missing_ok: bool = False) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file, one per non-blank line. A last line that does not parse
    (a write cut short by a kill) is dropped with a warning on stderr; a bad line before it raises
    ValueError naming `path:line`. `missing_ok`: a missing file reads as no rows."""
    path = Path(path)
    if missing_ok and not path.exists():
        return []
    if path.is_dir():
        raise ValueError(f"{path} is a folder, not a JSON-lines file")
    lines = path.read_bytes().split(b"\n")
    numbered = [(i, ln) for i, ln in enumerate(lines, 1) if ln.strip()]
    rows: list[dict[str, Any]] = []
    for j, (i, line) in enumerate(numbered):
        try:
            row = json.loads(line.decode("utf-8"))
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            row = e
        if not isinstance(row, dict):
            if j == len(numbered) - 1:
                print(
                    f"[sparsekv] {path}:{i}: dropped a torn last line ({len(line)} bytes, a "
                    f"write cut short by a stop); the {len(rows)} rows before it are kept",
                    file=sys.stderr,
                )
                break
            why = row if isinstance(row, ValueError) else f"a JSON {type(row).__name__}, not an object"
            raise ValueError(f"{path}:{i} is not a {what} ({why}); fix or remove that line")
        rows.append(row)
    return rows
