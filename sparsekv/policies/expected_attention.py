"""Expected Attention (kvpress): score each cached entry by the attention that future queries are
expected to pay it, from the statistics of the context's own queries. No extra forward pass.

At a prefill step of a budgeted layer with query heads `h` (grouped over KV heads) and head
dimension `d`:

- `q_t` = the pre-RoPE queries of the step's tokens (the layer's `q_proj`, then its QK-norm on
  Qwen3 / Gemma 3), rebuilt from the attention inputs (`needs_hidden_states`), from the
  `query_sinks`-th real token on (the first tokens are outliers); per query head their mean
  `mu` `(d,)` and covariance `Sigma` `(d, d)` (divided by the count, as kvpress does);
- `R` = the RoPE rotation averaged over the next `future_positions` positions (after the tokens
  seen so far), with the layer type's own rotary base and scaling (Gemma 3: its full layers use
  their own `rope_theta` and scaling, not the sliding layers'); `mu' = R mu`,
  `Sigma' = R Sigma R^T`;
- for every stored key `k_i` (after RoPE, as cached): `z_i = s mu'.k_i + s^2 k_i^T Sigma' k_i / 2`,
  the log of `E[exp(s q.k_i)]` for a Gaussian `q`, where `s` is the layer's own logit scale:
  `1/sqrt(d)` in kvpress's formula (`z = mu'.k/sqrt(d) + k^T Sigma' k/(2d)`), and Gemma 3's
  `query_pre_attn_scalar ** -0.5` there, because that is the scale its attention really applies
  (the expectation is of the model's attention, not of a re-scaled one; on gemma-3-270m both
  are 1/16). Soft-capping is ignored (Gemma 3 has none);
- score = `(softmax over the non-sink entries of z, averaged over the query heads of each KV
  group, + epsilon) * ||v_i||`; the first `query_sinks` real entries get the head's maximum + 1.

At a later multi-token step (a question appended to a compressed context) every stored entry is
rescored with that step's query statistics. A token generated one at a time enters with the
highest score its head holds (it is in the protected recent window at first anyway); re-ranks
keep the scores.
"""

from __future__ import annotations

import torch

from sparsekv.models.families import (
    attention_modules,
    attention_scaling,
    pre_rope_queries,
    rotary_cos_sin,
)
from sparsekv.policies.base import Policy, ScoreContext, register


