"""Bad-input cases of one surface: the public API (EvictionConfig, SparseKVCache, policies.get, ScorerAdapter, compress*)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import sparsekv
from eval.bad_inputs.framework import (
    _CACHE,
    TMP,
    adapter,
    adapter_dir,
    add,
    cfg,
    edited_copy,
    ids,
    model,
)

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
    return edited_copy(_saved_ctx(), "ctx", edit)


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
