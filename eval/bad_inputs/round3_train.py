"""Round 3, surface "train": training settings and the teacher store build with mistakes rounds
1 and 2 (train_config.py, round2_train.py) do not try: a config file with no settings, a run
name that climbs out of checkpoints/, a sequence too short for BOS plus a token, a teacher cache
that is a file, and `python -m sparsekv.teacher.store build` with lengths, shard sizes, threads,
signals, probe options, overrides and output folders it cannot use. A case is clear only when
the message names the key or flag and what it may be (`allowed`)."""

from __future__ import annotations

from pathlib import Path

from eval.bad_inputs.framework import TMP, Verdict, adapter_dir, add3
from eval.bad_inputs.round3_files import _fresh, base_yaml, docs, store_cli

TR = "train"
CF = "config"


def load(*overrides: str, extra: str = ""):
    from train.config import load_config
    return load_config(base_yaml(extra), list(overrides))


def train(*overrides: str, extra: str = ""):
    from train.loop import main as train_main
    return train_main(["--config", str(base_yaml(extra)), f"output_dir={_fresh('r3-run')}",
                       *overrides])


def _empty_config():
    from train.config import load_config
    p = _fresh("r3-empty").with_suffix(".yaml")
    p.write_text("# settings to come\n")
    c = load_config(p, [])
    return Verdict("silent", f"a config file with no settings accepted: it would train "
                   f"model={c.model!r} on dataset={c.dataset!r} for {c.max_steps} steps")


add3(TR, CF, "a config file with only a comment (no settings)", ("empty", "no settings"),
     _empty_config, allowed=("key",))


def _run_name_escape():
    c = load("run_name=../../outside")
    return Verdict("silent", f"run_name='../../outside' accepted: the run folder is "
                   f"{c.run_dir} (outside checkpoints/)")


add3(TR, CF, "run_name=../../outside (climbs out of checkpoints/)", ("run_name",),
     _run_name_escape)
add3(TR, CF, "run_name=/abs/path", ("run_name",), lambda: Verdict(
    "silent", f"run_name='/abs/run' gives run folder {load('run_name=/abs/run').run_dir}"))
add3(TR, CF, "seq_len=1 (BOS and no token; run)", ("seq_len",), lambda: train("seq_len=1"),
     allowed=(">= 2",))
add3(TR, CF, "teacher_cache=<an existing file> (run)", ("teacher_cache",),
     lambda: train(f"teacher_cache={docs()}"), allowed=("folder",))
add3(TR, CF, "lora.adapter=<a missing folder> (run)", ("lora.adapter", "/no/adapter/here"),
     lambda: train("lora.adapter=/no/adapter/here"), allowed=("does not exist",))
add3(TR, CF, "model=<an adapter folder> (run)", ("model", "adapter"),
     lambda: train(f"model={adapter_dir()}"), allowed=("lora.adapter", "learned", "not a model"))
add3(TR, CF, "--config <an eval grid YAML>", ("unknown config key", "policies"),
     lambda: train(extra="policies: [snapkv]\nbudgets: [0.3]\n"), allowed=("known keys",))

# ---------------------------------------------------------------------------------------------
# python -m sparsekv.teacher.store build
# ---------------------------------------------------------------------------------------------
SB = "teacher store build"


def build(*extra: str, length: str = "64", shard: str = "1", threads: str = "1",
          signals: str = "questions", out: Path | None = None):
    out = out or _fresh("r3-build")
    return store_cli("build", "--config", str(base_yaml()), "--out", str(out), "--sequences",
                     "2", "--length", length, "--shard-size", shard, "--threads", threads,
                     "--no-progress", "--signals", signals, *extra)


add3(TR, SB, "--length 1", ("--length",), lambda: build(length="1"), cli=True, allowed=(">= 2",))
add3(TR, SB, "--length 0", ("--length",), lambda: build(length="0"), cli=True, allowed=(">= 2",))
add3(TR, SB, "--shard-size 0", ("--shard-size", "shard_size"), lambda: build(shard="0"),
     cli=True, allowed=(">= 1",))
add3(TR, SB, "--threads 0", ("--threads",), lambda: build(threads="0"), cli=True,
     allowed=(">= 1",))
add3(TR, SB, "--signals quest (a typo)", ("signals", "quest"), lambda: build(signals="quest"),
     cli=True, allowed=("questions",))
add3(TR, SB, "a config override bogus=1", ("bogus",), lambda: build("bogus=1"), cli=True,
     allowed=("known keys",))
add3(TR, SB, "--config <a missing file>", ("--config", "no-config.yaml"),
     lambda: store_cli("build", "--config", str(TMP / "no-config.yaml"), "--out",
                       str(_fresh("r3-build")), "--sequences", "2"), cli=True,
     allowed=("does not exist",))


def _out_a_file():
    p = _fresh("r3-out-file").with_suffix(".txt")
    p.write_text("notes\n")
    return build(out=p)


add3(TR, SB, "--out <an existing file>", ("--out", "r3-out-file"), _out_a_file, cli=True,
     allowed=("folder",))


def _out_adapter_folder():
    import shutil
    folder = _fresh("r3-adapter-as-store")
    shutil.copytree(adapter_dir(), folder)
    rc = build(out=folder)
    if rc != 0:
        return rc
    left = sorted(p.name for p in folder.iterdir())
    return Verdict("silent", f"exit {rc}: a store built into an adapter folder; it now holds "
                   f"{left}")


add3(TR, SB, "--out <an adapter folder> (other files there)", ("--out", "store"),
     _out_adapter_folder, cli=True, allowed=("empty", "files", "folder"))


def _probe_unused():
    rc = build("--probe", "count=2")
    if rc != 0:
        return rc
    return Verdict("silent", f"exit {rc}: --probe count=2 accepted with --signals questions "
                   "(no probe signal: the option is ignored)")


add3(TR, SB, "--probe count=2 without the probe signal", ("--probe", "probe"), _probe_unused,
     cli=True, allowed=("--signals",))
add3(TR, SB, "--probe count=abc", ("--probe", "count"), lambda: build("--probe", "count=abc",
                                                                     signals="probe"),
     cli=True, allowed=("integer",))
add3(TR, SB, "--worker 2/2", ("--worker", "2/2"), lambda: build("--worker", "2/2"), cli=True,
     allowed=("0 <= I < W",))
