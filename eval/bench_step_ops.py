"""What the evicting cache does between two decode steps of the static layout: the tensor ops it
dispatches (each one a kernel launch on a GPU, and host time that a compiled, graph-captured
forward does not hide) and the wall time they take, next to the forward's own.

    python eval/bench_step_ops.py                                  # 32 layers, narrow widths, CPU
    python eval/bench_step_ops.py --policy knorm                   # a policy scored after the forward
    python eval/bench_step_ops.py --device cuda --width full       # Llama-3.1-8B's shape on a GPU

The model has Llama-3.1-8B's layer count and attention layout (32 layers, 32 query heads, 8 KV
heads, head_dim 128) with random weights; `--width narrow` (default) shrinks the hidden size,
MLP and vocabulary, which changes the forward's arithmetic but not the cache's code path. The
budget is 0.3 with `evict_slack` 8 and `rerank_every` 16 (the defaults), `layout="static"`, so
the decode steps include the incremental evictions and the re-ranks. Each decode step runs the
forward eagerly (with `position_ids`), then the cache's post-forward work (`finish_steps`);
both are counted with a `TorchDispatchMode` (every aten op, views included) in a first pass and
timed without it in a second (`--steps` each, after the prefill). Reported per pass: steps
that evicted or re-ranked, and the ops and milliseconds of the post-forward work on the other
steps and on those; from the counting pass also the largest tensor that work allocated and
the bytes it allocated per step, next to the bytes of one layer's key buffer (an eviction that
gathers the kept keys into new tensors allocates that much).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `eval` as a package
from eval.bench_gpu import SHAPES, bench_policy, check_counts, report
from sparsekv import EvictionConfig, SparseKVCache
from sparsekv.cache import static as static_layer
from sparsekv.models.default import resolve_dtype

NARROW = dict(hidden_size=256, intermediate_size=256, vocab_size=1024, head_dim=128)


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside the `with` block, and the bytes of the new
    storages they return (`largest`, `allocated`; views and in-place results are not new)."""

    def __init__(self):
        super().__init__()
        self.ops = self.largest = self.allocated = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        out = func(*args, **kwargs)
        given = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                size = t.untyped_storage().nbytes()
                self.largest, self.allocated = max(self.largest, size), self.allocated + size
        return out


def build(width: str, dtype: torch.dtype, device: str, layers: int | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(SHAPES["llama-3.1-8b"])
    if width == "narrow":
        spec.update(NARROW)
    if layers is not None:
        spec["num_hidden_layers"] = layers
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def sync(device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter()


@torch.no_grad()
def run_pass(model, args, count: bool) -> list[dict]:
    """Prefill, then `args.steps` decode steps; per step the ops (or ms) of the forward and of the
    post-forward work, and whether that work evicted."""
    cfg = EvictionConfig(
        budget=0.3,
        quantize=args.quantize,
        prefill_chunk=args.chunk,
        layout="static",
        max_length=args.prompt + args.steps + 1,
    )
    cache = SparseKVCache(model, cfg, bench_policy(model, args.policy))
    ids = torch.randint(
        3, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0)
    )
    tok = (
        model(input_ids=ids.to(args.device), cache=cache, logits_to_keep=1)
        .logits[:, -1:]
        .argmax(-1)
    )
    cache.batch_repeat_interleave(args.batch)
    static_layer.finish_steps(cache)
    tok = tok.expand(args.batch, 1).contiguous()
    layers = [cache.layers[i] for i in cache.budgeted_layers]
    finish = static_layer.finish_steps
    static_layer.finish_steps = lambda c: None  # the forward hook's call: run below, measured
    rows = []
    try:
        for _ in range(args.steps):
            pos = torch.full(
                (args.batch, 1), cache.tokens_seen(), dtype=torch.long, device=args.device
            )
            before = [layer.stored() for layer in layers]
            evictions = sum(layer.decode_steps for layer in layers)
            parts = {}
            for part in ("forward", "after"):
                counter = OpCounter() if count else contextlib.nullcontext()
                t0 = sync(args.device)
                with counter:
                    if part == "forward":
                        tok = model(input_ids=tok, position_ids=pos, cache=cache, logits_to_keep=1)
                        tok = tok.logits[:, -1:].argmax(-1)
                    else:
                        finish(cache)
                parts[part] = counter.ops if count else (sync(args.device) - t0) * 1e3
                if count and part == "after":
                    parts["after_largest"], parts["after_allocated"] = (
                        counter.largest,
                        counter.allocated,
                    )
            # a layer evicted (or re-ranked) when it kept fewer than it held plus the new entry,
            # or when its decode-step counter restarted
            evicted = any(layer.stored() < n + 1 for layer, n in zip(layers, before)) or (
                sum(layer.decode_steps for layer in layers) < evictions
            )
            rows.append({**parts, "evicted": evicted})
    finally:
        static_layer.finish_steps = finish
        scored = sum(layer.arrivals_in_forward for layer in layers)
        cache.close()
    keys = layers[0]._slots.buf["keys"]
    rows.append(
        {
            "scored_in_forward": scored,
            "layer_steps": len(layers) * args.steps,
            "layer_key_bytes": keys.numel() * keys.element_size(),
        }
    )
    return rows


def summary(rows: list[dict], unit: str) -> dict:
    steps, tail = rows[:-1], rows[-1]
    out = {"steps": len(steps), "evicting_steps": sum(r["evicted"] for r in steps), **tail}
    for kind, pick in (("other", False), ("evicting", True)):
        sel = [r for r in steps if r["evicted"] == pick]
        for part in ("forward", "after"):
            vals = [r[part] for r in sel]
            out[f"{part}_{unit}_{kind}"] = round(statistics.mean(vals), 3) if vals else None
        if unit == "ops":  # bytes of new tensors made by the post-forward work, per step
            out[f"after_largest_allocation_{kind}"] = max(
                (r["after_largest"] for r in sel), default=None
            )
            vals = [r["after_allocated"] for r in sel]
            out[f"after_allocated_bytes_{kind}"] = round(statistics.mean(vals)) if vals else None
    after = [r["after"] for r in steps]
    out[f"after_{unit}_mean"] = round(statistics.mean(after), 3)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--width", default="narrow", choices=("narrow", "full"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--policy", default="learned", help="learned (untrained head, blend 0) or a policy name"
    )
    p.add_argument("--quantize", default=None, choices=(None, "int8"))
    p.add_argument(
        "--layers", type=int, default=None, help="override the shape's 32 layers (tests)"
    )
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--steps", type=int, default=36)
    p.add_argument("--json", default=None, help="write the row here")
    args = p.parse_args(argv)
    check_counts(args, ("batch", "prompt", "chunk", "steps", "layers"))
    dtype = resolve_dtype(args.dtype, "--dtype")
    model = build(args.width, dtype, args.device, args.layers)
    row = {
        "width": args.width,
        "device": args.device,
        "dtype": args.dtype,
        "policy": args.policy,
        "quantize": args.quantize,
        "batch": args.batch,
        "prompt": args.prompt,
        "layers": model.config.num_hidden_layers,
        "ops": summary(run_pass(model, args, count=True), "ops"),
        "time": summary(run_pass(model, args, count=False), "ms"),
    }
    report(row, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
