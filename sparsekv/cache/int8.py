"""INT8 storage of kept keys and values: symmetric int8 with one scale per token and KV head."""

from __future__ import annotations

import torch


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per token and head: `(b, h, n, d)` -> int8 `(b, h, n, d)`
    and scale `(b, h, n, 1)` in x's dtype. Rounding error <= scale / 2 = absmax / 254."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-8) / 127.0
    q = torch.round(x.float() / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale.to(x.dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.to(scale.dtype) * scale


def dequantize_with(
    q: torch.Tensor, scale: torch.Tensor, own: torch.Tensor | None, at: torch.Tensor | None = None
) -> torch.Tensor:
    """`q` dequantized with one entry per sequence and head put back at full precision: `own`
    `(b, h, 1, d)` at slot `at` `(b, h, 1)` (None: the last slot). What attention saw for an INT8
    decode step, whose own key and value it read before they were stored as int8."""
    out = dequantize(q, scale)
    if own is None:
        return out
    if at is None:
        out[:, :, -1:] = own
    else:
        out.scatter_(2, at[..., None].expand(own.shape), own)
    return out
