"""The teacher's frozen forward: one no-grad pass that lets a callback see every layer's attention.

This module owns running a frozen model so that teacher statistics can be read from inside each
attention call: an attention implementation registered with transformers' `AttentionInterface`
(named `sparsekv_teacher` / `sparsekv_teacher_eager`, registered on first use, never on import)
delegates the attention output to sdpa (or the family's eager function) and additionally hands
the post-RoPE queries, keys and values, the layer's self_attn input and the call's scaling,
softcap and sliding window to a callback. What the callback computes (attention received, KVzip+)
lives in `sparsekv.teacher.statistics` and `sparsekv.teacher.reconstruction`; this module knows no statistic.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from sparsekv.models.families import (
    attention_modules,
    eager_attention_function,
    model_shape,
    text_config,
)

TEACHER_SDPA = "sparsekv_teacher"
TEACHER_EAGER = "sparsekv_teacher_eager"


class _Collector:
    """Per-forward state of `teacher_forward`, reached through a context variable.

    `compute(module, layer, query, key, value, hidden, kwargs)` runs inside the attention call of
    every layer in `layers`; `hidden` is that layer's self_attn input `(batch, seq, hidden)`.
    """

    def __init__(self, layer_of: dict[int, int], layers: set[int], compute: Callable):
        self.layer_of = layer_of
        self.layers = layers
        self.compute = compute
        self.seen: set[int] = set()
        self.hidden: dict[int, torch.Tensor] = {}


_ACTIVE: contextvars.ContextVar[_Collector | None] = contextvars.ContextVar(
    "sparsekv_teacher", default=None
)
_REGISTERED: set[str] = set()


QUERY_BLOCK = 512
"""Queries per sdpa call of a long masked forward (`_blocked_sdpa`)."""


def _blocked_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention, for a long forward with a boolean mask (a sliding-window
    layer, padding) run `QUERY_BLOCK` queries at a time over only the keys some query of the
    block may attend: the same output, without the masked-out products (a sliding window of 512
    over 3.4K tokens: about 3x less attention work on a CPU). Other calls go through unchanged
    (no mask: sdpa's own causal kernel already skips the upper triangle)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len = query.shape[2]
    if (
        not isinstance(attention_mask, torch.Tensor)
        or attention_mask.dtype != torch.bool
        or attention_mask.dim() != 4
        or q_len <= QUERY_BLOCK
        or kwargs.get("position_bias") is not None
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    allowed = attention_mask.any(0).any(0)  # (q, k): some sequence and head may attend
    outs = []
    for s in range(0, q_len, QUERY_BLOCK):
        e = min(q_len, s + QUERY_BLOCK)
        cols = allowed[s:e].any(0).nonzero()
        lo, hi = (int(cols[0]), int(cols[-1]) + 1) if cols.numel() else (0, key.shape[2])
        out, _ = sdpa_attention_forward(
            module, query[:, :, s:e], key[:, :, lo:hi], value[:, :, lo:hi],
            attention_mask[..., s:e, lo:hi], **kwargs,
        )
        outs.append(out)
    return torch.cat(outs, dim=1), None


def _teacher_attention(base: str, module, query, key, value, attention_mask, **kwargs):
    if base == "eager":
        out = eager_attention_function(module)(module, query, key, value, attention_mask, **kwargs)
    else:
        out = _blocked_sdpa(module, query, key, value, attention_mask, **kwargs)
    col = _ACTIVE.get()
    layer = col.layer_of.get(id(module)) if col is not None else None
    if layer is not None and layer in col.layers:
        col.compute(module, layer, query, key, value, col.hidden.get(layer), kwargs)
        col.seen.add(layer)
    return out


def layer_scaling(module: nn.Module, kwargs: dict[str, Any]) -> float:
    """The softmax scaling a layer's attention call uses (its own, else head_dim**-0.5)."""
    return kwargs.get("scaling") or module.head_dim**-0.5


