"""A sweep of bad inputs across sparsekv's surfaces (issue 16's target): each case feeds one bad
input and classifies what came back.

  clear   a ValueError / TypeError / FileNotFoundError / SystemExit, or a CLI exit 2, whose
          message names the parameter, flag, key or file (one of the case's `names`)
  unclear another exception type, or an accepted exception type whose message names nothing
  silent  accepted without error (or a CLI exit 0) where it should not be

Surfaces: api (EvictionConfig, SparseKVCache, policies.get, ScorerAdapter, compress*), adapter
files (damaged folders on disk), train config (train/config.py's load_config with YAML files and
key=value overrides, plus two short tiny runs), eval CLI (`sparsekv.cli.main([...])` in process,
stderr captured; fresh run into a folder with rows, --resume onto another model, locked folder).

Tiny random models only, one thread. Run:
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python eval/sweep_bad_inputs.py [--only SURFACE,...]
Writes docs/results/bad-inputs/{cases.json, summary.md}.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

torch.set_num_threads(1)

import sparsekv
from sparsekv.models.tiny import tiny_model

CLEAR_TYPES = (ValueError, TypeError, FileNotFoundError)
SURFACES = ("api", "adapter files", "train config", "eval cli")


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


def case(surface: str, group: str, name: str, names, cli: bool = False, warn_ok: bool = False):
    """Register `fn` as a case; `names`: words of which one must appear in the error message."""
    if isinstance(names, str):
        names = (names,)

    def deco(fn):
        CASES.append(Case(surface, group, name, fn, tuple(names), cli, warn_ok))
        return fn

    return deco


def add(surface: str, group: str, name: str, names, fn, cli: bool = False,
        warn_ok: bool = False) -> None:
    case(surface, group, name, names, cli, warn_ok)(fn)


def _names_in(msg: str, names: tuple[str, ...]) -> bool:
    low = msg.lower()
    return any(n.lower() in low for n in names)


def classify(c: Case) -> Outcome:
    err, out = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    kind, msg, etype = "silent", "", None
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            ret = c.fn()
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
        if c.cli:
            msg = err.getvalue().strip()
            if ret == 2:
                etype = "exit 2"
                kind = "clear" if _names_in(msg, c.names) else "unclear"
            elif ret in (0, None):
                etype = "exit 0"
                kind = "clear" if c.warn_ok and _names_in(msg, c.names) else "silent"
            else:
                etype, kind = f"exit {ret}", "unclear"
        else:
            msg = f"accepted: {ret!r}"[:300]
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


def damaged(edit: Callable[[Path], None], family: str = "llama") -> Path:
    """A copy of the saved tiny adapter folder with `edit(folder)` applied."""
    _n[0] += 1
    folder = TMP / f"damaged-{_n[0]}"
    shutil.copytree(adapter_dir(family), folder)
    edit(folder)
    return folder


def cfg(**kw):
    return sparsekv.EvictionConfig(**{"budget": 0.5, **kw})


def ids(n: int = 24):
    return torch.arange(1, n + 1).unsqueeze(0)


# ---------------------------------------------------------------------------------------------
# surface 1: the public API
# ---------------------------------------------------------------------------------------------
NAN, INF = float("nan"), float("inf")
EC = "EvictionConfig"
for field_name, values in {
    "budget": [0, -1, 1.5, 0.0, -0.2, True, "0.3", None, NAN, INF, [0.3], 2.0],
    "schedule": ["zigzag", [], [0], [1.5], [True, True], ["a"], 3, [NAN], None],
    "rerank_every": [-1, 1.5, True, "16", None],
    "sink_tokens": [-1, 2.0, "4"],
    "recent_window": [-5, None, 3.5],
    "prefill_chunk": [0, -1, 1.5, True, "8"],
    "pyramid_slope": [1.0, -0.1, NAN, "x", None],
    "evict_slack": [-1, 0.5],
    "quantize": ["int4", "fp8", True, "INT8"],
    "layout": ["paged", None, "Static"],
    "max_length": [0, 1.5, -3],
    "static_slack": [0, "2"],
}.items():
    for v in values:
        add("api", EC, f"{field_name}={v!r}", field_name,
            (lambda f=field_name, v=v: sparsekv.EvictionConfig(**{"budget": 0.5, f: v})))
add("api", EC, "layout='static', fractional budget, no max_length", ("max_length", "layout"),
    lambda: sparsekv.EvictionConfig(budget=0.5, layout="static"))
add("api", EC, "layout='static', static_slack below one step", "static_slack",
    lambda: sparsekv.EvictionConfig(budget=16, layout="static", static_slack=2, evict_slack=8))
add("api", EC, "from_dict with an unknown key", ("bugdet", "unknown"),
    lambda: sparsekv.EvictionConfig.from_dict({"budget": 0.3, "bugdet": 0.3}))
add("api", EC, "from_dict without budget", "budget",
    lambda: sparsekv.EvictionConfig.from_dict({"schedule": "uniform"}))
add("api", EC, "no arguments", "budget", lambda: sparsekv.EvictionConfig())

SK = "SparseKVCache"
add("api", SK, "policy='magic'", ("magic", "policy"),
    lambda: sparsekv.SparseKVCache(model(), cfg(), "magic"))
add("api", SK, "policy=123", "policy", lambda: sparsekv.SparseKVCache(model(), cfg(), 123))
add("api", SK, "config=None", "config", lambda: sparsekv.SparseKVCache(model(), None, "snapkv"))
add("api", SK, "config as a dict", "config",
    lambda: sparsekv.SparseKVCache(model(), {"budget": 0.3}, "snapkv"))
add("api", SK, "model=None", "model", lambda: sparsekv.SparseKVCache(None, cfg(), "snapkv"))
add("api", SK, "model is a string", "model",
    lambda: sparsekv.SparseKVCache("tiny:llama", cfg(), "snapkv"))
add("api", SK, "record=('bogus',)", ("record", "bogus"),
    lambda: sparsekv.SparseKVCache(model(), cfg(), "snapkv", record=("bogus",)))
add("api", SK, "record='scores' (a string, not a tuple)", "record",
    lambda: sparsekv.SparseKVCache(model(), cfg(), "snapkv", record="scores"))
add("api", SK, "record_window=0", "record_window",
    lambda: sparsekv.SparseKVCache(model(), cfg(budget=1.0), "full", record=("window",),
                                   record_window=0))
add("api", SK, "record_window=-1", "record_window",
    lambda: sparsekv.SparseKVCache(model(), cfg(budget=1.0), "full", record=("window",),
                                   record_window=-1))
add("api", SK, "a gemma3 head's policy on a llama model", ("model", "adapter", "gemma"),
    lambda: sparsekv.SparseKVCache(model("llama"), cfg(), adapter("gemma3").policy()))
add("api", SK, "layout='static' with the 'full' policy, no max_length",
    ("max_length", "full"),
    lambda: sparsekv.SparseKVCache(model(), sparsekv.EvictionConfig(budget=8, layout="static"),
                                   "full"))
add("api", SK, "explicit schedule with the wrong number of layers", ("schedule", "layer"),
    lambda: sparsekv.SparseKVCache(model(), cfg(schedule=[0.5] * 9), "snapkv"))

PG = "policies.get"


def pget(name, **kw):
    from sparsekv import policies
    return policies.get(name, **kw)


add("api", PG, "unknown name 'magic'", "magic", lambda: pget("magic"))
add("api", PG, "empty name", ("policy", "''"), lambda: pget(""))
add("api", PG, "name=None", ("policy", "name"), lambda: pget(None))
add("api", PG, "name=3", ("policy", "name"), lambda: pget(3))
add("api", PG, "name with a typo 'SnapKV'", ("snapkv",), lambda: pget("SnapKV"))
for pol in ("full", "random", "streaming", "h2o", "tova", "knorm", "snapkv", "pyramidkv",
            "expected_attention"):
    add("api", PG, f"{pol}: unknown kwarg bogus=1", "bogus",
        (lambda p=pol: pget(p, bogus=1)))
add("api", PG, "kvzip: unknown kwarg bogus=1", "bogus",
    lambda: pget("kvzip", encode=lambda s: [1], bogus=1))
add("api", PG, "learned: unknown kwarg bogus=1", "bogus",
    lambda: pget("learned", adapter=adapter(), bogus=1))
for pol, kw, nm in [
    ("random", {"seed": "x"}, "seed"), ("random", {"seed": -1}, "seed"),
    ("random", {"seed": 1.5}, "seed"), ("random", {"seed": None}, "seed"),
    ("snapkv", {"window": 0}, "window"), ("snapkv", {"window": 2.5}, "window"),
    ("snapkv", {"window": "32"}, "window"), ("snapkv", {"kernel_size": 4}, "kernel_size"),
    ("snapkv", {"kernel_size": 0}, "kernel_size"), ("snapkv", {"kernel_size": "7"}, "kernel_size"),
    ("snapkv", {"kernel_size": True}, "kernel_size"),
    ("pyramidkv", {"window": -1}, "window"), ("pyramidkv", {"kernel_size": 2}, "kernel_size"),
    ("expected_attention", {"future_positions": -1}, "future_positions"),
    ("expected_attention", {"future_positions": 1.5}, "future_positions"),
    ("expected_attention", {"query_sinks": -1}, "query_sinks"),
    ("expected_attention", {"epsilon": -0.1}, "epsilon"),
    ("expected_attention", {"epsilon": NAN}, "epsilon"),
    ("kvzip", {}, ("tokenizer", "encode")),
    ("kvzip", {"tokenizer": object(), "encode": lambda s: [1]}, ("tokenizer", "encode")),
    ("kvzip", {"encode": lambda s: [1], "chunk": 0}, "chunk"),
    ("kvzip", {"encode": lambda s: [1], "overlap": -1}, "overlap"),
    ("kvzip", {"encode": "not callable"}, "encode"),
    ("learned", {}, "adapter"),
    ("learned", {"adapter": None}, "adapter"),
    ("learned", {"adapter": "/nonexistent/adapter"}, ("adapter", "/nonexistent")),
    ("learned", {"adapter": 123}, "adapter"),
    ("learned", {"adapter": object()}, ("adapter", "score_layer")),
]:
    add("api", PG, f"{pol}: {kw!r}"[:90], nm, (lambda p=pol, k=kw: pget(p, **k)))
for kw, nm in [
    ({"blend": 2}, "blend"), ({"blend": NAN}, "blend"), ({"blend": "0.5"}, "blend"),
    ({"blend_mode": "avg"}, "blend_mode"), ({"recency": -1}, "recency"),
    ({"recency": INF}, "recency"), ({"kernel_size": 2}, "kernel_size"),
    ({"head_layer": "last"}, "head_layer"), ({"window": 0}, "window"),
    ({"use": "nope"}, ("use", "nope")), ({"use": 3}, "use"),
]:
    add("api", PG, f"learned (adapter): {kw!r}", nm,
        (lambda k=kw: pget("learned", adapter=adapter(), **k)))
add("api", PG, "'learned:/nonexistent'", ("/nonexistent", "learned"),
    lambda: pget("learned:/nonexistent"))
add("api", PG, "'learned:' (empty path)", ("learned", "adapter", "path"), lambda: pget("learned:"))

AD = "ScorerAdapter"
add("api", AD, "from_pretrained('/nonexistent')", "/nonexistent",
    lambda: sparsekv.ScorerAdapter.from_pretrained("/nonexistent/adapter"))
add("api", AD, "from_pretrained(a file)", "config.json",
    lambda: sparsekv.ScorerAdapter.from_pretrained(adapter_dir() / "config.json"))
add("api", AD, "from_pretrained(subfolder='../x')", "subfolder",
    lambda: sparsekv.ScorerAdapter.from_pretrained(adapter_dir(), subfolder="../x"))
add("api", AD, "from_pretrained(subfolder='missing')", ("subfolder", "missing"),
    lambda: sparsekv.ScorerAdapter.from_pretrained(adapter_dir(), subfolder="missing"))
add("api", AD, "from_pretrained(an empty folder)", ("config.json", "empty"),
    lambda: sparsekv.ScorerAdapter.from_pretrained(
        (TMP / "empty-folder").mkdir(exist_ok=True) or TMP / "empty-folder"))
add("api", AD, "for_model(kind='transformer')", "kind",
    lambda: sparsekv.ScorerAdapter.for_model(model(), kind="transformer"))
add("api", AD, "for_model(hidden=0)", "hidden",
    lambda: sparsekv.ScorerAdapter.for_model(model(), hidden=0))
add("api", AD, "for_model(layers=[99])", "layers",
    lambda: sparsekv.ScorerAdapter.for_model(model(), layers=[99]))
add("api", AD, "for_model(layers=[-1])", "layers",
    lambda: sparsekv.ScorerAdapter.for_model(model(), layers=[-1]))
add("api", AD, "for_model(layers=[])", "layers",
    lambda: sparsekv.ScorerAdapter.for_model(model(), layers=[]))
add("api", AD, "for_model(bogus=1)", "bogus",
    lambda: sparsekv.ScorerAdapter.for_model(model(), bogus=1))
add("api", AD, "for_model(blend=3)", "blend",
    lambda: sparsekv.ScorerAdapter.for_model(model(), blend=3))
add("api", AD, "settings('nope')", "nope", lambda: adapter().settings("nope"))


def _attach(m=None, **kw):
    with adapter().attach(model() if m is None else m, **kw):
        pass


add("api", AD, "attach(use='nope')", ("use", "nope"), lambda: _attach(use="nope"))
add("api", AD, "attach(budget=2.0)", "budget", lambda: _attach(budget=2.0))
add("api", AD, "attach(blend=5)", "blend", lambda: _attach(blend=5))
add("api", AD, "attach(bogus=1)", "bogus", lambda: _attach(bogus=1))
add("api", AD, "attach(schedule='zigzag')", "schedule", lambda: _attach(schedule="zigzag"))
add("api", AD, "attach onto a gemma3 model (head for llama)", ("model", "adapter", "gemma"),
    lambda: _attach(m=model("gemma3")))
add("api", AD, "check_compatible(gemma3 model)", ("model", "gemma"),
    lambda: adapter().check_compatible(model("gemma3")))

CP = "compress / CompressedContext"
add("api", CP, "context_ids as a string", "context_ids",
    lambda: sparsekv.compress(model(), "hello world", cfg()))
add("api", CP, "context_ids as floats", "context_ids",
    lambda: sparsekv.compress(model(), torch.rand(1, 8), cfg()))
add("api", CP, "context_ids empty", "context_ids",
    lambda: sparsekv.compress(model(), torch.zeros(1, 0, dtype=torch.long), cfg()))
add("api", CP, "context_ids 3-D", "context_ids",
    lambda: sparsekv.compress(model(), torch.ones(1, 2, 3, dtype=torch.long), cfg()))
add("api", CP, "context_ids beyond the vocabulary", ("context_ids", "vocab"),
    lambda: sparsekv.compress(model(), torch.full((1, 8), 10 ** 6), cfg()))
add("api", CP, "context_ids negative", ("context_ids",),
    lambda: sparsekv.compress(model(), torch.full((1, 8), -3), cfg()))
add("api", CP, "config=None", "config", lambda: sparsekv.compress(model(), ids(), None))
add("api", CP, "config as a float", "config", lambda: sparsekv.compress(model(), ids(), 0.3))
add("api", CP, "policy='magic'", "magic",
    lambda: sparsekv.compress(model(), ids(), cfg(), policy="magic"))
add("api", CP, "policy: a gemma3 head on llama", ("model", "adapter", "gemma"),
    lambda: sparsekv.compress(model(), ids(), cfg(), policy=adapter("gemma3")))
add("api", CP, "compress_text(tokenizer=None)", "tokenizer",
    lambda: sparsekv.compress_text(model(), None, "hello", cfg()))
add("api", CP, "load('/nonexistent')", "/nonexistent",
    lambda: sparsekv.CompressedContext.load("/nonexistent/ctx", model()))


def _saved_ctx() -> Path:
    if "ctx" not in _CACHE:
        _CACHE["ctx"] = sparsekv.compress(model(), ids(40), cfg()).save(TMP / "ctx")
    return _CACHE["ctx"]


def _ctx_copy(edit) -> Path:
    _n[0] += 1
    folder = TMP / f"ctx-{_n[0]}"
    shutil.copytree(_saved_ctx(), folder)
    edit(folder)
    return folder


def _ctx_file(folder: Path, suffix: str) -> Path:
    return next(p for p in folder.iterdir() if p.name.endswith(suffix))


add("api", CP, "load onto another model (gemma3)", ("model",),
    lambda: sparsekv.CompressedContext.load(_saved_ctx(), model("gemma3")))
add("api", CP, "load with garbled meta JSON", (".json",),
    lambda: sparsekv.CompressedContext.load(
        _ctx_copy(lambda f: _ctx_file(f, ".json").write_text("{not json")), model()))
add("api", CP, "load with truncated tensors", (".safetensors",),
    lambda: sparsekv.CompressedContext.load(
        _ctx_copy(lambda f: (p := _ctx_file(f, ".safetensors")).write_bytes(p.read_bytes()[:100])),
        model()))
def _bump_version(folder: Path) -> None:
    p = _ctx_file(folder, ".json")
    d = json.loads(p.read_text())
    d["format_version"] = 99
    p.write_text(json.dumps(d))


add("api", CP, "load a context of format_version 99", ("format_version", ".json"),
    lambda: sparsekv.CompressedContext.load(_ctx_copy(_bump_version), model()))
add("api", CP, "load an adapter folder as a context", ("context", "path"),
    lambda: sparsekv.CompressedContext.load(adapter_dir(), model()))


# ---------------------------------------------------------------------------------------------
# surface 2: adapter files
# ---------------------------------------------------------------------------------------------
AF = "adapter files"


def _cfgjson(folder: Path) -> Path:
    return folder / "config.json"


def _weights(folder: Path) -> Path:
    return folder / "model.safetensors"


def _edit_config(change: Callable[[dict], None]):
    def edit(folder: Path) -> None:
        d = json.loads(_cfgjson(folder).read_text())
        change(d)
        _cfgjson(folder).write_text(json.dumps(d))
    return edit


def _edit_state(change: Callable[[dict], None]):
    from safetensors.torch import load_file, save_file

    def edit(folder: Path) -> None:
        state = load_file(str(_weights(folder)))
        change(state)
        save_file(state, str(_weights(folder)))
    return edit


def _load(edit, family="llama"):
    return lambda: sparsekv.ScorerAdapter.from_pretrained(damaged(edit, family))


def _first(state: dict) -> str:
    return min(state)


def _set(d: dict, k: str, v: Any) -> None:
    d[k] = v


def _pop(d: dict, k: str) -> None:
    d.pop(k, None)


W = ("model.safetensors",)
C = ("config.json", "model.safetensors")  # a config change the weights contradict: either file
add(AF, "weights", "truncated safetensors (half)", W,
    _load(lambda f: _weights(f).write_bytes(_weights(f).read_bytes()[: len(_weights(f).read_bytes()) // 2])))
add(AF, "weights", "truncated safetensors (header only)", W,
    _load(lambda f: _weights(f).write_bytes(_weights(f).read_bytes()[:9])))
add(AF, "weights", "empty safetensors", W, _load(lambda f: _weights(f).write_bytes(b"")))
add(AF, "weights", "garbled bytes", W, _load(lambda f: _weights(f).write_bytes(os.urandom(4096))))
add(AF, "weights", "garbled header JSON", W,
    _load(lambda f: _weights(f).write_bytes((64).to_bytes(8, "little") + b"{" * 64)))
add(AF, "weights", "weights file missing", W, _load(lambda f: _weights(f).unlink()))
add(AF, "weights", "NaN weights", W + ("finite", "nan"),
    _load(_edit_state(lambda s: s[_first(s)].fill_(float("nan")))))
add(AF, "weights", "inf weights", W + ("finite", "inf"),
    _load(_edit_state(lambda s: s[_first(s)].fill_(float("inf")))))
add(AF, "weights", "a tensor of the wrong shape", W + ("shape",),
    _load(_edit_state(lambda s: s.__setitem__(_first(s), torch.zeros(3, 5)))))
add(AF, "weights", "a tensor missing", W + ("missing",),
    _load(_edit_state(lambda s: s.pop(_first(s)))))
add(AF, "weights", "an extra tensor", W + ("unexpected", "extra"),
    _load(_edit_state(lambda s: s.__setitem__("extra.weight", torch.zeros(2)))))
add(AF, "weights", "integer tensors", W + ("dtype",),
    _load(_edit_state(lambda s: s.__setitem__(_first(s), s[_first(s)].to(torch.int32)))))
add(AF, "config", "config.json missing", C, _load(lambda f: _cfgjson(f).unlink()))
add(AF, "config", "config.json not JSON", C, _load(lambda f: _cfgjson(f).write_text("{oops")))
add(AF, "config", "config.json a list", C, _load(lambda f: _cfgjson(f).write_text("[1, 2]")))
add(AF, "config", "config.json empty", C, _load(lambda f: _cfgjson(f).write_text("")))
for key in ("hidden_size", "layers", "format_version", "model_type", "num_kv_heads",
            "num_layers", "head_dim", "hidden"):
    add(AF, "config", f"key {key!r} missing", C + (key,),
        _load(_edit_config(lambda d, k=key: _pop(d, k))))
add(AF, "config", "an unknown extra key", C + ("bogus",),
    _load(_edit_config(lambda d: _set(d, "bogus", 1))))
for key, val in [
    ("format_version", 99), ("format_version", "2"), ("format_version", 0),
    ("format_version", None), ("hidden_size", 10 ** 9), ("hidden", 10 ** 8),
    ("num_kv_heads", -2), ("num_kv_heads", 0), ("head_dim", "x"), ("layers", [99]),
    ("layers", [-1]), ("layers", []), ("layers", "all"), ("kind", "transformer"),
    ("hidden", 0), ("recency", -1), ("blend", 5), ("blend_mode", "avg"),
    ("kernel_size", 2), ("head_layer", "last"), ("lora", "lora"), ("target", "x"),
    ("uses", {"agnostic": {"blend": 7}}), ("uses", {"bogus_use": {"recency": -1}}),
    ("uses", "aware"), ("model_type", 12),
]:
    add(AF, "config", f"{key}={val!r}", C + (key,),
        _load(_edit_config(lambda d, k=key, v=val: _set(d, k, v))))


def _set_use(d: dict, use: str, key: str, val: Any) -> None:
    d["uses"][use][key] = val


for use, key, val in [("aware", "blend", 7), ("aware", "recency", -1), ("agnostic", "kernel_size", 4),
                      ("agnostic", "blend_mode", "avg"), ("aware", "bogus", 1)]:
    add(AF, "config", f"uses[{use!r}][{key!r}]={val!r}", C + (key,),
        _load(_edit_config(lambda d, u=use, k=key, v=val: _set_use(d, u, k, v))))


def _config_hidden_size_and_weights_agree_but_model_differs() -> None:
    gem = sparsekv.ScorerAdapter.from_pretrained(adapter_dir("gemma3"))
    sparsekv.SparseKVCache(model("llama"), cfg(), gem.policy())


add(AF, "another model", "gemma3 head into SparseKVCache on llama", ("model", "gemma"),
    _config_hidden_size_and_weights_agree_but_model_differs)
add(AF, "another model", "policies.get('learned:<gemma3 head>') on llama", ("model", "gemma"),
    lambda: sparsekv.SparseKVCache(model("llama"), cfg(),
                                   pget(f"learned:{adapter_dir('gemma3')}")))
add(AF, "another model", "gemma3 head attach() onto llama", ("model", "gemma"),
    lambda: _attach_dir(adapter_dir("gemma3"), model("llama")))
add(AF, "another model", "llama head on a qwen3 model", ("model", "llama", "qwen"),
    lambda: sparsekv.SparseKVCache(model("qwen3"), cfg(),
                                   sparsekv.ScorerAdapter.from_pretrained(adapter_dir()).policy()))


def _attach_dir(folder: Path, m) -> None:
    with sparsekv.ScorerAdapter.from_pretrained(folder).attach(m):
        pass


# ---------------------------------------------------------------------------------------------
# surface 3: training configs
# ---------------------------------------------------------------------------------------------
TC = "train config"
TINY = ROOT / "configs" / "train" / "tiny-cpu.yaml"


def load_cfg(path, *overrides):
    from train.config import load_config
    return load_config(path, list(overrides))


def yaml_file(text: str) -> Path:
    _n[0] += 1
    p = TMP / f"train-{_n[0]}.yaml"
    p.write_text(text)
    return p


def tiny_yaml(extra: str) -> Path:
    return yaml_file(TINY.read_text() + "\n" + extra + "\n")


add(TC, "file", "missing config file", "nope.yaml", lambda: load_cfg(TMP / "nope.yaml"))
add(TC, "file", "YAML syntax error", ("not valid yaml", "line"),
    lambda: load_cfg(yaml_file("model: tiny:llama\nlayers: [1, 2\nlr: 0.1\n")))
add(TC, "file", "YAML tab indentation", ("yaml",),
    lambda: load_cfg(yaml_file("model: tiny:llama\nloss:\n\tkl_weight: 1\n")))
add(TC, "file", "YAML a list", ("mapping",), lambda: load_cfg(yaml_file("- a\n- b\n")))
add(TC, "file", "YAML a scalar", ("mapping",), lambda: load_cfg(yaml_file("just text\n")))
add(TC, "file", "duplicate key lr (YAML keeps the last)", ("lr", "duplicate"),
    lambda: load_cfg(yaml_file("model: tiny:llama\nlr: 0.1\nlr: -1\n")))
add(TC, "file", "duplicate key lr, both valid (YAML keeps the last)", ("lr", "duplicate"),
    lambda: load_cfg(yaml_file("model: tiny:llama\nlr: 0.1\nlr: 0.001\n")))
add(TC, "file", "lr: .nan", "lr", lambda: load_cfg(tiny_yaml("lr: .nan")))
add(TC, "file", "lr: .inf", "lr", lambda: load_cfg(tiny_yaml("lr: .inf")))
add(TC, "file", "unknown key 'learning_rate'", "learning_rate",
    lambda: load_cfg(tiny_yaml("learning_rate: 0.1")))
add(TC, "file", "typo key 'max_step'", "max_step", lambda: load_cfg(tiny_yaml("max_step: 3")))
for ov, nm in [
    ("lr=.nan", "lr"), ("lr=0", "lr"), ("lr=-1", "lr"), ("lr=fast", "lr"), ("lr=[1]", "lr"),
    ("lr=true", "lr"),
    ("max_steps=0", "max_steps"), ("max_steps=1.5", "max_steps"), ("max_steps=-3", "max_steps"),
    ("max_steps=ten", "max_steps"), ("batch_size=-1", "batch_size"), ("batch_size=0", "batch_size"),
    ("grad_accum=0", "grad_accum"), ("seq_len=0", "seq_len"), ("seq_len=2.5", "seq_len"),
    ("dtype=float8", "dtype"), ("attn_implementation=flash", "attn_implementation"),
    ("head=transformer", "head"), ("head_hidden=0", "head_hidden"), ("packing=zip", "packing"),
    ("log_with=wandb2", "log_with"), ("model=tiny:gpt2", "model"), ("layers=[]", "layers"),
    ("layers=[-1]", "layers"), ("layers=[1.5]", "layers"), ("layers=all", "layers"),
    ("push_to_hub=foo", "push_to_hub"), ("min_lr_ratio=2", "min_lr_ratio"),
    ("min_lr_ratio=.nan", "min_lr_ratio"), ("grad_clip=0", "grad_clip"),
    ("grad_clip=.nan", "grad_clip"), ("weight_decay=-1", "weight_decay"),
    ("weight_decay=.nan", "weight_decay"), ("warmup_steps=-1", "warmup_steps"),
    ("keep_last=0", "keep_last"), ("num_threads=0", "num_threads"), ("seed=-1", "seed"),
    ("seed=abc", "seed"), ("save_every=-1", "save_every"),
    ("teacher_block_size=0", "teacher_block_size"), ("max_documents=0", "max_documents"),
    ("cpu=maybe", "cpu"), ("progress_bar=3", "progress_bar"),
    ("target.bogus=1", ("target", "bogus")), ("loss.bogus=1", ("loss", "bogus")),
    ("inference.blend=5", ("inference", "blend")), ("inference.bogus=1", ("inference", "bogus")),
    ("inference.kernel_size=4", ("inference", "kernel_size")), ("lora.r=0", ("lora", "r")),
    ("lora.bogus=1", ("lora", "bogus")), ("build.bogus=1", ("build", "bogus")),
    ("target=5", "target"), ("loss=[1]", "loss"),
    ("max_steps", ("max_steps", "key=value")), ("=3", ("=3", "key=value")),
    ("layers=[1, 2", ("layers", "yaml")), ("seed.x=1", ("seed", "sub-key")),
    ("bogus_key=1", "bogus_key"),
]:
    add(TC, "override", ov, nm, (lambda o=ov: load_cfg(TINY, o)))


def _train(*overrides: str):
    from train.loop import main as train_main
    out = TMP / f"trainrun-{_n[0]}"
    _n[0] += 1
    return train_main(["--config", str(TINY), f"output_dir={out}", "max_steps=1",
                       "log_with=none", "progress_bar=false", *overrides])


# (a missing local .jsonl is built by data/build.py by design, so it is not a bad input)
add(TC, "run", "missing dataset file (.txt)", ("dataset", "missing.txt"),
    lambda: _train(f"dataset={TMP / 'missing.txt'}"))
add(TC, "run", "dataset: no such Hub dataset (offline)", ("dataset", "no-such-org"),
    lambda: _train("dataset=no-such-org/no-such-corpus"))
add(TC, "run", "text_field not in the dataset", ("text_field", "body"),
    lambda: _train("text_field=body"))
add(TC, "run", "resume=maybe (not a checkpoint)", ("resume", "maybe"), lambda: _train("resume=maybe"))


def _resume_other_model():
    from train.loop import main as train_main
    out = TMP / "trainrun-resume"
    base = ["--config", str(TINY), f"output_dir={out}", "log_with=none", "progress_bar=false"]
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        train_main([*base, "max_steps=2", "save_every=1"])
    return train_main([*base, "max_steps=3", "save_every=1", "model=tiny:gemma3"])


add(TC, "run", "resume a llama run onto tiny:gemma3", ("model", "gemma", "llama"),
    _resume_other_model)


# ---------------------------------------------------------------------------------------------
# surface 4: the eval CLI
# ---------------------------------------------------------------------------------------------
EV = "eval cli"
GRID = ["--model", "tiny:llama", "--policy", "snapkv", "--budget", "0.3", "--tasks", "passkey",
        "--lengths", "128", "--samples", "1", "--protocol", "agnostic", "--threads", "1",
        "--no-progress"]


def cli(*argv: str) -> int:
    from sparsekv.cli import main
    return main(list(argv))


def _out() -> str:
    _n[0] += 1
    return str(TMP / f"eval-{_n[0]}")


def _grid(**replace: str) -> list[str]:
    g = list(GRID)
    for flag, val in replace.items():
        flag = "--" + flag.replace("_", "-")
        g[g.index(flag) + 1] = val
    return g


def ev_flag(name, names, *argv, **replace):
    add(EV, "flags", name, names,
        (lambda a=argv, r=replace: cli("eval", *_grid(**r), *a, "--out", _out())), cli=True)


ev_flag("--tasks passkey,needle", "needle", tasks="passkey,needle")
ev_flag("--tasks ''", "task", tasks="")
ev_flag("--policy magic", "magic", policy="magic")
ev_flag("--policy ''", "polic", policy="")
ev_flag("--policy snapkv@window", "window", policy="snapkv@window")
ev_flag("--policy snapkv@window=0", "window", policy="snapkv@window=0")
ev_flag("--policy snapkv@bogus=1", "bogus", policy="snapkv@bogus=1")
ev_flag("--policy snapkv@schedule=zigzag", "schedule", policy="snapkv@schedule=zigzag")
ev_flag("--policy learned:/nonexistent", "/nonexistent", policy="learned:/nonexistent")
ev_flag("--budget 1.5", "budget", budget="1.5")
ev_flag("--budget abc", "budget", budget="abc")
ev_flag("--budget 0", "budget", budget="0")
ev_flag("--budget -0.3", "budget", budget="-0.3")
ev_flag("--budget nan", "budget", budget="nan")
ev_flag("--budget ''", "budget", budget="")
ev_flag("--budget 0.3,,0.5", "budget", budget="0.3,,0.5")
ev_flag("--protocol blind", "protocol", protocol="blind")
ev_flag("--lengths 12", "length", lengths="12")
ev_flag("--lengths abc", "length", lengths="abc")
ev_flag("--lengths -128", "length", lengths="-128")
ev_flag("--samples 0", "samples", samples="0")
ev_flag("--samples -1", "samples", samples="-1")
ev_flag("--samples abc", "samples", samples="abc")
ev_flag("--threads 0", "threads", threads="0")
ev_flag("--seed abc", "seed", "--seed", "abc")
ev_flag("--workers 0", "workers", "--workers", "0")
ev_flag("--workers -2", "workers", "--workers", "-2")
ev_flag("--dtype float8", "dtype", "--dtype", "float8")
ev_flag("--attn flash", ("attn", "attn_implementation"), "--attn", "flash")
ev_flag("--model tiny:gpt2", ("model", "gpt2"), model="tiny:gpt2")
ev_flag("--model /nonexistent", ("model", "/nonexistent"), model="/nonexistent/model")
ev_flag("--eviction rerank_every=-1", "rerank_every", "--eviction", "rerank_every=-1")
ev_flag("--eviction bogus=1", "bogus", "--eviction", "bogus=1")
ev_flag("--eviction garbage", "eviction", "--eviction", "garbage")
ev_flag("--eviction budget=0.3", ("budget", "eviction"), "--eviction", "budget=0.3")
ev_flag("--eviction layout=paged", "layout", "--eviction", "layout=paged")
ev_flag("--eviction prefill_chunk=0", "prefill_chunk", "--eviction", "prefill_chunk=0")
ev_flag("--adapter /nonexistent", "/nonexistent", "--adapter", "/nonexistent/adapter")
ev_flag("--bogus-flag", "bogus", "--bogus-flag")
ev_flag("--source without --ingest", ("source", "ingest"), "--source", "kvpress")
add(EV, "flags", "--report-only on an empty folder", ("report", "results", "folder", "rows"),
    lambda: cli("eval", "--report-only", "--out", _out()), cli=True)
add(EV, "flags", "--readme-plots without --report-only", ("readme-plots", "readme plot"),
    lambda: cli("eval", *GRID, "--readme-plots", "x", "--out", _out()), cli=True)
add(EV, "flags", "model-info --model /nonexistent", ("model", "/nonexistent"),
    lambda: cli("model-info", "--model", "/nonexistent/model"), cli=True)
add(EV, "flags", "model-info --dtype float8", ("dtype", "float8"),
    lambda: cli("model-info", "--model", "tiny:llama", "--dtype", "float8"), cli=True)


def ev_config(name, names, text):
    def run():
        p = yaml_file(text)
        return cli("eval", "--config", str(p), "--out", _out())
    add(EV, "config file", name, names, run, cli=True)


ev_config("config: YAML syntax error", ("yaml",), "tasks: [passkey\nbudgets: 0.3\n")
ev_config("config: unknown key", "task_list", "model: tiny:llama\ntask_list: [passkey]\n")
ev_config("config: unknown task", "haystack", "model: tiny:llama\ntasks: [passkey, haystack]\n")
ev_config("config: bad task option", ("keys", "task_options"),
          "model: tiny:llama\ntask_options: {multikey: {keys: 3}}\n")
ev_config("config: budgets a string", "budget", "model: tiny:llama\nbudgets: lots\n")
ev_config("config: eviction a list", "eviction", "model: tiny:llama\neviction: [1, 2]\n")
ev_config("config: samples -3", "samples", "model: tiny:llama\nsamples: -3\n")
ev_config("config: a list", ("mapping", "config"), "- a\n- b\n")
add(EV, "config file", "config: missing file", ("missing.yaml",),
    lambda: cli("eval", "--config", str(TMP / "missing.yaml")), cli=True)


def ev_ingest(name, names, text):
    def run():
        p = TMP / f"ingest-{_n[0]}.jsonl"
        _n[0] += 1
        p.write_text(text)
        return cli("eval", "--out", _finished_run(), "--ingest", str(p), "--source", "kvpress")
    add(EV, "ingest", name, names, run, cli=True)


ev_ingest("ingest: not JSON", ("ingest", ".jsonl", "line"), "{not json\n")
ev_ingest("ingest: row without keys", ("ingest", ".jsonl", "line", "task"), '{"a": 1}\n')
add(EV, "ingest", "ingest: missing file", ("missing.jsonl",),
    lambda: cli("eval", "--out", _finished_run(), "--ingest", str(TMP / "missing.jsonl")), cli=True)


def _finished_run() -> str:
    """A folder holding one finished tiny grid (built once; copied by the cases)."""
    if "run" not in _CACHE:
        out = str(TMP / "finished")
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            rc = cli("eval", *GRID, "--out", out)
        assert rc == 0, rc
        _CACHE["run"] = out
    _n[0] += 1
    copy = str(TMP / f"run-copy-{_n[0]}")
    shutil.copytree(_CACHE["run"], copy)
    return copy


add(EV, "rows", "a fresh run into a folder with rows", ("--resume", "--overwrite", "rows"),
    lambda: cli("eval", *GRID, "--out", _finished_run()), cli=True)
add(EV, "rows", "--resume onto another model's rows", ("model", "qwen3"),
    lambda: cli("eval", *_grid(model="tiny:qwen3"), "--resume", "--out", _finished_run()),
    cli=True)
add(EV, "rows", "--overwrite onto another model's rows", ("model", "qwen3"),
    lambda: cli("eval", *_grid(model="tiny:qwen3"), "--overwrite", "--out", _finished_run()),
    cli=True)
add(EV, "rows", "--resume with another seed", ("seed",),
    lambda: cli("eval", *GRID, "--seed", "9", "--resume", "--out", _finished_run()), cli=True)


def _locked():
    from sparsekv.evaluation.rows.folder import FolderLock
    out = _finished_run()
    with FolderLock(out):
        return cli("eval", *_grid(budget="0.5"), "--resume", "--out", out)


add(EV, "rows", "a folder locked by another run", ("lock", "busy", "pid"), _locked, cli=True)


def _torn_rows():
    out = _finished_run()
    with open(Path(out) / "results.jsonl", "a") as f:
        f.write('{"sample_id": "x", "task": "pa')
    return cli("eval", *_grid(budget="0.5"), "--resume", "--out", out)


add(EV, "rows", "--resume with a torn last row (dropped with a note)", ("results.jsonl", "torn"),
    _torn_rows, cli=True, warn_ok=True)
add(EV, "rows", "--policy learned:<gemma3 head> on tiny:llama", ("model", "gemma"),
    lambda: cli("eval", *_grid(policy=f"learned:{adapter_dir('gemma3')}"), "--out", _out()),
    cli=True)


# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated surfaces (api, 'adapter files', ...)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "bad-inputs"))
    args = ap.parse_args(argv)
    only = set(args.only.split(",")) if args.only else set(SURFACES)
    cases = [c for c in CASES if c.surface in only]
    t0 = time.time()
    results = []
    for i, c in enumerate(cases):
        r = classify(c)
        results.append(r)
        print(f"[{i + 1}/{len(cases)}] {r.outcome:7s} {c.surface} / {c.name}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r.__dict__ for r in results]
    summary = summarize(results, time.time() - t0)
    (out / "cases.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "summary.md").write_text(summary)
    print(summary)
    shutil.rmtree(TMP, ignore_errors=True)
    return 0


def summarize(results: list[Outcome], seconds: float) -> str:
    lines = [
        "# Bad-input sweep (issue 16's target)",
        "",
        (f"`python eval/sweep_bad_inputs.py` ({len(results)} cases, {seconds:.0f} s on a shared "
        "CPU, tiny random models). Outcome per case: **clear** (ValueError / TypeError / "
        "FileNotFoundError / SystemExit or CLI exit 2 whose message names the parameter, flag, "
        "key or file), **unclear** (another exception type, or a message naming none of them), "
        "**silent** (accepted). Every case and its message: `cases.json`."),
        "",
        "| surface | n | clear | unclear | silent |",
        "|---|---:|---:|---:|---:|",
    ]
    tot = {"n": 0, "clear": 0, "unclear": 0, "silent": 0}
    for s in SURFACES:
        rs = [r for r in results if r.surface == s]
        if not rs:
            continue
        cnt = {k: sum(r.outcome == k for r in rs) for k in ("clear", "unclear", "silent")}
        lines.append(f"| {s} | {len(rs)} | {cnt['clear']} | {cnt['unclear']} | {cnt['silent']} |")
        tot["n"] += len(rs)
        for k, v in cnt.items():
            tot[k] += v
    share = tot["clear"] / tot["n"] if tot["n"] else math.nan
    lines.append(f"| **all** | {tot['n']} | {tot['clear']} | {tot['unclear']} | {tot['silent']} |")
    lines += ["", f"Share clear: **{100 * share:.1f}%** (target: >= 95% and no silent case).", ""]
    lines += [
        ("Notes: an OSError (not FileNotFoundError) counts as unclear even when its message names "
        "the path, as the issue's definition asks. An exception that escapes `sparsekv.cli.main` "
        "is a raw traceback to the user, so unclear whatever it says. Inputs the library accepts "
        "by design are not swept: a missing local `.jsonl` dataset (built by data/build.py), an "
        "adapter config without `kind` (defaults to mlp and the weights must match), float16 "
        "adapter weights (read as float32), a negative eval `--seed`. A torn last line of "
        "`results.jsonl` on `--resume` is dropped with a note naming the file (issue 16's fix): "
        "that case counts as clear when the note is printed."),
        "",
    ]
    bad = [r for r in results if r.outcome != "clear"]
    lines.append("## Cases that are not clear" if bad else "Every case is clear.")
    for r in bad:
        msg = r.message.replace("|", "\\|").replace("\n", " ")
        lines.append(
            f"- **{r.outcome}** · {r.surface} / {r.group} · `{r.name}` · {r.error_type or '-'}: "
            f"{msg[:400]} (expected a message naming one of {r.names})"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
