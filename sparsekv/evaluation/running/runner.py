"""Runs an evaluation grid into its folder: `run_eval` (what `sparsekv eval` calls) and
`ingest_rows` (a peer's rows in, reports rewritten).

This module does the wiring: it plans the grid (`plan.py`), holds the folder's lock and decides
with the row store (`rows.py`) what is already done, runs the remaining (sample, protocol) groups
in this process or in worker processes (`execute.Runner` runs one group), folds their rows into
results.jsonl and writes the reports (`report.py`). Its own concerns are the worker processes
and stopping: workers die with their parent (PR_SET_PDEATHSIG on Linux, a watchdog on the
parent pid everywhere), and a stop (Ctrl-C, `kill PID`) keeps every finished row and says how
to continue.

Keeping rows (issue 16.2): a run into a folder that already holds rows refuses unless told
`resume` (keep every row, run only the runs missing) or `overwrite` (rerun the grid, each new row
replacing the old row of its slot; rows outside the grid are kept). Both together rerun only the
missing runs and those whose rows another method wrote (another spec or another adapter under the
same label). Rows of a learned policy record `adapter_hash`; a resume that finds rows of another
adapter under a label refuses (rows of two adapters are never one method), and the report labels
such rows apart when a folder holds them. Every row records its seed, model, prompt hash and
setup (`rows.identity`): rows of another seed, model, setup or prompts are refused, whatever the
folder's config.yaml says.
"""

from __future__ import annotations

import os
import platform
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from sparsekv.evaluation.config import EvalConfig
from sparsekv.evaluation.rows.folder import (
    FolderLock,
    check_out_folder,
    check_same_setup,
    read_config,
    read_prompts,  # noqa: F401  (public name, used by peers' scripts)
    write_config,
    write_prompts,
)
from sparsekv.evaluation.rows.identity import check_identity
from sparsekv.evaluation.rows.ingest import ingest
from sparsekv.evaluation.rows.store import (  # noqa: F401  (ROW_FIELDS, read_rows: public names)
    RESULTS,
    ROW_FIELDS,
    count_rows,
    dump_row,
    finished,
    folder_rows,
    merge_parts,
    part_files,
    part_path,
    read_rows,
)
from sparsekv.evaluation.running.execute import Runner
from sparsekv.evaluation.running.plan import build_samples, grid_size, groups_to_run, runs_left  # noqa: F401
from sparsekv.evaluation.tasks import Sample
from sparsekv.evaluation.tasks.codec import Codec

Group = tuple[Sample, str, frozenset]


