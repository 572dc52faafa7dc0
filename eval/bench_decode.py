"""Decode throughput of the evicting cache against the full cache, side by side in one process.

    python eval/bench_decode.py                      # default model, 4K-token prompt
    python eval/bench_decode.py --length 1024 --new-tokens 16 --policies snapkv,h2o

For every policy: budget 0.3 with re-ranking every 4, 16 and 64 decode steps and without
re-ranking (rerank_every=0). The real-prose prompt is prefilled once; every configuration starts
from its own compressed copy of that prefill (`SparseKVCache.fork`) and decodes `--new-tokens`
greedy tokens; only the decode loop is timed. Rounds are interleaved (every
configuration once per round) and the best round is kept, so background noise hits all alike.
Prints a Markdown table with tokens/s, the ratio to the full cache and the cost of each re-rank
interval against the same policy without re-ranking; `--json` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from tqdm import tqdm

from sparsekv import EvictionConfig, SparseKVCache, load_default_model, policies


def prose_ids(tok, length: int) -> torch.Tensor:
    from sparsekv.evaluation.text import corpus

    text, ids = "", []
    for doc in corpus():
        text += " ".join(doc.sentences) + "\n\n"
        if len(text) > length * 6:
            ids = tok(text, return_tensors="pt").input_ids
            if ids.shape[1] >= length:
                break
    if ids.shape[1] < length:
        raise ValueError(f"--length {length}: the prose corpus has only {ids.shape[1]} tokens")
    return ids[:, :length]


@torch.no_grad()
def decode_seconds(model, first_token, cache, new_tokens: int) -> tuple[float, int]:
    """`new_tokens` greedy steps from a prefilled cache (timed). Returns (seconds, kv bytes)."""
    tok = first_token
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        out = model(input_ids=tok, cache=cache, logits_to_keep=1)
        tok = out.logits[:, -1:].argmax(-1)
    return time.perf_counter() - t0, cache.kv_bytes()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=4096, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=32, help="decode steps timed per run")
    p.add_argument("--budget", type=float, default=0.3)
    p.add_argument("--policies", default="streaming,h2o,snapkv,pyramidkv,tova,knorm,random")
    p.add_argument("--rerank", default="0,4,16,64", help="rerank_every values (0 = never)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None, help="write the rows to this file")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tok = load_default_model()
    ids = prose_ids(tok, args.length)
    # One prefill serves every configuration: `fork` compresses it exactly as each policy's own
    # prefill would have (tested in tests/test_cache.py), so only decoding differs and is timed.
    base = SparseKVCache(model, EvictionConfig(budget=1.0), "full", record=("all", "window", "last"))
    with torch.no_grad():
        first = model(input_ids=ids, cache=base, logits_to_keep=1).logits[:, -1:].argmax(-1)
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    for n in names:
        policies.get(n)  # fail early on a bad name
    reranks = [int(r) for r in args.rerank.split(",")]
    configs = [("full", 0)] + [(n, r) for n in names for r in reranks]
    best: dict[tuple[str, int], float] = {}
    kv: dict[tuple[str, int], int] = {}
    bar = tqdm(total=len(configs) * args.rounds, desc="decode benchmark", unit="run")
    for _ in range(args.rounds):
        for name, r in configs:
            budget = 1.0 if name == "full" else args.budget
            cache = base.fork(EvictionConfig(budget=budget, rerank_every=r), name)
            secs, kv[(name, r)] = decode_seconds(model, first, cache, args.new_tokens)
            cache.close()
            best[(name, r)] = min(best.get((name, r), float("inf")), secs)
            bar.update()
    bar.close()

    full_tps = args.new_tokens / best[("full", 0)]
    rows = []
    for name, r in configs:
        tps = args.new_tokens / best[(name, r)]
        base = best.get((name, 0))
        rows.append(
            {
                "policy": name,
                "rerank_every": r,
                "tokens_per_s": round(tps, 2),
                "vs_full": round(tps / full_tps, 3),
                "rerank_cost_pct": None if name == "full" or r == 0 else round(100 * (best[(name, r)] / base - 1), 1),
                "kv_bytes": kv[(name, r)],
            }
        )
    print(f"\nmachine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"prompt {args.length} tokens, {args.new_tokens} decode steps, budget {args.budget}, best of {args.rounds}")
    print("| policy | rerank_every | tokens/s | vs full | re-rank cost vs none | KV MiB |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        cost = "" if row["rerank_cost_pct"] is None else f"{row['rerank_cost_pct']:+.1f}%"
        print(f"| {row['policy']} | {row['rerank_every'] or '-'} | {row['tokens_per_s']:.2f} | "
              f"{row['vs_full']:.2f}x | {cost} | {row['kv_bytes'] / 2**20:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
