"""Running one decode-heavy sample (`decode_tasks`) through one cache, and its metrics.

A run (batch 1, no padding): the prompt `context_ids` is prefilled in one forward (the cache
compresses it to the budget); then the continuation `target_ids` is fed **token by token**, so
an evicting cache scores every new token on arrival, evicts once a layer exceeds its budget by
`evict_slack`, and re-ranks every `rerank_every` steps, exactly as during generation; then
`max_new_tokens` tokens are generated greedily after the continuation (free-running, compared
with the full cache's generation). Block feeding is not used: nothing here shows it equal to
token-by-token feeding for every policy (a multi-token step is a "prefill" step for the cache).

Only the decoder runs per step; the output layer (262k rows on gemma-3-270m, over half of a
step) is applied afterwards to all kept final hidden states at once (`output_logits`, equal to
the model's own logits, tested), which is what makes 1,000+-token continuations affordable on a
CPU. Per step the trace keeps the final hidden state `(hidden,)`, the KV bytes held and the
step's seconds; a clock around `EvictingLayer.rerank` measures the re-ranks themselves.

Metrics (`score_trace`), over the continuation positions 1..K-1 (position 0 is predicted by the
prefill, which attends to the whole prompt before anything is evicted):
- `kl_mean`: KL(full || policy) in nats, mean over positions; `windows`: per `window`-token
  window (default 256) the mean KL, perplexity and top-1 (argmax == true token); `kl_curve`:
  mean KL per 64 positions (for plots);
- `nll`, `ppl`, `top1` over the whole continuation;
- `recall`, `recall_first` (decode_recall): top-1 accuracy of the referring tokens, all of them
  and the first token of each reference;
- `kv_curve`: `[position, kv bytes of all layers, kv bytes of the budgeted layers]` every 64
  steps; `kv_bytes_end`, `kv_bytes_peak`;
- `agreement`, `prefix_match`, `repetition` of the greedy generation against the full cache's;
- `decode_ms_per_token` (mean over the teacher-forced steps), `rerank_s`, `reranks`,
  `rerank_pct` (re-rank seconds as a share of the decode seconds).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from sparsekv.evaluation import metrics as M
from sparsekv.evaluation.tasks import Sample

WINDOW = 256
CURVE_STEP = 64
NAN = float("nan")


def output_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The model's output layer on final hidden states: `(n, hidden)` -> `(n, vocab)` float32,
    with the final logit soft-capping of the families that have one (Gemma)."""
    from sparsekv.models.families import text_config

    logits = model.get_output_embeddings()(hidden).float()
    cap = getattr(text_config(model), "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


class RerankClock:
    """Times every global re-rank of one `SparseKVCache` (wall seconds and count), by wrapping
    the `rerank` method of each of its evicting layers for the cache's lifetime."""

    def __init__(self, cache):
        from sparsekv.cache import EvictingLayer

        self.seconds = 0.0
        self.count = 0
        for layer in getattr(cache, "layers", []):
            if isinstance(layer, EvictingLayer):
                layer.rerank = self._timed(layer.rerank)

    def _timed(self, fn):
        def rerank() -> None:
            t0 = time.perf_counter()
            fn()
            self.seconds += time.perf_counter() - t0
            self.count += 1

        return rerank


def _budgeted_bytes(cache) -> int:
    from sparsekv.cache import EvictingLayer

    return sum(layer.nbytes() for layer in getattr(cache, "layers", []) if isinstance(layer, EvictingLayer))


@dataclass
class DecodeTrace:
    """What one run produced. `hidden`: `(K-1, hidden)` final hidden states predicting
    `target_ids[1:]`; `kv_bytes`/`kv_budgeted`/`step_s`: one entry per teacher-forced step."""

    hidden: torch.Tensor
    kv_bytes: list[int]
    kv_budgeted: list[int]
    step_s: list[float]
    output_ids: list[int]
    kv_bytes_compressed: int
    prefill_s: float
    gen_s: float
    rerank_s: float = 0.0
    reranks: int = 0
    rerank_every: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@torch.no_grad()
def trace_sample(model, cache, sample: Sample, eos_ids=frozenset()) -> DecodeTrace:
    """Prefill `sample.context_ids`, feed `sample.target_ids` one token at a time, then generate
    `sample.max_new_tokens` greedy tokens (stopping at an id in `eos_ids`), all through `cache`."""
    if sample.kind != "decode":
        raise ValueError(f"sample {sample.sample_id!r} has kind {sample.kind!r}; expected 'decode'")
    if len(sample.target_ids) < 2:
        raise ValueError(f"sample {sample.sample_id!r}: target_ids needs >= 2 tokens")
    dec = model.get_decoder()
    dev = next(model.parameters()).device
    clock = RerankClock(cache)

    def step(ids: list[int]) -> torch.Tensor:  # (hidden,) of the last position
        x = torch.tensor([ids], dtype=torch.long, device=dev)
        return dec(input_ids=x, cache=cache, use_cache=True).last_hidden_state[0, -1]

    t0 = time.perf_counter()
    step(sample.context_ids)
    prefill_s = time.perf_counter() - t0
    compressed = M.kv_bytes(cache)
    hidden, kv, kv_b, secs = [], [], [], []
    target = sample.target_ids
    last = None
    for t, tok in enumerate(target):
        t0 = time.perf_counter()
        h = step([tok])
        secs.append(time.perf_counter() - t0)
        kv.append(M.kv_bytes(cache))
        kv_b.append(_budgeted_bytes(cache))
        if t < len(target) - 1:
            hidden.append(h)
        last = h
    t0 = time.perf_counter()
    out: list[int] = []
    while len(out) < sample.max_new_tokens:
        out.append(int(output_logits(model, last[None]).argmax(-1)))
        if out[-1] in eos_ids or len(out) == sample.max_new_tokens:
            break
        last = step([out[-1]])
    gen_s = time.perf_counter() - t0
    cfg = getattr(cache, "config", None)
    return DecodeTrace(torch.stack(hidden), kv, kv_b, secs, out, compressed, prefill_s, gen_s,
                       clock.seconds, clock.count, getattr(cfg, "rerank_every", None))


@torch.no_grad()
def position_stats(model, sample: Sample, trace: DecodeTrace, ref: DecodeTrace | None = None,
                   chunk: int = 256) -> dict[str, torch.Tensor]:
    """Per continuation position 1..K-1: `nll`, `top1` (argmax == true token) and, with a
    reference trace, `kl` (KL(ref || this) in nats); each `(K-1,)` float32. The output layer runs
    `chunk` positions at a time."""
    tgt = torch.tensor(sample.target_ids[1:], dtype=torch.long)
    n = len(tgt)
    nll, top1, kl = torch.empty(n), torch.empty(n), torch.empty(n)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        lp = torch.log_softmax(output_logits(model, trace.hidden[s:e]), -1).cpu()
        nll[s:e] = -lp.gather(-1, tgt[s:e, None])[:, 0]
        top1[s:e] = (lp.argmax(-1) == tgt[s:e]).float()
        if ref is not None:
            rlp = torch.log_softmax(output_logits(model, ref.hidden[s:e]), -1).cpu()
            kl[s:e] = M.kl_divergence(rlp, lp)
    out = {"nll": nll, "top1": top1}
    if ref is not None:
        out["kl"] = kl
    return out


def _mean(x: torch.Tensor) -> float:
    return float(x.mean()) if len(x) else NAN


def score_trace(sample: Sample, trace: DecodeTrace, stats: dict[str, torch.Tensor],
                ref: DecodeTrace | None = None, window: int = WINDOW) -> dict[str, Any]:
    """The row metrics of one run (see the module docstring) from `position_stats`."""
    nll, top1, kl = stats["nll"], stats["top1"], stats.get("kl")
    row: dict[str, Any] = {"nll": _mean(nll), "top1": _mean(top1)}
    row["ppl"] = math.exp(row["nll"])
    row["kl_mean"] = _mean(kl) if kl is not None else 0.0
    row["kl"] = row["kl_mean"]
    # Window w covers continuation positions [w*window, (w+1)*window); stats index i is position i+1.
    wins = []
    for start in range(0, len(sample.target_ids), window):
        lo, hi = max(0, start - 1), min(len(nll), start + window - 1)
        if hi <= lo:
            continue
        w = {"start": start, "end": hi + 1, "ppl": math.exp(_mean(nll[lo:hi])), "top1": _mean(top1[lo:hi])}
        w["kl"] = _mean(kl[lo:hi]) if kl is not None else 0.0
        wins.append(w)
    row["windows"] = wins
    row["kl_curve"] = ([round(_mean(kl[i : i + CURVE_STEP]), 6) for i in range(0, len(kl), CURVE_STEP)]
                       if kl is not None else [])
    positions = sample.metadata.get("recall_positions")
    if positions:
        every = [top1[p - 1] for ps in positions for p in ps]
        first = [top1[ps[0] - 1] for ps in positions if ps]
        row["recall"] = float(sum(every) / len(every))
        row["recall_first"] = float(sum(first) / len(first))
    row["kv_curve"] = [[t + 1, trace.kv_bytes[t], trace.kv_budgeted[t]]
                       for t in range(CURVE_STEP - 1, len(trace.kv_bytes), CURVE_STEP)]
    row["kv_bytes_compressed"] = trace.kv_bytes_compressed
    row["kv_bytes_end"] = trace.kv_bytes[-1]
    row["kv_bytes_peak"] = max(trace.kv_bytes)
    out = trace.output_ids
    row["output_ids"] = out
    row["new_tokens"] = len(out)
    row["repetition"] = M.repetition_rate(out)
    if ref is not None:
        row["agreement"], row["prefix_match"] = M.token_agreement(ref.output_ids, out)
    else:
        row["agreement"], row["prefix_match"] = 1.0, len(out)
    decode_s = sum(trace.step_s)
    row["prefill_s"] = round(trace.prefill_s, 4)
    row["decode_s"] = round(decode_s, 4)
    row["decode_ms_per_token"] = round(1000 * decode_s / len(trace.step_s), 3)
    row["decode_tok_s"] = round(len(trace.step_s) / decode_s, 2) if decode_s > 0 else None
    row["gen_s"] = round(trace.gen_s, 4)
    row["rerank_every"] = trace.rerank_every
    row["rerank_s"] = round(trace.rerank_s, 5)
    row["reranks"] = trace.reranks
    row["rerank_pct"] = round(100 * trace.rerank_s / decode_s, 4) if decode_s > 0 else None
    row["score"] = row.get("recall", row["top1"])
    return row


def run_decode(model, sample: Sample, cache, ref: DecodeTrace | None = None, eos_ids=frozenset()
               ) -> tuple[dict[str, Any], DecodeTrace]:
    """One run of a decode sample through `cache` (closed afterwards): its metrics against the
    reference trace `ref` (None for the reference itself) and its trace."""
    try:
        trace = trace_sample(model, cache, sample, eos_ids)
    finally:
        if hasattr(cache, "close"):
            cache.close()
    stats = position_stats(model, sample, trace, ref)
    return score_trace(sample, trace, stats, ref), trace
