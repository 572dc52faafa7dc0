"""Writing an adapter folder without ever removing a file it did not write: a new folder as a
temporary sibling renamed into place; an existing adapter's folder file by file (each staged,
fsynced, then moved over the old one, journaled so that a kill leaves the old adapter or the new
one, `recover`ed by the next save or load); a folder holding anything else is refused unless
told to overwrite. Temporary files of killed saves are removed. What the files hold is
`sparsekv.scoring.files`'s."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from sparsekv.io import fsync_path, pid_alive
from sparsekv.scoring.adapter_config import LORA_DIR
from sparsekv.scoring.files import (
    CARD_NAME,
    CONFIG_NAME,
    LEGACY_CONFIG_NAME,
    LEGACY_WEIGHTS_NAME,
    WEIGHTS_NAME,
)

ADAPTER_NAMES = frozenset(
    (CONFIG_NAME, WEIGHTS_NAME, CARD_NAME, LEGACY_CONFIG_NAME, LEGACY_WEIGHTS_NAME)
)
"""What an adapter folder may hold at its top level besides the `LORA_DIR` subfolder (format 2
and format 1 names; `save_pretrained` writes the format-2 ones and leaves the others)."""
LORA_NAMES = frozenset(("adapter_config.json", "adapter_model.safetensors", CARD_NAME))
"""What the `LORA_DIR` subfolder (a PEFT folder) may hold."""
_TMP = ".tmp-"
_JOURNAL = (_TMP, ".old-", ".new-")
"""A save's own names beside a file NAME: `.NAME.tmp-PID-X` (the new bytes, staged), and while
an existing folder's files are replaced, `.NAME.old-PID-X` (a hard link to the old file) or
`.NAME.new-PID-X` (an empty mark: NAME did not exist before); `.commit-PID` says that every file
was replaced."""
_COMMIT = ".commit-"
_ACTIVE: set[Path] = set()
"""The journal files (staged files, marks, commit marks) of this process's saves now running:
`recover` leaves them alone and takes this process's others for leftovers of a failed save."""


def _parse(name: str) -> tuple[str, str, int] | None:
    """(NAME, kind ".tmp-" / ".old-" / ".new-", pid) of a save's own name, else None."""
    if not name.startswith("."):
        return None
    for kind in _JOURNAL:
        if kind in name:
            base, rest = name[1:].rsplit(kind, 1)
            pid = rest.split("-", 1)[0]
            return (base, kind, int(pid)) if pid.isdigit() else None
    return None


def _temp_of(name: str, allowed: frozenset[str]) -> bool:
    """Whether `name` is a save's own file (`_JOURNAL`) of a name in `allowed`, or its mark."""
    if name.startswith(_COMMIT) and name[len(_COMMIT):].isdigit():
        return True
    parsed = _parse(name)
    return parsed is not None and parsed[0] in allowed


def _stale(name: str) -> bool:
    """A temporary name (`...tmp-PID-XXXX`) whose writing process is gone (a killed save)."""
    pid = name.rsplit(_TMP, 1)[-1].split("-", 1)[0]
    return pid.isdigit() and not pid_alive(int(pid))


def foreign_files(folder: Path) -> list[str]:
    """The entries of an existing `folder` that are not an adapter's (`ADAPTER_NAMES`, a
    `LORA_DIR` subfolder of `LORA_NAMES`, the temporary files of a save), relative to it."""
    out = []
    for p in sorted(Path(folder).iterdir()):
        if p.name == LORA_DIR and p.is_dir() and not p.is_symlink():
            out += [
                f"{LORA_DIR}/{q.name}"
                for q in sorted(p.iterdir())
                if not (
                    (q.name in LORA_NAMES and q.is_file()) or _temp_of(q.name, LORA_NAMES)
                )
            ]
        elif not ((p.name in ADAPTER_NAMES and p.is_file()) or _temp_of(p.name, ADAPTER_NAMES)):
            out.append(p.name + ("/" if p.is_dir() else ""))
    return out


