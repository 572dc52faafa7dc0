"""The bad-input sweep's machinery: a case (one bad input, the names a clear error must
mention), how its outcome is classified (clear, unclear, silent), and the tiny fixtures the cases
share (models, adapters, folders), built once. The cases live in one module per surface."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

torch.set_num_threads(1)

import sparsekv  # noqa: E402
from sparsekv.models.tiny import tiny_model  # noqa: E402

CLEAR_TYPES = (ValueError, TypeError, FileNotFoundError)
SURFACES = ("api", "adapter files", "train config", "eval cli")
SURFACES2 = ("api", "files", "train", "eval cli", "kills")
"""Round 2's surfaces (eval/bad_inputs/round2_*.py): the public API, files on disk (adapters,
saved contexts, run folders), training (configs and runs), the eval CLI, and SIGKILLs."""
SURFACES3 = SURFACES2
"""Round 3's surfaces (eval/bad_inputs/round3_*.py), the same five as round 2's."""
OUTCOMES = ("clear", "unclear", "silent", "data loss")


@dataclass
class Case:
    surface: str
    group: str
    name: str
    fn: Callable[[], Any]
    names: tuple[str, ...]
    cli: bool = False
    warn_ok: bool = False
    """Carrying on with a warning (stderr) that names one of `names` is the right answer."""
    round: int = 1
    allowed: tuple[str, ...] = ()
    """Round 3: words of which one must also appear for "clear" (the allowed values or what to
    do instead), so a message naming the parameter but not what it may be is "unclear"."""


@dataclass
class Verdict:
    """What a case returns when it judges the outcome itself (a kill, a result to compare):
    `outcome` one of OUTCOMES ("clear" for a kill: nothing lost and the rerun finished)."""

    outcome: str
    message: str


@dataclass
class Outcome:
    surface: str
    group: str
    name: str
    outcome: str
    error_type: str | None
    message: str
    names: list[str] = field(default_factory=list)
    seconds: float = 0.0


CASES: list[Case] = []


def case(surface: str, group: str, name: str, names, cli: bool = False, warn_ok: bool = False,
         round: int = 1, allowed=()):
    """Register `fn` as a case; `names`: words of which one must appear in the error message;
    `allowed` (round 3): words of which one must appear too."""
    if isinstance(names, str):
        names = (names,)
    if isinstance(allowed, str):
        allowed = (allowed,)

    def deco(fn):
        CASES.append(Case(surface, group, name, fn, tuple(names), cli, warn_ok, round,
                          tuple(allowed)))
        return fn

    return deco


def add(surface: str, group: str, name: str, names, fn, cli: bool = False,
        warn_ok: bool = False, round: int = 1) -> None:
    case(surface, group, name, names, cli, warn_ok, round)(fn)


def add2(surface: str, group: str, name: str, names, fn, cli: bool = False,
         warn_ok: bool = False) -> None:
    """Register a case of round 2 (`python eval/sweep_bad_inputs.py --round 2`)."""
    case(surface, group, name, names, cli, warn_ok, 2)(fn)


def add3(surface: str, group: str, name: str, names, fn, cli: bool = False,
         warn_ok: bool = False, allowed=()) -> None:
    """Register a case of round 3 (`python eval/sweep_bad_inputs.py --round 3`); `allowed`:
    words of which one must appear besides one of `names` for the case to be clear."""
    case(surface, group, name, names, cli, warn_ok, 3, allowed)(fn)


def _names_in(msg: str, names: tuple[str, ...]) -> bool:
    low = msg.lower()
    return any(n.lower() in low for n in names)


def classify(c: Case) -> Outcome:
    err, out = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    kind, msg, etype = "silent", "", None
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                ret = c.fn()
            finally:
                for w in caught:
                    err.write(f"{w.category.__name__}: {w.message}\n")
    except SystemExit as e:  # argparse's exit 2 (its usage line names the flag)
        etype = "SystemExit"
        msg = err.getvalue().strip() or str(e)
        kind = "clear" if e.code not in (0, None) and _names_in(msg, c.names) else "unclear"
    except CLEAR_TYPES as e:
        etype = type(e).__name__
        msg = str(e)
        if c.cli:  # escaped sparsekv.cli.main: the user sees a traceback, not an exit 2
            msg = f"raw traceback ({etype} escaped the CLI): {msg}"
            kind = "unclear"
        else:
            kind = "clear" if _names_in(msg, c.names) else "unclear"
    except Exception as e:  # noqa: BLE001  (every other type is "unclear" by definition)
        etype = type(e).__name__
        tb = traceback.extract_tb(e.__traceback__)
        where = f" (raised in {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
        msg = f"{e}{where}"
        kind = "unclear"
    else:
        if isinstance(ret, Verdict):
            kind, msg = ret.outcome, ret.message
            etype = "verdict"
        elif c.cli:
            msg = err.getvalue().strip()
            if ret == 2:
                etype = "exit 2"
                kind = "clear" if _names_in(msg, c.names) else "unclear"
            elif ret in (0, None):
                etype = "exit 0"
                kind = "clear" if c.warn_ok and _names_in(msg, c.names) else "silent"
            else:
                etype, kind = f"exit {ret}", "unclear"
        elif c.warn_ok and _names_in(err.getvalue(), c.names):
            kind, etype, msg = "clear", "warning", err.getvalue().strip()
        else:
            msg = f"accepted: {ret!r}"[:300]
    if kind == "clear" and etype != "verdict" and c.allowed and not _names_in(msg, c.allowed):
        kind = "unclear"  # names the thing but not what it may be (round 3's stricter reading)
    lines = [x for x in msg.splitlines() if x.strip()]
    short = " | ".join(lines[-3:])[:600]
    return Outcome(c.surface, c.group, c.name, kind, etype, short, list(c.names),
                   round(time.perf_counter() - t0, 3))


# ---------------------------------------------------------------------------------------------
# shared fixtures (built once, lazily)
# ---------------------------------------------------------------------------------------------
_CACHE: dict[str, Any] = {}
TMP = Path(tempfile.mkdtemp(prefix="sparsekv-sweep-"))


def model(family: str = "llama"):
    key = f"model:{family}"
    if key not in _CACHE:
        _CACHE[key] = tiny_model(family).eval()
    return _CACHE[key]


def adapter(family: str = "llama"):
    key = f"adapter:{family}"
    if key not in _CACHE:
        _CACHE[key] = sparsekv.ScorerAdapter.for_model(model(family), hidden=8)
    return _CACHE[key]


def adapter_dir(family: str = "llama") -> Path:
    key = f"adapter_dir:{family}"
    if key not in _CACHE:
        _CACHE[key] = adapter(family).save_pretrained(TMP / f"adapter-{family}")
    return _CACHE[key]


_n = [0]


def fresh(name: str) -> Path:
    """A new path under the sweep's temporary folder, `name` with a unique number."""
    _n[0] += 1
    return TMP / f"{name}-{_n[0]}"


