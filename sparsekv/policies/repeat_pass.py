"""The repeat pass: KVzip's context reconstruction run on top of an evicting cache.

This module owns the machinery that scores a prefill by asking the model to repeat it: it runs
the extra forwards through the cache, captures the budgeted layers' queries, turns them into one
statistic per cached entry, and leaves nothing of the repeat behind. The repeat prompt's text and
chunk layout come from the policy (`Policy.repeat_inputs`, built on `sparsekv.policies.reconstruction`);
selection and eviction stay with the cache. It imports neither the cache nor the policies.

After a forward that left `pending` entries in the budgeted layers (the cache defers the scoring
of a policy with `scores_after_prefill`), `score_pending(cache)`:

1. splits the forward's tokens into chunks (the policy's `repeat_inputs`: <= 2,048 tokens each,
   after the repeat prompt, later chunks after the last 8 tokens of the previous one);
2. per chunk snapshots every layer's state (full layers: entries, positions, tokens seen;
   sliding layers, Gemma 3: their window and true length), runs one forward over the repeat
   input on top of the cache, and restores the snapshot, so stored lengths, positions and
   `get_seq_length()` are exactly as before (the tensors themselves, bitwise);
3. in each budgeted layer, inside that forward, takes the repeat's queries (after QK-norm and
   RoPE, as the attention received them) and computes, with the layer's own scaling and
   soft-capping, the softmax over the sink tokens, the chunk's entries and the repeat's own
   keys (causal among them); the statistic of a chunk entry is its maximum over the query
   heads of its KV group and over the repeat's (non-padding) queries;
4. hands each budgeted layer that statistic `(batch, kv_heads, stored)` (0 for older entries),
   through `EvictingLayer.finish_repeat`, which scores and evicts.

Batches with left padding are repeated row by row in the padded coordinates: every row's chunk
has the same bounds, padding is masked out of the repeat as it was out of the context, and when
the forward had explicit `position_ids` (as `generate` passes them: real tokens only) the repeat
continues them. A padded row then scores as it would alone, except on sliding-window layers,
where the padding inside a repeat chunk takes slots of the window (Gemma 3's budgeted layers see
slightly different hidden states for that row).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sparsekv.cache import SparseKVCache

QUERY_BLOCK = 256
"""Repeat queries scored at a time: extra memory O(block x (sinks + 2 chunk)) per layer."""


class _Collector:
    """Per-chunk state of a repeat forward: where the chunk lies, and each layer's statistic."""

    def __init__(self, start: int, end: int, sink_tokens: int, first_valid: torch.Tensor | None):
        self.start, self.end = start, end
        self.sink_tokens = sink_tokens
        self.first_valid = first_valid  # (batch,) leading pads of each row, or None
        self.stats: dict[int, torch.Tensor] = {}  # layer_idx -> (batch, kv_heads, end - start)

    def collect(self, layer: Any, query: torch.Tensor, scaling: float, softcap: float | None) -> None:
        """Called by a budgeted layer after the repeat forward's attention. `query`
        `(batch, heads, r, head_dim)` the repeat's queries; the layer stores the context
        (its last `layer.pending` entries are the scored forward's) then the `r` repeat entries."""
        keys = layer.dense()[0]  # (batch, kv_heads, stored + r, head_dim)
        pos = layer.positions  # (batch, kv_heads, stored + r)
        r = query.shape[2]
        base = keys.shape[2] - r  # entries stored before the repeat
        lo = base - layer.pending + self.start
        hi = base - layer.pending + self.end
        lead = 0 if self.first_valid is None else int(self.first_valid.max())
        m = min(lo, lead + self.sink_tokens)  # the sinks lie among the first entries of each head
        start = 0 if self.first_valid is None else self.first_valid.to(pos.device)[:, None, None]
        sinks = (pos[..., :m] >= 0) & (pos[..., :m] < start + self.sink_tokens)
        sel = torch.cat([keys[:, :, :m], keys[:, :, lo:hi], keys[:, :, base:]], dim=2)
        valid = torch.cat([sinks, pos[..., lo:hi] >= 0, pos[..., base:] >= 0], dim=-1)
        self.stats[layer.layer_idx] = repeat_attention(
            query, sel, valid, m, hi - lo, scaling, softcap, query_valid=pos[:, 0, base:] >= 0
        )


def repeat_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    key_valid: torch.Tensor,
    offset: int,
    length: int,
    scaling: float,
    softcap: float | None = None,
    query_valid: torch.Tensor | None = None,
    block_size: int = QUERY_BLOCK,
) -> torch.Tensor:
    """Max attention the repeat's queries pay to the chunk's entries.

    `query` `(batch, heads, r, d)`; `keys` `(batch, kv_heads, n, d)`: [sinks, chunk, repeat],
    the chunk at `[offset, offset + length)`, the `r` repeat keys last (causal among the
    queries); `key_valid` `(batch, kv_heads, n)` bool (False: left out of the softmax);
    `query_valid` `(batch, r)` bool (False: padding, ignored). Logits are `scaling * q.k`,
    soft-capped when `softcap` is set. Returns `(batch, kv_heads, length)`, the maximum over the
    query heads of each KV group and over the valid queries, float32 (float64 for float64 inputs).
    """
    b, hq, r, d = query.shape
    hk, n = keys.shape[1], keys.shape[2]
    g = hq // hk
    dtype = torch.promote_types(query.dtype, torch.float32)
    kf = keys.to(dtype)
    out = torch.zeros(b, hk, length, dtype=dtype, device=query.device)
    rep = torch.arange(r, device=query.device)
    for s in range(0, r, block_size):
        qb = query[:, :, s : s + block_size].to(dtype).reshape(b, hk, g, -1, d)
        nb = qb.shape[3]
        logits = torch.einsum("bhgqd,bhkd->bhgqk", qb, kf) * scaling
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        allowed = key_valid[:, :, None, None, :].expand(b, hk, 1, nb, n).clone()
        future = rep[None, :] > rep[s : s + nb, None]  # (nb, r): repeat key after the query
        allowed[..., n - r :] &= ~future
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
        part = probs[..., offset : offset + length]  # (b, hk, g, nb, length)
        if query_valid is not None:
            part = part * query_valid[:, None, None, s : s + nb, None].to(dtype)
        out = torch.maximum(out, part.amax(dim=(2, 3)))
    return out