@register("expected_attention")
class ExpectedAttentionPolicy(Policy):
    """Expected Attention: softmax of the expected logits of future queries, times ||v||."""

    needs_hidden_states = True

    def __init__(self, future_positions: int = 512, query_sinks: int = 4, epsilon: float = 0.0,
                 use_covariance: bool = True, use_vnorm: bool = True):
        """`future_positions`: positions the RoPE rotation is averaged over; `query_sinks`: first
        real tokens left out of the query statistics and of the softmax; `epsilon` >= 0: added to
        the probabilities before the value norms multiply them; `use_covariance`, `use_vnorm`:
        kvpress's switches (both on in its default)."""
        for name, v, low in (("future_positions", future_positions, 1), ("query_sinks", query_sinks, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name}={v!r} must be an int >= {low}")
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not 0 <= epsilon < float("inf"):
            raise ValueError(f"epsilon={epsilon!r} must be a finite number >= 0")
        for name, v in (("use_covariance", use_covariance), ("use_vnorm", use_vnorm)):
            if not isinstance(v, bool):
                raise ValueError(f"{name}={v!r} must be a bool")
        self.future_positions, self.query_sinks, self.epsilon = future_positions, query_sinks, float(epsilon)
        self.use_covariance, self.use_vnorm = use_covariance, use_vnorm

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        if ctx.phase == "prefill" and ctx.num_new > 1 and ctx.hidden_states is not None:
            return self.expected_scores(ctx)
        out = ctx.carry()
        n = out.shape[-1]
        if ctx.num_new:  # a decode token: the highest score of its head
            old = out[..., : n - ctx.num_new]
            out[..., n - ctx.num_new :] = old.amax(-1, keepdim=True) if old.shape[-1] else 1.0
        return out

    def expected_scores(self, ctx: ScoreContext) -> torch.Tensor:
        """Scores of every stored entry `(batch, kv_heads, seq)` from this step's queries."""
        if ctx.model is None:
            raise ValueError("policy 'expected_attention' reads the model's query projection: use it "
                             "through SparseKVCache, which passes the model in ScoreContext.model")
        module = attention_modules(ctx.model)[ctx.layer_idx]
        weight = module.q_proj.weight
        q = pre_rope_queries(module, ctx.hidden_states.to(weight.device, weight.dtype))  # (b, hq, new, d)
        dtype = torch.promote_types(q.dtype, torch.float32)
        q = q.to(dtype)
        b, hq, new, d = q.shape
        pos = ctx.positions  # (b, kv_heads, seq): absolute slots, -1 = padding
        # the first real slot of each row (a sink: kept by every head)
        first = torch.where(pos >= 0, pos, torch.iinfo(pos.dtype).max).amin(-1, keepdim=True)
        pos_new = pos[:, 0, -new:]  # the step's tokens are the same in every head
        use = (pos_new >= 0) & (pos_new >= first[:, 0] + self.query_sinks)  # (b, new)
        w = use.to(dtype)[:, None, :, None]  # (b, 1, new, 1)
        count = w.sum(2, keepdim=True).clamp_min(1.0)
        mu = (q * w).sum(2, keepdim=True) / count  # (b, hq, 1, d)
        cos, sin = rotary_cos_sin(
            ctx.model, ctx.layer_idx,
            torch.arange(ctx.tokens_seen, ctx.tokens_seen + self.future_positions),
        )
        c, s = cos.to(q.device, dtype).mean(0), sin.to(q.device, dtype).mean(0)  # (d,)
        # q_rot = q*cos + rotate_half(q)*sin = (diag(cos) + diag(sin) P) q, P = rotate_half
        P = torch.zeros(d, d, dtype=dtype, device=q.device)
        half = d // 2
        P[:half, half:] = -torch.eye(half, dtype=dtype, device=q.device)
        P[half:, :half] = torch.eye(half, dtype=dtype, device=q.device)
        R = torch.diag(c) + s[:, None] * P  # (d, d), averaged over the future positions
        scale = attention_scaling(module)
        groups = hq // ctx.keys.shape[1]
        keys = ctx.keys.to(dtype).repeat_interleave(groups, dim=1)  # (b, hq, seq, d)
        z = scale * torch.einsum("bhnd,bhd->bhn", keys, (mu @ R.T)[:, :, 0])
        if self.use_covariance:
            centered = (q - mu) * w
            sigma = torch.einsum("bhnd,bhne->bhde", centered, centered) / count  # (b, hq, d, d)
            sigma = R @ sigma @ R.T
            z = z + scale**2 / 2 * torch.einsum("bhnd,bhde,bhne->bhn", keys, sigma, keys)
        sinks = (pos >= 0) & (pos < first + self.query_sinks)  # (b, kv_heads, seq)
        scored = (pos >= 0) & ~sinks
        z = z.masked_fill(~scored.repeat_interleave(groups, dim=1), float("-inf"))
        p = torch.softmax(z, dim=-1).nan_to_num(0.0)
        p = p.view(b, hq // groups, groups, -1).mean(2)  # (b, kv_heads, seq)
        out = p + self.epsilon
        if self.use_vnorm:
            out = out * ctx.values.to(dtype).norm(dim=-1)
        top = out.masked_fill(~scored, float("-inf")).amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top + 1, torch.ones_like(top))
        out = torch.where(sinks, top, out)
        return out.masked_fill(pos < 0, float("-inf")).float()

    def __repr__(self) -> str:
        return (f"ExpectedAttentionPolicy(future_positions={self.future_positions}, "
                f"query_sinks={self.query_sinks}, epsilon={self.epsilon})")
