"""Prefill cost of each policy against the full cache: the cost columns of the peer table.

    python eval/bench_prefill.py --length 2048 --rounds 3 \
        --policies kvzip,expected_attention,snapkv,learned:checkpoints/gemma3-270m-sparsekv
    python eval/bench_prefill.py --model tiny:gemma3 --length 256 --rounds 2 --out /tmp/bench

Every method prefills the same real-prose prompt live, through its own cache (never a fork of a
shared prefill): the time covers the forward and the policy's scoring and eviction (KVzip's
repeat pass included), and is divided by the full cache's prefill time of the same round
(transformers' `DynamicCache`, `logits_to_keep=1` for all). Rounds are interleaved (every
method once per round, the full cache first, after one untimed warm-up round) and the median of
the per-round ratios is reported. Two clocks: wall time, and the process's CPU time, which on a
CPU shared with other jobs barely moves with their load (with one torch thread it is the work
done; wall time there measures the neighbours as much as the method). Also per method: the peak
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
from sparsekv.evaluation.running.models import load_model


def prose_ids(codec, length: int) -> list[int]:
    """The first `length` tokens of the evaluation prose (after the codec's BOS)."""
    from sparsekv.evaluation.tasks.text import eval_texts

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
def prefill(model, ids: torch.Tensor, cache) -> tuple[float, float, int, int]:
    """One timed prefill; returns (wall seconds, CPU seconds, peak KV bytes, peak RSS above the
    start in bytes)."""
    with PeakRSS() as rss:
        start = rss.peak
        t0, c0 = time.perf_counter(), time.process_time()
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    if hasattr(cache, "peak_kv_bytes"):
        kv = cache.peak_kv_bytes()
    else:
        kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    return seconds, cpu, kv, max(0, rss.peak - start)


def run(model, codec, methods: list[str], length: int, rounds: int, budget: float) -> list[dict]:
    from transformers import DynamicCache

    ids = torch.tensor([prose_ids(codec, length)], device=next(model.parameters()).device)
    built = {m: build_policy(m, codec) for m in methods}
    names = ["full", *methods]
    wall: dict[str, list[float]] = {m: [] for m in names}
    cpu: dict[str, list[float]] = {m: [] for m in names}
    peak_kv: dict[str, int] = {}
    peak_rss: dict[str, int] = {}
    cfg = EvictionConfig(budget=budget)
    for r in range(rounds + 1):  # round 0 warms up (first-call allocations, lazy imports)
        for m in names:
            cache = DynamicCache(config=model.config) if m == "full" else SparseKVCache(model, cfg, built[m])
            seconds, cpu_s, kv, rss = prefill(model, ids, cache)
            if hasattr(cache, "close"):
                cache.close()
            if r:
                wall[m].append(seconds)
                cpu[m].append(cpu_s)
                peak_kv[m], peak_rss[m] = max(peak_kv.get(m, 0), kv), max(peak_rss.get(m, 0), rss)

    def ratio(clock: dict[str, list[float]], m: str) -> list[float]:
        return [a / b for a, b in zip(clock[m], clock["full"])]

    rows = []
    for m in names:
        rows.append({
            "method": m,
            "prefill_s_median": round(statistics.median(wall[m]), 4),
            "prefill_cpu_s_median": round(statistics.median(cpu[m]), 4),
            "prefill_ratio": round(statistics.median(ratio(wall, m)), 3),
            "prefill_cpu_ratio": round(statistics.median(ratio(cpu, m)), 3),
            "prefill_ratios": [round(x, 3) for x in ratio(wall, m)],
            "prefill_cpu_ratios": [round(x, 3) for x in ratio(cpu, m)],
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
        ("| method | prefill + scoring CPU (s) | x full prefill (CPU) | wall (s) | x full (wall) "
         "| peak KV (MiB) | peak RSS above start (MiB) | scorer parameters |"),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['method']} | {r['prefill_cpu_s_median']:.2f} | {r['prefill_cpu_ratio']:.2f} | "
                     f"{r['prefill_s_median']:.2f} | {r['prefill_ratio']:.2f} | {r['peak_kv_mb']:.1f} | "
                     f"{r['peak_rss_delta_mb']:.0f} | {r['scorer_params']:,} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="'default', 'tiny:<family>' or a model folder")
    p.add_argument("--length", type=int, default=2048, help="prompt tokens")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (after one warm-up round)")
    p.add_argument("--budget", type=float, default=0.3)
    p.add_argument("--policies", default="kvzip,expected_attention,snapkv")
    p.add_argument("--out", default="docs/results/prefill", help="folder for prefill.json / prefill.md")
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
