"""Round 2, surface "kills": a process killed (SIGKILL) or a write failing (disk full) in the
middle of writing, then the same command run again: a training run with a checkpoint every
step (the rerun must continue, no step lost or repeated), `sparsekv eval` (its --resume must
end with every row once), `ScorerAdapter.save_pretrained` and `CompressedContext.save` over an
earlier save (the folder must hold one whole save, the old or the new), and the teacher store
build (`python -m sparsekv.teacher.store build ... --resume`). Each case returns a Verdict:
"clear" when nothing is lost and the rerun finishes, "data loss" otherwise. The killed
processes are tiny (tiny:llama, one thread) and started here; each case takes 10-20 s."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import sparsekv
from eval.bad_inputs.framework import ROOT, Verdict, add2, cfg, ids, model
from eval.bad_inputs.framework import fresh as _fresh
from eval.bad_inputs.round2_train import base_yaml

KI = "kills"
RNG = random.Random(36)  # the kills' extra delays (the moment itself still varies by timing)
PY = sys.executable
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
       "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}



def kill_when(argv: list[str], ready, timeout: float = 60.0, delay: float = 0.0) -> str:
    """Start `argv`, SIGKILL it once `ready()` holds (after `delay` more seconds); returns
    "killed" or, when it ended first, "finished rc=N"."""
    proc = subprocess.Popen(argv, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    t0 = time.time()
    try:
        while proc.poll() is None and time.time() - t0 < timeout:
            if ready():
                if delay:
                    time.sleep(delay)
                break
            time.sleep(0.01)
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace")[-300:]
            return f"finished rc={proc.returncode} {err}"
        proc.kill()  # SIGKILL
        proc.wait()
        return "killed"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def quiet(fn, *a, **kw):
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        return fn(*a, **kw)


def _lines(p: Path) -> list[dict]:
    """The rows of a JSON-lines file, a torn last line left out."""
    out = []
    for x in p.read_text().splitlines() if p.is_file() else []:
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(x))
    return out


# ---------------------------------------------------------------------------------------------
def _train_killed() -> Verdict:
    """Training with a checkpoint every step, SIGKILLed once step-0003/ is written, then run
    again with the same command (resume=auto): it must continue from the newest complete
    checkpoint and finish, each step logged once."""
    out, conf = _fresh("kill-train"), base_yaml()
    args = ["--config", str(conf), f"output_dir={out}", "max_steps=10", "save_every=1",
            "keep_last=2"]
    how = kill_when([PY, "train.py", *args], lambda: (out / "step-0003").exists(),
                    delay=RNG.uniform(0.0, 0.3))
    if how != "killed":
        return Verdict("unclear", f"the run was not killed mid-way: {how}")
    before = sorted(p.name for p in out.glob("step-*"))
    from train.loop import main as train_main
    try:
        quiet(train_main, args)
    except SystemExit as e:
        return Verdict("data loss", f"the rerun after the kill failed (exit {e.code}); "
                       f"checkpoints then: {before}")
    steps = [r.get("step") for r in _lines(out / "metrics.jsonl") if "step" in r and "loss" in r]
    final_ok = (out / "final" / "model.safetensors").is_file()
    dup = sorted({s for s in steps if steps.count(s) > 1})
    missing = sorted(set(range(1, 11)) - set(steps))
    if not final_ok:
        return Verdict("data loss", f"no final/ after the rerun (checkpoints at the kill: {before})")
    if missing:
        return Verdict("data loss", f"steps {missing} missing from metrics.jsonl after the rerun "
                       f"(checkpoints at the kill: {before})")
    if dup:
        return Verdict("data loss", f"steps {dup} logged twice in metrics.jsonl: the rerun "
                       f"repeated them (checkpoints at the kill: {before})")
    return Verdict("clear", f"killed with {before}; the rerun continued to step 10, each step "
                   "logged once")


add2(KI, "train", "SIGKILL during training with save_every=1, then the same command",
     ("resume",), _train_killed)

# ---------------------------------------------------------------------------------------------
GRID = ["eval", "--model", "tiny:llama", "--policy", "snapkv", "--budget", "0.3", "--tasks",
        "passkey", "--lengths", "128", "--samples", "12", "--protocol", "agnostic", "--threads",
        "1", "--no-progress"]
CLI = [PY, "-c", "import sys; from sparsekv.cli import main; sys.exit(main(sys.argv[1:]))"]


def _slot(r: dict) -> tuple:
    return (r.get("sample_id"), r.get("task"), r.get("length"), r.get("protocol"),
            r.get("policy"), r.get("budget"))


def _eval_killed() -> Verdict:
    """`sparsekv eval` of 12 samples SIGKILLed after its third row, then `--resume`: every
    (sample, policy, budget) row once, none lost."""
    out = _fresh("kill-eval")
    res = out / "results.jsonl"

    def three_rows() -> bool:  # rows go to results.part-*.jsonl until the grid is done
        return sum(p.read_text().count("\n") for p in out.glob("results*.jsonl")) >= 3

    how = kill_when([*CLI, *GRID, "--out", str(out)], three_rows)
    if how != "killed":
        return Verdict("unclear", f"the run was not killed mid-way: {how}")
    n_before = sum(len(_lines(p)) for p in out.glob("results*.jsonl"))
    from sparsekv.cli import main
    rc = quiet(main, [*GRID, "--resume", "--out", str(out)])
    rows = _lines(res)
    slots = [_slot(r) for r in rows]
    dup = len(slots) - len(set(slots))
    if rc != 0:
        return Verdict("data loss", f"--resume after the kill exited {rc} ({n_before} rows then)")
    if len(set(slots)) != 24 or dup:
        return Verdict("data loss", f"after --resume: {len(set(slots))} of 24 rows, {dup} "
                       f"duplicated ({n_before} rows at the kill)")
    return Verdict("clear", f"killed at {n_before} rows; --resume ended with the 24 rows once")


add2(KI, "eval", "SIGKILL during sparsekv eval, then --resume", ("resume", "results.jsonl"),
     _eval_killed)

# ---------------------------------------------------------------------------------------------
SAVE_LOOP = """
import sys, pathlib
import sparsekv
from sparsekv.models.tiny import tiny_model
m = tiny_model("llama").eval()
out, ready, what = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
if what == "adapter":
    a = [sparsekv.ScorerAdapter.for_model(m, hidden=h) for h in (8, 16)]
    save = lambda i: a[i].save_pretrained(out, overwrite=True)
