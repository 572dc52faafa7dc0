"""Round 3, surface "files": files rounds 1 and 2 (adapter_files.py, round2_files.py) do not
touch: teacher store folders read by `python -m sparsekv.teacher.store info|verify` and by
`dataset=store:DIR` (a store.json garbled, of the wrong shape or missing a key; shards torn,
removed or flipped), saved contexts whose context.json records were edited in other places, and
training data files of kinds the loader does not read (CSV, gzip, plain text) or whose dataset
split / config cannot apply to a local file. A case is clear only when the message names the
file or key and says what is expected (`allowed`)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import sparsekv
from eval.bad_inputs.framework import _CACHE, TMP, Verdict, add3, edited_copy, json_edit, model
from eval.bad_inputs.framework import fresh as _fresh
from eval.bad_inputs.framework import tiny_docs as docs
from eval.bad_inputs.round3_api import saved_ctx

FI = "files"




def base_yaml(extra: str = "", dataset: Path | str | None = None) -> Path:
    p = _fresh("r3-train").with_suffix(".yaml")
    p.write_text(
        "model: tiny:llama\nnum_threads: 1\nhead_hidden: 8\nteacher_block_size: 64\n"
        f"dataset: {dataset or docs()}\nseq_len: 64\nbatch_size: 1\nmax_steps: 1\n"
        "warmup_steps: 0\nlog_with: none\nprogress_bar: false\nsave_every: 0\n" + extra)
    return p


def quiet(fn, *a, **kw):
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        return fn(*a, **kw)


def store_cli(*argv: str) -> int:
    from sparsekv.teacher.store import main
    return main(list(argv))


def tiny_store() -> Path:
    """A teacher store of 3 sequences of 64 tokens (one per shard), built once."""
    if "r3-store" not in _CACHE:
        out = TMP / "r3-store"
        rc = quiet(store_cli, "build", "--config", str(base_yaml()), "--out", str(out),
                   "--sequences", "3", "--length", "64", "--shard-size", "1", "--threads", "1",
                   "--no-progress", "--signals", "questions")
        assert rc in (0, None), rc
        _CACHE["r3-store"] = out
    return _CACHE["r3-store"]


def store_copy(edit) -> Path:
    return edited_copy(tiny_store(), "r3-store-edit", edit)


def _meta(change):
    return json_edit("store.json", change)


def _drop(key):
    def change(d):
        d.pop(key, None)
        return d
    return _meta(change)


def _shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("shard-*.safetensors"))


ST = "teacher store"


def info(edit):
    return lambda: store_cli("info", str(store_copy(edit)))


def verify(edit):
    return lambda: store_cli("verify", str(store_copy(edit)))


add3(FI, ST, "info: store.json garbled (a torn write by hand)", ("store.json",),
     info(lambda f: (f / "store.json").write_text('{"format": 1,')), cli=True,
     allowed=("JSON", "rebuild", "build"))
add3(FI, ST, "info: store.json a JSON list", ("store.json",),
     info(lambda f: (f / "store.json").write_text("[1, 2]")), cli=True,
     allowed=("object", "mapping"))
add3(FI, ST, "info: store.json without 'length'", ("store.json", "length"),
     info(_drop("length")), cli=True, allowed=("missing", "lacks"))
add3(FI, ST, "info: store.json 'layers' a string", ("store.json", "layers"),
     info(_meta(lambda d: {**d, "layers": "0,1,2,3"})), cli=True,
     allowed=("list", "fingerprint", "edited"))
add3(FI, ST, "verify: the first shard truncated", ("shard-00000",),
     verify(lambda f: _shards(f)[0].write_bytes(b"x" * 10)), cli=True,
     allowed=("parse", "damaged", "--resume"))
add3(FI, ST, "verify: the middle shard removed", ("shard-00001", "missing"),
     verify(lambda f: _shards(f)[1].unlink()), cli=True, allowed=("--resume", "missing"))
add3(FI, ST, "verify: every shard removed", ("shard", "no complete"),
     verify(lambda f: [p.unlink() for p in _shards(f)]), cli=True,
     allowed=("build", "--resume", "no complete"))


def _flip(folder: Path) -> None:
    p = _shards(folder)[-1]
    b = bytearray(p.read_bytes())
    b[-5] ^= 0xFF
    p.write_bytes(bytes(b))


add3(FI, ST, "verify: one byte flipped in a shard's tensors", ("shard-00002",),
     verify(_flip), cli=True, allowed=("checksum",))
add3(FI, ST, "info: a folder that is not a store", ("store.json", "not a teacher store"),
     lambda: store_cli("info", str(TMP)), cli=True, allowed=("build",))


def _train_on_store(edit):
    def run():
        from train.loop import main as train_main
        folder = store_copy(edit)
        return train_main(["--config", str(base_yaml()), f"dataset=store:{folder}",
                           f"output_dir={_fresh('r3-store-run')}"])
    return run


add3(FI, ST, "train dataset=store:<its store.json garbled>", ("store.json",),
     _train_on_store(lambda f: (f / "store.json").write_text('{"format": 1,')),
     allowed=("JSON", "build"))

# ---------------------------------------------------------------------------------------------
# saved contexts: records rounds 1 and 2 did not edit
# ---------------------------------------------------------------------------------------------
CX = "saved context"


def _ctx_edit(change):
    def run():
        folder = _fresh("r3-ctx-edit")
        shutil.copytree(saved_ctx(), folder)
        p = folder / "context.json"
        d = json.loads(p.read_text())
        change(d)
        p.write_text(json.dumps(d))
        return sparsekv.CompressedContext.load(folder, model())
    return run


add3(FI, CX, "context.json dtype edited to bfloat16", ("dtype", "bfloat16"),
     _ctx_edit(lambda d: d.__setitem__("dtype", "bfloat16")), allowed=("float32",))
add3(FI, CX, "context.json dtype 'float8' (not a dtype sparsekv writes)", ("dtype", "float8"),
     _ctx_edit(lambda d: d.__setitem__("dtype", "float8")), allowed=("bfloat16",))
add3(FI, CX, "context.json kept edited ([1, 1, 1, 1])", ("kept",),
     _ctx_edit(lambda d: d.__setitem__("kept", [1, 1, 1, 1])), allowed=("context.safetensors",
                                                                          "40", "match"))
add3(FI, CX, "context.json num_tokens negative", ("num_tokens",),
     _ctx_edit(lambda d: d.__setitem__("num_tokens", -40)), allowed=("int", ">= 1", "40"))
add3(FI, CX, "context.json model_shape a list", ("model_shape",),
     _ctx_edit(lambda d: d.__setitem__("model_shape", [])), allowed=("mapping", "object"))
add3(FI, CX, "context.json without 'policy'", ("policy",),
     _ctx_edit(lambda d: d.pop("policy")), allowed=("has the fields", "missing"))

# ---------------------------------------------------------------------------------------------
# training data of kinds the loader does not read, and split / config on a local file
# ---------------------------------------------------------------------------------------------
TD = "training data"


def _train_data(name: str, data: bytes, *extra: str):
    def run():
        from train.loop import main as train_main
        p = _fresh("r3-data").with_name(name)
        p.write_bytes(data)
        return train_main(["--config", str(base_yaml(dataset=p)),
                           f"output_dir={_fresh('r3-data-run')}", *extra])
    return run


TEXT = "The quick brown fox jumps over the lazy dog. " * 20
add3(FI, TD, "a .csv file", ("docs.csv",), _train_data("docs.csv", f"text\n{TEXT}\n".encode()),
     allowed=(".parquet",))


def _gz() -> bytes:
    import gzip
    return gzip.compress(docs().read_bytes())


add3(FI, TD, "a .jsonl.gz file (compressed JSONL)", ("docs.jsonl.gz",),
     lambda: _train_data("docs.jsonl.gz", _gz())(), allowed=(".parquet",))
add3(FI, TD, "an existing .txt file", ("docs.txt",), _train_data("docs.txt", TEXT.encode()),
     allowed=(".parquet",))


def _parquet(table: dict) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq
    p = _fresh("r3-pq").with_suffix(".parquet")
    pq.write_table(pa.table(table), p)
    return p.read_bytes()


add3(FI, TD, "a .parquet whose texts are in 'body'", ("text_field", "body"),
     lambda: _train_data("docs.parquet", _parquet({"body": [TEXT] * 12}))(),
     allowed=("columns",), cli=False)
add3(FI, TD, "a .parquet of garbage bytes", ("docs.parquet",),
     _train_data("docs.parquet", b"PAR1 not really a parquet file PAR1"), allowed=("read",))


def _split_on_local():
    from train.config import load_config
    from train.data import config_texts
    c = load_config(base_yaml(), ["dataset_split=validation"])
    texts = config_texts(c, build=False)
    return Verdict("silent", f"dataset_split=validation on a local .jsonl ignored: {len(texts)} "
                   "texts of the whole file read")


add3(FI, TD, "dataset_split=validation on a local .jsonl", ("dataset_split",), _split_on_local)


def _config_on_local():
    from train.config import load_config
    from train.data import config_texts
    c = load_config(base_yaml(), ["dataset_config=en"])
    texts = config_texts(c, build=False)
    return Verdict("silent", f"dataset_config=en on a local .jsonl ignored: {len(texts)} texts")


add3(FI, TD, "dataset_config=en on a local .jsonl", ("dataset_config",), _config_on_local)
