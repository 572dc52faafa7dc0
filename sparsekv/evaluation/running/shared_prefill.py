"""The shared prefill, one per prompt: the recorded full-cache prefill every forking method
starts from (`_SharedPrefill`) and the forward that records it (`prefill_shared`).

Shared prefill (the default, `EvalConfig.shared_prefill`): the compressed part of each prompt is
prefilled once by a full `SparseKVCache` that records the attention statistics the grid's
policies read, and the reference and every policy x budget start from `fork` of it, which keeps
exactly what that policy's own prefill would have kept (eviction happens after each layer's
attention, so the prefill's outputs do not depend on the policy). The prefill forward then
runs once per prompt instead of once per method. `prefill_s` of such rows is the shared
forward (which computes the statistics of every policy) plus the method's own fork and question
forward. Which methods fork is decided by `plan.plan_forks`; `shared_prefill: false` prefills
every run live, with transformers' `DynamicCache` as the full-cache reference.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sparsekv.evaluation import metrics as M
from sparsekv.evaluation.config import PolicySpec
from sparsekv.evaluation.tasks import Sample

if TYPE_CHECKING:
    from sparsekv.evaluation.running.execute import Runner


@dataclass
class _SharedPrefill:
    """One recorded full-cache prefill: the cache, the last logits `(1, vocab)`, its seconds, the
    process's peak resident memory during it (bytes) and the LoRA it ran with (None: the plain
    model)."""

    cache: Any
    logits: torch.Tensor
    seconds: float
    peak_rss: int
    lora: Any = None


@torch.no_grad()
def prefill_shared(
    runner: Runner, sample: Sample, protocol: str, spec: PolicySpec | None = None
) -> _SharedPrefill:
    """Prefill the compressed part of the prompt once, with the full cache recording what
    every forkable policy needs; on the model that `spec` runs on (its LoRA applied for the
    forward, see `Runner.applied`), the plain model when `spec` is None."""
    from sparsekv import EvictionConfig, SparseKVCache

    ids = sample.context_ids if runner._split(sample, protocol) else sample.prompt_ids
    rec = SparseKVCache(
        runner.model,
        EvictionConfig(budget=1.0),
        "full",
        record=runner.forks.record,
        record_window=runner.forks.record_window,
    )
    with M.PeakRSS() as rss, runner.applied(spec):
        t0 = time.perf_counter()
        logits = runner._forward(ids, rec, 1)
        seconds = time.perf_counter() - t0
    return _SharedPrefill(rec, logits, seconds, rss.peak, runner.lora_of(spec))