def _stage(dest: Path, data: bytes) -> Path:
    """`data` written and fsynced into a temporary file beside `dest` (same folder, so that
    `os.replace` onto `dest` is atomic)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}{_TMP}{os.getpid()}-", dir=dest.parent)
    _ACTIVE.add(Path(tmp))  # until write_folder removes it
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        _ACTIVE.discard(Path(tmp))
        raise
    return Path(tmp)


def recover(folder: Path) -> None:
    """Undo what a killed save left in an adapter `folder` (and its `LORA_DIR`): staged files
    removed; and when the save was replacing files (its `.old-` / `.new-` marks are there), the
    folder as it was before it (each `.NAME.old-` moved back over NAME, each NAME marked `.new-`
    removed), or, when its `.commit-PID` mark says every file was replaced, as it is after it.
    Only an adapter's own names are touched (`_temp_of`), and only those of saves no longer
    running (their process gone, or in this process not `_ACTIVE`: a save that failed here).
    `write_folder` and `from_pretrained` call it."""
    folder = Path(folder)
    if not folder.is_dir():
        return

    def gone(path: Path, pid: int) -> bool:
        return path not in _ACTIVE if pid == os.getpid() else not pid_alive(pid)

    wheres = [(folder, ADAPTER_NAMES)]
    if (folder / LORA_DIR).is_dir():
        wheres.append((folder / LORA_DIR, LORA_NAMES))
    entries = [
        (w, p.name) for w, allowed in wheres for p in w.iterdir() if _temp_of(p.name, allowed)
    ]
    if not entries:
        return
    commits = {
        n: int(n[len(_COMMIT):]) for w, n in entries if w == folder and n.startswith(_COMMIT)
    }
    committed = set(commits.values())
    for where, name in entries:
        parsed = _parse(name)
        if parsed is None or not gone(where / name, parsed[2]):
            continue
        base, kind, pid = parsed
        if kind == ".old-" and pid not in committed:
            os.replace(where / name, where / base)  # the old file back
            # (a rename between two links of one file does nothing: the file was not replaced)
            (where / name).unlink(missing_ok=True)
            continue
        if kind == ".new-" and pid not in committed:
            (where / base).unlink(missing_ok=True)  # a file the killed save added
        (where / name).unlink(missing_ok=True)
    for name, pid in commits.items():
        if gone(folder / name, pid):
            (folder / name).unlink(missing_ok=True)
    for where, _ in wheres:
        fsync_path(where)


def _replace_all(target: Path, staged: list[tuple[Path, Path]]) -> None:
    """Move each staged file over its destination so that a kill at any point leaves, after
    `recover`, the old folder or the new one: the old files are first linked aside (or the new
    names marked), then replaced, then a commit mark written, then the marks removed."""
    marks = []
    tag = f"{os.getpid()}-{os.urandom(4).hex()}"
    for _, dest in staged:
        if dest.exists():
            mark = dest.parent / f".{dest.name}.old-{tag}"
            try:
                os.link(dest, mark)
            except OSError:  # a file system without hard links
                shutil.copy2(dest, mark)
        else:
            mark = dest.parent / f".{dest.name}.new-{tag}"
            mark.touch()
        marks.append(mark)
        _ACTIVE.add(mark)
    for where in {dest.parent for _, dest in staged}:
        fsync_path(where)
    try:
        for tmp, dest in staged:
            os.replace(tmp, dest)
        for where in {dest.parent for _, dest in staged}:
            fsync_path(where)
    except BaseException:  # a full disk, an interrupt: the old files back now
        _ACTIVE.difference_update(marks)
        recover(target)
        raise
    commit = target / f"{_COMMIT}{os.getpid()}"
    _ACTIVE.add(commit)
    try:
        commit.touch()
        fsync_path(target)
        for mark in marks:
            mark.unlink(missing_ok=True)
        commit.unlink(missing_ok=True)
    finally:  # interrupted here: what is left is a leftover, which the next recover finishes
        _ACTIVE.difference_update([*marks, commit])
    fsync_path(target)


def write_folder(
    target: Path, files: dict[str, bytes], overwrite: bool = False
) -> Path:
    """Write an adapter folder: `files` maps a path relative to `target` (`config.json`,
    `lora/adapter_model.safetensors`, ...) to its bytes. Returns `target`.

    A new folder is filled as a temporary sibling and renamed into place (a reader sees no
    folder or the complete one). Into an existing folder, each file is written to a temporary
    file beside it, fsynced, and moved over the old one with `os.replace`, all of them staged
    before the first is replaced and journaled (`_replace_all`), so that after a kill `recover`
    gives the old adapter or the new one, never the files of both; nothing else in the folder is
    touched, so saving never removes a file it did not write (a `lora/` of an earlier save
    stays, unnamed by the new config, when the new adapter has none). An existing folder that
    holds anything but an adapter's files (`foreign_files`: a training run's `step-*/`,
    `metrics.jsonl`, ...) is refused with a ValueError naming them, unless `overwrite=True`,
    which writes the adapter's files beside them and leaves them as they are. Temporary files
    of killed saves are removed."""
    target = Path(target).expanduser()
    if target.exists() and not target.is_dir():
        raise ValueError(f"save_directory={str(target)!r} exists and is not a folder")
    if not isinstance(overwrite, bool):
        raise ValueError(f"overwrite={overwrite!r} must be True or False")
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        for p in target.parent.iterdir():
            if p.name.startswith(f".{target.name}{_TMP}") and p.is_dir() and _stale(p.name):
                # the temporary folder of a killed save
                shutil.rmtree(p, ignore_errors=True)
        tmp = Path(
            tempfile.mkdtemp(prefix=f".{target.name}{_TMP}{os.getpid()}-", dir=target.parent)
        )
        try:
            os.chmod(tmp, 0o755)
            for rel, data in files.items():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp / rel).write_bytes(data)
                with open(tmp / rel, "rb+") as f:
                    os.fsync(f.fileno())
            if target.exists():  # another save made it meanwhile: write into it instead
                raise FileExistsError(target)
            os.rename(tmp, target)
            fsync_path(target.parent)
            return target
        except FileExistsError:
            pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    foreign = foreign_files(target)
    if foreign and not overwrite:
        more = f" and {len(foreign) - 8} more" if len(foreign) > 8 else ""
        shown = ", ".join(foreign[:8]) + more
        raise ValueError(
            f"save_directory={str(target)!r} is not an adapter folder: it holds {shown}, which "
            "an adapter does not write. Nothing was written or removed; save into a new (or "
            "an adapter's) folder, or pass overwrite=True to write the adapter's files beside "
            "them (they are left as they are)"
        )
    recover(target)
    staged: list[tuple[Path, Path]] = []
    try:
        for rel, data in files.items():
            dest = target / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            if dest.is_dir():
                raise ValueError(f"{dest} is a folder; the adapter writes a file there")
            staged.append((_stage(dest, data), dest))
        _replace_all(target, staged)
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
            _ACTIVE.discard(tmp)
    return target
