"""The forward hooks a `SparseKVCache` installs on its model: marking the model's own forwards,
capturing attention inputs, noting a forward's token ids, scoring a repeat pass once a forward
returns, chunking a long prefill, finishing the static layout's decode steps.

Each hook holds a weak reference to its cache and acts only on forwards through that cache."""

from __future__ import annotations

import sys

import torch

import sparsekv.cache.static as static
from sparsekv.cache.layer import BEAM_SEARCH, EvictingLayer
from sparsekv.policies.repeat_pass import score_pending


def _remove_hooks(hooks: list) -> None:
    for h in hooks:
        h.remove()
    hooks.clear()


def _through(kwargs: dict, cache) -> bool:
    """Whether a module's call (its keyword arguments) runs through `cache`."""
    return cache is not None and (
        kwargs.get("cache") is cache or kwargs.get("past_key_values") is cache
    )


def _arm(ref):
    """Forward pre-hook on the model's first attention module: a forward of this model is about
    to update the cache (`SparseKVCache._check_forward` refuses any other); a forward without
    tokens is refused here, before the attention reshapes an empty tensor. Nothing under
    `torch.compile` (a compiled step is one of the model's own)."""

    def hook(module, args, kwargs):
        cache = None if torch.compiler.is_compiling() else ref()
        if _through(kwargs, cache):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            if isinstance(hidden, torch.Tensor) and hidden.dim() == 3 and hidden.shape[1] == 0:
                raise ValueError(
                    f"input_ids is empty: the forward through this SparseKVCache has no tokens "
                    f"(input_ids or inputs_embeds of shape {tuple(hidden.shape[:2])}); give at "
                    "least one token"
                )
            cache._armed = True

    return hook


def _capture_hidden(ref, layer: EvictingLayer, first: bool):
    def hook(module, args, kwargs):
        cache = ref()
        if cache is not None and kwargs.get("cache") is cache:
            layer.hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            if first:  # layers run in order: deeper budgeted layers of this step may read it
                cache.shared.first_hidden = layer.hidden

    return hook


def _note_inputs(ref):
    """Forward pre-hook on the model: keep the forward's `input_ids` `(batch, new)`, 2-D
    `attention_mask` `(batch, seen)` and `position_ids` for a repeat pass (not those of the
    repeat's own forwards), and the ids for policies that read them."""

    def hook(module, args, kwargs):
        cache = ref()
        if cache is not None and kwargs.get("cache") is cache and not cache.in_repeat:
            ids = kwargs.get("input_ids", args[0] if args else None)
            cache.step_inputs = (ids, kwargs.get("attention_mask"), kwargs.get("position_ids"))
            cache.shared.input_ids = ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None

    return hook


def _check_inputs(ref):
    """Forward pre-hook on the model (the first one): `_check_step`, for forwards of this
    cache's own (not its repeat passes'), outside `torch.compile`."""

    def hook(module, args, kwargs):
        cache = None if torch.compiler.is_compiling() else ref()
        if cache is not None and kwargs.get("cache") is cache and not cache.in_repeat \
                and not cache._in_chunked_prefill:
            _check_step(cache, kwargs.get("input_ids", args[0] if args else None), kwargs)

    return hook


