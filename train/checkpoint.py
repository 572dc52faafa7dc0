"""Checkpoint folders: atomic writes, tensors-only state files, RNG capture, resume lookup.

This module owns the layout of `<run>/step-000N/` and `<run>/final/` and the rules that make a
killed run resumable at any moment:

- A folder is written under a temporary name in the same parent (`.step-000N.tmp`) and renamed
  into place when complete (`os.rename` is atomic), so every `step-*` folder is complete;
  leftovers of an interrupted write are removed on the next save. Old folders are renamed away
  before they are deleted, for the same reason.
- Nothing is pickled. State dicts (optimizer, RNG) are stored as safetensors files whose tensors
  are the state's tensors and whose metadata holds the rest of the structure as JSON
  (`save_state_dict` / `load_state_dict`). The scheduler state and the trainer state (step, data
  position) are JSON.

It knows nothing about models or data; the trainer decides what goes into a folder.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file

STEP_RE = re.compile(r"^step-(\d+)$")
TRAINER_STATE = "trainer_state.json"


def step_dir_name(step: int) -> str:
    return f"step-{step:04d}"


# ---------------------------------------------------------------------- tensors-only state dicts


def _split(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Replace every tensor in `obj` by a reference, collecting the tensors; JSON-able skeleton."""
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().cpu().contiguous().clone()
        return {"__tensor__": path}
    if isinstance(obj, np.ndarray):
        tensors[path] = torch.from_numpy(obj.astype(np.int64) if obj.dtype == np.uint32 else obj)
        return {"__ndarray__": path, "dtype": str(obj.dtype)}
    if isinstance(obj, dict):
        return {"__dict__": [[k, _split(v, f"{path}.{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        kind = "__tuple__" if isinstance(obj, tuple) else "__list__"
        return {kind: [_split(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store {type(obj).__name__} at {path!r} without pickling")


def _join(skel: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if not isinstance(skel, dict):
        return skel
    if "__tensor__" in skel:
        return tensors[skel["__tensor__"]]
    if "__ndarray__" in skel:
        return tensors[skel["__ndarray__"]].numpy().astype(skel["dtype"])
    if "__dict__" in skel:
        return {k: _join(v, tensors) for k, v in skel["__dict__"]}
    if "__tuple__" in skel:
        return tuple(_join(v, tensors) for v in skel["__tuple__"])
    return [_join(v, tensors) for v in skel["__list__"]]


def save_state_dict(state: Any, path: str | Path) -> None:
    """Store a nested state (dicts, lists, tuples, tensors, numbers, strings) without pickle."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _split(state, "s", tensors)
    save_file(tensors, str(path), metadata={"skeleton": json.dumps(skeleton)})


def load_state_dict(path: str | Path) -> Any:
    """Inverse of `save_state_dict` (tensors come back on the CPU). A file that is not one
    (unreadable, truncated, without its skeleton) is a ValueError naming it."""
    try:
        with safe_open(str(path), framework="pt") as f:
            skeleton = json.loads((f.metadata() or {})["skeleton"])
        return _join(skeleton, load_file(str(path)))
    except (SafetensorError, OSError, KeyError, TypeError, ValueError) as e:
        why = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(f"{path} is not a state file written by train.py ({why})") from None


def optimizer_mismatch(state: Any, optimizer: torch.optim.Optimizer, names: list[str]) -> str | None:
    """Why a loaded optimizer `state` does not fit `optimizer` (parameter groups, parameters per
    group, the shape of each parameter's moments), naming the parameter from `names` (in the
    optimizer's order); None when it fits. torch checks only the counts, and a state of other
    shapes would load and fail at the next step."""
    if not isinstance(state, dict) or not {"state", "param_groups"} <= set(state):
        return "it is not an optimizer state (no state and param_groups)"
    saved, groups = state["param_groups"], optimizer.param_groups
    if len(saved) != len(groups):
        return f"it has {len(saved)} parameter groups, this run's optimizer {len(groups)}"
    ids = [i for g in saved for i in g.get("params", [])]
    params = [p for g in groups for p in g["params"]]
    if len(ids) != len(params):
        return f"it holds {len(ids)} parameters, this run's head {len(params)}"
    for n, (i, p) in enumerate(zip(ids, params)):
        for k, v in (state["state"].get(i) or {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape != p.shape:
                name = names[n] if n < len(names) else f"parameter {n}"
                return (
                    f"its {k} of {name} has shape {tuple(v.shape)}, the parameter "
                    f"{tuple(p.shape)}"
                )
    return None


# ---------------------------------------------------------------------- RNG


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU (and CUDA) generator states."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    np.random.set_state(tuple(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------- folders


def tmp_path(final: Path) -> Path:
    """The temporary sibling a folder is written under before its atomic rename."""
    return final.parent / f".{final.name}.tmp"


def begin(final: Path) -> Path:
    """Fresh empty temporary folder for `final` (removing leftovers of an interrupted write)."""
    tmp = tmp_path(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit(final: Path) -> None:
    """Atomically move the completed temporary folder into place (replacing an older `final`)."""
    tmp = tmp_path(final)
    if final.exists():
        remove(final)
    os.rename(tmp, final)


def remove(path: Path) -> None:
    """Delete a folder so that it never appears half-deleted under its own name."""
    trash = path.parent / f".{path.name}.del"
    shutil.rmtree(trash, ignore_errors=True)
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def clean_leftovers(run_dir: Path) -> list[str]:
    """Remove what interrupted writes left in a run folder (hidden `.step-*` / `.final*` entries)."""
    removed = []
    for p in run_dir.iterdir() if run_dir.is_dir() else []:
        if p.name.startswith((".step-", ".final", ".config.yaml")):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            removed.append(p.name)
    return removed


def step_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete `step-N` folders of a run, oldest first."""
    if not run_dir.is_dir():
        return []
    found = []
    for p in run_dir.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir() and (p / TRAINER_STATE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest(run_dir: Path) -> Path | None:
    dirs = step_dirs(run_dir)
    return dirs[-1][1] if dirs else None


def prune(run_dir: Path, keep_last: int | None) -> list[Path]:
    """Delete all but the newest `keep_last` step folders; returns the deleted paths."""
    if keep_last is None:
        return []
    old = [p for _, p in step_dirs(run_dir)][:-keep_last]
    for p in old:
        remove(p)
    return old


def write_json(obj: Any, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def read_json(path: Path) -> Any:
    """The JSON in `path`; a file that is not JSON (or not UTF-8) is a ValueError naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
