"""One decode-heavy sample of a grid, run for every method: the samples of an `EvalConfig`'s
decode tasks, the full cache's reference trace (kept between runs), each method's rows, and the
row file they go to. `decode_grid` runs a whole grid into a folder; `sparsekv eval`
(`execute.Runner.run_group`) hands its decode samples to `decode_rows`."""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import yaml

from sparsekv.evaluation.config import REFERENCE, EvalConfig, PolicySpec
from sparsekv.evaluation.running.decode import DecodeTrace, run_decode
from sparsekv.evaluation.running.plan import build_samples
from sparsekv.evaluation.tasks import Sample, get_task
from sparsekv.evaluation.tasks.decode import DECODE_KIND
from sparsekv.io import atomic_path, read_jsonl

_SETUP = ("model", "dtype", "attn_implementation", "seed", "eviction", "task_options")


def decode_samples(cfg: EvalConfig, codec) -> list[Sample]:
    """The grid's decode samples, in order index -> task -> length (`plan.build_samples`, after
    checking that every task is a decode task)."""
    for task in cfg.tasks:
        if get_task(task).kind != DECODE_KIND:
            raise ValueError(f"task {task!r} is not a decode task; decode tasks: "
                             f"{', '.join(t for t, s in _decode_specs())}")
    return build_samples(cfg, codec)


def _decode_specs():
    from sparsekv.evaluation.tasks import TASKS

    return [(t, s) for t, s in TASKS.items() if s.kind == DECODE_KIND]


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
    from sparsekv.models.default import cache_dir

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
    with atomic_path(path) as tmp:
        torch.save({"row": _clean(row), "trace": {f.name: getattr(trace, f.name) for f in fields(DecodeTrace)}}, tmp)
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
    return read_jsonl(path, missing_ok=True)


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
