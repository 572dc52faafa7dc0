"""Measured batched decoding under one memory cap: the largest batch that really runs, and its
tokens per second per GPU, for the full cache and for the evicting cache (issue 20.2).

    python eval/bench_serving.py                 # Llama-3.1-8B shape, bf16, CUDA, 80 GiB cap
    python eval/bench_serving.py --tiny          # dry run on the CPU at a tiny shape (seconds)

The model has Llama-3.1-8B's shape with random weights (`bench_gpu.build_model`): real memory
and time, meaningless text. Modes:

- `dynamic`: transformers' DynamicCache, eager (what `model.generate` does by default);
- `static`: transformers' StaticCache, decode step compiled (the fair full-cache baseline);
- `0.3`: SparseKVCache, budget 0.3, `layout="static"`, decode step compiled; scores from
  `--policy`: "learned" (default: a gating head of the shipped architecture, untrained, with
  blend 0 as in the query-agnostic use: the scorer's real cost, random choices), "snapkv" (the
  scores of docs/gpu-h200.md; it also recomputes each step's attention to the kept keys), "knorm";
- `0.3+int8`: the same, kept entries stored as INT8; decode attention reads the int8 slots
  (`sparsekv.cache.int8_attention`: the Triton kernel on CUDA, `int8_kernel` in the rows).

Per length and mode: one sequence is prefilled (in chunks) and its cache (compressed, for the
budget modes) replicated across the batch; then decode steps run at that batch. The batch is
searched by really running it under the cap (`torch.cuda.set_per_process_memory_fraction`, so
an allocation past the cap is an out-of-memory error): eager runs at batch 1 and 2 measure what
one more sequence adds to the peak (its KV and the step's transients that grow with the batch;
the KV bytes alone on a CPU dry run), the first compiled probe is the batch that predicts, then up
by 25% (or down by 15% from a failure) and bisection, `--probes` runs at most (batch 1 counted,
batch 2 not). A probe counts as fitting when its warm-up (compilation, graph capture)
and timed steps all ran. Reported:
the largest batch that ran, the smallest that did not (if probed), and the measured decode
tokens/s at the largest (batch x steps / seconds), with the KV bytes per sequence.

Rows also record `between_steps_ms`: the host time per timed step that the evicting cache
spends after each forward (`static_layer.finish_steps`: evictions, and the scoring a policy
does not do inside the forward), which a compiled forward does not contain.

Compilation: `model.forward` is compiled (`--compile`, default "reduce-overhead" on CUDA, none
on the CPU) for decode steps only, which pass `position_ids`. With the learned policy at blend
0 (and StreamingLLM) the evicting cache scores each decode step inside the compiled forward and
only its evictions (every `evict_slack` + 1 steps, and the re-ranks) run eagerly after it,
without moving keys or values; other policies are scored eagerly after each forward
(`sparsekv.cache.static`; rows record `scored_in_forward`, the share of layer steps scored
inside). Rows are written to `--json` as they complete (atomically: the file holds
the rows before a row or after it, never part of one), so a run cut short by a time limit keeps
what it measured; `--resume` then runs only the (length, mode) pairs that file lacks, or whose
row is a failure. Every row records its `setup` (shape, dtype, cap, compilation, steps, probes,
prefill chunks, scoring policy, decode attention, device and software): a resume whose setup
differs from a kept row's stops with the settings that differ, since one table must not mix
two setups (or two machines). Lengths run in the order given (32K first by default: the
headline).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `eval` as a package
from eval.bench_gpu import SHAPES, build_model, write_rows  # noqa: E402
from eval.bench_serving_caches import (  # noqa: E402
    decode,
    kv_bytes,
    make_cache,
    prefill,
    replicate,
    timed_finish,
)
from eval.bench_serving_rows import (  # noqa: E402
    SETUP_KEYS,  # noqa: F401 - also importable from here, as before
    comparable,  # noqa: F401
    int8_kernel,
    load_rows,
    print_table,
    setup,
)
from sparsekv import SparseKVCache
from sparsekv.cache import attention as sparse_attention
from sparsekv.models.default import resolve_dtype

MODES = ("static", "0.3", "0.3+int8", "dynamic")  # run in this order: the headline pair first
TINY = [
    "--shape",
    "tiny",
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--lengths",
    "256,128",
    "--chunk",
    "64",
    "--static-chunk",
    "32",
    "--new-tokens",
    "3",
    "--warmup-steps",
    "1",
    "--memory-gib",
    "0.02",
    "--probes",
    "3",
    "--compile",
    "none",
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def probe(model, mode: str, ids, batch: int, args, compiled: bool = True) -> dict | None:
    """Prefill, replicate to `batch`, warm up, time `new_tokens` steps. None when out of memory.
    `compiled=False`: eager whatever `--compile` says (the batch-1 probe, for memory only)."""
    n = ids.shape[1]
    cache = step = None
    try:
        cache = make_cache(model, mode, n, args)
        tok = prefill(model, cache, ids, mode, args.chunk)
        per_seq = kv_bytes(cache)
        cache = replicate(model, cache, batch)
        if (
            not args.device.startswith("cuda")
            and args.weights + kv_bytes(cache) > args.memory_gib * 2**30
        ):
            raise torch.OutOfMemoryError(
                "over --memory-gib (weights + KV; the cap on a CPU dry run)"
            )
        tok = tok.expand(batch, 1).contiguous()
        step = model
        compiled = compiled and mode != "dynamic" and args.compile != "none"
        if compiled:
            # dynamic=None: after the first batch size, dynamo recompiles once with the batch
            # (and the slot count) symbolic; later probes only record new CUDA graphs
            model.forward = torch.compile(model.forward, mode=args.compile)
        t0 = time.perf_counter()
        decode(step, cache, tok, n, args.warmup_steps, args.device)
        warm = time.perf_counter() - t0
        with timed_finish() as between:
            secs = decode(step, cache, tok, n + args.warmup_steps, args.new_tokens, args.device)
        peak = torch.cuda.max_memory_allocated() if args.device.startswith("cuda") else 0
        # the share of (budgeted layer, decode step) pairs scored inside the forward, whose
        # evictions move no key or value (`Policy.score_arrival`); None for the full caches
        scored = None
        if isinstance(cache, SparseKVCache):
            layers = [cache.layers[i] for i in cache.budgeted_layers]
            steps = len(layers) * (args.warmup_steps + args.new_tokens)
            scored = sum(getattr(layer, "arrivals_in_forward", 0) for layer in layers) / max(steps, 1)
        return {
            "mode": mode,
            "length": n,
            "batch": batch,
            "kv_bytes_per_seq": per_seq,
            "kv_bytes": kv_bytes(cache),
            # positions, scores and the slot map beside the KV (counted in peak_bytes)
            "bookkeeping_bytes": (
                cache.memory_bytes()["bookkeeping"] if isinstance(cache, SparseKVCache) else 0
            ),
            "peak_bytes": peak,
            "warmup_s": warm,
            "decode_s": secs,
            "tok_s": batch * args.new_tokens / secs,
            "ms_per_step": 1000 * secs / args.new_tokens,
            "compiled": compiled,
            "scored_in_forward": scored,
            # host time per timed step in the cache's work after the forward (evictions, and
            # the scoring a policy does not do in the forward): eager, between compiled steps
            "between_steps_ms": (
                1000 * between[0] / args.new_tokens if isinstance(cache, SparseKVCache) else None
            ),
        }
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not isinstance(e, torch.OutOfMemoryError) and "out of memory" not in str(e):
            raise
        log(f"    {mode} @ {n}, batch {batch}: out of memory ({str(e).splitlines()[0][:160]})")
        if compiled and args.compile != "none":  # a failed capture may leave stale graph state
            torch._dynamo.reset()
        return None
    finally:
        model.__dict__.pop("forward", None)  # back to the eager forward
        if isinstance(cache, SparseKVCache):
            cache.close()
        del cache, step
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


def search(model, mode: str, ids, args, weights: int) -> dict:
    """The largest batch that runs under the cap, within `args.probes` real runs."""
    one = probe(model, mode, ids, 1, args, compiled=False)
    if one is None:
        return {
            "mode": mode,
            "length": ids.shape[1],
            "batch": 0,
            "tok_s": 0.0,
            "fails_at": 1,
            "probes": 1,
        }
    cap = args.memory_gib * 2**30
    # what one more sequence really costs at the peak: its KV plus the step's transients that grow
    # with the batch (dequantized copies, attention outputs, logits), from a second eager run at
    # batch 2; on a CPU dry run (no peak counter) the KV bytes alone
    per_seq = one["kv_bytes_per_seq"]
    two = probe(model, mode, ids, 2, args, compiled=False) if one["peak_bytes"] else None
    if two is not None:
        per_seq = max(per_seq, two["peak_bytes"] - one["peak_bytes"])
    work = max(one["peak_bytes"] - weights - per_seq, 0)  # what does not grow with the batch
    guess = max(1, int((cap - weights - work) // max(per_seq, 1)))
    best, lo, hi, probes = one, 1, None, 1
    batch = guess
    while probes < args.probes and (hi is None or hi - lo > 1):
        log(f"  {mode} @ {ids.shape[1]}: probing batch {batch}")
        row = probe(model, mode, ids, batch, args)
        probes += 1
        if row is None:
            hi = batch
        else:
            lo, best = batch, row
        if hi is None:  # no failure yet: grow past the estimate
            batch = max(lo + 1, int(lo * 1.25))
        elif lo < hi // 2:  # only far smaller batches ran: step down from the failure
            batch = max(lo + 1, int(hi * 0.85))
        else:
            batch = (lo + hi) // 2
            if batch == lo:
                break
    return {
        **best,
        "fails_at": hi,
        "probes": probes,
        "batch_estimate": guess,
        "peak_bytes_per_seq": per_seq,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--tiny", action="store_true", help="CPU dry run at a tiny shape: " + " ".join(TINY)
    )
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32")
    p.add_argument(
        "--lengths", default="32768,16384,8192", help="prompt lengths, run in this order"
    )
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--chunk", type=int, default=4096, help="prefill chunk of the full-cache modes")
    p.add_argument(
        "--static-chunk",
        type=int,
        default=512,
        help="prefill chunk of the budget modes (also the static layout's free room)",
    )
    p.add_argument("--policy", default="learned", choices=["learned", "snapkv", "knorm"],
                   help="scores of the budget modes (learned: untrained head, blend 0)")
    p.add_argument(
        "--attention",
        default="packed",
        choices=["packed", "transformers"],
        help="decode attention of the full-cache modes: packed (sparsekv_sdpa: grouped-query "
        "decode on the KV heads, what the budget modes always use) or transformers (its sdpa, "
        "which repeats keys per query head when compiled; the 2026-11-30 table)",
    )
    p.add_argument("--new-tokens", type=int, default=32, help="timed decode steps per probe")
    p.add_argument(
        "--warmup-steps", type=int, default=3, help="untimed decode steps (compile, capture)"
    )
    p.add_argument("--memory-gib", type=float, default=80.0, help="memory cap, enforced on CUDA")
    p.add_argument(
        "--probes", type=int, default=3, help="real runs per length and mode, batch 1 included"
    )
    p.add_argument(
        "--compile",
        default=None,
        help='"reduce-overhead" (CUDA default), "default", "none" (CPU default)',
    )
    p.add_argument(
        "--json", default=None, help="write rows here (JSON list, replaced atomically after each row)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the finished rows of --json that have this run's setup; run only the rest",
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    if args.tiny:  # flags given after --tiny's defaults override them
        args = p.parse_args(TINY + argv)
    args.compile = args.compile or ("reduce-overhead" if args.device.startswith("cuda") else "none")
    modes = args.modes.split(",")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"--modes: unknown mode {m!r}; allowed values: {', '.join(MODES)}")
    if args.probes < 1:
        raise SystemExit(f"--probes={args.probes} must be >= 1")
    if args.resume and not args.json:
        raise SystemExit("--resume needs --json: the file whose finished rows are kept")
    dtype = resolve_dtype(args.dtype, "--dtype")
    kept = load_rows(Path(args.json), args) if args.resume else {}
    torch._dynamo.config.recompile_limit = 64  # every mode, batch and length reuses model.forward
    torch._dynamo.config.accumulated_recompile_limit = 512
    model = build_model(args.shape, dtype, args.device)
    if args.attention == "packed":  # the baselines decode with the attention the budget modes use
        model.set_attn_implementation(sparse_attention.register("sdpa"))
    weights = args.weights = sum(t.numel() * t.element_size() for t in model.parameters())
    if args.device.startswith("cuda"):
        index = torch.device(args.device).index  # "cuda" alone: the current device
        index = torch.cuda.current_device() if index is None else index
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gib * 2**30 / total), index)
    log(
        f"{args.shape} ({weights / 2**30:.1f} GiB weights, {args.dtype}) on {args.device}, cap "
        f"{args.memory_gib:g} GiB, compile={args.compile}, modes {modes}, policy {args.policy}"
    )
    gen = torch.Generator().manual_seed(0)
    lengths = [int(x) for x in args.lengths.split(",")]
    # rows of the file that this run does not measure again, kept as they were (in their order)
    planned = {(n, m) for n in lengths for m in modes}
    rows: list[dict] = [r for key, r in kept.items() if key not in planned]
    for n in lengths:
        ids = torch.randint(0, model.config.vocab_size, (1, n), generator=gen).to(args.device)
        for mode in modes:
            if (n, mode) in kept:
                rows.append(kept[(n, mode)])
                log(f"{n} {mode}: kept from {args.json} (batch {kept[(n, mode)]['batch']})")
                continue
            t0 = time.perf_counter()
            try:
                row = search(model, mode, ids, args, weights)
            except Exception as e:  # noqa: BLE001 - one mode's failure must not cost the others
                model.__dict__.pop("forward", None)
                torch._dynamo.reset()
                error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                log(f"{n} {mode}: failed ({error})")
                row = {"mode": mode, "length": n, "batch": 0, "tok_s": 0.0, "error": error}
            row["search_s"] = time.perf_counter() - t0
            row["setup"] = setup(args, mode)
            # (also at the top level of a row, where the tables and earlier rows have them)
            for key in ("policy", "attention", "sdpa_force_gqa"):
                row[key] = row["setup"][key]
            # which implementation read the INT8 slots (sparsekv.cache.int8_attention)
            row["int8_kernel"] = int8_kernel(args.device) if mode.endswith("int8") else None
            rows.append(row)
            if "error" not in row:
                between = row.get("between_steps_ms")
                log(
                    f"{n} {mode}: batch {row['batch']} (fails at {row.get('fails_at')}), "
                    f"{row['tok_s']:.1f} tok/s, {row['search_s']:.0f} s"
                    + (f", {between:.1f} ms/step between steps" if between is not None else "")
                )
            write_rows(rows, args.json)
    print_table(rows, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
