"""Round 3, surface "kills": writes that fail part-way in places round 2 (round2_kills.py:
SIGKILLs of whole processes, a full disk at fsync while a save replaced an earlier one) did not
reach: a training checkpoint's rename into place, the final adapter's save at the end of a run,
a teacher store shard's write, an eval row's append (disk full) and the merge of the eval's part
files, and saves into new folders. Each is made to fail in process (os.rename / os.replace /
os.fsync / the row writer raising), then the same command is run again. "clear": nothing lost
and the rerun finished, every step or row once; "data loss" otherwise."""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path

import sparsekv
from eval.bad_inputs.framework import Verdict, add3, cfg, ids, model
from eval.bad_inputs.round3_files import _fresh, base_yaml, docs, quiet, store_cli

KI = "kills"


@contextlib.contextmanager
def failing(module, name: str, when):
    """`module.name` raises OSError (EIO / ENOSPC) on calls where `when(args, count)` holds."""
    real, calls = getattr(module, name), [0]

    def fake(*args, **kwargs):
        calls[0] += 1
        if when(args, calls[0]):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(*args, **kwargs)

    setattr(module, name, fake)
    try:
        yield calls
    finally:
        setattr(module, name, real)


def _steps(out: Path) -> list:
    p = out / "metrics.jsonl"
    rows = []
    for x in p.read_text().splitlines() if p.is_file() else []:
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(x))
    return [r["step"] for r in rows if "step" in r and "loss" in r]


def _train(out: Path, *extra: str):
    from train.loop import main as train_main
    return quiet(train_main, ["--config", str(base_yaml()), f"output_dir={out}", "max_steps=4",
                              "save_every=1", "keep_last=2", *extra])


def _judge_run(out: Path, first: str) -> Verdict:
    try:
        _train(out)
    except (SystemExit, Exception) as e:  # noqa: BLE001
        return Verdict("data loss", f"the rerun failed after {first}: {type(e).__name__}: {e}")
    steps = _steps(out)
    if not (out / "final" / "model.safetensors").is_file():
        return Verdict("data loss", f"no final/ after the rerun ({first})")
    missing = sorted(set(range(1, 5)) - set(steps))
    dup = sorted({s for s in steps if steps.count(s) > 1})
    if missing or dup:
        return Verdict("data loss", f"after {first} and a rerun: steps missing {missing}, "
                       f"repeated {dup}")
    try:
        sparsekv.ScorerAdapter.from_pretrained(out / "final")
    except Exception as e:  # noqa: BLE001
        return Verdict("data loss", f"final/ does not load: {e}")
    return Verdict("clear", f"{first}; the rerun continued to step 4, each step once")


def _checkpoint_rename_fails() -> Verdict:
    out = _fresh("r3-kill-ckpt")
    with failing(os, "rename", lambda a, n: str(a[1]).endswith("step-0002")):
        with contextlib.suppress(Exception, SystemExit):
            _train(out)
    return _judge_run(out, "step-0002's rename into place failed")


def _final_save_fails() -> Verdict:
    out = _fresh("r3-kill-final")
    cls = sparsekv.ScorerAdapter
    real = cls.save_pretrained

    def save_disk_full(self, *a, **kw):  # the disk fills after the save's first fsync
        with failing(os, "fsync", lambda args, n: n >= 2):
            return real(self, *a, **kw)

    cls.save_pretrained = save_disk_full
    try:
        with contextlib.suppress(Exception, SystemExit):
            _train(out)
    finally:
        cls.save_pretrained = real
    return _judge_run(out, "the final adapter's save failed (disk full)")


add3(KI, "train", "a checkpoint's rename fails at step 2, then the same command",
     ("resume",), _checkpoint_rename_fails)
add3(KI, "train", "the final adapter's save fails (disk full), then the same command",
     ("resume",), _final_save_fails)


