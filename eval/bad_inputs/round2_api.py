"""Round 2, surface "api": the public API with inputs round 1 (eval/bad_inputs/api.py) does not
try: numpy and torch scalars for numbers, bools for ints, numbers as strings, odd containers,
batches and masks the cache cannot take, caches reused or crossed, contexts and adapters used
after they were changed, saves onto paths that hold something else."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import sparsekv
from eval.bad_inputs.framework import (
    _CACHE,
    TMP,
    Verdict,
    _n,
    adapter,
    adapter_dir,
    add2,
    cfg,
    ids,
    model,
)

API = "api"
EC = "EvictionConfig"
NAN = float("nan")


def ec(**kw):
    return sparsekv.EvictionConfig(**{"budget": 0.5, **kw})


for field_name, v in [
    ("budget", np.float32(0.3)), ("budget", torch.tensor(0.3)), ("budget", "abc"),
    ("budget", "0tok"), ("budget", "-5tok"), ("budget", "2.5tok"), ("budget", 1e-9),
    ("budget", complex(0.3, 0)), ("budget", np.int64(1)),
    ("schedule", "Pyramid"), ("schedule", {"a": 0.5}), ("schedule", (0.5, None, 0.5, 0.5)),
    ("schedule", [0.5, "0.5", 0.5, 0.5]),
    ("rerank_every", NAN), ("rerank_every", np.float64(16.0)),
    ("sink_tokens", True), ("sink_tokens", None), ("recent_window", True),
    ("recent_window", "64"), ("evict_slack", True), ("evict_slack", "8"), ("evict_slack", None),
    ("quantize", ""), ("quantize", 8), ("layout", ""), ("layout", 1),
    ("max_length", "4096"), ("max_length", True), ("pyramid_slope", float("inf")),
]:
    add2(API, EC, f"{field_name}={v!r}", field_name,
         (lambda f=field_name, v=v: ec(**{f: v})))
add2(API, EC, "from_dict(None)", ("from_dict", "dict", "mapping"),
     lambda: sparsekv.EvictionConfig.from_dict(None))
add2(API, EC, "from_dict('budget=0.3')", ("from_dict", "dict", "mapping"),
     lambda: sparsekv.EvictionConfig.from_dict("budget=0.3"))
add2(API, EC, "from_dict({'budget': '0.3'}) (a string number)", "budget",
     lambda: sparsekv.EvictionConfig.from_dict({"budget": "0.3"}))
add2(API, EC, "sink_tokens + recent_window above a token budget's max_length", (
    "max_length", "sink", "recent"),
     lambda: sparsekv.EvictionConfig(budget=16, layout="static", max_length=8))

SK = "SparseKVCache"
add2(API, SK, "model=object()", "model", lambda: sparsekv.SparseKVCache(object(), cfg(), "snapkv"))
add2(API, SK, "policy=a Policy class, not an instance", "policy",
     lambda: sparsekv.SparseKVCache(model(), cfg(),
                                    type(sparsekv.policies.get("snapkv"))))
add2(API, SK, "record=['scores'] (a list)", "record",
     lambda: sparsekv.SparseKVCache(model(), cfg(), "snapkv", record=["bogus"]))
add2(API, SK, "record_window='8'", "record_window",
     lambda: sparsekv.SparseKVCache(model(), cfg(budget=1.0), "full", record=("window",),
                                    record_window="8"))


def _generate(cache, input_ids, **kw):
    return model().generate(input_ids=input_ids, cache=cache, max_new_tokens=2, do_sample=False,
                            **kw)


def _mask_shorter():
    x = ids(20)
    return _generate(sparsekv.SparseKVCache(model(), cfg(), "snapkv"), x,
                     attention_mask=torch.ones(1, 12, dtype=torch.long))


add2(API, SK, "attention_mask shorter than input_ids", ("attention_mask", "mask"), _mask_shorter)


def _mask_zeros():
    x = ids(20)
    return _generate(sparsekv.SparseKVCache(model(), cfg(), "snapkv"), x,
                     attention_mask=torch.zeros(1, 20, dtype=torch.long))


add2(API, SK, "attention_mask all zeros", ("attention_mask", "mask", "padding"), _mask_zeros)


def _reuse_cache():
    """A cache holding one prompt passed again with another prompt: the new prompt is read as
    the continuation of the old one, so its answer differs from a fresh cache's."""
    cache = sparsekv.SparseKVCache(model(), cfg(budget=1.0), "full")
    _generate(cache, ids(20))
    other = torch.arange(30, 50).unsqueeze(0)
    got = _generate(cache, other)
    ref = _generate(sparsekv.SparseKVCache(model(), cfg(budget=1.0), "full"), other)
    if torch.equal(got, ref):
        return Verdict("clear", "a reused cache answers as a fresh one")
    return Verdict("silent", f"a reused cache continues the old prompt: {got.tolist()} vs "
                   f"fresh {ref.tolist()}")