def _snapshot(cache: SparseKVCache) -> tuple[list[dict], Any]:
    # Cache layers replace their tensors on update (never write into the stored ones), so a
    # shallow copy of each layer's attributes restores it exactly.
    return [dict(layer.__dict__) for layer in cache.layers], cache.shared.first_valid


def _restore(cache: SparseKVCache, snap: tuple[list[dict], Any]) -> None:
    states, first_valid = snap
    for layer, state in zip(cache.layers, states):
        layer.__dict__.clear()
        layer.__dict__.update(state)
    cache.shared.first_valid = first_valid


@torch.no_grad()
def score_pending(
    cache: SparseKVCache, attention: dict[int, torch.Tensor] | None = None
) -> dict[int, torch.Tensor] | None:
    """Score the entries the last forward through `cache` left pending by repeating that
    forward's tokens (`cache.step_inputs`), then let each budgeted layer evict. A no-op when
    nothing is pending (returns None). Returns what each budgeted layer was scored with,
    `{layer index: (batch, kv_heads, stored)}`; passing that back as `attention` for a cache
    holding the same entries with the same pending tokens (another fork of one recorded
    prefill, see `SparseKVCache.fork`) scores it without running the repeat again."""
    layers = [cache.layers[i] for i in cache.budgeted_layers]
    pending = {layer.pending for layer in layers}
    if pending == {0}:
        return None
    if attention is not None:
        for layer in layers:
            layer.finish_repeat(attention[layer.layer_idx])
        return attention
    ids, mask, step_pos = cache.step_inputs if cache.step_inputs is not None else (None, None, None)
    if ids is None or len(pending) != 1 or ids.shape[1] != pending.pop():
        raise ValueError(
            f"policy {cache.policy.name!r} repeats the tokens of each prefill: call the model with "
            "input_ids (not inputs_embeds), one forward per prefill"
        )
    layout = getattr(cache.config, "layout", "dynamic")
    if layout != "dynamic":  # static slots are written in place: a snapshot could not restore them
        raise ValueError(f"policy {cache.policy.name!r} needs layout='dynamic', got layout={layout!r}")
    n = ids.shape[1]
    rows = [cache.policy.repeat_inputs(row) for row in ids.tolist()]
    step_mask = None if mask is None else mask[:, -n:]
    stats: dict[int, list[tuple[int, int, torch.Tensor]]] = {layer.layer_idx: [] for layer in layers}
    for chunk in zip(*rows):
        (_, start, end), width = chunk[0], len(chunk[0][0])
        if any(len(c[0]) != width or c[1:] != (start, end) for c in chunk):
            raise ValueError("repeat_inputs gave the rows of a batch different layouts")
        rep_ids = torch.tensor([c[0] for c in chunk], dtype=torch.long, device=ids.device)
        rep_mask, rep_pos = None, None
        if mask is not None:
            prompt = mask.new_ones((mask.shape[0], width - (end - start)))
            rep_mask = torch.cat([mask, prompt, step_mask[:, start:end]], dim=1)
        if step_pos is not None:  # continue the forward's own positions (generate: real tokens only)
            steps = torch.arange(width, device=ids.device)[None]
            if rep_mask is not None:
                steps = (rep_mask[:, -width:].long().cumsum(-1) - 1).clamp_min(0)
            rep_pos = step_pos[:, -1:] + 1 + steps
        col = _Collector(start, end, cache.config.sink_tokens, cache.shared.first_valid)
        snap = _snapshot(cache)
        cache.shared.repeat, cache.in_repeat = col, True
        try:
            cache.model(input_ids=rep_ids, attention_mask=rep_mask, position_ids=rep_pos, cache=cache,
                        use_cache=True, logits_to_keep=1)
        finally:
            _restore(cache, snap)
            cache.shared.repeat, cache.in_repeat = None, False
        missing = sorted(set(stats) - set(col.stats))
        if missing:
            raise RuntimeError(f"the repeat forward did not reach the evicting layers {missing}")
        for idx, stat in col.stats.items():
            stats[idx].append((start, end, stat))
    used = {}
    for layer in layers:
        keys = layer.keys
        b, h, stored = keys.shape[0], keys.shape[1], keys.shape[2]
        att = torch.zeros((b, h, stored), dtype=stats[layer.layer_idx][0][2].dtype, device=keys.device)
        first = stored - layer.pending
        for start, end, stat in stats[layer.layer_idx]:
            att[..., first + start : first + end] = stat
        layer.finish_repeat(att)
        used[layer.layer_idx] = att
    return used
