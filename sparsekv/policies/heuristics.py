"""The rule-based baselines: full, random, StreamingLLM, H2O, SnapKV, PyramidKV, TOVA, key-norm.

Each is a few lines on top of `Policy`: it turns the statistics the cache hands it into one
score per stored entry. Selection, protection of sinks/recent tokens and gathering are the
cache's job, so none of that appears here.
"""

from __future__ import annotations

import torch

from sparsekv.policies.base import (
    Policy,
    ScoreContext,
    check_int,
    check_kernel_size,
    max_pool_seq,
    register,
)

MAX_SEED = 2**64 - 1
"""The largest seed `torch.Generator.manual_seed` takes."""


@register("full")
class FullPolicy(Policy):
    """Keep everything: the reference every other policy is compared with."""

    evicts = False

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        return torch.zeros(ctx.positions.shape, device=ctx.positions.device)


@register("random")
class RandomPolicy(Policy):
    """Uniformly random scores drawn once per entry (seeded generator, reproducible)."""

    def __init__(self, seed: int = 0):
        self.seed = check_int("seed", seed, 0, MAX_SEED)
        self._gen: dict[torch.device, torch.Generator] = {}

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        dev = ctx.positions.device  # (reading ctx.keys would build an INT8 layer's keys)
        if dev not in self._gen:
            self._gen[dev] = torch.Generator(device=dev).manual_seed(self.seed)
        out = ctx.carry()
        b, h, n = out.shape
        if ctx.num_new:
            out[..., n - ctx.num_new :] = torch.rand(
                (b, h, ctx.num_new), generator=self._gen[dev], device=dev
            )
        return out


@register("streaming")
class StreamingPolicy(Policy):
    """StreamingLLM: attention sinks (protected by the cache) + the most recent tokens."""

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        return ctx.positions.float()

    def score_arrival(self, layer_idx, hidden_states, positions) -> torch.Tensor:
        return positions.float()


@register("h2o")
class H2OPolicy(Policy):
    """Heavy-Hitter Oracle: the attention each entry has received from every query so far."""

    attention_queries = "all"

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        if ctx.attention is None:  # a re-rank: the accumulated sums already rank the entries
            return ctx.carry()
        return ctx.carry() + ctx.attention


@register("tova")
class TOVAPolicy(Policy):
    """TOVA: the attention the current (last) query pays to each entry, head-wise."""

    attention_queries = "last"

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        if ctx.attention is None:  # a re-rank without a new query keeps the last ranking
            return ctx.carry()
        return ctx.attention


@register("knorm")
class KeyNormPolicy(Policy):
    """Key-norm: entries with a low L2 key norm draw attention; keep the lowest norms."""

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        return -ctx.keys.float().norm(dim=-1)


@register("snapkv")
class SnapKVPolicy(Policy):
    """SnapKV: attention from an observation window of the last prompt queries, max-pooled
    along the sequence so that neighbours of an attended token survive with it. During decoding
    each new query's attention is added (a sliding observation window)."""

    attention_queries = "window"

    def __init__(self, window: int = 32, kernel_size: int = 7):
        self.window = check_int("window", window, 1)
        self.kernel_size = check_kernel_size(kernel_size)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        if ctx.attention is None:
            return ctx.carry()
        att = max_pool_seq(ctx.attention, self.kernel_size)
        if ctx.phase == "prefill" and ctx.prev_scores is None:
            return att
        return ctx.carry() + att


@register("pyramidkv")
class PyramidKVPolicy(SnapKVPolicy):
    """PyramidKV: SnapKV's scores with pyramid budgets (shallow layers keep more)."""

    schedule = "pyramid"