def _register() -> None:
    """Register the teacher implementations with transformers (idempotent; on first use)."""
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    def sdpa_fn(module, query, key, value, attention_mask, **kwargs):
        return _teacher_attention("sdpa", module, query, key, value, attention_mask, **kwargs)

    def eager_fn(module, query, key, value, attention_mask, **kwargs):
        return _teacher_attention("eager", module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(TEACHER_SDPA, sdpa_fn)
    AttentionMaskInterface.register(TEACHER_SDPA, sdpa_mask)
    AttentionInterface.register(TEACHER_EAGER, eager_fn)
    AttentionMaskInterface.register(TEACHER_EAGER, eager_mask)
    _REGISTERED.update((TEACHER_SDPA, TEACHER_EAGER))


def _set_attn(model: nn.Module, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # a bare module around a config (no PreTrainedModel API)
        text_config(model)._attn_implementation = name


@contextmanager
def teacher_attention(model: nn.Module) -> Iterator[None]:
    """Switch `model` to the teacher attention implementation; restore the original on exit."""
    _register()
    cfg = text_config(model)
    original = cfg._attn_implementation
    name = TEACHER_EAGER if original is not None and "eager" in original else TEACHER_SDPA
    _set_attn(model, name)
    try:
        yield
    finally:
        _set_attn(model, original)


def valid_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """`(batch, seq)` bool, True for real tokens (all of them when `attention_mask` is None)."""
    if attention_mask is None:
        return torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}; expected input_ids' {tuple(input_ids.shape)}"
        )
    return attention_mask.to(torch.bool)


def teacher_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    compute: Callable,
    *,
    layers: Sequence[int],
    hidden_layers: Sequence[int],
    cache: Any = None,
) -> dict[int, torch.Tensor]:
    """One frozen forward of `model` on `input_ids` `(batch, seq)` that calls
    `compute(module, layer, query, key, value, hidden, kwargs)` from inside the attention of every
    layer in `layers` (query `(batch, heads, seq, head_dim)` and key/value `(batch, kv_heads, seq,
    head_dim)` after RoPE and norms; `hidden` `(batch, seq, hidden)` the layer's self_attn input;
    `kwargs` the attention call's scaling, softcap, sliding_window). Returns the self_attn inputs
    of `hidden_layers`, detached: layer -> `(batch, seq, hidden)`.

    The forward runs under `torch.no_grad()` with `logits_to_keep=1`, in eval mode; the model's
    mode, attention implementation and hooks are restored afterwards. Without `cache` it keeps
    no cache; with a transformers `Cache` it continues (and extends) the sequence that cache
    holds: the queries, hidden states and returned inputs are the new tokens', the keys and
    values span the cached tokens too (how one prefix serves several continuations).
    """
    shape = model_shape(model)
    want, keep_hidden = set(layers), set(hidden_layers)
    for name, chosen in (("layers", want), ("hidden_layers", keep_hidden)):
        bad = sorted(x for x in chosen if not 0 <= x < shape.num_layers)
        if bad:
            raise ValueError(
                f"{name} {bad} out of range for a model with {shape.num_layers} layers"
            )
    modules = attention_modules(model)
    col = _Collector({id(m): i for i, m in enumerate(modules)}, want, compute)

    def make_hook(idx: int):
        def hook(module, args, kwargs):
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            col.hidden[idx] = h.detach()

        return hook

    handles = [
        m.register_forward_pre_hook(make_hook(i), with_kwargs=True)
        for i, m in enumerate(modules)
        if i in keep_hidden or i in want
    ]
    was_training = model.training
    token = _ACTIVE.set(col)
    try:
        model.eval()
        with teacher_attention(model), torch.no_grad():
            model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                use_cache=cache is not None,
                logits_to_keep=1,
                **({} if cache is None else {"cache": cache}),
            )
    finally:
        _ACTIVE.reset(token)
        for h in handles:
            h.remove()
        model.train(was_training)
    missing = sorted(want - col.seen)
    if missing:
        raise RuntimeError(f"no attention statistics were seen for layers {missing}")
    return {i: col.hidden[i] for i in sorted(keep_hidden)}
