"""A grid of decode-heavy runs (issue 18): every decode sample of an `EvalConfig` under the
full cache (the reference) and every policy x budget, one row per run appended to
`<out>/results.jsonl` as it finishes, so a stopped grid resumes where it stopped.

    python -m sparsekv.evaluation.decode_grid --config configs/eval/decode-rerank.yaml
    python -m sparsekv.evaluation.decode_grid --config ... --samples 2 --threads 1   # grows it

Rows already in `results.jsonl` (same sample, label and budget) are kept and not rerun; the
reference of a sample is recomputed whenever one of its methods still has to run (its hidden
states are needed for the KL). The folder's `config.yaml` holds the resolved grid of the last
run (with its environment); a grid whose model, dtype, seed, eviction or task options differ
from the folder's is refused. At the end `decode_report.write_decode_report` writes the tables
and plots. The runs themselves are `sparsekv.evaluation.decode.run_decode`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import yaml

from sparsekv.evaluation import decode_tasks
from sparsekv.evaluation.config import REFERENCE, EvalConfig, PolicySpec
from sparsekv.evaluation.decode import DecodeTrace, run_decode
from sparsekv.evaluation.plan import build_samples
from sparsekv.evaluation.tasks import Sample, get_task

_SETUP = ("model", "dtype", "attn_implementation", "seed", "eviction", "task_options")


def decode_samples(cfg: EvalConfig, codec) -> list[Sample]:
    """The grid's decode samples, in order index -> task -> length (`plan.build_samples`, after
    checking that every task is a decode task)."""
    for task in cfg.tasks:
        if get_task(task).kind != decode_tasks.DECODE_KIND:
            raise ValueError(f"task {task!r} is not a decode task; decode tasks: "
                             f"{', '.join(t for t, s in _decode_specs())}")
    return build_samples(cfg, codec)


def _decode_specs():
    from sparsekv.evaluation.tasks import TASKS

    return [(t, s) for t, s in TASKS.items() if s.kind == decode_tasks.DECODE_KIND]


def _settings(policy) -> dict[str, Any]:
    """The learned policy's scoring settings, recorded on its rows."""
    if not hasattr(policy, "blend"):
        return {}
    return {"policy_settings": {"blend": policy.blend, "blend_mode": policy.blend_mode,
                                "kernel_size": policy.kernel_size, "head_layer": policy.head_layer}}


class RunnerMethods:
    """The `builder` of `run_sample` over the harness's `Runner` (`sparsekv eval` and this
    module's grid): its policies (adapters loaded once, kvzip given the codec), per-method
    eviction settings and LoRA (`Runner.applied`)."""

    def __init__(self, runner):
        self.runner = runner

    def applied(self, spec: PolicySpec):
        return self.runner.applied(spec)

    def row(self, sample: Sample, label: str, spec_text: str, budget, spec: PolicySpec | None) -> dict[str, Any]:
        """A row's harness fields (learned methods' rows carry their adapter's `adapter_hash`)."""
        return self.runner._row(sample, "agnostic", label, spec_text, budget, spec)

    def cache(self, spec: PolicySpec | None, budget):
        from sparsekv import EvictionConfig, SparseKVCache

        if spec is None:
            return SparseKVCache(self.runner.model, EvictionConfig(budget=1.0), "full")
        return SparseKVCache(self.runner.model, self.runner.eviction_config(spec, budget),
                             self.runner.build_policy(spec))


def decode_rows(runner, sample: Sample, skip=frozenset()) -> Iterator[dict[str, Any]]:
    """The rows of one decode sample for `sparsekv eval` (`execute.Runner.run_group` hands its
    decode samples here): the harness's row fields, then this module's metrics."""
    yield from run_sample(runner.model, runner.codec, runner.cfg, sample, RunnerMethods(runner), set(skip))


def _ref_path(cfg: EvalConfig, sample: Sample) -> Path:
    """Where the full cache's trace of `sample` is kept between runs (outside the results)."""
    from sparsekv.default_model import cache_dir

    key = json.dumps([cfg.model, cfg.dtype, cfg.attn_implementation, sample.context_ids, sample.target_ids,
                      sample.max_new_tokens])
    return cache_dir() / "decode-refs" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.pt"


def reference(model, codec, cfg: EvalConfig, sample: Sample, builder: RunnerMethods):
    """(row metrics, trace) of the full cache on `sample`, from the trace cache when another run
    (or process) already computed it; a fresh one is saved there (atomically)."""
    path = _ref_path(cfg, sample)
    if path.exists():
        saved = torch.load(path, weights_only=True)
        trace = DecodeTrace(**saved["trace"])
        return saved["row"], trace
    row, trace = run_decode(model, sample, builder.cache(None, None), None, codec.eos_ids)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save({"row": _clean(row), "trace": {f.name: getattr(trace, f.name) for f in fields(DecodeTrace)}}, tmp)
    tmp.replace(path)
    return row, trace


