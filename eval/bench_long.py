"""Long prompts on the default model: full cache vs. chunked prefill with eviction.

    python eval/bench_long.py                              # 4K, 8K, 16K tokens, budget 0.3
    python eval/bench_long.py --lengths 2048 --new-tokens 4

Every (mode, length) runs in its own Python process so that its peak RSS is its own. The full
cache prefills the prompt in one forward, as `model.generate` would; the evicting cache prefills
`--chunk` tokens at a time and evicts after each chunk (SnapKV scores, `--budget` of the tokens
in the full-attention layers). Reported: prefill seconds, decode tokens/s, KV bytes held at the
end, the peak KV bytes during prefill (measured by the cache) against budget + chunk, and the
process's peak RSS. The prompt is real prose (Python's documentation), tokenized.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch


def child(mode: str, length: int, budget: float, chunk: int, new_tokens: int) -> dict:
    from sparsekv import EvictionConfig, SparseKVCache, load_default_model

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    from eval.bench_decode import prose_ids

    model, tok = load_default_model()
    ids = prose_ids(tok, length)
    if mode == "full":
        cfg, policy = EvictionConfig(budget=1.0), "full"
    else:
        cfg, policy = EvictionConfig(budget=budget, prefill_chunk=chunk), "snapkv"
    cache = SparseKVCache(model, cfg, policy)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(input_ids=ids, cache=cache, logits_to_keep=1)
        t1 = time.perf_counter()
        prefill_peak = cache.peak_kv_bytes()
        tok_ = out.logits[:, -1:].argmax(-1)
        for _ in range(new_tokens):
            tok_ = model(input_ids=tok_, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
        t2 = time.perf_counter()
    full_layers = len(cache.budgeted_layers)
    entry = 2 * model.config.num_key_value_heads * model.config.head_dim * 4  # K+V, float32
    sliding = cache.kv_bytes() - sum(cache.layers[i].nbytes() for i in cache.budgeted_layers)
    bound = sliding + full_layers * entry * (int(budget * length) + 1 + chunk)
    return {
        "mode": mode,
        "length": length,
        "prefill_s": round(t1 - t0, 2),
        "decode_tok_s": round(new_tokens / (t2 - t1), 2),
        "kv_bytes_end": cache.kv_bytes(),
        "kv_bytes_peak": prefill_peak,
        "kv_bound_budget_plus_chunk": bound if mode != "full" else None,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="4096,8192,16384")
    p.add_argument("--modes", default="full,chunked")
    p.add_argument("--budget", type=float, default=0.3)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--json", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--child", nargs=2, metavar=("MODE", "LENGTH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        row = child(args.child[0], int(args.child[1]), args.budget, args.chunk, args.new_tokens)
        print("ROW " + json.dumps(row))
        return 0
    rows = []
    for n in [int(x) for x in args.lengths.split(",")]:
        for mode in args.modes.split(","):
            if mode not in ("full", "chunked"):
                raise SystemExit(f"--modes: unknown mode {mode!r}; allowed values: full, chunked")
            cmd = [sys.executable, __file__, "--child", mode, str(n), "--budget", str(args.budget),
                   "--chunk", str(args.chunk), "--new-tokens", str(args.new_tokens)]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            print(f"running {mode} at {n} tokens ...", flush=True)
            res = subprocess.run(cmd, capture_output=True, text=True)
            line = [ln for ln in res.stdout.splitlines() if ln.startswith("ROW ")]
            if res.returncode != 0 or not line:
                rows.append({"mode": mode, "length": n, "error": res.stderr.strip().splitlines()[-1:]})
                continue
            rows.append(json.loads(line[0][4:]))
    print(f"\ndefault model (gemma-3-270m, float32), CPU with {torch.get_num_threads()} threads; "
          f"budget {args.budget} in the full-attention layers, chunk {args.chunk}")
    print("| length | mode | prefill s | decode tok/s | KV MiB end | KV MiB peak | bound budget+chunk | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|")
    mib = 2**20
    for r in rows:
        if "error" in r:
            print(f"| {r['length']} | {r['mode']} | failed: {r['error']} |||||")
            continue
        bound = "-" if r["kv_bound_budget_plus_chunk"] is None else f"{r['kv_bound_budget_plus_chunk'] / mib:.1f}"
        print(f"| {r['length']} | {r['mode']} | {r['prefill_s']} | {r['decode_tok_s']} | {r['kv_bytes_end'] / mib:.1f} | "
              f"{r['kv_bytes_peak'] / mib:.1f} | {bound} | {r['peak_rss_bytes'] / mib:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