add2(API, SK, "one cache passed to two generate calls with other prompts", ("cache", "reuse"),
     _reuse_cache)


def _crop_bad():
    cache = sparsekv.SparseKVCache(model(), cfg(budget=1.0), "full")
    _generate(cache, ids(20))
    cache.crop("3")


add2(API, SK, "cache.crop('3')", ("crop", "max_length"), _crop_bad)


def _float_input_ids():
    return _generate(sparsekv.SparseKVCache(model(), cfg(), "snapkv"), ids(20).float())


add2(API, SK, "generate with float input_ids through a cache", ("input_ids", "float"),
     _float_input_ids)

PG = "policies.get"


def pget(name, **kw):
    return sparsekv.policies.get(name, **kw)


for pol, kw, nm in [
    ("random", {"seed": True}, "seed"), ("random", {"seed": np.int64(3)}, "seed"),
    ("snapkv", {"window": True}, "window"), ("snapkv", {"window": np.float64(32)}, "window"),
    ("snapkv", {"kernel_size": -3}, "kernel_size"),
    ("pyramidkv", {"window": "32"}, "window"),
    ("expected_attention", {"future_positions": True}, "future_positions"),
    ("expected_attention", {"epsilon": "0.1"}, "epsilon"),
    ("expected_attention", {"query_sinks": 2.5}, "query_sinks"),
    ("kvzip", {"encode": lambda s: [1], "chunk": True}, "chunk"),
    ("kvzip", {"encode": lambda s: [1], "chunk": 8, "overlap": 8}, "overlap"),
    ("learned", {"adapter": str(TMP / "no-adapter-here")}, ("adapter", "no-adapter-here")),
]:
    add2(API, PG, f"{pol}: {kw!r}"[:90], nm, (lambda p=pol, k=kw: pget(p, **k)))
add2(API, PG, "' snapkv' (leading space)", ("snapkv", "policy"), lambda: pget(" snapkv"))
add2(API, PG, "'snapkv:foo' (an argument for a policy that takes none)", ("snapkv", "foo"),
     lambda: pget("snapkv:foo"))
for kw, nm in [({"blend": True}, "blend"), ({"recency": "1"}, "recency"),
               ({"kernel_size": np.int64(3)}, "kernel_size"), ({"use": ""}, "use")]:
    add2(API, PG, f"learned (adapter): {kw!r}", nm,
         (lambda k=kw: pget("learned", adapter=adapter(), **k)))

AD = "ScorerAdapter"
for kw, nm in [({"hidden": True}, "hidden"), ({"hidden": "8"}, "hidden"), ({"hidden": 1.5}, "hidden"),
               ({"kind": None}, "kind"), ({"layers": [0, 0]}, "layers"), ({"layers": "0"}, "layers"),
               ({"layers": [True]}, "layers")]:
    add2(API, AD, f"for_model({kw!r})", nm,
         (lambda k=kw: sparsekv.ScorerAdapter.for_model(model(), **k)))


def _attach(**kw):
    with adapter().attach(model(), **kw):
        pass