def run_sample(model, codec, cfg: EvalConfig, sample: Sample, builder,
               skip: set[tuple[str, str]] = frozenset(), only: set[str] | None = None,
               ) -> Iterator[dict[str, Any]]:
    """Rows of one sample: the reference (unless its key is in `skip`), then every policy x
    budget whose `(label, str(budget))` is not in `skip` (and whose label is in `only`, when
    given). `builder` is a `RunnerMethods` (caches, LoRA, the harness's row fields). A crashing
    method yields a row with `error` set."""
    eos = codec.eos_ids
    ref_row, ref = reference(model, codec, cfg, sample, builder)
    if (REFERENCE, "1.0") not in skip:
        start = builder.row(sample, REFERENCE, REFERENCE, 1.0, None)
        yield {**start, **ref_row}
    for spec in cfg.policy_specs:
        for budget in cfg.budgets_of(spec, "agnostic"):
            if (spec.label, str(budget)) in skip or (only is not None and spec.label not in only):
                continue
            row = builder.row(sample, spec.label, spec.spec, budget, spec)
            try:
                # a learned method whose adapter carries a LoRA runs with it (removed after)
                with builder.applied(spec):
                    cache = builder.cache(spec, budget)
                    row.update(_settings(cache.policy))
                    metrics, _ = run_decode(model, sample, cache, ref, eos)
                row.update(metrics)
            except Exception as e:  # noqa: BLE001  (a crashing method is a measured miss, not a stop)
                row.update(error=f"{type(e).__name__}: {e}", score=0.0, kl=None, kl_mean=None)
                print(f"[decode grid] {spec.label}@{budget} on {sample.sample_id} failed: {e}", file=sys.stderr)
            yield row


def _clean(x):
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _check_setup(out: Path, cfg: EvalConfig) -> None:
    path = out / "config.yaml"
    if not path.exists():
        return
    old = yaml.safe_load(path.read_text()) or {}
    new = cfg.to_dict()
    for k in _SETUP:
        if k in old and old[k] != new[k]:
            raise ValueError(f"{out} holds rows of a grid with {k}={old[k]!r}; this one has {k}={new[k]!r}: "
                             "use another --out")


def append_row(path: Path, row: dict[str, Any]) -> None:
    """Append one JSON line with a single write on an O_APPEND descriptor, so processes that
    share a grid folder (each with its own `only`) never interleave their lines."""
    data = (json.dumps(_clean(row)) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def run_decode_grid(cfg: EvalConfig, model=None, codec=None, progress: bool = True, report: bool = True,
                    only: set[str] | None = None) -> Path:
    """Run (or resume) the decode grid of `cfg` into `cfg.out`; returns the folder. `only`: run
    just the methods with these labels (several processes can share one grid this way)."""
    import transformers

    from sparsekv import __version__
    from sparsekv.evaluation.models import load_model

    if cfg.out is None:
        raise ValueError("out is not set: give --out DIR (or out: in the config)")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    _check_setup(out, cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    if model is None:
        model, codec = load_model(cfg.model, cfg.dtype, cfg.attn_implementation, seed=cfg.seed, device=cfg.device)
    from sparsekv.evaluation.execute import Runner

    runner = Runner(model, codec, cfg)
    runner.plan()  # builds every policy once: a bad spec fails before any work
    builder = RunnerMethods(runner)
    env = {"sparsekv": __version__, "torch": str(torch.__version__), "transformers": transformers.__version__,
           "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
           "torch_threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    resolved = {**cfg.to_dict(), "policy_specs": [p.to_dict() for p in cfg.policy_specs], "environment": env}
    _write_atomic(out / "config.yaml", yaml.safe_dump(resolved, sort_keys=False))
    results = out / "results.jsonl"
    done: dict[str, set[tuple[str, str]]] = {}
    for r in read_rows(results):
        if not r.get("error"):
            done.setdefault(r["sample_id"], set()).add((r["policy"], str(r["budget"])))
    want = {(REFERENCE, "1.0")} | {(p.label, str(b)) for p in cfg.policy_specs for b in cfg.budgets_of(p, "agnostic")
                                   if only is None or p.label in only}
    for sample in decode_samples(cfg, codec):
        have = done.get(sample.sample_id, set())
        if want <= have:
            continue
        t0 = time.perf_counter()
        for row in run_sample(model, codec, cfg, sample, builder, have, only):
            append_row(results, row)
            if progress:
                print(f"[decode grid] {sample.sample_id} {row['policy']}@{row['budget']}: "
                      f"kl {row.get('kl_mean')} ppl {row.get('ppl')} recall {row.get('recall')} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    if report:
        from sparsekv.evaluation.decode_report import write_decode_report

        write_decode_report(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML grid (configs/eval/decode-*.yaml)")
    p.add_argument("--out", help="output folder (default: the config's)")
    p.add_argument("--samples", type=int)
    p.add_argument("--threads", type=int)
    p.add_argument("--only", help="comma-separated labels: run just these methods (the reference always)")
    p.add_argument("--budgets", help="comma-separated budgets instead of the config's (e.g. one budget first)")
    p.add_argument("--report-only", action="store_true", help="rewrite the tables and plots of --out")
    args = p.parse_args(argv)
    cfg = EvalConfig.from_yaml(args.config, out=args.out, samples=args.samples, threads=args.threads,
                               budgets=args.budgets)
    if args.report_only:
        from sparsekv.evaluation.decode_report import write_decode_report

        write_decode_report(Path(cfg.out))
        return 0
    only = {x.strip() for x in args.only.split(",") if x.strip()} if args.only else None
    if only:
        unknown = sorted(only - {p.label for p in cfg.policy_specs})
        if unknown:
            raise ValueError(f"--only {unknown}: not labels of this grid; labels: "
                             f"{', '.join(p.label for p in cfg.policy_specs)}")
    run_decode_grid(cfg, only=only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
