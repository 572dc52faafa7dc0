"""Round 2, surface "files": damaged or odd files the library reads, none of round 1's
(eval/bad_inputs/adapter_files.py edits config.json fields and the weights' bytes; api.py loads a
garbled / truncated / version-99 context): adapter folders whose files are links, folders or
other formats, a base model's folder or a context's folder given as an adapter; saved contexts
whose context.json fields were edited or whose tensors came from another save; training JSONL
files with torn, empty or mistyped lines; results.jsonl files of eval runs read by
`sparsekv eval --report-only` / `--resume`."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import sparsekv
from eval.bad_inputs.eval_cli import GRID, cli
from eval.bad_inputs.framework import (
    _CACHE,
    TMP,
    Verdict,
    add2,
    cfg,
    damaged,
    edited_copy,
    ids,
    json_edit,
    model,
)
from eval.bad_inputs.framework import fresh as _fresh

FI = "files"



# ---------------------------------------------------------------------------------------------
# adapter folders
# ---------------------------------------------------------------------------------------------
AD = "adapter folder"


def _load_adapter(edit):
    return lambda: sparsekv.ScorerAdapter.from_pretrained(damaged(edit))


def _dangling_weights(f: Path) -> None:
    """The weights moved elsewhere and a link left behind (a `ln -s` onto a scratch disk)."""
    (f / "model.safetensors").unlink()
    (f / "model.safetensors").symlink_to(TMP / "scratch-gone" / "model.safetensors")


def _weights_a_folder(f: Path) -> None:
    """An unzip tool made model.safetensors/ a folder holding the file."""
    data = (f / "model.safetensors").read_bytes()
    (f / "model.safetensors").unlink()
    (f / "model.safetensors").mkdir()
    (f / "model.safetensors" / "model.safetensors").write_bytes(data)


def _config_a_folder(f: Path) -> None:
    text = (f / "config.json").read_text()
    (f / "config.json").unlink()
    (f / "config.json").mkdir()
    (f / "config.json" / "config.json").write_text(text)


def _peft_names(f: Path) -> None:
    """Files renamed to PEFT's names (adapter_model.safetensors / adapter_config.json)."""
    (f / "model.safetensors").rename(f / "adapter_model.safetensors")


def _pytorch_bin(f: Path) -> None:
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(str(f / "model.safetensors")), f / "pytorch_model.bin")
    (f / "model.safetensors").unlink()


def _weights_linked_to_other(f: Path) -> None:
    """model.safetensors a symlink to another adapter's weights (hidden 16, config says 8)."""
    other = _CACHE.get("adapter16")
    if other is None:
        other = sparsekv.ScorerAdapter.for_model(model(), hidden=16).save_pretrained(
            TMP / "adapter-hidden16")
        _CACHE["adapter16"] = other
    (f / "model.safetensors").unlink()
    (f / "model.safetensors").symlink_to(other / "model.safetensors")


add2(FI, AD, "model.safetensors a dangling symlink", ("model.safetensors",),
     _load_adapter(_dangling_weights))
add2(FI, AD, "model.safetensors a folder (unzipped into itself)", ("model.safetensors",),
     _load_adapter(_weights_a_folder))
add2(FI, AD, "config.json a folder", ("config.json",), _load_adapter(_config_a_folder))
add2(FI, AD, "weights renamed adapter_model.safetensors (PEFT's name)",
     ("model.safetensors", "adapter_model"), _load_adapter(_peft_names))
add2(FI, AD, "weights as pytorch_model.bin instead of safetensors",
     ("model.safetensors", "pytorch_model.bin"), _load_adapter(_pytorch_bin))
add2(FI, AD, "model.safetensors linked to another adapter's weights (hidden 16)",
     ("model.safetensors", "hidden", "shape"), _load_adapter(_weights_linked_to_other))


def _base_model_folder() -> Path:
    """A Hugging Face model folder (what `save_pretrained` of the base model writes)."""
    folder = _fresh("hf-model")
    model().save_pretrained(folder)
    return folder


add2(FI, AD, "a base model's folder given as the adapter", ("adapter", "config.json",
                                                             "sparsekv_type"),
     lambda: sparsekv.ScorerAdapter.from_pretrained(_base_model_folder()))


def _ctx() -> sparsekv.CompressedContext:
    if "files-ctx" not in _CACHE:
        _CACHE["files-ctx"] = sparsekv.compress(model(), ids(40), cfg())
    return _CACHE["files-ctx"]


def _saved_ctx() -> Path:
    if "files-ctx-dir" not in _CACHE:
        _CACHE["files-ctx-dir"] = _ctx().save(TMP / "files-ctx")
    return _CACHE["files-ctx-dir"]


add2(FI, AD, "a saved context's folder given as the adapter", ("adapter", "config.json",
                                                                "context"),
     lambda: sparsekv.ScorerAdapter.from_pretrained(_saved_ctx()))

