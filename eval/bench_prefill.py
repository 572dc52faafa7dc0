"""Prefill cost of each policy against the full cache: the cost columns of the peer table.

    python eval/bench_prefill.py --length 2048 --rounds 3 \
        --policies kvzip,expected_attention,snapkv,learned:checkpoints/gemma3-270m-sparsekv
    python eval/bench_prefill.py --model tiny:gemma3 --length 256 --rounds 2 --out /tmp/bench

Every method prefills the same real-prose prompt live, through its own cache (never a fork of a
shared prefill): the time covers the forward and the policy's scoring and eviction (KVzip's
repeat pass included), and is divided by the full cache's prefill time of the same round
(transformers' `DynamicCache`, `logits_to_keep=1` for all). Rounds are interleaved (every
method once per round, the full cache first) and the median of the per-round ratios is
reported, so slow phases of a shared machine hit all methods alike. Also per method: the peak
KV bytes the cache held (KVzip's repeat included), the process's peak resident memory above
what it held before the prefill (sampled every 5 ms), and the scorer's trained parameters (0
for the heuristics and the peers, the head's parameters for a learned adapter).

Writes `prefill.json` (settings and rows) and `prefill.md` (a Markdown table) under `--out`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from sparsekv import EvictionConfig, SparseKVCache, policies
from sparsekv.evaluation.metrics import PeakRSS
from sparsekv.evaluation.models import load_model


def prose_ids(codec, length: int) -> list[int]:
    """The first `length` tokens of the evaluation prose (after the codec's BOS)."""
    from sparsekv.evaluation.text import eval_texts

    ids: list[int] = list(codec.bos_ids)
    for _, text in eval_texts("prose"):
        ids += codec.encode(text + "\n\n")
        if len(ids) >= length:
            return ids[:length]
    raise ValueError(f"--length {length}: the evaluation prose has only {len(ids)} tokens")


def build_policy(spec: str, codec):
    """A policy from its name; KVzip gets the codec's `encode` for its repeat prompt."""
    if spec == "kvzip":
        return policies.get("kvzip", encode=codec.encode)
    return policies.get(spec)


def scorer_parameters(policy) -> int:
    """Trained parameters a policy scores with: the learned head's, 0 for everything else."""
    adapter = getattr(policy, "adapter", None)
    head = getattr(adapter, "head", adapter)
    if head is None or not hasattr(head, "parameters"):
        return 0
    return sum(p.numel() for p in head.parameters())


@torch.no_grad()
def prefill(model, ids: torch.Tensor, cache) -> tuple[float, int, int]:
    """One timed prefill; returns (seconds, peak KV bytes, peak RSS above the start in bytes)."""
    with PeakRSS() as rss:
        start = rss.peak
        t0 = time.perf_counter()
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        seconds = time.perf_counter() - t0
    if hasattr(cache, "peak_kv_bytes"):
        kv = cache.peak_kv_bytes()
    else:
        kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    return seconds, kv, max(0, rss.peak - start)


def run(model, codec, methods: list[str], length: int, rounds: int, budget: float) -> list[dict]:
    from transformers import DynamicCache

    ids = torch.tensor([prose_ids(codec, length)], device=next(model.parameters()).device)
    built = {m: build_policy(m, codec) for m in methods}
    times: dict[str, list[float]] = {m: [] for m in ["full", *methods]}
    ratios: dict[str, list[float]] = {m: [] for m in methods}
    peak_kv: dict[str, int] = {}
    peak_rss: dict[str, int] = {}
    cfg = EvictionConfig(budget=budget)
    for _ in range(rounds + 1):  # round 0 warms up (first-call allocations, lazy imports)
        for m in ["full", *methods]:
            if m == "full":
                cache = DynamicCache(config=model.config)
            else:
                cache = SparseKVCache(model, cfg, built[m])
            seconds, kv, rss = prefill(model, ids, cache)
            if hasattr(cache, "close"):
                cache.close()
            times[m].append(seconds)
            peak_kv[m], peak_rss[m] = max(peak_kv.get(m, 0), kv), max(peak_rss.get(m, 0), rss)
        for m in methods:
            ratios[m].append(times[m][-1] / times["full"][-1])
    rows = []
    for m in ["full", *methods]:
        timed = times[m][1:]
        rows.append({
            "method": m,
            "prefill_s_median": round(statistics.median(timed), 4),
            "prefill_ratio": 1.0 if m == "full" else round(statistics.median(ratios[m][1:]), 3),
            "prefill_ratios": [] if m == "full" else [round(r, 3) for r in ratios[m][1:]],
            "peak_kv_mb": round(peak_kv[m] / 2**20, 2),
            "peak_rss_delta_mb": round(peak_rss[m] / 2**20, 1),
            "scorer_params": 0 if m == "full" else scorer_parameters(built[m]),
        })
    return rows


def markdown(rows: list[dict], settings: dict) -> str:
    lines = [
        (f"Prefill cost at {settings['length']} tokens, budget {settings['budget']}, model "
         f"{settings['model']}, median of {settings['rounds']} interleaved rounds ({settings['machine']})."),
        "",
        ("| method | prefill + scoring (s) | x full prefill | peak KV (MB) | peak RSS above start (MB) "
         "| scorer parameters |"),
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['method']} | {r['prefill_s_median']:.3f} | {r['prefill_ratio']:.2f} | "
                     f"{r['peak_kv_mb']:.1f} | {r['peak_rss_delta_mb']:.0f} | {r['scorer_params']:,} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="'default', 'tiny:<family>' or a model folder")
    p.add_argument("--length", type=int, default=2048, help="prompt tokens")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (after one warm-up round)")
    p.add_argument("--budget", type=float, default=0.3)
    p.add_argument("--policies", default="kvzip,expected_attention,snapkv")
    p.add_argument("--out", default="eval/results/prefill", help="folder for prefill.json / prefill.md")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.length < 2:
        p.error("--rounds must be >= 1 and --length >= 2")
    model, codec = load_model(args.model)
    methods = [m for m in args.policies.split(",") if m]
    rows = run(model, codec, methods, args.length, args.rounds, args.budget)
    settings = {"model": args.model, "length": args.length, "rounds": args.rounds, "budget": args.budget,
                "torch_threads": torch.get_num_threads(), "machine": platform.machine() + ", "
                + f"{torch.get_num_threads()} threads, shared CPU"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=2) + "\n")
    table = markdown(rows, settings)
    (out / "prefill.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
