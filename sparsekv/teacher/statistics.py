"""Teacher statistics: what the frozen model's own full attention says each token is worth.

This module owns the supervision signal of the gating head. It knows nothing about caches,
heads or losses. Everything here is a pure function of a model and its inputs.

**Attention received.** For one layer, query heads `h`, queries `i` and keys `j` (absolute
positions, causal, within the sliding window where the layer slides, padding excluded),
with `p[h, i, j]` the attention probability of query `i` on key `j`:

    a[g, i, j] = sum over the query heads h of KV group g of p[h, i, j]
    mass:  r[g, j] = sum_i  w_i * a[g, i, j]        max:  r[g, j] = max_i  w_i * a[g, i, j]

over the queries `i` that may see `j` (with `exclude_self`, `i > j` only: the entry's own query
has been served before any eviction can happen, so it says nothing about keeping it; with
`min_distance` D, `i >= j + D` only: the attention a token receives once it is at least D
positions old). The two combine as one rule, `i - j >= max(D, 1 if exclude_self else 0)`:
`exclude_self=True` is the `D = 1` case, and any `D >= 1` excludes the self term whatever
`exclude_self` says.

**Decode-time targets (`min_distance`).** A cache that always keeps its newest `recent_window`
tokens (64 here) never decides about a token while it is inside that window; what decides its
eviction during generation is the attention it receives after it has left the window.
`min_distance=64` makes the target exactly that: only queries 64 or more positions later count.
The last D real tokens of a sequence then have no counted query and a target of 0; train with
the loss's `recent_window >= D` so they stay out of the loss.
`normalize` removes the bias that counting gives early tokens:

- "none": `w_i = 1`, raw sums. Early tokens collect from up to n queries, late ones from few.
- "length" (default): `w_i = 1`, then the mass is divided by the number of queries that count
  for `j` (may see it and are far enough after it, see `min_distance`): the mean attention one
  such query pays to `j`. This removes the linear counting
  bias; a residual ~log(n/j) favour of early tokens remains (a query at position i spreads over
  i+1 keys, and early tokens are also seen by the early, concentrated queries). For "max" it
  changes nothing (a max is already per query).
- "uniform": `w_i` = the number of keys query `i` may see, then divided by the count as for
  "length": the mean over later queries of the attention relative to a uniform spread. Exactly
  1 everywhere for a uniformly attending model, so fully position-neutral.

**Cumulative target.** Attention to a token in one layer alone is a weak signal (sinks and
punctuation attract attention without mattering). For each budgeted layer `l` the target is a
weighted mix of the received attention of `l` and of the layers after it:

    target_l = sum_{l' in S(l)} decay**d(l, l') * dist(r_l') / sum_{l' in S(l)} decay**d(l, l')

- `S(l)` = `l` and every later layer (`source_layers="all"`), or `l` and the later
  full-attention layers only (`"budgeted"`); `d(l, l')` is the rank distance of `l'` after `l`
  within `S(l)` (0 for `l` itself). `"all_budgeted"`: every full-attention layer, earlier ones
  too, with `d` the distance between their ranks among the full-attention layers, so the last
  budgeted layer (which has no later layer to borrow from) shares the earlier layers' signal. Default `decay=0.5`: weights 1, 1/2, 1/4, ... so the layer's
  own attention dominates and each later layer counts half as much as the one before it.
- `dist(r)` rescales each layer's statistic to sum to 1 over the sequence (per batch row and KV
  head), so layers whose attention is spread differently (sliding windows vs. full attention,
  long vs. short contexts) weigh in by `decay` only, not by their scale.
- KV head `g` of layer `l'` has no relation to KV head `g` of layer `l`: with
  `cross_head="mean"` (default) later layers contribute their mean over KV heads (a per-token
  importance shared by all heads of `l`) and only `l` itself contributes per head; `"same"`
  uses the same head index in every layer.
- `cross_layer="per_layer"` is `dist(r_l)` alone (the ablation).

Targets are therefore distributions over the sequence: `(batch, kv_heads, seq)`, >= 0, each row
summing to 1 over the real tokens (0 on padding). Only their ranking matters to the cache.

**Signal.** `signal="questions"` (default) is everything above: the attention a token receives
from the later queries of its own sequence (on the synthetic samples that includes the answer's
attention to the needle). `"reconstruction"` and `"both"` ask the frozen model to repeat the
context and read the attention the repeated copy pays back; `kind="kvzip_plus"` is KVzap's
regression target on that same pass. Both live in `sparsekv.teacher.reconstruction`, which
builds on the forward machinery here; `training_targets` there serves every signal.

**Memory.** `attention_received` processes `block_size` queries at a time and only the keys
they may see, so the extra memory is O(block_size x seq) per layer (O(block_size x window) on
sliding layers); no `seq x seq` matrix is ever built. `collect_attention_stats` computes it from
inside one frozen forward (`torch.no_grad`, `use_cache=False`) run by
`sparsekv.teacher.forward.teacher_forward`, which sees the post-RoPE queries and keys of every
layer. The model's attention implementation is restored afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from sparsekv.models.families import model_shape
from sparsekv.teacher.config import (  # noqa: F401  (re-exported: the target's definition)
    CROSS_HEAD,
    CROSS_LAYER,
    NORMALIZE,
    SIGNALS,
    SOURCE_LAYERS,
    STATS,
    TARGET_KINDS,
    TargetConfig,
)
from sparsekv.teacher.forward import (  # noqa: F401  (teacher_attention re-exported)
    TEACHER_EAGER,
    TEACHER_SDPA,
    layer_scaling,
    teacher_attention,
    teacher_forward,
    valid_mask,
)


@dataclass
class TeacherStats:
    """What one frozen forward yields.

    received: layer -> `(batch, kv_heads, seq)` float32 attention statistic (see `attention_received`).
    hidden_states: layer -> `(batch, seq, hidden)` inputs of that layer's self_attn (the output of
    its input layernorm), detached, in the model's dtype: what the gating head reads.
    valid: `(batch, seq)` bool, True for real (non-padding) tokens.
    """

    received: dict[int, torch.Tensor] = field(default_factory=dict)
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)
    valid: torch.Tensor | None = None


@torch.no_grad()
def attention_received(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    num_kv_groups: int,
    stat: str = "mass",
    block_size: int = 512,
    sliding_window: int | None = None,
    key_padding: torch.Tensor | None = None,
    normalize: str = "none",
    exclude_self: bool = False,
    min_distance: int = 0,
) -> torch.Tensor:
    """Attention each key receives from the queries that may see it, per KV head.

    query `(batch, heads, q, head_dim)` and key `(batch, kv_heads, seq, head_dim)`, both after
    RoPE; `heads = kv_heads * num_kv_groups` (query head h uses KV head h // num_kv_groups, as in
    transformers' `repeat_kv`). Query i sits at absolute position `seq - q + i` (so q == seq for a
    full forward). Causal; with `sliding_window` w a query at position t sees keys > t - w (the
    transformers convention). `key_padding` `(batch, seq)` is the usual attention mask (True/1 =
    real token): padding keys receive nothing and padding queries contribute nothing.
    `scaling` and `softcap` are the layer's (logits = tanh(q.k * scaling / softcap) * softcap).

    `stat`: "mass" sums over queries, "max" takes the max; both after summing the probabilities
    over the query heads of each KV group. `normalize`, `exclude_self` and `min_distance` (only
    queries at position >= key + min_distance count; combined with exclude_self as
    max(min_distance, 1)): see the module docstring. Returns `(batch, kv_heads, seq)` float32.

    Queries are processed `block_size` at a time against only the keys they may see, so the
    extra memory is O(batch x heads x block_size x seq), never seq x seq. No gradient flows.
    """
    if stat not in STATS:
        raise ValueError(f"stat={stat!r} is not supported; allowed values: {', '.join(STATS)}")
    if normalize not in NORMALIZE:
        raise ValueError(
            f"normalize={normalize!r} is not supported; allowed values: {', '.join(NORMALIZE)}"
        )
    if block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be >= 1")
    if isinstance(min_distance, bool) or not isinstance(min_distance, int) or min_distance < 0:
        raise ValueError(f"min_distance={min_distance!r} must be an int >= 0")
    gap = max(min_distance, 1 if exclude_self else 0)  # counted: query - key >= gap
    b, hq, q_len, d = query.shape
    kb, hk, n, kd = key.shape
    if kb != b or kd != d or hq != hk * num_kv_groups:
        raise ValueError(
            f"query {tuple(query.shape)} and key {tuple(key.shape)} do not match with "
            f"num_kv_groups={num_kv_groups}"
        )
    if q_len > n:
        raise ValueError(f"more queries ({q_len}) than keys ({n})")
    g = num_kv_groups
    offset = n - q_len
    dev = query.device
    valid = None
    if key_padding is not None:
        if key_padding.shape != (b, n):
            raise ValueError(f"key_padding has shape {tuple(key_padding.shape)}; expected {(b, n)}")
        valid = key_padding.to(device=dev, dtype=torch.bool)

    out = torch.zeros(b, hk, n, dtype=torch.float32, device=dev)
    per_query = normalize in ("length", "uniform") and stat == "mass"
    count = torch.zeros(b, 1, n, dtype=torch.float32, device=dev) if per_query else None
    kf = key.float()
    positions = torch.arange(n, device=dev)

    for s in range(0, q_len, block_size):
        e = min(s + block_size, q_len)
        qpos = positions[offset + s : offset + e]  # (B,)
        hi = offset + e  # causal: no query of the block sees keys >= hi
        lo = 0 if sliding_window is None else max(0, offset + s - sliding_window + 1)
        kpos = positions[lo:hi]  # (K,)
        allowed = kpos[None, :] <= qpos[:, None]  # (B, K)
        if sliding_window is not None:
            allowed = allowed & (kpos[None, :] > qpos[:, None] - sliding_window)
        allowed = allowed[None, None]  # (1, 1, B, K)
        if valid is not None:
            allowed = allowed & valid[:, None, None, lo:hi]  # (b, 1, B, K)

        qb = query[:, :, s:e].float().reshape(b, hk, g * (e - s), d)
        # In-place from here on: at most two (batch, heads, block, keys) float32 buffers live.
        logits = torch.matmul(qb, kf[:, :, lo:hi].transpose(-1, -2)).mul_(
            scaling
        )  # (b, hk, g*B, K)
        logits = logits.view(b, hk, g, e - s, hi - lo)
        if softcap is not None:
            logits.div_(softcap).tanh_().mul_(softcap)
        # finfo.min rather than -inf: a fully masked row (a padding query) stays finite and is
        # zeroed below instead of turning into NaN.
        logits.masked_fill_(~allowed[:, :, None], torch.finfo(torch.float32).min)
        probs = torch.softmax(logits, dim=-1)
        del logits

        counted = allowed  # which (query, key) pairs count: valid query, may see, far enough
        if valid is not None:
            counted = counted & valid[:, None, offset + s : offset + e, None]
        if gap > 0:
            counted = counted & (qpos[:, None] - kpos[None, :] >= gap)[None, None]
        if normalize == "uniform":
            seen = allowed.sum(-1, keepdim=True).to(torch.float32)  # keys each query sees
            probs.mul_(seen[:, :, None])
        probs = probs.masked_fill_(~counted[:, :, None], 0.0).sum(2)  # (b, hk, B, K)

        if stat == "mass":
            out[:, :, lo:hi] += probs.sum(-2)
        else:
            out[:, :, lo:hi] = torch.maximum(out[:, :, lo:hi], probs.amax(-2))
        if count is not None:
            count[:, :, lo:hi] += counted.sum(-2).to(torch.float32).expand(b, 1, hi - lo)
        del probs

    if count is not None:
        out = torch.where(count > 0, out / count.clamp_min(1.0), torch.zeros_like(out))
    return out


def collect_attention_stats(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    target: TargetConfig | None = None,
    block_size: int = 512,
    *,
    layers: Sequence[int] | None = None,
    hidden_layers: Sequence[int] | None = None,
) -> TeacherStats:
    """One frozen forward of `model` on `input_ids` `(batch, seq)`; returns `TeacherStats`.

    `received[l]` `(batch, kv_heads, seq)` for every layer in `layers` (default: all layers),
    computed with `target.stat`, `target.normalize`, `target.exclude_self` and
    `target.min_distance`;
    `hidden_states[l]` `(batch, seq, hidden)` for every layer in `hidden_layers` (default: all).
    `target` defaults to `TargetConfig()`. `attention_mask` `(batch, seq)`: 1 = real token (left or right padding both work).
    See `sparsekv.teacher.forward.teacher_forward` for how the forward runs.
    """
    target = TargetConfig() if target is None else target
    n_layers = model_shape(model).num_layers
    valid = valid_mask(input_ids, attention_mask)
    received: dict[int, torch.Tensor] = {}

    def compute(module, layer, query, key, value, hidden, kwargs):
        received[layer] = attention_received(
            query,
            key,
            scaling=layer_scaling(module, kwargs),
            softcap=kwargs.get("softcap"),
            num_kv_groups=query.shape[1] // key.shape[1],
            stat=target.stat,
            block_size=block_size,
            sliding_window=kwargs.get("sliding_window"),
            key_padding=valid,
            normalize=target.normalize,
            exclude_self=target.exclude_self,
            min_distance=target.min_distance,
        )

    hidden = teacher_forward(
        model,
        input_ids,
        valid.long() if attention_mask is not None else None,
        compute,
        layers=range(n_layers) if layers is None else layers,
        hidden_layers=range(n_layers) if hidden_layers is None else hidden_layers,
    )
    return TeacherStats(received=received, hidden_states=hidden, valid=valid)


# --------------------------------------------------------------------------- targets


def source_layers(
    layer: int, target: TargetConfig, layer_types: Sequence[str], full_only: bool = False
) -> list[int]:
    """The layers whose statistics make up `layer`'s target, nearest first (`layer` itself first).

    `full_only` (the reconstruction signal): sliding-window layers are left out whatever
    `target.source_layers` says, since they cannot see a repeated copy; "all" then reads as
    "budgeted"."""
    if target.cross_layer == "per_layer":
        return [layer]
    if target.source_layers == "all_budgeted":
        full = [i for i, t in enumerate(layer_types) if t == "full_attention" and i != layer]
        return [layer, *sorted(full, key=lambda i: (abs(i - layer), i))]
    later = range(layer + 1, len(layer_types))
    if target.source_layers == "budgeted" or full_only:
        later = [i for i in later if layer_types[i] == "full_attention"]
    return [layer, *later]


def _dist(x: torch.Tensor) -> torch.Tensor:
    """Rescale rows of `(batch, kv_heads, seq)` to sum to 1 (all-zero rows stay zero)."""
    total = x.sum(-1, keepdim=True)
    return torch.where(
        total > 0, x / total.clamp_min(torch.finfo(x.dtype).tiny), torch.zeros_like(x)
    )


def cumulative_targets(
    received: dict[int, torch.Tensor],
    layers: Sequence[int],
    target: TargetConfig,
    layer_types: Sequence[str],
    full_only: bool = False,
) -> dict[int, torch.Tensor]:
    """The target of every layer in `layers`: layer -> `(batch, kv_heads, seq)`, rows summing to 1.

    `received` must hold every layer in `source_layers(l, target, layer_types, full_only)` for
    each `l`.
    """
    out: dict[int, torch.Tensor] = {}
    for layer in layers:
        sources = source_layers(layer, target, layer_types, full_only)
        missing = [s for s in sources if s not in received]
        if missing:
            raise ValueError(f"the target of layer {layer} needs statistics of layers {missing}")
        full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        acc = None
        total = 0.0
        for rank, src in enumerate(sources):
            if target.source_layers == "all_budgeted" and layer in full and src in full:
                rank = abs(full.index(src) - full.index(layer))
            w = target.decay**rank
            if w == 0.0:
                continue
            r = _dist(received[src].float())
            if src != layer and target.cross_head == "mean":
                r = r.mean(1, keepdim=True)
            acc = w * r if acc is None else acc + w * r
            total += w
        out[layer] = _dist(acc / total)
    return out


def default_layers(model: nn.Module) -> list[int]:
    """The layers the budget applies to: the full-attention layers (all layers if none are)."""
    shape = model_shape(model)
    return shape.full_layers or list(range(shape.num_layers))


def teacher_targets(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    target: TargetConfig | None = None,
    layers: Sequence[int] | None = None,
    block_size: int = 512,
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Targets and head inputs for the budgeted `layers` (default: `default_layers(model)`).

    Returns `(targets, hidden_states)`: layer -> `(batch, kv_heads, seq)` target distributions
    and layer -> `(batch, seq, hidden)` self_attn inputs. Only the layers the targets need are
    computed. This is `signal="questions"`; `sparsekv.teacher.reconstruction.training_targets`
    serves every signal.
    """
    target = TargetConfig() if target is None else target
    if target.signal != "questions":
        raise ValueError(
            f"teacher_targets computes signal='questions' only, not signal={target.signal!r}; "
            "use sparsekv.teacher.reconstruction.training_targets"
        )
    shape = model_shape(model)
    layers = list(default_layers(model) if layers is None else layers)
    needed = sorted(
        {s for layer in layers for s in source_layers(layer, target, shape.layer_types)}
    )
    stats = collect_attention_stats(
        model, input_ids, attention_mask, target, block_size, layers=needed, hidden_layers=layers
    )
    targets = cumulative_targets(stats.received, layers, target, shape.layer_types)
    return targets, stats.hidden_states
