"""Decode time per step against the re-rank interval, in one process (issue 18, the re-rank study).

    python eval/bench_decode.py --prompt 768 --steps 48 --budgets 256 \\
        --policies learned:checkpoints/gemma3-270m-sparsekv --rerank 0,4,8,16,64 --rounds 10 \\
        --threads 1 --json docs/results/decode-timing/rows.json
    python eval/bench_decode.py --length 4096 --new-tokens 32 --budget 0.3 --policies h2o,snapkv

Every configuration (policy x budget x `rerank_every`, plus the full cache) starts from its own
prefill of the same real-prose prompt (`--prompt` tokens, more than the budget, so eviction runs
from the first step) and then feeds the same `--steps` tokens of the text's continuation one at
a time through the whole model (logits included, as generation does); only those steps are
timed. Rounds are interleaved: every configuration once per round, in a shuffled order, so the
machine's background load hits all alike. Per policy and budget, `rerank_every=0` runs twice per
round (labelled `0` and `0'`): the two are the same configuration, so their difference is the
measurement noise (the A/A comparison), reported beside the re-rank costs.

Per configuration: the median over rounds of the ms per step; the cost against the same policy
without re-ranking as the median over rounds of the paired per-round ratio, with a 95% interval
(bootstrap over rounds); and the re-rank's own time, measured by a clock around
`EvictingLayer.rerank`, as ms per step and as a share of the decode time. Prints a Markdown table;
`--json` writes the rows and the run's settings.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from sparsekv import EvictionConfig, SparseKVCache, load_default_model, policies
from sparsekv.evaluation.running.decode import RerankClock
from sparsekv.evaluation.tasks import make_sample
from sparsekv.evaluation.tasks.codec import HFCodec
from sparsekv.evaluation.tasks.decode import DECODE_KIND  # noqa: F401  (registers the tasks)
from sparsekv.io import write_atomic


def text_ids(tok, prompt: int, steps: int) -> tuple[list[int], list[int]]:
    """`prompt` tokens (bos included) and the next `steps` tokens of evaluation prose."""
    codec = HFCodec(tok)
    s = make_sample("decode_prose", codec, steps + prompt, 0, seed=0, prompt_tokens=1, gen_tokens=0)
    ids = s.context_ids + s.target_ids
    return ids[:prompt], ids[prompt : prompt + steps]


@torch.no_grad()
def timed_steps(model, cache, prompt: list[int], steps: list[int]) -> tuple[float, float, int, int]:
    """Prefill `prompt`, then feed `steps` one token at a time (timed). Returns (decode seconds,
    re-rank seconds, re-ranks, kv bytes at the end)."""
    clock = RerankClock(cache)
    model(input_ids=torch.tensor([prompt]), cache=cache, logits_to_keep=1)
    t0 = time.perf_counter()
    for tok in steps:
        model(input_ids=torch.tensor([[tok]]), cache=cache, logits_to_keep=1)
    secs = time.perf_counter() - t0
    kv = cache.kv_bytes()
    cache.close()
    return secs, clock.seconds, clock.count, kv


def _budget(text: str):
    v = float(text)
    return int(v) if v.is_integer() and v > 1 else v


def _interval(ratios: list[float], draws: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the median of `ratios`."""
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", "--length", dest="prompt", type=int, default=768, help="prompt tokens prefilled")
    p.add_argument("--steps", "--new-tokens", dest="steps", type=int, default=48, help="decode steps timed per run")
    p.add_argument("--budgets", "--budget", dest="budgets", default="256",
                   help="comma-separated budgets: token counts (>1) or fractions in (0, 1]")
    p.add_argument("--policies", default="learned:checkpoints/gemma3-270m-sparsekv,h2o",
                   help="comma-separated policies (learned:DIR for a trained scorer)")
    p.add_argument("--blend", type=float, default=None, help="learned: blend at re-rank (default: the adapter's)")
    p.add_argument("--blend-mode", default=None, help="learned: mix or max (default: the adapter's)")
    p.add_argument("--rerank", default="0,4,8,16,64", help="rerank_every values (0 = never)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--no-full", action="store_true", help="skip the full-cache configuration")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    reranks = [int(r) for r in args.rerank.split(",")]
    if 0 not in reranks:
        raise ValueError(f"--rerank {args.rerank!r} must include 0 (the never-re-rank baseline)")
    budgets = [_budget(b) for b in args.budgets.split(",")]
    model, tok = load_default_model()
    prompt, steps = text_ids(tok, args.prompt, args.steps)
    kwargs = {k: v for k, v in (("blend", args.blend), ("blend_mode", args.blend_mode)) if v is not None}
    built = {}
    for name in (n.strip() for n in args.policies.split(",") if n.strip()):
        built[name] = policies.get(name, **kwargs) if name.startswith("learned") else policies.get(name)
    # (label, policy name, budget, rerank_every); "0'" is the A/A twin of rerank_every=0
    configs = [] if args.no_full else [("full", "full", 1.0, 0)]
    for name in built:
        for b in budgets:
            for r in reranks:
                configs.append((f"{name}|{b}|{r}", name, b, r))
            configs.append((f"{name}|{b}|0'", name, b, 0))
    secs: dict[str, list[float]] = {c[0]: [] for c in configs}
    rr: dict[str, list[float]] = {c[0]: [] for c in configs}
    count: dict[str, int] = {}
    kv: dict[str, int] = {}
    order = random.Random(0)
    bar = tqdm(total=len(configs) * args.rounds, desc="decode timing", unit="run")
    for _ in range(args.rounds):
        for label, name, b, r in order.sample(configs, len(configs)):
            policy = "full" if name == "full" else built[name]
            cache = SparseKVCache(model, EvictionConfig(budget=b, rerank_every=r), policy)
            s, rs, n, kv[label] = timed_steps(model, cache, prompt, steps)
            secs[label].append(s)
            rr[label].append(rs)
            count[label] = n
            bar.update()
    bar.close()

    rows = []
    for label, name, b, r in configs:
        ms = [1000 * s / args.steps for s in secs[label]]
        row = {"policy": name, "budget": b, "rerank_every": r, "twin": label.endswith("'"),
               "ms_per_step": round(statistics.median(ms), 3),
               "rerank_ms_per_step": round(1000 * statistics.median(rr[label]) / args.steps, 4),
               "rerank_pct_of_decode": round(100 * sum(rr[label]) / sum(secs[label]), 4),
               "reranks_per_run": count[label], "kv_bytes": kv[label], "rounds": args.rounds}
        if name != "full" and (r != 0 or row["twin"]):
            base = secs[f"{name}|{b}|0"]
            ratios = [x / y for x, y in zip(secs[label], base)]
            lo, hi = _interval(ratios)
            row["cost_vs_never_pct"] = round(100 * (statistics.median(ratios) - 1), 2)
            row["cost_ci95_pct"] = [round(100 * (lo - 1), 2), round(100 * (hi - 1), 2)]
        rows.append(row)
    setting = {"prompt_tokens": args.prompt, "steps": args.steps, "rounds": args.rounds, "policies": args.policies,
               "policy_kwargs": kwargs, "machine": platform.machine(), "processor": platform.processor(),
               "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
               "load_average_end": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"\n{setting}")
    print("| policy | budget | rerank_every | ms/step (median) | cost vs never (median, 95% CI) | "
          "re-rank ms/step (clock) | re-rank % of decode | KV MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        r = "-" if row["policy"] == "full" else (f"{row['rerank_every']}'" if row["twin"] else row["rerank_every"])
        cost = ""
        if "cost_vs_never_pct" in row:
            lo, hi = row["cost_ci95_pct"]
            cost = f"{row['cost_vs_never_pct']:+.1f}% [{lo:+.1f}, {hi:+.1f}]"
        print(f"| {row['policy']} | {row['budget']} | {r} | {row['ms_per_step']:.1f} | {cost} | "
              f"{row['rerank_ms_per_step']:.3f} | {row['rerank_pct_of_decode']:.3f} | {row['kv_bytes'] / 2**20:.1f} |")
    if args.json:
        write_atomic(Path(args.json), json.dumps({"setting": setting, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
