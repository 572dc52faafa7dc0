"""Which entries of a budgeted layer stay: pure functions over a layer's per-entry tensors (the
absolute `positions` `(batch, kv_heads, stored)`, -1 for padding, and the policy's `scores`),
with no state of their own. `protected` marks what is never evicted (sinks, the recent window,
the shared core), `core_marks` is what the first budgeted layer hands the others as the shared
core, and `keep_indices` the `k` entries per head that survive an eviction, in stored order.
`EvictingLayer` (and its static subclass) call them and gather the result."""

from __future__ import annotations

import torch

__all__ = ["core_marks", "gather_entries", "keep_indices", "protected"]


def protected(
    positions: torch.Tensor,
    seen: int,
    sink_tokens: int,
    recent_window: int,
    first_valid: torch.Tensor | None = None,
    core: torch.Tensor | None = None,
) -> torch.Tensor:
    """`(batch, kv_heads, stored)` bool: the sinks (the first `sink_tokens` real tokens of each
    sequence; `first_valid` counts its leading pads), the last `recent_window` of the `seen`
    tokens and, when given, the members of `core` (`(batch, heads, positions)` bool, by absolute
    position; a core of another KV-head count marks an entry any of its heads holds)."""
    start = first_valid.to(positions.device)[:, None, None] if first_valid is not None else 0
    sinks = (positions >= 0) & (positions < start + sink_tokens)
    kept = sinks | (positions >= seen - recent_window)
    if core is None:
        return kept
    if core.shape[1] != positions.shape[1]:
        core = core.any(dim=1, keepdim=True).expand(-1, positions.shape[1], -1)
    core = core.to(positions.device)
    inside = (positions >= 0) & (positions < core.shape[-1])
    member = core.gather(-1, positions.clamp(0, core.shape[-1] - 1)) & inside
    return kept | member


def core_marks(
    scores: torch.Tensor, positions: torch.Tensor, prot: torch.Tensor, seen: int, k: int
) -> torch.Tensor:
    """The shared core `(batch, heads, seen)` bool: per head, the absolute positions of the `k`
    best-scored entries that are neither protected nor padding (fewer where a head has fewer)."""
    b, h, _ = positions.shape
    core = torch.zeros((b, h, seen + 1), dtype=torch.bool, device=positions.device)
    if k > 0:  # the last slot takes what is not a core entry (protected, padding)
        eff = scores.masked_fill(prot | (positions < 0), float("-inf"))
        best, idx = eff.topk(k, dim=-1, sorted=False)
        pos = positions.gather(-1, idx).masked_fill(best == float("-inf"), seen)
        core.scatter_(-1, pos, True)
    return core[..., :seen]


def keep_indices(
    scores: torch.Tensor, positions: torch.Tensor, prot: torch.Tensor, k: int
) -> torch.Tensor:
    """`(batch, heads, k)` indices, ascending, of the entries an eviction keeps: every protected
    entry first, then the best scores; padding last."""
    eff = scores.masked_fill(prot, float("inf")).masked_fill(positions < 0, float("-inf"))
    return eff.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values


def gather_entries(tensor: torch.Tensor | None, index) -> torch.Tensor | None:
    """Entries `index` (a slice, or `(batch, heads, k)` indices) of one per-entry tensor
    `(batch, heads, stored[, dim])`, in that order; None stays None."""
    if tensor is None:
        return None
    if isinstance(index, slice):
        return tensor[:, :, index]
    if tensor.ndim == 4:
        return tensor.gather(2, index[..., None].expand(-1, -1, -1, tensor.shape[-1]))
    return tensor.gather(2, index)
