"""The caches that eval/bench_serving.py measures and the steps it times: a batch-1 cache per
mode (`make_cache`), its chunked prefill (`prefill`), the cache repeated across the batch
(`replicate`), its KV bytes (`kv_bytes`), timed decode steps (`decode`) and the host time the
evicting cache spends between them (`timed_finish`).
"""

from __future__ import annotations

import contextlib
import time

import torch

from eval.bench_gpu import bench_policy
from sparsekv import EvictionConfig, SparseKVCache
from sparsekv.cache import static as static_layer
from sparsekv.cache.static import finish_steps


def make_cache(model, mode: str, length: int, args):
    """A batch-1 cache of `mode`, and how to prefill it."""
    from transformers import DynamicCache, StaticCache

    total = length + args.warmup_steps + args.new_tokens + 1
    if mode == "dynamic":
        return DynamicCache(config=model.config)
    if mode == "static":
        return StaticCache(config=model.config, max_cache_len=total)
    cfg = EvictionConfig(
        budget=0.3,
        quantize="int8" if mode.endswith("int8") else None,
        prefill_chunk=args.static_chunk,
        rerank_every=16,
        layout="static",
        max_length=total,
    )
    return SparseKVCache(model, cfg, bench_policy(model, args.policy))


@torch.no_grad()
def prefill(model, cache, ids, mode: str, chunk: int):
    """Prefill `ids` `(1, n)` through `cache`; returns the next token `(1, 1)`."""
    if isinstance(cache, SparseKVCache):  # its own hook splits into `prefill_chunk` pieces
        return model(input_ids=ids, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
    for s in range(0, ids.shape[1], chunk):
        pos = torch.arange(s, min(s + chunk, ids.shape[1]), device=ids.device)[None]
        out = model(
            input_ids=ids[:, s : s + chunk], position_ids=pos, cache=cache, logits_to_keep=1
        )
    return out.logits[:, -1:].argmax(-1)


def replicate(model, cache, batch: int):
    """The batch-1 `cache` repeated `batch` times (a new cache for StaticCache)."""
    from transformers import StaticCache

    if not isinstance(cache, StaticCache):
        cache.batch_repeat_interleave(batch)
        if isinstance(cache, SparseKVCache):
            finish_steps(cache)  # point the device-side slot indices at the new buffers
        return cache
    big = StaticCache(config=model.config, max_cache_len=cache.layers[0].max_cache_len)
    src = cache.layers[0]
    big.early_initialization(batch, src.num_heads, src.k_head_dim, src.keys.dtype, src.device)
    for new, old in zip(big.layers, cache.layers):
        new.keys.copy_(old.keys.expand_as(new.keys))
        new.values.copy_(old.values.expand_as(new.values))
        new.cumulative_length.copy_(old.cumulative_length)
    return big


def kv_bytes(cache) -> int:
    if isinstance(cache, SparseKVCache):
        return cache.kv_bytes()
    return sum(
        t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None
    )


@torch.no_grad()
def decode(step, cache, tok, start: int, steps: int, device: str) -> float:
    """`steps` decode steps from position `start`; returns seconds (synchronized at the edges)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    b = tok.shape[0]
    for i in range(steps):
        pos = torch.full((b, 1), start + i, dtype=torch.long, device=tok.device)
        tok = (
            step(input_ids=tok, position_ids=pos, cache=cache, logits_to_keep=1)
            .logits[:, -1:]
            .argmax(-1)
        )
    sync()
    return time.perf_counter() - t0


@contextlib.contextmanager
def timed_finish():
    """Sum the host seconds of `static_layer.finish_steps` (the model's forward hook calls it
    after each forward through a static-layout cache) into the yielded one-element list."""
    real, spent = static_layer.finish_steps, [0.0]

    def timed(cache) -> None:
        t0 = time.perf_counter()
        real(cache)
        spent[0] += time.perf_counter() - t0

    static_layer.finish_steps = timed
    try:
        yield spent
    finally:
        static_layer.finish_steps = real