def _in_beam_search() -> bool:
    """Whether this forward is called from transformers' beam search (its `_beam_search` frame
    is on the stack): `generate` passes no generation settings to the model, and a prefill
    through this cache should be refused before it runs, not at the first `reorder_cache`."""
    try:
        from transformers.generation.utils import GenerationMixin
    except ImportError:  # pragma: no cover - transformers without generation
        return False
    code = getattr(getattr(GenerationMixin, "_beam_search", None), "__code__", None)
    frame = sys._getframe(1)
    while frame is not None and code is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _check_step(cache, ids, kwargs: dict) -> None:
    """Refuse, before the model runs, a forward whose inputs cannot belong to this cache's
    sequence: token ids that are not integers, a 2-D `attention_mask` that does not cover the
    tokens seen plus the new ones, a sequence whose mask is all zeros, and (without a mask)
    positions that do not continue where the cache stopped, which is what `generate` sends when
    a cache that already holds one prompt is passed again with another. Multi-token steps only
    for the checks that read values (a decode step would pay a host sync per token)."""
    embeds = kwargs.get("inputs_embeds")
    if isinstance(ids, torch.Tensor) and (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):
        raise ValueError(
            f"input_ids must hold integer token ids (torch.long), got {ids.dtype}; pass "
            "tokenizer(...).input_ids, or inputs_embeds for embeddings"
        )
    new_t = ids if isinstance(ids, torch.Tensor) else embeds
    if not isinstance(new_t, torch.Tensor) or new_t.dim() < 2:
        return
    new = int(new_t.shape[1])
    if new > 1 and cache.tokens_seen() == 0 and _in_beam_search():  # a prefill under beams
        raise ValueError(BEAM_SEARCH)
    mask = kwargs.get("attention_mask")
    pos = kwargs.get("position_ids")
    # tokens_seen() loops over the layers: read only where a check needs it (not on a decode
    # step without a 2-D mask, the common one)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        seen = cache.tokens_seen()
        if mask.shape[-1] != seen + new:
            raise ValueError(
                f"attention_mask covers {mask.shape[-1]} tokens, but this forward has {new} new "
                f"tokens and the SparseKVCache has seen {seen}: the mask must cover past + new = "
                f"{seen + new} tokens"
                + (
                    " (a cache holds one sequence: build a new SparseKVCache for another prompt)"
                    if seen and mask.shape[-1] <= seen
                    else ""
                )
            )
        if new > 1 and not bool(mask.any(-1).all()):
            rows = (~mask.bool().any(-1)).nonzero().flatten().tolist()
            raise ValueError(
                f"attention_mask is all zeros for sequence(s) {rows}: such a sequence has no token "
                "to attend to; give each sequence at least one real token (mask 1)"
            )
    if isinstance(pos, torch.Tensor) and pos.dim() == 2 and pos.shape[-1] != new:
        raise ValueError(
            f"position_ids cover {pos.shape[-1]} tokens but this forward has {new} new tokens "
            "(under generate, positions come from attention_mask: pass a mask covering every "
            "token, past + new, or none)"
        )
    if mask is None and new > 1 and isinstance(pos, torch.Tensor) and pos.dim() == 2:
        seen = cache.tokens_seen()
        if seen and (start := int(pos[:, 0].min())) != seen:
            raise ValueError(
                f"this SparseKVCache has already seen {seen} tokens, but the forward's positions "
                f"start at {start}: a cache holds one sequence and continues it. For another "
                "prompt build a new SparseKVCache (or copy.deepcopy one made for a shared "
                "prefix, and pass the prefix plus the new tokens)"
            )


def _after_forward(ref):
    """Forward hook on the model: once a forward through the cache returns, score the entries it
    left pending by a repeat pass (then they are evicted)."""

    def hook(module, args, kwargs, output):
        cache = ref()
        if cache is not None and kwargs.get("cache") is cache and not cache.in_repeat:
            score_pending(cache)

    return hook


def _chunk_prefill(ref):
    """Forward pre-hook on the model: run all but the last chunk of a long input (`input_ids`,
    or `inputs_embeds`) as separate forwards through this cache (each followed by eviction),
    then let the call go on with the last chunk."""

    def hook(module, args, kwargs):
        cache = ref()
        if cache is None or kwargs.get("cache") is not cache or cache._in_chunked_prefill:
            return None
        if args:
            kwargs = {"input_ids": args[0], **kwargs}
        # token ids, or their embeddings `(batch, n, hidden)` under `inputs_embeds`
        key = "inputs_embeds" if kwargs.get("inputs_embeds") is not None else "input_ids"
        ids = kwargs.get(key)
        chunk = cache.config.prefill_chunk
        if ids is None or ids.shape[1] <= chunk:
            return None
        n = ids.shape[1]
        seen = cache.tokens_seen()
        mask, pos = kwargs.get("attention_mask"), kwargs.get("position_ids")
        last = n - ((n - 1) % chunk + 1)  # start of the final chunk
        if mask is not None:  # chunks may be single tokens: have the layers check them all
            cache.shared.padding_check_until = seen + n
        cache._in_chunked_prefill = True
        try:
            with torch.no_grad():
                for s in range(0, last, chunk):
                    e = s + chunk
                    module(
                        **{key: ids[:, s:e]},
                        attention_mask=None if mask is None else mask[:, : seen + e],
                        position_ids=None if pos is None else pos[:, s:e],
                        cache=cache,
                        use_cache=True,
                        logits_to_keep=1,
                    )
        finally:
            cache._in_chunked_prefill = False
        kwargs[key] = ids[:, last:]
        if pos is not None:
            kwargs["position_ids"] = pos[:, last:]
        return (), kwargs

    return hook


def _finish_static_steps(ref):
    """Forward hook on the model (static layout): once a forward through the cache returns,
    finish its decode steps (`sparsekv.cache.static.finish_steps`, looked up at call time;
    eagerly, outside a compiled `model.forward`)."""

    def hook(module, args, kwargs, output):
        cache = ref()
        if cache is not None and kwargs.get("cache") is cache:
            static.finish_steps(cache)

    return hook