# ---------------------------------------------------------------------------------------------
# saved contexts (CompressedContext.save / load)
# ---------------------------------------------------------------------------------------------
CX = "saved context"


def _ctx_copy(edit) -> Path:
    return edited_copy(_saved_ctx(), "ctx-edit", edit)


def _edit_meta(change):
    return json_edit("context.json", change, indent=2)


def _load_ctx(edit):
    return lambda: sparsekv.CompressedContext.load(_ctx_copy(edit), model())


def _set(d, k, v):
    d[k] = v


def _other_tensors(folder: Path) -> None:
    """context.safetensors copied from another context's folder (of the same length)."""
    other = sparsekv.compress(model(), ids(40) + 5, cfg()).save(_fresh("ctx-other"))
    shutil.copy(other / "context.safetensors", folder / "context.safetensors")


def _layers_cut(d):
    d["layers"] = d["layers"][:2]
    d["kept"] = d["kept"][:2]


def _other_meta(folder: Path) -> None:
    """context.json copied from another context's folder (one of 30 tokens), tensors kept."""
    other = sparsekv.compress(model(), ids(30), cfg()).save(_fresh("ctx-other30"))
    shutil.copy(other / "context.json", folder / "context.json")


add2(FI, CX, "context.json num_tokens edited (41 for 40)", ("num_tokens", "context_ids"),
     _load_ctx(_edit_meta(lambda d: _set(d, "num_tokens", 41))))
add2(FI, CX, "context.json num_tokens a float (40.0, rewritten by a JSON tool)", ("num_tokens",),
     _load_ctx(_edit_meta(lambda d: _set(d, "num_tokens", 40.0))))
add2(FI, CX, "context.json from another context's folder (30 tokens, not 40)",
     ("context.json", "context.safetensors", "digest", "num_tokens"), _load_ctx(_other_meta))
add2(FI, CX, "context.json with two of the model's four layers", ("layers",),
     _load_ctx(_edit_meta(_layers_cut)))
add2(FI, CX, "context.json config.budget edited to 2.0", ("budget", "config"),
     _load_ctx(_edit_meta(lambda d: d["config"].__setitem__("budget", 2.0))))
add2(FI, CX, "context.json policy name edited to 'magic'", ("policy", "magic"),
     _load_ctx(_edit_meta(lambda d: d["policy"].update(name="magic", spec="magic"))))
add2(FI, CX, "context.json config a string", ("config",),
     _load_ctx(_edit_meta(lambda d: _set(d, "config", "budget=0.5"))))
add2(FI, CX, "context.safetensors from another context's folder", ("context.safetensors",
                                                                   "digest"),
     _load_ctx(_other_tensors))
add2(FI, CX, "context.safetensors empty (0 bytes)", ("context.safetensors",),
     _load_ctx(lambda f: (f / "context.safetensors").write_bytes(b"")))
add2(FI, CX, "an empty folder (made by hand for the context)", ("context.json", "context"),
     lambda: sparsekv.CompressedContext.load((p := _fresh("empty-ctx")).mkdir() or p, model()))

# ---------------------------------------------------------------------------------------------
# training JSONL data
# ---------------------------------------------------------------------------------------------
TD = "training data"
TRAIN_DOCS = [{"text": "The quick brown fox jumps over the lazy dog. " * 6 + f"Doc {i}."}
              for i in range(12)]


def _train_yaml(dataset: Path) -> Path:
    p = _fresh("train-yaml").with_suffix(".yaml")
    p.write_text(
        "model: tiny:llama\nnum_threads: 1\nhead_hidden: 8\nteacher_block_size: 64\n"
        f"dataset: {dataset}\nseq_len: 64\nbatch_size: 1\nmax_steps: 1\nwarmup_steps: 0\n"
        "log_with: none\nprogress_bar: false\nsave_every: 0\n"
    )
    return p


def _train_on(lines: list[str]):
    def run():
        from train.loop import main as train_main
        data = _fresh("docs").with_suffix(".jsonl")
        data.write_text("".join(x + "\n" for x in lines))
        return train_main(["--config", str(_train_yaml(data)), f"output_dir={_fresh('trun')}"])
    return run


GOOD = [json.dumps(d) for d in TRAIN_DOCS]
add2(FI, TD, "a bad JSON line in the middle (a hand edit)", (".jsonl", "line"),
     _train_on(GOOD[:5] + ['{"text": "unterminated'] + GOOD[5:]))
add2(FI, TD, "a row whose text is null", ("text", "line"),
     _train_on(GOOD[:3] + ['{"text": null}'] + GOOD[3:]))
add2(FI, TD, "a row whose text is a number", ("text", "line"),
     _train_on(GOOD[:3] + ['{"text": 12345}'] + GOOD[3:]))
