"""Round 2, surface "train": training configs and runs with mistakes round 1
(eval/bad_inputs/train_config.py: YAML syntax, unknown keys, out-of-range overrides of the
top-level numbers, missing datasets) does not try: YAML's own readings of numbers and lists,
settings that contradict each other (warm-up longer than the run or than its schedule, a store
with a teacher cache), nested keys one level deeper, layers the model does not have, `store:`
datasets that are missing, not stores or of another length, and output folders that are files,
empty or hold another run. Tiny runs: model tiny:llama, 12 short documents, seq_len 64,
max_steps 1-2."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from eval.bad_inputs.framework import _CACHE, TMP, Verdict, add2
from eval.bad_inputs.framework import fresh as _fresh
from eval.bad_inputs.framework import tiny_docs as docs

TR = "train"




def base_yaml(extra: str = "") -> Path:
    p = _fresh("train2").with_suffix(".yaml")
    p.write_text(
        "model: tiny:llama\nnum_threads: 1\nhead_hidden: 8\nteacher_block_size: 64\n"
        f"dataset: {docs()}\nseq_len: 64\nbatch_size: 1\nmax_steps: 1\nwarmup_steps: 0\n"
        "log_with: none\nprogress_bar: false\nsave_every: 0\n" + extra
    )
    return p


def load(extra: str = "", *overrides: str):
    from train.config import load_config
    return load_config(base_yaml(extra), list(overrides))


def train(*overrides: str, extra: str = "", out: Path | None = None):
    from train.loop import main as train_main
    out = out if out is not None else _fresh("train2-run")
    return train_main(["--config", str(base_yaml(extra)), f"output_dir={out}", *overrides])


def quiet(fn, *a, **kw):
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        return fn(*a, **kw)


# ---------------------------------------------------------------------------------------------
# YAML's readings
# ---------------------------------------------------------------------------------------------
CF = "config"


def _lr_exponent() -> Verdict:
    """`lr: 1e-3` in a YAML file: PyYAML (YAML 1.1) reads it as the string '1e-3'."""
    c = load("lr: 1e-3\n")
    if isinstance(c.lr, float) and c.lr == 1e-3:
        return Verdict("clear", "lr: 1e-3 read as the float 0.001")
    return Verdict("silent", f"lr: 1e-3 read as {c.lr!r} ({type(c.lr).__name__})")


add2(TR, CF, "lr: 1e-3 in YAML (PyYAML reads a string)", ("lr",), _lr_exponent)
add2(TR, CF, "layers: 2 (an int, not a list)", ("layers",), lambda: load("layers: 2\n"))
add2(TR, CF, "layers: [0, 0, 1] (a layer twice; run)", ("layers",),
     lambda: train(extra="layers: [0, 0, 1]\n"))
add2(TR, CF, "num_threads=2.5", ("num_threads",), lambda: load("", "num_threads=2.5"))
add2(TR, CF, "max_samples=0", ("max_samples",), lambda: load("", "max_samples=0"))
add2(TR, CF, "text_field='' (empty)", ("text_field",), lambda: load("", "text_field="))

# ---------------------------------------------------------------------------------------------
# nested keys one level deeper, values of nested configs
# ---------------------------------------------------------------------------------------------
NE = "nested"
add2(TR, NE, "inference.uses.agnostic.bogus=1", ("bogus",),
     lambda: load("", "inference.uses.agnostic.bogus=1"))
add2(TR, NE, "inference.uses.agnostik.blend=0.5 (a misspelt use)", ("agnostik",),
     lambda: load("", "inference.uses.agnostik.blend=0.5"))


def _deep_valid() -> Verdict:
    """A valid two-level override (the agnostic use's blend) must be taken as written."""
    try:
        c = load("", "inference.uses.agnostic.blend=0.5")
    except ValueError as e:
        return Verdict("unclear", f"a valid setting refused: ValueError: {e}")
    got = c.inference_uses().get("agnostic", {}).get("blend")
    if got == 0.5:
        return Verdict("clear", "inference.uses.agnostic.blend=0.5 taken")
    return Verdict("silent", f"inference.uses.agnostic.blend=0.5 gave {got!r}")


add2(TR, NE, "inference.uses.agnostic.blend=0.5 (valid, two levels deep)", ("blend",),
     _deep_valid)
add2(TR, NE, "target.stat=maximum", ("stat", "maximum"), lambda: load("", "target.stat=maximum"))
add2(TR, NE, "target.decay=-0.5", ("decay",), lambda: load("", "target.decay=-0.5"))
add2(TR, NE, "loss.temperature=0", ("temperature",), lambda: load("", "loss.temperature=0"))
add2(TR, NE, "loss.budget=1.5", ("budget",), lambda: load("", "loss.budget=1.5"))
add2(TR, NE, "lora.target_modules=[q_prj] (a typo)", ("target_modules", "q_prj"),
     lambda: load("", "lora.target_modules=[q_prj]"))

# ---------------------------------------------------------------------------------------------
# settings that contradict each other
# ---------------------------------------------------------------------------------------------
CO = "conflicts"
add2(TR, CO, "warmup_steps=50 with max_steps=2 (the peak lr is never reached; run)",
     ("warmup_steps",), lambda: train("max_steps=2", "warmup_steps=50"), warn_ok=True)
add2(TR, CO, "schedule_steps=2 below warmup_steps=5 (run)", ("schedule_steps", "warmup_steps"),
     lambda: train("max_steps=2", "warmup_steps=5", "schedule_steps=2"), warn_ok=True)
add2(TR, CO, "dataset=store:DIR with teacher_cache set", ("teacher_cache", "store"),
     lambda: load("", f"dataset=store:{TMP / 'some-store'}", f"teacher_cache={TMP / 'tc'}"))
add2(TR, CO, "layers=[7] on a 4-layer model (run)", ("layers", "7"),
     lambda: train("layers=[7]"))

# ---------------------------------------------------------------------------------------------
# store: datasets
# ---------------------------------------------------------------------------------------------
ST = "store dataset"


def tiny_store() -> Path:
    """A teacher store of 2 sequences of 64 tokens from the tiny corpus, built once."""
    if "store" not in _CACHE:
        from sparsekv.teacher.store import main as store_main
        out = TMP / "train2-store"
        rc = quiet(store_main, ["build", "--config", str(base_yaml()), "--out", str(out),
                                "--sequences", "2", "--length", "64", "--shard-size", "1",
                                "--threads", "1", "--no-progress", "--signals", "questions"])
        assert rc in (0, None), rc
        _CACHE["store"] = out
    return _CACHE["store"]


add2(TR, ST, "dataset=store:<missing folder>", ("store", "no-store-here"),
     lambda: train(f"dataset=store:{TMP / 'no-store-here'}"))
add2(TR, ST, "dataset=store:<the .jsonl corpus itself>", ("store", "train2-docs.jsonl"),
     lambda: train(f"dataset=store:{docs()}"))


def _store_adapter_folder():
    from eval.bad_inputs.framework import adapter_dir
    return train(f"dataset=store:{adapter_dir()}")


add2(TR, ST, "dataset=store:<an adapter folder>", ("store", "store.json"), _store_adapter_folder)
add2(TR, ST, "dataset=store:<a 64-token store> with seq_len=128", ("seq_len", "64", "128"),
     lambda: train(f"dataset=store:{tiny_store()}", "seq_len=128"))
add2(TR, ST, "dataset=store:<a store of tiny:llama> with model=tiny:qwen3", ("model", "qwen3"),
     lambda: train(f"dataset=store:{tiny_store()}", "model=tiny:qwen3"))

# ---------------------------------------------------------------------------------------------
# output folders
# ---------------------------------------------------------------------------------------------
OD = "output_dir"


def _out_a_file():
    p = _fresh("out-file").with_suffix(".txt")
    p.write_text("notes\n")
    return train(out=p)


add2(TR, OD, "output_dir an existing file", ("output_dir", "out-file"), _out_a_file)


def _out_empty() -> Verdict:
    """`output_dir=$OUT` with OUT unset: the run must not write into a default folder unasked."""
    from train.config import load_config
    c = load_config(base_yaml(), ["output_dir="])
    return Verdict("silent", f"output_dir='' accepted: the run folder becomes {c.run_dir}")


add2(TR, OD, "output_dir= (empty, an unset shell variable)", ("output_dir",), _out_empty)


def _other_head_run():
    out = _fresh("train2-head")
    quiet(train, "max_steps=1", "save_every=1", out=out)
    return train("max_steps=2", "save_every=1", "head=linear", out=out)


add2(TR, OD, "resume=auto onto a run of head=mlp with head=linear", ("head", "linear", "mlp"),
     _other_head_run)


def _resume_never():
    out = _fresh("train2-never")
    quiet(train, "max_steps=1", "save_every=1", out=out)
    return train("max_steps=2", "save_every=1", "resume=never", out=out)


add2(TR, OD, "resume=never onto a folder with checkpoints", ("resume", "never", "checkpoint"),
     _resume_never)


def _resume_other_step():
    """resume=<step folder of another run> whose head_hidden differs."""
    a, b = _fresh("train2-a"), _fresh("train2-b")
    quiet(train, "max_steps=1", "save_every=1", "head_hidden=16", out=a)
    return train("max_steps=2", f"resume={a / 'step-0001'}", out=b)


add2(TR, OD, "resume=<another run's step-0001/> with another head_hidden",
     ("head_hidden", "16", "8"), _resume_other_step)
