"""Bad-input cases of one surface: training configs (load_config with YAML files and key=value overrides, two short tiny runs)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from eval.bad_inputs.framework import ROOT, TMP, _n, add

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