add2(FI, TD, "a .jsonl file of 0 bytes", (".jsonl", "empty", "no documents"), _train_on([]))
add2(FI, TD, "a .jsonl of a single JSON array (not one object a line)", (".jsonl", "line",
                                                                        "object"),
     _train_on([json.dumps(TRAIN_DOCS)]))
add2(FI, TD, "every row's text empty", ("text", "empty", "no tokens", "documents"),
     _train_on([json.dumps({"text": ""})] * 12))

# ---------------------------------------------------------------------------------------------
# eval run folders (results.jsonl read by --report-only / --resume)
# ---------------------------------------------------------------------------------------------
EV = "eval results"


def _run_copy() -> Path:
    if "files-run" not in _CACHE:
        out = TMP / "files-finished"
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            rc = cli("eval", *GRID, "--out", str(out))
        assert rc == 0, rc
        _CACHE["files-run"] = out
    copy = _fresh("files-run")
    shutil.copytree(_CACHE["files-run"], copy)
    return copy


def _edit_rows(change):
    """A finished run with its results.jsonl rows changed by `change(rows) -> lines`."""
    def make() -> Path:
        out = _run_copy()
        p = out / "results.jsonl"
        rows = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
        p.write_text("".join(x + "\n" for x in change(rows)))
        return out
    return make


def _report(make, *extra):
    return lambda: cli("eval", "--report-only", "--out", str(make()), *extra)


def _report_judged(make, word: str):
    """--report-only on an edited folder: refused naming `word` (clear), a note naming it on
    stderr (clear), or the report built without a word (silent: what summary.csv then says)."""
    def run():
        out = make()
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = cli("eval", "--report-only", "--out", str(out))
        msg = err.getvalue().strip()
        if rc == 2 and word in msg:
            return Verdict("clear", msg.splitlines()[-1])
        if rc not in (0, 2):
            return Verdict("unclear", f"exit {rc}: {msg[-300:]}")
        if rc == 2:
            return Verdict("unclear", f"exit 2 naming no {word!r}: {msg[-300:]}")
        if word in msg:
            return Verdict("clear", f"a note: {msg.splitlines()[-1]}")
        rows = (out / "summary.csv").read_text().splitlines()
        snap = next((x for x in rows if ",snapkv," in x), rows[-1])
        return Verdict("silent", f"exit 0, no note; summary.csv: {rows[0][:90]} / {snap[:90]}")
    return run


def _resume(make):
    return lambda: cli("eval", *GRID, "--resume", "--out", str(make()))


def _drop_key(rows, key):
    rows[-1].pop(key)
    return [json.dumps(r) for r in rows]


def _bad_mid(rows):
    lines = [json.dumps(r) for r in rows]
    return [lines[0], "<<<<<<< HEAD", *lines[1:]]


def _score_text(rows):
    rows[-1]["score"] = "n/a"  # a peer's tool writing "n/a" for a sample it could not score
    return [json.dumps(r) for r in rows]


add2(FI, EV, "--report-only: a row without 'score'", ("score",),
     _report_judged(_edit_rows(lambda rows: _drop_key(rows, "score")), "score"))
add2(FI, EV, "--report-only: a git conflict marker line in the middle", ("results.jsonl",
                                                                         "line"),
     _report(_edit_rows(_bad_mid)), cli=True)
add2(FI, EV, "--report-only: a row's score the string 'n/a'", ("score",),
     _report_judged(_edit_rows(_score_text), "score"))
add2(FI, EV, "--resume: a row without 'policy'", ("results.jsonl", "policy"),
     _resume(_edit_rows(lambda rows: _drop_key(rows, "policy"))), cli=True)


def _results_a_folder() -> Path:
    out = _run_copy()
    (out / "results.jsonl").unlink()
    (out / "results.jsonl").mkdir()
    return out


add2(FI, EV, "--report-only: results.jsonl a folder", ("results.jsonl",),
     _report(_results_a_folder), cli=True)


def _rows_doubled() -> Verdict:
    """results.jsonl concatenated with itself (`cat a b > results.jsonl` of two copies): the
    report must not count a sample twice, or say it found duplicates."""
    out = _edit_rows(lambda rows: [json.dumps(r) for r in rows + rows])()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli("eval", "--report-only", "--out", str(out))
    msg = err.getvalue()
    if rc == 2 and any(w in msg.lower() for w in ("duplicate", "twice", "results.jsonl")):
        return Verdict("clear", msg.strip().splitlines()[-1])
    if rc != 0:
        return Verdict("unclear", f"exit {rc}: {msg.strip()[-300:]}")
    if "duplicate" in msg.lower():
        return Verdict("clear", f"reported with a warning: {msg.strip()[-300:]}")
    summary = (out / "summary.csv").read_text()
    return Verdict("silent", f"report built from doubled rows without a word; summary.csv: "
                   f"{summary.splitlines()[1][:160] if len(summary.splitlines()) > 1 else ''}")


add2(FI, EV, "--report-only: every row twice (two copies concatenated)", ("duplicate",),
     _rows_doubled)