def tiny_docs() -> Path:
    """A tiny JSONL corpus (12 documents), written once."""
    p = TMP / "tiny-docs.jsonl"
    if not p.exists():
        p.write_text("".join(
            json.dumps({"text": "The quick brown fox jumps over the lazy dog. " * 6 + f"Doc {i}."})
            + "\n" for i in range(12)))
    return p


def edited_copy(src: Path, name: str, edit: Callable[[Path], None]) -> Path:
    """A fresh copy of the folder `src` (under the sweep's temporary folder, named after `name`)
    with `edit(folder)` applied."""
    folder = fresh(name)
    shutil.copytree(src, folder)
    edit(folder)
    return folder


def json_edit(filename: str, change: Callable[[dict], dict | None], indent: int | None = None):
    """An `edit` for `edited_copy`: `change` the JSON file `filename` of the folder in place (it
    mutates the dict, or returns the new one)."""
    def edit(folder: Path) -> None:
        p = folder / filename
        d = json.loads(p.read_text())
        new = change(d)
        p.write_text(json.dumps(d if new is None else new, indent=indent))
    return edit


def damaged(edit: Callable[[Path], None], family: str = "llama") -> Path:
    """A copy of the saved tiny adapter folder with `edit(folder)` applied."""
    return edited_copy(adapter_dir(family), "damaged", edit)


def cfg(**kw):
    return sparsekv.EvictionConfig(**{"budget": 0.5, **kw})


def ids(n: int = 24):
    return torch.arange(1, n + 1).unsqueeze(0)