for kw, nm in [({"budget": True}, "budget"), ({"budget": "0.3"}, "budget"),
               ({"rerank_every": -1}, "rerank_every"), ({"lora": "yes"}, "lora"),
               ({"recency": -2}, "recency"), ({"sink_tokens": "4"}, "sink_tokens")]:
    add2(API, AD, f"attach({kw!r})", nm, (lambda k=kw: _attach(**k)))
add2(API, AD, "attach(None)", "model", lambda: _attach_model(None))


def _attach_model(m):
    with adapter().attach(m):
        pass


def _nested_attach():
    """The inner block's settings apply inside it, the outer's again after it."""
    a, m = adapter(), model()
    with a.attach(m, budget=0.3) as outer:
        with a.attach(m, budget=0.5) as inner:
            m.generate(input_ids=ids(20), max_new_tokens=1, do_sample=False)
        m.generate(input_ids=ids(20), max_new_tokens=1, do_sample=False)
    got = (inner.last_cache.config.budget, outer.last_cache.config.budget)
    if got == (0.5, 0.3) and "generate" not in vars(m):
        return Verdict("clear", "the inner settings inside, the outer after, generate restored")
    return Verdict("silent", f"budgets used (inner, outer): {got}")


add2(API, AD, "attach nested inside attach on the same model", ("attach", "already"),
     _nested_attach)
add2(API, AD, "policy(use='nope')", ("use", "nope"), lambda: adapter().policy(use="nope"))
add2(API, AD, "from_pretrained(None)", ("path", "None", "from_pretrained"),
     lambda: sparsekv.ScorerAdapter.from_pretrained(None))
add2(API, AD, "from_pretrained(123)", ("path", "123", "from_pretrained"),
     lambda: sparsekv.ScorerAdapter.from_pretrained(123))
add2(API, AD, "save_pretrained('')", ("save_directory", "path", "''"),
     lambda: adapter().save_pretrained(""))


def _save_onto_file():
    p = TMP / "a-file.txt"
    p.write_text("keep me")
    adapter().save_pretrained(p)


add2(API, AD, "save_pretrained onto an existing file", ("a-file.txt", "file"), _save_onto_file)

CP = "compress / CompressedContext"


def comp(x, **kw):
    return sparsekv.compress(model(), x, cfg(), **kw)


add2(API, CP, "context_ids of batch 2", ("context_ids", "one sequence"),
     lambda: comp(torch.ones(2, 8, dtype=torch.long)))
add2(API, CP, "context_ids a ragged list of lists", "context_ids",
     lambda: comp([[1, 2, 3], [4, 5]]))
add2(API, CP, "context_ids a list of bools", "context_ids", lambda: comp([True, False, True]))
add2(API, CP, "context_ids a numpy float array", "context_ids",
     lambda: comp(np.array([5.0, 6.0, 7.5])))
add2(API, CP, "context_ids a set", "context_ids", lambda: comp({5, 6, 7}))
add2(API, CP, "context_ids a list of numeric strings", "context_ids", lambda: comp(["5", "6"]))
add2(API, CP, "policy=None", "policy", lambda: comp(ids(), policy=None))
add2(API, CP, "lora=1", "lora", lambda: comp(ids(), lora=1))


def _ctx():
    if "ctx2" not in _CACHE:
        _CACHE["ctx2"] = sparsekv.compress(model(), ids(40), cfg())
    return _CACHE["ctx2"]


add2(API, CP, "generate(question_ids=[])", "question_ids", lambda: _ctx().generate([]))
add2(API, CP, "generate(question_ids of batch 2)", "question_ids",
     lambda: _ctx().generate(torch.ones(2, 3, dtype=torch.long)))
add2(API, CP, "generate(question_ids='hi')", "question_ids", lambda: _ctx().generate("hi"))
add2(API, CP, "generate(max_new_tokens=-1)", "max_new_tokens",
     lambda: _ctx().generate([5, 6], max_new_tokens=-1))
add2(API, CP, "generate(max_new_tokens='4')", "max_new_tokens",
     lambda: _ctx().generate([5, 6], max_new_tokens="4"))
add2(API, CP, "ask with tokenizer=object()", "tokenizer",
     lambda: _ctx().ask("hi", tokenizer=object()))
