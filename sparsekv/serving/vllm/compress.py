"""Compressing a context for vLLM (sparsekv's environment): vLLM gives every layer of a request
one sequence length, so a context it serves must keep the same number K of entries in every
budgeted layer. `compress_for_vllm` turns a per-layer budget (the pyramid, a list schedule) into
that one K: the largest layer's budget, rounded up to vLLM's block size (at most the context's
length), and every budgeted layer keeps its own top-K by its own scores (the uniform schedule at
K tokens). A layer that the schedule gave less keeps more, never less, than its budget: the
cost is memory (K x the budgeted layers, against the schedule's total), and the answers are those
of that uniform cache. With a uniform budget K is that budget rounded up to a block."""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

__all__ = ["BLOCK_SIZE", "compress_for_vllm", "slots_for_vllm"]

BLOCK_SIZE = 128
"""vLLM's KV block on the CPU (tokens); pass the engine's `block_size` where it differs."""


def slots_for_vllm(model, config, num_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """K for a context of `num_tokens` under `config`: the most entries a budgeted layer of
    `model` may keep (its schedule share, at least the sinks and the recent window), rounded up to
    a multiple of `block_size`, at most `num_tokens`."""
    from sparsekv.cache.schedules import layer_capacity, layer_fractions
    from sparsekv.models.families import model_shape

    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be an int >= 1 (vLLM's block size)")
    shape = model_shape(model)
    fractions = layer_fractions(config, max(1, len(shape.full_layers)))
    floor = config.sink_tokens + config.recent_window
    most = max(max(layer_capacity(config, f, num_tokens), floor) for f in fractions)
    return min(num_tokens, math.ceil(most / block_size) * block_size)


def compress_for_vllm(
    model, context_ids: Any, config, policy: Any = "snapkv", block_size: int = BLOCK_SIZE,
    **compress_kwargs: Any,
):
    """`sparsekv.compress` for a context vLLM serves: every budgeted layer keeps the same K
    (`slots_for_vllm`), its own top-K by its own scores; returns the `CompressedContext` (save it
    and serve it with `sparsekv.serving.vllm.ask_many` or the connector). A per-layer schedule is
    said to be served as one K, with the bytes it costs."""
    from sparsekv.config import EvictionConfig, Tokens
    from sparsekv.serving.compressed import compress
    from sparsekv.serving.context_inputs import as_ids

    if not isinstance(config, EvictionConfig):
        raise ValueError(f"config must be an EvictionConfig, got {type(config).__name__}")
    ids = as_ids(context_ids, "context_ids", "cpu")
    n = int(ids.shape[1])
    k = slots_for_vllm(model, config, n, block_size)
    if config.schedule != "uniform":
        warnings.warn(
            f"schedule={config.schedule!r}: vLLM serves one length per request, so every "
            f"budgeted layer keeps K = {k} of the {n} tokens (the largest layer's budget, "
            f"rounded up to a block of {block_size}), each its own top {k}",
            UserWarning,
            stacklevel=2,
        )
    one_k = dataclasses.replace(config, budget=Tokens(k), schedule="uniform")
    return compress(model, ids, one_k, policy, **compress_kwargs)
