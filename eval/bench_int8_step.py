"""What one INT8 decode step of the static layout allocates: the bytes of its largest allocation
and of all its allocations, against the bytes of the int8 store and of one layer's dequantized
keys (a copy the step made of every layer before `sparsekv.cache.int8_attention`).

    python eval/bench_int8_step.py                              # tiny shape, CPU, bf16, 32K slots
    python eval/bench_int8_step.py --device cuda --shape llama-3.1-8b --batch 8

The model has the shape's dimensions and random weights (`bench_gpu.build_model`); the learned
policy (an untrained head of the shipped architecture, blend 0) scores, as in bench_serving.
The cache's buffers are sized for `--max-length` tokens at budget 0.3, so a short prompt gives
the decode step the slots (and the attention work) of a long context. On the CPU the sizes come
from the profiler's allocation events (the op's own allocations); on CUDA also the growth of
the peak allocated memory over the step. Timing: the mean of `--steps` eager decode steps after
one warm-up.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `eval` as a package
from eval.bench_gpu import SHAPES, bench_policy, build_model, check_counts, report
from sparsekv import EvictionConfig, SparseKVCache
from sparsekv.models.default import resolve_dtype


def allocations(fn) -> tuple[int, int]:
    """(largest, total) bytes allocated by the ops that `fn` runs (CPU profiler events, each
    allocation counted once: by the op that made it)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0]
    return max(sizes, default=0), sum(sizes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-length", type=int, default=32_768)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--json", default=None, help="write the row here")
    args = p.parse_args(argv)
    check_counts(args, ("batch", "max_length", "prompt", "steps"))
    dtype = resolve_dtype(args.dtype, "--dtype")
    model = build_model(args.shape, dtype, args.device)
    policy = bench_policy(model, "learned")
    cfg = EvictionConfig(budget=0.3, layout="static", max_length=args.max_length, quantize="int8")
    cache = SparseKVCache(model, cfg, policy)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), generator=gen)
    tok = model(input_ids=ids.to(args.device), cache=cache, logits_to_keep=1).logits.argmax(-1)
    seen = [args.prompt]

    def step():
        nonlocal tok
        pos = torch.full((args.batch, 1), seen[0], device=args.device)
        tok = model(input_ids=tok, position_ids=pos, cache=cache, logits_to_keep=1).logits.argmax(-1)
        seen[0] += 1

    step()  # warm-up
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    largest, total = allocations(step)
    grown = torch.cuda.max_memory_allocated() - base if cuda else None
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / args.steps * 1e3
    layers = [cache.layers[i] for i in cache.budgeted_layers]
    store = sum(layer.nbytes() for layer in layers)
    keys = layers[0]._slots.buf["keys"]
    dequantized = keys.numel() * torch.finfo(dtype).bits // 8
    row = {
        "shape": args.shape, "device": args.device, "dtype": args.dtype, "batch": args.batch,
        "max_length": args.max_length, "slots": layers[0].slots, "budgeted_layers": len(layers),
        "int8_store_bytes": store, "layer_dequantized_key_bytes": dequantized,
        "step_largest_allocation": largest, "step_allocated_bytes": total,
        "step_peak_growth": grown, "ms_per_step": round(ms, 2),
    }
    cache.close()
    report(row, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
