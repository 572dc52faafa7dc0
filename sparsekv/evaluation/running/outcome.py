"""What one run scored: turning a run's raw outputs (tokens, step logits, bytes, timings) into
the metrics of its row, against the full cache's `Reference`.

KL divergence, KL(full || policy) in nats from the next-token distributions:
- `kl`: at the first decoding step whose logits came from the compressed cache, i.e. step 0
  under the agnostic protocol (the question's forward) and step 1 under the aware protocol or
  without a question (step 0 comes from the prefill itself, which attends to everything before
  the cache compresses); step 0 whenever the prompt is prefilled in chunks. It is computed only
  while the policy's output so far equals the full cache's (same inputs), else NaN.
- `kl_mean`: the mean over all such steps with a shared prefix (for continuation samples: over
  every teacher-forced position, which always share their inputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from sparsekv.evaluation import metrics as M
from sparsekv.evaluation.tasks import Sample
from sparsekv.evaluation.tasks.codec import Codec

NAN = float("nan")


@dataclass
class Reference:
    """What the full cache produced for one sample and protocol: tokens and log-probabilities
    per step `(steps, vocab)` (continuation: per teacher-forced position)."""

    output_ids: list[int]
    logprobs: torch.Tensor
    score: float
    extra: dict[str, Any] = field(default_factory=dict)


def fill_row(
    row: dict[str, Any], sample: Sample, res: dict[str, Any], ref: Reference | None, codec: Codec
) -> tuple[dict[str, Any], torch.Tensor]:
    """Fill `row` with the metrics of one run's raw outputs `res` (from `execute.Runner`:
    `step_logits` `(steps, vocab)`, `output_ids`, KV bytes, timings, `first_compressed`),
    compared with the full cache's `ref` (None for the reference itself). Returns the row and
    the run's log-probabilities `(steps, vocab)`."""
    lp = torch.log_softmax(res["step_logits"], dim=-1)
    row.update(
        kv_bytes_compressed=res["kv_bytes_compressed"],
        kv_bytes_end=res["kv_bytes_end"],
        kv_bytes_peak=res.get("kv_bytes_peak"),
        peak_rss_mb=round(res["peak_rss_mb"], 1),
        prefill_s=round(res["prefill_s"], 4),
        decode_s=round(res["decode_s"], 4),
        prefill_shared=res["prefill_shared"],
        fork_s=round(res["fork_s"], 4) if "fork_s" in res else None,
    )
    if sample.kind == "continuation":
        tgt = torch.tensor(sample.target_ids[1:], device=lp.device)
        nll = -lp.gather(-1, tgt[:, None])[:, 0]
        row["nll"] = float(nll.mean())
        row["ppl"] = math.exp(row["nll"])
        row["top1"] = float((lp.argmax(-1) == tgt).float().mean())
        row["score"] = row["top1"]
        row["output"] = ""
        row["output_ids"] = []
        if ref is not None:
            kl = M.kl_divergence(ref.logprobs, lp)
            row["kl_mean"] = float(kl.mean())
            row["kl"] = row["kl_mean"]
        return row, lp
    out = res["output_ids"]
    n = len(out)
    row["output_ids"] = out
    row["output"] = codec.decode(out)
    row["new_tokens"] = n
    row["decode_tok_s"] = (
        round((n - 1) / res["decode_s"], 2) if n > 1 and res["decode_s"] > 0 else None
    )
    row["repetition"] = M.repetition_rate(out)
    if sample.kind == "answer":
        row["score"] = M.score_answer(row["output"], sample.answer)
    if ref is not None:
        agree, prefix = M.token_agreement(ref.output_ids, out)
        row["agreement"], row["prefix_match"] = agree, prefix
        if sample.kind == "generate":
            row["score"] = agree
        first = res["first_compressed"]
        valid = [t for t in range(first, min(len(ref.logprobs), len(lp))) if t <= prefix]
        if valid:
            kls = M.kl_divergence(ref.logprobs[valid], lp[valid])
            row["kl_mean"] = float(kls.mean())
            row["kl"] = float(kls[0]) if valid[0] == first else NAN
        else:
            row["kl"] = row["kl_mean"] = NAN
    return row, lp