def _environment(model, codec) -> dict[str, Any]:
    import transformers

    from sparsekv._version import __version__

    device = next(model.parameters()).device
    return {
        "sparsekv": __version__,
        "torch": str(torch.__version__),
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "accelerator": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "model_class": type(model).__name__,
        "tokenizer": codec.name,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _refuse_fresh(out: Path, n: int) -> None:
    raise ValueError(
        f"{out} already holds {n} result rows; a fresh run never replaces them silently: add "
        "--resume to keep them and run only what is missing, --overwrite to rerun this grid "
        "replacing its rows (rows outside the grid are kept), or give another --out"
    )


# ---- workers -----------------------------------------------------------------------------
def _die_with_parent(parent_pid: int) -> None:
    """Make this worker end when its parent does, however the parent ends (kill -9 included):
    the kernel sends SIGKILL on the parent's death (Linux prctl PR_SET_PDEATHSIG), and a
    watchdog thread checks the parent pid every second (every platform; it also covers a parent
    that died before the prctl)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="sparsekv-parent-watchdog", daemon=True).start()


def _run_groups(
    cfg: EvalConfig, groups: list[Group], part: Path, model=None, codec=None, on_row=None
) -> None:
    """Run `groups` ((sample, protocol, method keys to skip)) and append their rows to `part`."""
    from sparsekv.evaluation.running.models import load_model

    if model is None:
        model, codec = load_model(cfg.model, cfg.dtype, cfg.attn_implementation, seed=cfg.seed, device=cfg.device)
    runner = Runner(model, codec, cfg)
    runner.plan()
    with open(part, "a") as f:
        for s, protocol, skip in groups:
            for row in runner.run_group(s, protocol, skip):
                dump_row(f, row)
                if on_row is not None:
                    on_row(s, protocol, row)


def _worker(cfg_dict: dict, groups: list[Group], part: str, threads: int, parent_pid: int) -> None:
    """Entry point of one worker process (spawned): its own model, one shard of the groups."""
    _die_with_parent(parent_pid)
    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # Ctrl-C reaches the whole group: the parent stops us
    torch.set_num_threads(threads)
    cfg = EvalConfig.from_dict(cfg_dict)
    torch.manual_seed(cfg.seed)
    _run_groups(cfg, groups, Path(part))


def _line_count(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def _run_in_workers(
    cfg: EvalConfig, todo: list[Group], out: Path, workers: int, threads: int, bar
) -> None:
    """Deal the groups round-robin to `workers` spawned processes and wait for them; on a stop
    (KeyboardInterrupt) they are terminated before it propagates."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = []
    try:
        for k in range(workers):
            shard = todo[k::workers]
            if shard:
                part = part_path(out, k)
                pr = ctx.Process(
                    target=_worker,
                    args=(cfg.to_dict(), shard, str(part), threads, os.getpid()),
                    daemon=True,
                )
                pr.start()
                procs.append((pr, part))
        seen = 0
        while any(pr.is_alive() for pr, _ in procs):
            time.sleep(0.5)
            n = sum(_line_count(part) for _, part in procs)
            bar.update(n - seen)
            seen = n
        bar.update(sum(_line_count(part) for _, part in procs) - seen)
    except BaseException:
        for pr, _ in procs:
            pr.terminate()
        for pr, _ in procs:
            pr.join()
        raise
    failed = [pr.exitcode for pr, _ in procs if pr.exitcode != 0]
    if failed:
        raise RuntimeError(
            f"{len(failed)} evaluation worker(s) failed (exit codes {failed}); "
            f"finished rows are kept: rerun with --resume to continue"
        )


class _StopOnSigterm:
    """`kill PID` stops the run as Ctrl-C does (background jobs ignore SIGINT)."""

    def __enter__(self):
        self.previous = None
        if threading.current_thread() is threading.main_thread():

            def stop(signum, frame):
                raise KeyboardInterrupt

            self.previous = signal.signal(signal.SIGTERM, stop)
        return self

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


# ---- the grid ----------------------------------------------------------------------------
def run_eval(
    cfg: EvalConfig,
    model=None,
    codec: Codec | None = None,
    progress: bool = True,
    report: bool = True,
    resume: bool = False,
    overwrite: bool = False,
    readme_series: list[str] | None = None,
) -> Path:
    """Run the grid of `cfg` and write everything into `cfg.out`; returns the folder.

    A folder that already holds rows needs `resume=True` (keep every row, whatever grid wrote
    it, and run only the runs this grid still misses: a grid can grow in samples, tasks,
    methods or budgets, or survive a stop) or `overwrite=True` (rerun this grid, each new row
    replacing the row of its slot; other rows are kept); both: rerun only what is missing or
    was written by another method under the same label. With `cfg.workers` > 1 the groups are
    dealt round-robin to that many spawned processes (each loads its own model and uses
    `threads` or cores / workers torch threads; `model` serves only to plan and tokenize). Rows
    are appended to `results.part-<k>.jsonl` as they finish and folded into results.jsonl at
    the end or on a stop. The folder is locked while the run lasts. `readme_series`: also
    draw the README plots of those methods (`plots.readme_plots`).
    """
    from tqdm.auto import tqdm

    from sparsekv.evaluation.running.models import load_model

    if cfg.out is None:
        raise ValueError("out is not set: give --out DIR (or out: in the config)")
    out = check_out_folder(cfg.out)  # a file, or a path through one: refused before loading
    if not (resume or overwrite) and (n := count_rows(out)):
        _refuse_fresh(out, n)  # early, before loading anything
    workers = cfg.workers
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // workers)
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    if model is None:
        model, codec = load_model(cfg.model, cfg.dtype, cfg.attn_implementation, seed=cfg.seed, device=cfg.device)
    elif codec is None:
        raise ValueError("pass the codec together with the model")
    runner = Runner(model, codec, cfg)
    runner.plan()  # builds every policy once: fails before any work
    with FolderLock(out):
        merge_parts(out)  # the finished rows of a stopped run are kept
        rows = folder_rows(out)
        if rows and not (resume or overwrite):
            _refuse_fresh(out, len(rows))
        samples = build_samples(cfg, codec)
        if rows:  # what the rows were run with: config.yaml, and what each row records
            check_same_setup(out, cfg)
            check_identity(rows, cfg, out, samples, read_config(out))
        done: dict = {}
        if resume:
            kept = finished(rows, cfg, runner.hashes, out, runner.settings)
            if kept.conflicts and not overwrite:
                more = (
                    f" ({len(kept.conflicts) - 1} more such labels)"
                    if len(kept.conflicts) > 1
                    else ""
                )
                raise ValueError(kept.conflicts[0] + more)
            if kept.legacy:
                labels = ", ".join(f"{label!r} ({n})" for label, n in kept.legacy.items())
                print(
                    f"resume: rows of {labels} carry no adapter_hash (written before rows "
                    "recorded it); they are kept as runs of the adapters now at those paths",
                    file=sys.stderr,
                )
            done = kept.done
        write_prompts(samples, cfg, out / "prompts.jsonl", keep_others=bool(rows))
        write_config(out, cfg, environment=_environment(model, codec))
        todo = groups_to_run(cfg, samples, done)
        bar = tqdm(
            total=runs_left(cfg, todo),
            unit="run",
            disable=not progress,
            desc="sparsekv eval",
            dynamic_ncols=True,
        )
        if rows:  # said with or without the bar: which rows stay and what runs
            if resume and overwrite:
                mode = "--resume --overwrite (missing runs, and runs another spec or adapter wrote)"
            else:
                mode = "--resume (missing runs only)" if resume else "--overwrite (every run of the grid)"
            tqdm.write(
                f"{mode}: {len(rows)} rows in {out}, {runs_left(cfg, todo)} runs in {len(todo)} "
                "groups to do" + ("; nothing to run" if not todo else ""),
                file=sys.stderr,
            )
        try:
            with _StopOnSigterm():
                if workers == 1 or len(todo) <= 1:

                    def on_row(s, protocol, row):
                        bar.set_postfix_str(
                            f"{s.sample_id} {protocol} {row['policy']}@{row['budget']}",
                            refresh=False,
                        )
                        bar.update(1)

                    _run_groups(cfg, todo, part_path(out, 0), model, codec, on_row)
                else:
                    _run_in_workers(cfg, todo, out, workers, threads, bar)
        except KeyboardInterrupt:
            bar.close()
            n = merge_parts(out)
            print(
                f"stopped: {n} rows finished in this run saved to {out / RESULTS} (every finished "
                "row is kept); rerun with --resume to continue",
                file=sys.stderr,
            )
            raise
        except BaseException:
            bar.close()
            merge_parts(out)
            raise
        bar.close()
        merge_parts(out)
        if report:
            from sparsekv.evaluation.reports.tables import write_reports

            write_reports(out, readme_series)
    return out


def ingest_rows(out: str | Path, rows_path: str | Path, source: str | None = None) -> int:
    """Add result rows produced elsewhere (e.g. the kvpress peer run on `prompts.jsonl`) to the
    results of `out` (`rows.ingest`: a row replaces only the row of its own slot), then rewrite
    the summary and plots. Returns the number of rows added."""
    from sparsekv.evaluation.reports.tables import write_reports

    with FolderLock(out):
        n = ingest(out, rows_path, source)
        write_reports(out)
    return n
