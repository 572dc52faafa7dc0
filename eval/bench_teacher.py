"""Teacher statistics at long lengths on one device: blockwise, never the n x n matrix.

    python eval/bench_teacher.py                                   # Llama-3.1-8B shape, bf16, CUDA
    python eval/bench_teacher.py --shape tiny --device cpu --lengths 512,1024 --dtype float32   # CI

The training targets need, per layer, the attention every key receives from every later query.
`sparsekv.teacher.statistics.attention_received` computes it `--block-size` queries at a time, so its extra
memory grows with n, not n^2. For every length this measures, on the model shape of
`eval/bench_gpu.py` with random weights (no download):

- kernel: one layer's statistics from random queries and keys of that layer's shape: time, peak
  extra device memory, and the bytes of the float32 n x n scores of all heads that a naive
  implementation would hold (the ratio is what blockwise saves); plus the relative difference
  between two block sizes (the blocks must not change the result);
- forward: `teacher_targets` through the whole model (all full-attention layers, the default
  target): time, peak device memory, and that every target is a distribution.

Prints one Markdown table; `--json` keeps the rows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `eval` as a package
from eval.bench_gpu import SHAPES, Meter, build_model, write_rows  # noqa: E402
from sparsekv.models.default import resolve_dtype  # noqa: E402
from sparsekv.models.families import model_shape  # noqa: E402
from sparsekv.teacher.statistics import attention_received, teacher_targets  # noqa: E402


@torch.no_grad()
def kernel_row(shape, hq: int, n: int, dtype, device: str, block: int, meter: Meter) -> dict:
    g = torch.Generator(device=device).manual_seed(n)
    hk, d = shape.num_kv_heads, shape.head_dim
    q = torch.randn(1, hq, n, d, generator=g, device=device, dtype=dtype)
    k = torch.randn(1, hk, n, d, generator=g, device=device, dtype=dtype)
    kw = dict(scaling=d**-0.5, num_kv_groups=hq // hk)
    attention_received(q[:, :, :block], k[:, :, :block], block_size=block, **kw)  # warm-up
    meter.reset()
    base = meter.allocated()
    t0 = meter.now()
    out = attention_received(q, k, block_size=block, **kw)
    seconds = meter.now() - t0
    extra = meter.peak() - base
    other = attention_received(q, k, block_size=4 * block, **kw)
    rel = ((out - other).norm() / out.norm()).item()
    # causal: every query's probabilities sum to one, so the mass over keys is n per query head
    mass = (out.sum(-1) / (n * hq // hk)).mean().item()
    return {"kernel_s": seconds, "kernel_extra_bytes": extra, "naive_bytes": hq * n * n * 4,
            "block_rel_diff": rel, "mass_per_query": mass}


@torch.no_grad()
def forward_row(model, n: int, device: str, block: int, meter: Meter) -> dict:
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=gen).to(device)
    meter.reset()
    t0 = meter.now()
    targets, hidden = teacher_targets(model, ids, block_size=block)
    seconds = meter.now() - t0
    sums = torch.stack([t.float().sum(-1) for t in targets.values()])
    return {"forward_s": seconds, "forward_peak_bytes": meter.peak(), "layers": len(targets),
            "target_sum_err": (sums - 1).abs().max().item()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32")
    p.add_argument("--lengths", default="8192,16384,32768")
    p.add_argument("--block-size", type=int, default=512, help="queries per block")
    p.add_argument("--no-forward", action="store_true", help="the kernel only (no model)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dtype = resolve_dtype(args.dtype, "--dtype")
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        raise SystemExit(f"--lengths: expected comma-separated integers, got {args.lengths!r}") from None
    if args.block_size < 1:
        raise SystemExit(f"--block-size must be >= 1, got {args.block_size}")
    meter = Meter(args.device)
    model = build_model(args.shape, dtype, args.device)
    shape = model_shape(model)
    heads = model.config.num_attention_heads
    rows = []
    for n in tqdm(lengths, desc=f"teacher {args.shape} on {args.device}", unit="length"):
        row = {"length": n, **kernel_row(shape, heads, n, dtype, args.device, args.block_size, meter)}
        if not args.no_forward:
            row.update(forward_row(model, n, args.device, args.block_size, meter))
        rows.append(row)
        write_rows(rows, args.json)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"\nteacher statistics, {args.shape} ({shape.num_layers} layers, {heads} query / "
          f"{shape.num_kv_heads} KV heads, head dim {shape.head_dim}), {args.dtype}, block "
          f"{args.block_size}, on {device}")
    print("| length | kernel s (1 layer) | kernel extra MiB | naive n x n MiB | saved | "
          "blocks rel. diff | forward s (all layers) | forward peak MiB | max |sum-1| |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fwd = (f"{r['forward_s']:.2f} | {r['forward_peak_bytes'] / 2**20:.0f} | {r['target_sum_err']:.1e}"
               if "forward_s" in r else "- | - | -")
        extra = r["kernel_extra_bytes"]
        saved = f"{r['naive_bytes'] / extra:.0f}x" if extra > 0 else "-"
        print(f"| {r['length']} | {r['kernel_s']:.3f} | {extra / 2**20:.0f} | {r['naive_bytes'] / 2**20:.0f} | "
              f"{saved} | {r['block_rel_diff']:.1e} | {fwd} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
