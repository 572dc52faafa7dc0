"""The learned policy: a trained gating head scores each token once, when it enters the cache.

With `recency` > 0 the score of a token at absolute position `p` is `logit + recency * p / 1000`:
an exponential recency prior on the head's log-importance (see `AdapterConfig.recency`). Because
the bonus is linear in the absolute position, the ranking it gives never changes as new tokens
arrive, so a token is still scored once, when it enters the cache.

At prefill and at each global re-rank the head's prior can be blended with observed attention:
the observation window's at prefill (the last `window` queries of the prompt, as SnapKV reads
it), the attention the kept entries received since the last re-rank at a re-rank (`blend` in
[0, 1]; 0 = prior only). Both are turned into per-head standard scores first, so that neither
scale dominates, then combined by `blend_mode`:

- "mix": `(1 - blend) * z_prior + blend * z_observed`, a weighted average;
- "max": `max((1 - blend) * z_prior, blend * z_observed)`, a union: a token is kept when either
  signal ranks it high (a needle the head flags that the window does not look at, or a token
  the window attends to that the head rates low). An average would drop both kinds.
"""

from __future__ import annotations

import torch

from sparsekv.policies.base import Policy, ScoreContext, check_kernel_size, max_pool_seq, register

BLEND_MODES = ("mix", "max")
HEAD_LAYERS = ("own", "first")


def check_settings(blend, blend_mode, recency, kernel_size, head_layer) -> dict:
    """The learned policy's settings checked (shared by the policy and `AdapterConfig`, which
    records them as an adapter's defaults); returns them normalized."""
    if isinstance(blend, bool) or not isinstance(blend, (int, float)) or not (0.0 <= blend <= 1.0):
        raise ValueError(f"blend={blend!r} must be a number in [0, 1]")
    if blend_mode not in BLEND_MODES:
        raise ValueError(f"blend_mode={blend_mode!r} is not supported; allowed values: {', '.join(BLEND_MODES)}")
    if isinstance(recency, bool) or not isinstance(recency, (int, float)) or not (0.0 <= recency < float("inf")):
        raise ValueError(f"recency={recency!r} must be a finite number >= 0")
    if head_layer not in HEAD_LAYERS:
        raise ValueError(f"head_layer={head_layer!r} is not supported; allowed values: {', '.join(HEAD_LAYERS)}")
    return {"blend": float(blend), "blend_mode": blend_mode, "recency": float(recency),
            "kernel_size": check_kernel_size(kernel_size), "head_layer": head_layer}


def _moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head mean and standard deviation over the finite entries of `(batch, heads, seq)`."""
    finite = torch.isfinite(x)
    cnt = finite.sum(-1, keepdim=True).clamp_min(1)
    mean = torch.where(finite, x, 0.0).sum(-1, keepdim=True) / cnt
    var = (torch.where(finite, x - mean, 0.0) ** 2).sum(-1, keepdim=True) / cnt
    return mean, var.sqrt() + 1e-6


@register("learned")
class LearnedPolicy(Policy):
    """Scores from a `ScorerAdapter` (gating head on each layer's attention inputs)."""

    needs_hidden_states = True

    def __init__(self, adapter, blend: float | None = None, window: int = 32, recency: float | None = None,
                 blend_mode: str | None = None, kernel_size: int | None = None, head_layer: str | None = None):
        """`adapter`: a `ScorerAdapter`, a folder or Hub id to load one from, or any object with
        `score_layer(layer_idx, hidden_states (batch, new, hidden)) -> (batch, kv_heads, new)`.
        `blend`, `blend_mode`, `recency`, `kernel_size`, `head_layer`: None = the adapter's
        recorded default (`adapter.config`), else 0, "mix", 0, 1 and "own".
        `head_layer`: "own" (each budgeted layer's head reads that layer's attention inputs) or
        "first" (the first budgeted layer's head scores each token once, from that layer's
        inputs, and every budgeted layer uses that score: one cross-layer importance per token).
        `kernel_size` (odd): the head's scores of the tokens entering together (a prefill chunk)
        are max-pooled over that many neighbours, as SnapKV pools attention, so that a number
        split into digit tokens is kept or dropped as a whole; the prefill window attention used
        by blending is pooled the same way."""
        if isinstance(adapter, str):
            from sparsekv.adapter import ScorerAdapter

            adapter = ScorerAdapter.from_pretrained(adapter)
        recorded = getattr(adapter, "config", None)
        given = {"blend": blend, "blend_mode": blend_mode, "recency": recency, "kernel_size": kernel_size,
                 "head_layer": head_layer}
        fallback = {"blend": 0.0, "blend_mode": "mix", "recency": 0.0, "kernel_size": 1, "head_layer": "own"}
        settings = check_settings(**{k: getattr(recorded, k, fallback[k]) if v is None else v for k, v in given.items()})
        self.adapter = adapter
        self.blend, self.blend_mode = settings["blend"], settings["blend_mode"]
        self.recency, self.kernel_size = settings["recency"], settings["kernel_size"]
        self.head_layer = settings["head_layer"]
        self.hidden_from_first = self.head_layer == "first"
        # the head that scores the tokens of a budgeted layer: its own, or the first layer's
        self._first_layer = self._adapter_first_layer() if self.hidden_from_first else None
        self.window = window
        # With blending on, the cache tracks the attention kept entries receive (observed) and
        # also hands over the prompt's observation-window attention at prefill.
        self.tracks_observed = self.blend > 0
        self.attention_queries = "window" if self.blend > 0 else None

    def _adapter_first_layer(self) -> int:
        layers = getattr(getattr(self.adapter, "config", None), "layers", None)
        if not layers:
            raise ValueError("head_layer='first' needs an adapter whose config lists its layers")
        return min(layers)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        out = ctx.carry()
        if ctx.num_new:
            layer = ctx.layer_idx if self._first_layer is None else self._first_layer
            new = self.adapter.score_layer(layer, ctx.hidden_states).to(out.dtype)  # (b, kv_heads, new)
            new = max_pool_seq(new, self.kernel_size)
            if self.recency:
                pos = ctx.positions[..., -ctx.num_new :].to(out.dtype)
                new = new + self.recency / 1000.0 * pos
            out[..., out.shape[-1] - ctx.num_new :] = new
        if self.blend > 0:
            obs = ctx.attention if ctx.phase == "prefill" else (ctx.observed if ctx.phase == "rerank" else None)
            if obs is not None:
                # Mix standard scores, then map back onto the prior's scale so that tokens
                # scored later by the head alone stay comparable with the blended ones.
                mean, std = _moments(out)
                if ctx.phase == "prefill":
                    obs = max_pool_seq(obs.float(), self.kernel_size)
                seen = torch.log(obs.float().clamp_min(1e-9))
                seen_mean, seen_std = _moments(seen)
                prior, observed = (1 - self.blend) * (out - mean) / std, self.blend * (seen - seen_mean) / seen_std
                z = torch.maximum(prior, observed) if self.blend_mode == "max" else prior + observed
                return torch.where(torch.isfinite(out), mean + std * z, out)
        return out
