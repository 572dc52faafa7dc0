"""What a policy reads from a budgeted layer: the `ScoreContext` of a step (built lazily: keys
and values only when the policy reads them) and the attention the stored entries received from
the step's queries. The layer (`sparsekv.cache.layer.EvictingLayer`) calls these; policies see
only the `ScoreContext`."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

import sparsekv.cache.attention as attn
from sparsekv.policies import ScoreContext

if TYPE_CHECKING:
    from sparsekv.cache.layer import EvictingLayer


def score_context(layer: EvictingLayer, phase: str, query=None, attention=None) -> ScoreContext:
    """The `ScoreContext` of `layer`'s current step (`phase`: prefill, decode or rerank)."""
    shared = layer.shared
    n_old = layer.stored() - layer.num_new
    prev = None if layer.scores is None else layer.scores[..., :n_old]
    return ScoreContext(
        layer_idx=layer.layer_idx,
        phase=phase,
        # built only if the policy reads them (ScoreContext), while this step's entries are
        # live; an INT8 layer dequantizes only what is read
        keys=functools.partial(layer._dense_one, 0),
        values=functools.partial(layer._dense_one, 1),
        positions=layer.positions,
        num_new=layer.num_new,
        tokens_seen=layer.seen,
        prev_scores=prev,
        attention=attention,
        observed=layer.observed,
        queries=query,
        hidden_states=hidden_states(layer),
        budget_rank=layer.budget_rank,
        num_budgeted=shared.num_budgeted,
        input_ids=new_ids(layer),
        model=shared.model() if shared.model is not None else None,
    )


def hidden_states(layer: EvictingLayer) -> torch.Tensor | None:
    """The attention inputs the policy scores this step's new entries from: the layer's, or the
    first budgeted layer's for a policy with `hidden_from_first`."""
    return layer.shared.first_hidden if layer.shared.policy.hidden_from_first else layer.hidden


def new_ids(layer: EvictingLayer) -> torch.Tensor | None:
    """Token ids of the new entries `(batch, num_new)`, when the policy reads them and the
    forward that brought them had ids."""
    ids, n = layer.shared.input_ids, layer.num_new
    if not layer.shared.policy.needs_input_ids or ids is None or not n:
        return None
    return ids[:, -n:] if ids.shape[-1] >= n else None


def received_from(
    layer: EvictingLayer, which: str | None, window: int, query, kv_mask, scaling, softcap
):
    """Attention the stored entries received from the new queries that `which` selects: "all"
    (or None), the "last" one, or the last `window`. `(batch, kv_heads, stored)`."""
    q = query.shape[2]
    n = {"all": q, "last": 1, "window": min(window, q), None: q}[which]
    m = None if kv_mask is None else kv_mask[:, :, -n:]
    keys, scale, last = layer.scoring_keys()
    return attn.received_attention(
        query[:, :, -n:], keys, m, scaling, softcap, key_scale=scale, last_key=last
    )


def attention_stats(layer: EvictingLayer, query, kv_mask, scaling, softcap):
    """What the policy asks of this step's attention (`Policy.attention_queries`, or every query
    when it tracks observed attention), or None when it asks nothing."""
    policy = layer.shared.policy
    if policy.attention_queries is None and not policy.tracks_observed:
        return None
    # While decoding there is one query: every selection is that query.
    return received_from(
        layer, policy.attention_queries, policy.window, query, kv_mask, scaling, softcap
    )


def record(layer: EvictingLayer, query, kv_mask, scaling, softcap) -> None:
    """Keep what any policy could ask for, so `SparseKVCache.fork` can compress later."""
    rec, shared = layer.recorded, layer.shared
    for which in shared.record:
        att = received_from(layer, which, shared.record_window, query, kv_mask, scaling, softcap)
        if which == "all" and which in rec:
            att[..., : rec[which].shape[-1]] += rec[which]
        rec[which] = att
    if layer.hidden is not None:
        h = rec.get("hidden")
        rec["hidden"] = layer.hidden if h is None else torch.cat([h, layer.hidden], dim=1)
