"""Throughput and memory at scale: full cache vs. budget 0.3 (with and without INT8).

    python eval/bench_gpu.py                                   # Llama-3.1-8B shape, bf16, CUDA
    python eval/bench_gpu.py --shape tiny --device cpu --lengths 256,512 --dtype float32   # CI

The model has the real shape of Llama-3.1-8B (or Qwen2.5-7B) built from its config with random
weights: no download. Random weights give meaningless text but real memory and time. For every
prompt length and mode it measures: KV bytes held after decoding, peak device memory, prefill
seconds, decode tokens/s; then the largest batch that fits in `--memory-gib` of device memory,
estimated from the measured weight bytes, prefill working memory and KV bytes per sequence (the
KV part is what eviction shrinks). Prints one Markdown table with ratios to the full cache.

Modes: `dynamic` is transformers' own DynamicCache (no sparsekv: the baseline a user has today),
`full` is SparseKVCache at budget 1.0 (its bookkeeping without eviction), `0.3` keeps 30% of the
tokens (SnapKV scores), `0.3+int8` stores those as INT8. Prefill runs in chunks (`--chunk`) for
every mode, so all pay for the same activations and differ only in what they keep. An untimed
warm-up run per mode (`--warmup` tokens) comes first. `--profile N` adds, per run, what N more
decode steps cost: kernels launched, device-busy and wall milliseconds per step.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from tqdm import tqdm

from sparsekv import EvictionConfig, SparseKVCache
from sparsekv.models.default import resolve_dtype

SHAPES = {
    "llama-3.1-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
        max_position_embeddings=131072,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, rope_theta=1000000.0,
        max_position_embeddings=131072,
    ),
    "tiny": dict(
        model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, vocab_size=1024, max_position_embeddings=8192,
    ),
}
MODES = {
    "dynamic": dict(budget=None, quantize=None, policy=None),  # transformers' own DynamicCache
    "full": dict(budget=1.0, quantize=None, policy="full"),
    "0.3": dict(budget=0.3, quantize=None, policy="snapkv"),
    "0.3+int8": dict(budget=0.3, quantize="int8", policy="snapkv"),
}


def report(row: dict, path: str | None) -> None:
    """Print a benchmark's JSON row, and write it to `path` (atomically) when given."""
    print(json.dumps(row, indent=1))
    write_rows(row, path)


def write_rows(rows: dict | list, path: str | None) -> None:
    """Replace `path` (when given) by `rows` as JSON, atomically: a run killed mid-write leaves
    the previous rows whole. The benchmarks call it after every row."""
    from pathlib import Path

    from sparsekv.io import write_atomic

    if path:
        write_atomic(Path(path), json.dumps(rows, indent=1))


def check_counts(args, names: tuple[str, ...]) -> None:
    """Stop with the flag's name when a count among `names` (args attributes; None = unset) is
    below 1."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"--{name.replace('_', '-')}={value} must be >= 1")


def bench_policy(model, name: str):
    """The budget modes' policy: `name`, or for "learned" a gating head of the shipped
    architecture, untrained (seed 0), at blend 0 as in the query-agnostic use: the scorer's real
    cost with random choices."""
    if name != "learned":
        return name
    from sparsekv import ScorerAdapter

    torch.manual_seed(0)
    return ScorerAdapter.for_model(model).to(next(model.parameters()).device).policy(blend=0.0)


def build_model(shape: str, dtype: torch.dtype, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(SHAPES[shape])
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


class Meter:
    """Peak device memory and wall time, synchronizing only at the edges of what is timed."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated() if self.cuda else 0

    def allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else 0


def dynamic_kv_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