def _store_shard_fails() -> Verdict:
    out = _fresh("r3-kill-store")
    args = ["build", "--config", str(base_yaml()), "--out", str(out), "--sequences", "4",
            "--length", "64", "--shard-size", "1", "--threads", "1", "--no-progress",
            "--signals", "questions", f"dataset={docs()}"]
    with failing(os, "replace", lambda a, n: "shard-00001" in str(a[1])):
        with contextlib.suppress(Exception, SystemExit):
            quiet(store_cli, *args)
    try:
        rc = quiet(store_cli, *args, "--resume")
        vrc = quiet(store_cli, "verify", str(out))
    except (Exception, SystemExit) as e:  # noqa: BLE001
        return Verdict("data loss", f"--resume after the failed shard: {type(e).__name__}: {e}")
    shards = len(list(out.glob("shard-*.safetensors")))
    if rc not in (0, None) or vrc not in (0, None) or shards != 4:
        return Verdict("data loss", f"--resume exit {rc}, verify exit {vrc}, {shards} of 4 shards")
    return Verdict("clear", "a shard's write failed; --resume built it, verify passed")


add3(KI, "teacher store", "a shard's write fails (disk full), then --resume", ("resume",),
     _store_shard_fails)

GRID = ["eval", "--model", "tiny:llama", "--policy", "snapkv,h2o", "--budget", "0.3", "--tasks",
        "passkey", "--lengths", "128", "--samples", "2", "--protocol", "agnostic", "--threads",
        "1", "--no-progress"]


def _slots(out: Path) -> list:
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines() if x.strip()]
    return [(r["sample_id"], r["policy"], r["budget"]) for r in rows]


def _eval_fails(module_name: str, name: str, when, what: str) -> Verdict:
    import importlib

    from sparsekv.cli import main
    out = _fresh("r3-kill-eval")
    mod = importlib.import_module(module_name)
    with failing(mod, name, when), contextlib.suppress(Exception):
        quiet(main, [*GRID, "--out", str(out)])
    rc = quiet(main, [*GRID, "--resume", "--out", str(out)])
    if rc != 0 or not (out / "results.jsonl").is_file():
        return Verdict("data loss", f"--resume after {what} exited {rc}")
    slots = _slots(out)
    if len(set(slots)) != 6 or len(slots) != 6:
        return Verdict("data loss", f"after {what} and --resume: {len(set(slots))} of 6 rows, "
                       f"{len(slots) - len(set(slots))} repeated")
    return Verdict("clear", f"{what}; --resume ended with the 6 rows once")


add3(KI, "eval", "the third row's append fails (disk full), then --resume", ("resume",),
     lambda: _eval_fails("sparsekv.evaluation.running.runner", "dump_row",
                         lambda a, n: n == 3, "the third row's append failed"))
add3(KI, "eval", "the merge of the part files fails, then --resume", ("resume",),
     lambda: _eval_fails("sparsekv.evaluation.rows.store", "write_rows_atomic",
                         lambda a, n: n == 1, "merging the part files failed"))


def _new_folder_save(what: str) -> Verdict:
    """A save into a new folder whose last step (the rename into place, or the folder's fsync)
    fails: the path holds nothing or a whole save, and saving again works."""
    out = _fresh(f"r3-new-{what}")
    if what == "adapter":
        obj = sparsekv.ScorerAdapter.for_model(model(), hidden=8)

        def save():
            obj.save_pretrained(out)

        def load():
            return sparsekv.ScorerAdapter.from_pretrained(out).config.hidden
    else:
        obj = sparsekv.compress(model(), ids(30), cfg())

        def save():
            obj.save(out)

        def load():
            return sparsekv.CompressedContext.load(out, model()).num_tokens
    with failing(os, "rename", lambda a, n: Path(a[1]) == out), \
            failing(os, "replace", lambda a, n: Path(a[1]) == out), contextlib.suppress(OSError):
        save()
    if out.exists():
        try:
            load()
        except Exception as e:  # noqa: BLE001
            return Verdict("data loss", f"a half save left at {out.name}: {e}")
    try:
        save()
        got = load()
    except Exception as e:  # noqa: BLE001
        return Verdict("data loss", f"saving again failed: {type(e).__name__}: {e}")
    return Verdict("clear", f"the failed save left {'a whole save' if out.exists() else 'nothing'}"
                   f"; saving again gave {got}")


add3(KI, "save", "save_pretrained into a new folder: the rename into place fails",
     ("save_pretrained",), lambda: _new_folder_save("adapter"))
add3(KI, "save", "CompressedContext.save into a new folder: the rename into place fails",
     ("save",), lambda: _new_folder_save("context"))
