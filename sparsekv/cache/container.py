"""`SparseKVCache`: the transformers `Cache` that collects one layer per model layer (an
`EvictingLayer` or `StaticEvictingLayer` for each budgeted layer, transformers' own layers for
the rest), measures them, and wires itself into the model (attention implementation, hooks).

The package docstring (`sparsekv.cache`) describes the life of a step."""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    get_layer_types_and_kwargs,
)

import sparsekv.cache.attention as attn
import sparsekv.cache.state as state
from sparsekv.cache.hooks import (
    _after_forward,
    _arm,
    _capture_hidden,
    _check_inputs,
    _chunk_prefill,
    _finish_static_steps,
    _note_inputs,
    _remove_hooks,
)
from sparsekv.cache.layer import _RECORDABLE, EvictingLayer
from sparsekv.cache.schedules import layer_fractions
from sparsekv.cache.shared import SharedState
from sparsekv.cache.static import StaticEvictingLayer
from sparsekv.config import EvictionConfig
from sparsekv.models.families import attention_modules, model_shape, text_config
from sparsekv.policies import Policy
from sparsekv.policies import get as get_policy
from sparsekv.policies.repeat_pass import score_pending


class SparseKVCache(Cache):
    """A KV cache that keeps, per budgeted layer, only what `policy` scores highest.

    Args:
        model: the transformers causal LM this cache serves (Llama, Mistral, Qwen2/3, Gemma 3).
        config: an `EvictionConfig`.
        policy: a policy name (`sparsekv.policies.available()`) or a `Policy` instance.

    Pass it as `cache=` to `model(...)` or `model.generate(...)` of that same model: another
    model's forward is refused (its entries are this model's keys and values). Building it
    switches the model to the `sparsekv_<sdpa|eager>` attention implementation (identical to the
    base one for any other cache) and installs hooks; `close()` (or leaving a `with` block, or
    the cache being garbage-collected) removes them, and when the model's last open cache
    closes, the model goes back to the implementation it had. A closed cache refuses further
    forwards.
    """

    def __init__(
        self,
        model,
        config: EvictionConfig,
        policy: str | Policy = "snapkv",
        record: tuple[str, ...] = (),
        record_window: int = 32,
    ):
        if not isinstance(config, EvictionConfig):
            raise ValueError(f"config must be an EvictionConfig, got {type(config).__name__}")
        config.validate()  # changed behind its immutability: the field's error, here
        if not hasattr(getattr(model, "config", None), "model_type"):
            raise TypeError(f"model must be a Hugging Face causal LM, got {type(model).__name__}")
        self.model = model
        self.config = config
        self.policy = get_policy(policy)
        bad = [r for r in record if r not in _RECORDABLE]
        if bad:
            raise ValueError(f"record={tuple(record)!r}: unknown {bad}; allowed values: {', '.join(_RECORDABLE)}")
        if record and self.policy.evicts:
            raise ValueError(f"record=... needs the 'full' policy (nothing evicted), got {self.policy.name!r}")
        shape = model_shape(model)
        self.policy.check_model(shape)  # a learned head trained for another shape fails here
        self.shape = shape
        budgeted = shape.full_layers
        if not budgeted:
            raise ValueError(
                f"{shape.model_type} has no full-attention layer: every layer slides over a window of "
                f"{shape.sliding_window} tokens, so there is nothing for a budget to bound"
            )
        schedule = self.policy.schedule or config.schedule
        fractions = layer_fractions(config, len(budgeted), schedule)
        self.shared = SharedState(config, self.policy, len(budgeted))
        self.shared.min_fraction = min(fractions)
        if isinstance(config.budget, float) and config.shared_core > min(fractions) + 1e-9:
            raise ValueError(
                f"shared_core={config.shared_core} is more than the smallest budgeted layer keeps "
                f"({min(fractions):.3g} of the tokens under schedule {schedule!r} at budget "
                f"{config.budget}); allowed: [0, {min(fractions):.3g}]"
            )
        if isinstance(record_window, bool) or not isinstance(record_window, int) or record_window < 1:
            raise ValueError(f"record_window={record_window!r} must be an int >= 1")
        self.shared.record, self.shared.record_window = tuple(record), record_window
        self.shared.model = weakref.ref(model)
        if self.policy.scores_after_prefill and config.prefill_chunk:
            raise ValueError(
                f"policy {self.policy.name!r} scores by repeating the whole prefilled context, which "
                f"prefill_chunk={config.prefill_chunk} evicts chunk by chunk; use prefill_chunk=None"
            )
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config(model))
        layers: list[Any] = []
        for i, (kind, kw) in enumerate(zip(layer_types, layer_kwargs)):
            if i in budgeted:
                r = budgeted.index(i)
                kind_cls = StaticEvictingLayer if config.layout == "static" else EvictingLayer
                layers.append(kind_cls(self.shared, i, r, fractions[r]))
            else:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kw))
        super().__init__(layers=layers)
        self.budgeted_layers = budgeted
        self.shared.measure = weakref.WeakMethod(self.kv_bytes)
        self._hooks: list[Any] = []
        self._in_chunked_prefill = False
        self.step_inputs: tuple | None = None  # (input_ids, attention_mask, position_ids) of the last forward
        self.in_repeat = False  # a repeat pass is running its forwards through this cache
        self._repeat_memo: dict = {}  # fork(): repeat attention per (policy.repeat_key(), sinks)
        self._armed = False  # the first attention module of `model` started a forward through it
        token = object()  # this cache among the model's open caches (`_release`)
        self._use_sparse_attention(model, token)
        self._install_hooks(model)
        self._finalizer = weakref.finalize(self, _release, self._hooks, weakref.ref(model), token)

    # ---- public measurements ----------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes held right now by the key and value tensors of all layers."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, EvictingLayer):
                total += layer.nbytes()
            elif getattr(layer, "is_initialized", False) and layer.keys is not None:
                total += layer.keys.nbytes + layer.values.nbytes
        return total

    def memory_bytes(self) -> dict[str, int]:
        """Bytes the cache holds right now: `kv` (what `kv_bytes` counts: keys, values, INT8
        scales), `bookkeeping` (the budgeted layers' per-entry positions, scores and observed
        attention, with `layout="static"` their whole buffers and the slot map) and `total`."""
        kv = self.kv_bytes()
        extra = sum(layer.bookkeeping_nbytes() for layer in self.layers if isinstance(layer, EvictingLayer))
        return {"kv": kv, "bookkeeping": extra, "total": kv + extra}

    def peak_kv_bytes(self) -> int:
        """The most bytes the key/value tensors held at once since creation or `reset_peak()`
        (sampled after every append to a budgeted layer, where the peaks are)."""
        return max(self.shared.peak_bytes, self.kv_bytes())

    def reset_peak(self) -> None:
        self.shared.peak_bytes = self.kv_bytes()

    def layer_lengths(self) -> list[int]:
        """Entries stored per layer (sliding layers included)."""
        return [
            layer.stored()
            if isinstance(layer, EvictingLayer)
            else layer.keys.shape[-2]
            if getattr(layer, "is_initialized", False) and layer.keys is not None
            else 0
            for layer in self.layers
        ]

    def get_query_offset(self, layer_idx: int = 0):
        # transformers' mask preparation reads this every forward; a static layer answers with a
        # device tensor, so that a compiled decode step does not specialize on the token count
        layer = self.layers[layer_idx]
        offset = layer.query_offset() if isinstance(layer, StaticEvictingLayer) else None
        return super().get_query_offset(layer_idx) if offset is None else offset

    def tokens_seen(self) -> int:
        """Absolute number of tokens processed so far."""
        return max((layer.get_seq_length() for layer in self.layers), default=0)

    def budgets(self) -> dict[int, int]:
        """Capacity of each budgeted layer at the current number of tokens seen."""
        return {layer.layer_idx: layer.capacity() for layer in self.layers if isinstance(layer, EvictingLayer)}

    # ---- transformers' cache protocol ----------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx == 0 and not torch.compiler.is_compiling():
            self._check_forward(key_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _check_forward(self, key_states: torch.Tensor) -> None:
        """At the first layer of every forward: refuse a closed cache, and a forward of a model
        other than the one this cache was built for (the hook `_arm` on that model's first
        attention module marks its own forwards)."""
        if not self._finalizer.alive:
            raise ValueError(
                "this SparseKVCache is closed (close(), the end of its with block, or attach() "
                "after its generate call): its hooks are gone and the model may be back on its "
                "own attention, so it would no longer evict; build a new SparseKVCache(model, "
                "config, policy) for another forward"
            )
        if not self._armed:
            shape = self.shape
            got = (int(key_states.shape[1]), int(key_states.shape[-1]))
            other = (
                f", and of another shape: its first layer gives {got[0]} KV heads of dim "
                f"{got[1]}, the cache's model {shape.num_kv_heads} of dim {shape.head_dim}"
                if got != (shape.num_kv_heads, shape.head_dim)
                else " (of the same shape: it would never evict)"
            )
            raise ValueError(
                f"this SparseKVCache was built for another model ({type(self.model).__name__} "
                f"at {id(self.model):#x}); a forward of a different model object is using it"
                f"{other}. Build one cache per model: SparseKVCache(model, config, policy) "
                "with the model whose generate or forward it is passed to"
            )
        self._armed = False

    # ---- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        """Remove the hooks this cache installed on the model; the last open cache of a model
        also switches it back to the attention implementation it had before. A closed cache
        refuses further forwards."""
        self.shared.first_hidden = None
        self._repeat_memo.clear()
        self._finalizer()

    def __enter__(self) -> SparseKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `abs(tokens_to_remove)` tokens (transformers' convention: a negative
        int); only before the first eviction. Raises ValueError for anything but an int whose
        size is at most the tokens seen."""
        n = tokens_to_remove
        if isinstance(n, bool) or not isinstance(n, int):
            raise ValueError(
                f"crop(tokens_to_remove={n!r}): tokens_to_remove must be an int (negative: the "
                "number of tokens to remove from the end), got "
                f"{type(n).__name__}"
            )
        seen = self.tokens_seen()
        if abs(n) > seen:
            raise ValueError(
                f"crop(tokens_to_remove={n}) removes more tokens than the cache has seen ({seen})"
            )
        super().crop(n)

    def __deepcopy__(self, memo: dict) -> SparseKVCache:
        """A new cache on the same model and policy holding copies of this cache's kept entries
        and counters (transformers' prompt-reuse recipe: prefill once, `copy.deepcopy(cache)`
        per continuation). The model is shared, never copied."""
        if self.shared.record:
            raise ValueError(
                "a cache built with record=... is for fork(); copy.deepcopy the caches fork() returns"
            )
        tensors, meta = state.snapshot(self)
        new = SparseKVCache(self.model, self.config, self.policy)
        return state.restore(new, tensors, meta, state.model_dtype(self.model))

    def __repr__(self) -> str:
        return f"SparseKVCache(policy={self.policy!r}, config={self.config}, budgeted_layers={self.budgeted_layers})"

    # ---- wiring into the model --------------------------------------------------------------
    @staticmethod
    def _use_sparse_attention(model, token: object) -> None:
        entry = _OPEN.setdefault(model, {"before": None, "ours": None, "tokens": set()})
        current = text_config(model)._attn_implementation or "eager"
        if not current.startswith("sparsekv_"):
            name = attn.register(current)
            model.set_attn_implementation(name)
            entry["before"], entry["ours"] = current, name
        entry["tokens"].add(token)

    def fork(self, config: EvictionConfig, policy: str | Policy) -> SparseKVCache:
        """A new cache holding what `policy` under `config` would have kept after this cache's
        prefill, computed from what this cache recorded (built with `record=...` and the full
        policy). One prefill then serves every policy and budget: the prefill's own outputs do
        not depend on the policy, since eviction happens after each layer's attention.
        Reproduces a prefill done in one forward (not `prefill_chunk`)."""
        policy = get_policy(policy)
        if not self.shared.record:
            raise ValueError("fork() needs a cache built with record=('window', ...) and the 'full' policy")
        which = policy.attention_queries or ("all" if policy.tracks_observed else None)
        if which is not None and which not in self.shared.record:
            raise ValueError(f"policy {policy.name!r} needs recorded attention {which!r}; record={self.shared.record}")
        if which == "window" and policy.window != self.shared.record_window:
            raise ValueError(
                f"policy {policy.name!r} observes a window of {policy.window} queries but this cache "
                f"recorded {self.shared.record_window}; build it with record_window={policy.window}"
            )
        new = SparseKVCache(self.model, config, policy)
        new.shared.input_ids = self.shared.input_ids
        if policy.hidden_from_first:
            new.shared.first_hidden = self.layers[self.budgeted_layers[0]].recorded.get("hidden")
        for i, layer in enumerate(self.layers):
            if isinstance(layer, EvictingLayer):
                if policy.needs_hidden_states and "hidden" not in layer.recorded:
                    raise ValueError(f"policy {policy.name!r} needs hidden states: record them with a "
                                     "cache whose hooks capture them (record=... does)")
                new.layers[i].load_from(layer)
            else:
                new.layers[i] = copy.copy(layer)  # transformers' layers replace tensors, never mutate them
        new.shared.first_hidden = None
        if policy.scores_after_prefill:
            ids = None if self.step_inputs is None else self.step_inputs[0]
            if ids is None or ids.shape[1] != self.tokens_seen():
                raise ValueError(f"fork() with policy {policy.name!r} needs the input_ids of a prefill "
                                 "done in one forward of this cache")
            new.step_inputs = self.step_inputs
            key = policy.repeat_key()
            if key is None:
                score_pending(new)
            else:  # the repeat sees the same entries in every fork: run it once per key
                key = (key, config.sink_tokens)
                self._repeat_memo[key] = score_pending(new, self._repeat_memo.get(key))
        return new

    def _install_hooks(self, model) -> None:
        ref = weakref.ref(self)
        first = attention_modules(model)[0]  # marks the model's own forwards (`_check_forward`)
        self._hooks.append(first.register_forward_pre_hook(_arm(ref), with_kwargs=True))
        if self.policy.needs_hidden_states or self.shared.record:
            modules = attention_modules(model)
            for i in self.budgeted_layers:
                layer = self.layers[i]
                first = i == self.budgeted_layers[0]
                self._hooks.append(
                    modules[i].register_forward_pre_hook(_capture_hidden(ref, layer, first), with_kwargs=True)
                )
        self._hooks.append(model.register_forward_pre_hook(_check_inputs(ref), with_kwargs=True))
        if self.config.layout == "static":  # decode steps are scored once the forward returns
            self._hooks.append(model.register_forward_hook(_finish_static_steps(ref), with_kwargs=True))
        if self.config.prefill_chunk:
            self._hooks.append(model.register_forward_pre_hook(_chunk_prefill(ref), with_kwargs=True))
        if self.policy.scores_after_prefill or self.shared.record or self.policy.needs_input_ids:
            self._hooks.append(model.register_forward_pre_hook(_note_inputs(ref), with_kwargs=True))
        if self.policy.scores_after_prefill:
            self._hooks.append(model.register_forward_hook(_after_forward(ref), with_kwargs=True))


_OPEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per model with open caches: the attention implementation it had before a cache switched it
("before", None when it was already sparsekv's), the one it was switched to ("ours") and a token
per open cache ("tokens")."""


def _release(hooks: list, model_ref: Any, token: object) -> None:
    """A cache closes (or is collected): its hooks go; when it was its model's last open cache,
    the model goes back to the attention implementation it had before (unless someone switched
    it since)."""
    _remove_hooks(hooks)
    model = model_ref()
    entry = None if model is None else _OPEN.get(model)
    if entry is None:
        return
    entry["tokens"].discard(token)
    if entry["tokens"] or entry["before"] is None:
        return
    if text_config(model)._attn_implementation == entry["ours"]:
        model.set_attn_implementation(entry["before"])
    entry["before"] = entry["ours"] = None
