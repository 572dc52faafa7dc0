"""One run of one method on one sample: prefill (or fork a shared prefill), question, then
greedy decoding or teacher forcing; its raw outputs and measurements (`execute_run`).

How one run goes (batch 1, greedy, no sampling):
- "answer" and "generate" samples: the prompt is prefilled with `logits_to_keep=1`; under the
  agnostic protocol the context alone first (the cache compresses it), then the question through
  the compressed cache; under the aware protocol context + question in one forward. Then
  greedy decoding token by token up to `max_new_tokens` or an end-of-sequence token.
- "continuation" samples: the context is prefilled (compressed), then the held-out continuation
  is teacher-forced through the cache and scored position by position.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from sparsekv.evaluation import metrics as M
from sparsekv.evaluation.running.shared_prefill import _SharedPrefill
from sparsekv.evaluation.tasks import Sample

if TYPE_CHECKING:
    from sparsekv.evaluation.running.execute import Runner


@torch.no_grad()
def execute_run(
    runner: Runner,
    sample: Sample,
    protocol: str,
    start,
    chunk: int | None,
    shared: _SharedPrefill | None,
) -> dict[str, Any]:
    """One run. `start()` returns a cache holding the compressed prefix: a fresh cache that
    this function prefills (shared is None) or a fork of the shared prefill. Returns raw
    outputs (token ids, step logits) and measurements."""
    ctx, q = sample.context_ids, sample.question_ids
    split = runner._split(sample, protocol)
    res: dict[str, Any] = {"prefill_shared": shared is not None}
    with M.PeakRSS() as rss:
        t0 = time.perf_counter()
        cache = start()
        if shared is None:
            logits = runner._forward(ctx if split else ctx + q, cache, 1)
        else:
            logits = shared.logits
            res["fork_s"] = time.perf_counter() - t0
        res["kv_bytes_compressed"] = M.kv_bytes(cache)
        if split and q:
            logits = runner._forward(q, cache, 1)
        res["prefill_s"] = (
            time.perf_counter() - t0 + (shared.seconds if shared is not None else 0.0)
        )
        chunked = chunk is not None and len(ctx) + len(q) > chunk
        res["first_compressed"] = 0 if (split or chunked) else 1
        t1 = time.perf_counter()
        if sample.kind == "continuation":
            tgt = sample.target_ids[:-1]
            step = chunk or len(tgt)
            parts = [runner._forward(tgt[i : i + step], cache, 0) for i in range(0, len(tgt), step)]
            res["step_logits"] = torch.cat(parts, 0)  # (K-1, vocab) predicting target[1:]
            res["output_ids"] = []
        else:
            steps = [logits[-1]]
            out = [int(logits[-1].argmax())]
            one_line = sample.kind == "answer"
            while len(out) < sample.max_new_tokens and out[-1] not in runner.codec.eos_ids:
                if one_line and M.answer_complete(runner.codec.decode(out)):
                    break  # only the first line is scored
                logits = runner._forward([out[-1]], cache, 1)
                steps.append(logits[-1])
                out.append(int(logits[-1].argmax()))
            res["step_logits"] = torch.stack(steps)
            res["output_ids"] = out
        res["decode_s"] = time.perf_counter() - t1
        res["kv_bytes_end"] = M.kv_bytes(cache)
        if shared is None:  # a fork never held the whole prefix itself
            peak = cache.peak_kv_bytes() if hasattr(cache, "peak_kv_bytes") else 0
            res["kv_bytes_peak"] = int(max(peak, res["kv_bytes_compressed"], res["kv_bytes_end"]))
        if hasattr(cache, "close"):
            cache.close()
    peak = max(rss.peak, shared.peak_rss if shared is not None else 0)
    res["peak_rss_mb"] = peak / 2**20
    return res