@torch.no_grad()
def profile_steps(model, cache, tok, steps: int, meter: Meter) -> dict:
    """Where a decode step's time goes: kernels launched and device-busy time per step (from
    torch.profiler) against the step's wall time. Busy far below wall = host-bound."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if meter.cuda else [])
    t0 = meter.now()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            tok = model(input_ids=tok, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
        meter.now()
    wall = meter.now() - t0
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC"))
    busy_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    return {"launches_per_step": launches / steps, "busy_ms_per_step": busy_us / 1e3 / steps,
            "step_ms": wall * 1e3 / steps}


def run_one(model, ids, mode: str, chunk: int, new_tokens: int, meter: Meter, profile: int = 0) -> dict:
    m = MODES[mode]
    if m["policy"] is None:
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
    else:
        cfg = EvictionConfig(budget=m["budget"], quantize=m["quantize"], prefill_chunk=chunk, rerank_every=16)
        cache = SparseKVCache(model, cfg, m["policy"])
    meter.reset()
    base = meter.allocated()
    t0 = meter.now()
    if m["policy"] is None:  # the same chunks as SparseKVCache's prefill hook
        for s in range(0, ids.shape[1], chunk):
            out = model(input_ids=ids[:, s : s + chunk], cache=cache, logits_to_keep=1)
    else:
        out = model(input_ids=ids, cache=cache, logits_to_keep=1)
    t1 = meter.now()
    prefill_peak = meter.peak() - base
    tok = out.logits[:, -1:].argmax(-1)
    for _ in range(new_tokens):
        tok = model(input_ids=tok, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
    t2 = meter.now()
    row = {
        "mode": mode,
        "length": ids.shape[1],
        "kv_bytes": dynamic_kv_bytes(cache) if m["policy"] is None else cache.kv_bytes(),
        "peak_bytes": meter.peak(),
        "prefill_working_bytes": prefill_peak,
        "prefill_s": t1 - t0,
        "decode_tok_s": new_tokens / (t2 - t1),
    }
    if profile:
        row.update(profile_steps(model, cache, tok, profile, meter))
    if m["policy"] is not None:
        cache.close()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32")
    p.add_argument("--lengths", default="8192,16384,32768")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--chunk", type=int, default=4096, help="prefill chunk (tokens)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--memory-gib", type=float, default=80.0, help="device memory for the batch estimate")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="profile STEPS more decode steps per run: kernel launches, device-busy ms, wall ms")
    p.add_argument("--warmup", type=int, default=1024, help="tokens of an untimed first run per mode (0: none)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dtype = resolve_dtype(args.dtype, "--dtype")
    modes = args.modes.split(",")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"--modes: unknown mode {m!r}; allowed values: {', '.join(MODES)}")
    lengths = [int(x) for x in args.lengths.split(",")]
    meter = Meter(args.device)
    model = build_model(args.shape, dtype, args.device)
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    gen = torch.Generator().manual_seed(0)
    rows = []
    if args.warmup:  # kernels compiled, allocator and library handles set up before any timing
        ids = torch.randint(0, model.config.vocab_size, (1, args.warmup), generator=gen).to(args.device)
        for mode in modes:
            run_one(model, ids, mode, args.chunk, 2, meter)
    for n in tqdm(lengths, desc=f"{args.shape} on {args.device}", unit="length"):
        ids = torch.randint(0, model.config.vocab_size, (1, n), generator=gen).to(args.device)
        for mode in modes:
            row = run_one(model, ids, mode, args.chunk, args.new_tokens, meter, args.profile)
            budget = args.memory_gib * 2**30 - weights - row["prefill_working_bytes"]
            row["max_batch_est"] = max(0, int(budget // max(row["kv_bytes"], 1)))
            rows.append(row)
            write_rows(rows, args.json)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"\n{args.shape} ({weights / 2**30:.1f} GiB weights, {args.dtype}) on {device}; "
          f"chunk {args.chunk}, {args.new_tokens} decode steps, batch estimate for {args.memory_gib:g} GiB")
    print("| length | mode | KV MiB | KV vs full | peak MiB | prefill s | decode tok/s | max batch (est.) |")
    print("|---|---|---|---|---|---|---|---|")
    full = {r["length"]: r for r in rows if r["mode"] == "full"}
    full = full or {r["length"]: r for r in rows if r["mode"] == "dynamic"}
    for r in rows:
        ref = full.get(r["length"])
        ratio = f"{r['kv_bytes'] / ref['kv_bytes']:.2f}x" if ref else "-"
        print(f"| {r['length']} | {r['mode']} | {r['kv_bytes'] / 2**20:.1f} | {ratio} | "
              f"{r['peak_bytes'] / 2**20:.0f} | {r['prefill_s']:.2f} | {r['decode_tok_s']:.1f} | {r['max_batch_est']} |")
    if args.profile:
        print(f"\nper decode step ({args.profile} profiled steps): kernels launched, device busy, wall")
        print("| length | mode | kernels | busy ms | wall ms |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['length']} | {r['mode']} | {r['launches_per_step']:.0f} | {r['busy_ms_per_step']:.2f} | "
                  f"{r['step_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