add2(API, CP, "ask_many(['a', 3])", ("question", "3"),
     lambda: _ctx().ask_many(["a", 3], tokenizer=_char_tok()))
add2(API, CP, "compress_text(context=b'bytes')", "context",
     lambda: sparsekv.compress_text(model(), _char_tok(), b"bytes", cfg()))
add2(API, CP, "compress_text(add_special_tokens='no')", "add_special_tokens",
     lambda: sparsekv.compress_text(model(), _char_tok(), "hello", cfg(), add_special_tokens="no"))
add2(API, CP, "load(path, model=None)", "model",
     lambda: sparsekv.CompressedContext.load(_saved(), None))
add2(API, CP, "load(path, model=a string)", "model",
     lambda: sparsekv.CompressedContext.load(_saved(), "tiny:llama"))


def _char_tok():
    class CharTokenizer:
        bos_token_id = 1

        def __call__(self, text, add_special_tokens=True):
            got = [3 + ord(c) % 125 for c in text]
            return {"input_ids": ([1] if add_special_tokens else []) + got}

        def decode(self, got, skip_special_tokens=False):
            return "".join(chr(i - 3 + 32) for i in got if not (skip_special_tokens and i < 3))

    return CharTokenizer()


def _saved() -> Path:
    if "ctx2-saved" not in _CACHE:
        _CACHE["ctx2-saved"] = _ctx().save(TMP / "ctx2")
    return _CACHE["ctx2-saved"]


def _save_over_folder():
    """Saving a context onto a folder of other files (a run folder, an adapter) must not remove
    them."""
    _n[0] += 1
    folder = TMP / f"user-folder-{_n[0]}"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    (folder / "sub").mkdir()
    (folder / "sub" / "data.bin").write_bytes(b"1234")
    try:
        _ctx().save(folder)
    except (ValueError, FileExistsError, FileNotFoundError, TypeError) as e:
        left = (folder / "notes.txt").exists() and (folder / "sub" / "data.bin").exists()
        if not left:
            return Verdict("data loss", f"refused ({e}) but removed the folder's files")
        named = str(folder) in str(e) or "folder" in str(e)
        return Verdict("clear" if named else "unclear", f"{type(e).__name__}: {e}")
    left = (folder / "notes.txt").exists() and (folder / "sub" / "data.bin").exists()
    if not left:
        return Verdict("data loss", f"save replaced {folder}: notes.txt and sub/ are gone")
    return Verdict("silent", "saved into the folder beside its files")


add2(API, CP, "save onto a folder of someone else's files", ("folder",), _save_over_folder)


def _save_onto_adapter():
    _n[0] += 1
    import shutil
    folder = TMP / f"adapter-copy-{_n[0]}"
    shutil.copytree(adapter_dir(), folder)
    try:
        _ctx().save(folder)
    except (ValueError, FileExistsError) as e:
        ok = (folder / "model.safetensors").exists()
        return Verdict("clear" if ok else "data loss", f"{type(e).__name__}: {e}")
    if not (folder / "model.safetensors").exists():
        return Verdict("data loss", "save replaced an adapter folder: model.safetensors is gone")
    return Verdict("silent", "saved into the adapter folder")


add2(API, CP, "save onto an adapter folder", ("folder", "adapter"), _save_onto_adapter)


def _save_onto_file_ctx():
    p = TMP / "ctx-target.txt"
    p.write_text("keep me")
    try:
        _ctx().save(p)
    except (ValueError, FileExistsError, NotADirectoryError) as e:
        ok = p.is_file() and p.read_text() == "keep me"
        kind = type(e).__name__
        if not ok:
            return Verdict("data loss", f"{kind}: {e}; the file is gone")
        clear = kind != "NotADirectoryError" and "ctx-target.txt" in str(e)
        return Verdict("clear" if clear else "unclear", f"{kind}: {e}")
    if not (p.is_file() and p.read_text() == "keep me"):
        return Verdict("data loss", "save replaced a file with a context folder")
    return Verdict("silent", "accepted")


add2(API, CP, "save onto an existing file", ("ctx-target.txt",), _save_onto_file_ctx)