else:
    x = sparsekv.EvictionConfig(budget=0.5)
    c = [sparsekv.compress(m, __import__("torch").arange(1, n + 1).unsqueeze(0), x)
         for n in (40, 30)]
    save = lambda i: c[i].save(out)
save(0)
ready.write_text("1")
i = 1
while True:
    save(i % 2)
    i += 1
"""


def _save_loop_killed(what: str) -> Verdict:
    """A process saving two different adapters (hidden 8 / 16) or contexts (40 / 30 tokens)
    onto one folder, over and over, SIGKILLed at a random moment: the folder must load as one
    of the two."""
    out, ready = _fresh(f"kill-{what}"), _fresh(f"kill-{what}-ready")
    how = kill_when([PY, "-c", SAVE_LOOP, str(out), str(ready), what], ready.exists,
                    delay=RNG.uniform(0.3, 1.2))
    if how != "killed":
        return Verdict("unclear", f"the saving process was not killed: {how}")
    left = sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}"))
    try:
        if what == "adapter":
            got = sparsekv.ScorerAdapter.from_pretrained(out)
            desc = f"hidden={got.config.hidden}"
        else:
            got = sparsekv.CompressedContext.load(out, model())
            desc = f"{got.num_tokens} tokens"
    except Exception as e:  # noqa: BLE001  (any refusal here is a lost save)
        return Verdict("data loss", f"after the kill the folder does not load: "
                       f"{type(e).__name__}: {str(e)[:300]}")
    return Verdict("clear", f"after the kill the folder loads ({desc}); leftovers: {left}")


add2(KI, "save", "SIGKILL while ScorerAdapter.save_pretrained rewrites a folder",
     ("save_pretrained",), lambda: _save_loop_killed("adapter"))
add2(KI, "save", "SIGKILL while CompressedContext.save rewrites a folder", ("save",),
     lambda: _save_loop_killed("context"))


# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def disk_full_at_fsync(n: int):
    """os.fsync raises ENOSPC from its `n`-th call on (a disk that fills during a save)."""
    real, calls = os.fsync, [0]

    def fsync(fd):
        calls[0] += 1
        if calls[0] >= n:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    os.fsync = fsync
    try:
        yield calls
    finally:
        os.fsync = real


def _disk_full(what: str) -> Verdict:
    """A save over an earlier one that fails half-way (disk full at the second fsync): the
    earlier save must still load, and saving again once there is room must work."""
    out = _fresh(f"full-{what}")
    if what == "adapter":
        old = sparsekv.ScorerAdapter.for_model(model(), hidden=8)
        new = sparsekv.ScorerAdapter.for_model(model(), hidden=16)
        old.save_pretrained(out)

        def save():
            new.save_pretrained(out, overwrite=True)

        def check():
            return f"hidden={sparsekv.ScorerAdapter.from_pretrained(out).config.hidden}"
    else:
        old = sparsekv.compress(model(), ids(40), cfg())
        new = sparsekv.compress(model(), ids(30), cfg())
        old.save(out)

        def save():
            new.save(out)

        def check():
            return f"{sparsekv.CompressedContext.load(out, model()).num_tokens} tokens"
    failed = None
    with disk_full_at_fsync(2):
        try:
            save()
        except OSError as e:
            failed = e
    if failed is None:
        return Verdict("silent", "the save did not report the failed fsync (disk full)")
    try:
        after = check()
    except Exception as e:  # noqa: BLE001
        return Verdict("data loss", f"after the failed save ({failed}) the folder does not "
                       f"load: {type(e).__name__}: {str(e)[:300]}")
    try:
        save()
        again = check()
    except Exception as e:  # noqa: BLE001
        return Verdict("data loss", f"saving again after the failed save fails: "
                       f"{type(e).__name__}: {str(e)[:300]}")
    return Verdict("clear", f"failed save ({failed}) left the old one ({after}); saving again "
                   f"gave {again}")


add2(KI, "save", "disk full (ENOSPC at fsync) during save_pretrained over an adapter",
     ("save_pretrained",), lambda: _disk_full("adapter"))
add2(KI, "save", "disk full (ENOSPC at fsync) during CompressedContext.save over a context",
     ("save",), lambda: _disk_full("context"))


def _crash_between_files() -> Verdict:
    """save_pretrained over an adapter of another hidden size, the process dying after its
    first file took its place (os.replace fails from its second call on, as a kill there
    would leave it): the folder must still load, as the old adapter or the new one."""
    out = _fresh("crash-adapter")
    sparsekv.ScorerAdapter.for_model(model(), hidden=8).save_pretrained(out)
    new = sparsekv.ScorerAdapter.for_model(model(), hidden=16)
    real, calls = os.replace, [0]

    def replace(a, b):
        calls[0] += 1
        if calls[0] >= 2:
            raise OSError(errno.EIO, "Input/output error (the process died here)")
        return real(a, b)

    os.replace = replace
    try:
        new.save_pretrained(out, overwrite=True)
    except OSError:
        pass
    finally:
        os.replace = real
    if calls[0] < 2:
        return Verdict("clear", f"one os.replace for the whole save ({calls[0]} call)")
    try:
        got = sparsekv.ScorerAdapter.from_pretrained(out)
    except Exception as e:  # noqa: BLE001
        return Verdict("data loss", f"after a crash between the files' replacements the folder "
                       f"does not load: {type(e).__name__}: {str(e)[:300]}")
    return Verdict("clear", f"the folder loads (hidden={got.config.hidden}) after a crash "
                   f"between the files' replacements ({calls[0]} os.replace calls)")


add2(KI, "save", "crash between two files' os.replace in save_pretrained over an adapter",
     ("save_pretrained",), _crash_between_files)


# ---------------------------------------------------------------------------------------------
def _store_killed() -> Verdict:
    """`python -m sparsekv.teacher.store build` of 320 sequences (4 per shard, from
    data/tiny.jsonl) SIGKILLed after its fifth shard, then the same command with --resume: 80
    shards, every row verified."""
    out, conf = _fresh("kill-store"), base_yaml()
    args = ["build", "--config", str(conf), "--out", str(out), "--sequences", "320", "--length",
            "64", "--shard-size", "4", "--threads", "1", "--no-progress", "--signals",
            "questions", f"dataset={ROOT / 'data' / 'tiny.jsonl'}"]
    how = kill_when([PY, "-m", "sparsekv.teacher.store", *args],
                    lambda: len(list(out.glob("shard-*.safetensors"))) >= 5,
                    delay=RNG.uniform(0.0, 0.2))
    if how != "killed":
        return Verdict("unclear", f"the build was not killed mid-way: {how}")
    before = len(list(out.glob("shard-*.safetensors")))
    from sparsekv.teacher.store import main as store_main
    try:
        rc = quiet(store_main, [*args, "--resume"])
    except SystemExit as e:
        rc = e.code
    if rc not in (0, None):
        return Verdict("data loss", f"the --resume after the kill exited {rc} ({before} shards "
                       "then)")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
        try:
            vrc = store_main(["verify", str(out)])
        except SystemExit as e:
            vrc = e.code
    shards = len(list(out.glob("shard-*.safetensors")))
    if vrc not in (0, None):
        return Verdict("data loss", f"verify after --resume exited {vrc}: {err.getvalue()[-300:]}")
    if shards != 80:
        return Verdict("data loss", f"{shards} shards of 80 after --resume ({before} at the kill)")
    return Verdict("clear", f"killed at {before} shards; --resume finished 80, verify passed")


add2(KI, "teacher store", "SIGKILL during the teacher store build, then --resume",
     ("resume",), _store_killed)
