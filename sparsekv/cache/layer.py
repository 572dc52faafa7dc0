"""`EvictingLayer`: one budgeted layer of a `SparseKVCache` in the default (dynamic) layout.

It owns the kept entries of one layer and their bookkeeping: dense keys and values (int8 with
scales under `quantize="int8"`), each entry's absolute position, latest score and attention
observed since the last re-rank, and `seen` (tokens processed) apart from `stored`. It asks the
policy for scores and keeps the top ones (sinks and the recent window always), gathering the kept
rows into new tensors. The container (`sparsekv.cache.container`) builds one per budgeted layer;
the static layout (`sparsekv.cache.static`) is its subclass."""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import (
    DynamicLayer,
)

import sparsekv.cache.attention as attn
import sparsekv.cache.policy_inputs as inputs
import sparsekv.cache.selection as selection
from sparsekv.cache.int8 import dequantize, dequantize_with, quantize
from sparsekv.cache.schedules import layer_capacity
from sparsekv.cache.shared import SharedState
from sparsekv.policies.base import checked_scores

BEAM_SEARCH = (
    "num_beams > 1: beam search is not supported by SparseKVCache (beams would need per-beam "
    "eviction histories); use greedy decoding or sampling (num_beams=1)"
)

_RECORDABLE = ("all", "window", "last")
_PER_ENTRY = ("keys", "values", "key_scale", "value_scale", "positions", "scores", "observed")


class EvictingLayer(DynamicLayer):
    """One budgeted layer: dense kept entries plus their positions and scores."""

    is_sliding = False
    is_croppable = False

    def __init__(self, shared: SharedState, layer_idx: int, budget_rank: int, fraction: float):
        super().__init__()
        self.shared = shared
        self.layer_idx = layer_idx
        self.budget_rank = budget_rank
        self.fraction = fraction
        self.seen = 0
        self.num_new = 0
        self.positions: torch.Tensor | None = None
        self.scores: torch.Tensor | None = None
        self.observed: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None
        self.has_padding = False
        self.decode_steps = 0
        self.arrivals_in_forward = 0  # decode steps the static layout scored inside the forward
        self.evicted = False
        self.quantized = shared.config.quantize == "int8"
        self.key_scale: torch.Tensor | None = None  # (batch, kv_heads, stored, 1) when quantized
        self.value_scale: torch.Tensor | None = None
        self._new_kv: tuple | None = None  # an INT8 decode step's own key and value until attended
        self._fresh: tuple | None = None  # the same, until `_live` is first read
        self._live_kv: tuple | None = None
        self._live = None  # this step's full-precision K, V (see the property)
        self.recorded: dict[str, torch.Tensor] = {}  # see SparseKVCache(record=...)
        self.pending = 0  # newest entries awaiting scores from a repeat pass (scores_after_prefill)

    # ---- transformers' layer protocol -------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        b, h = key_states.shape[:2]
        store = torch.int8 if self.quantized else key_states.dtype
        self.keys = key_states.new_empty((b, h, 0, key_states.shape[-1]), dtype=store)
        self.values = value_states.new_empty((b, h, 0, value_states.shape[-1]), dtype=store)
        self.positions = torch.empty((b, h, 0), dtype=torch.long, device=self.device)
        if self.quantized:
            self.key_scale = key_states.new_empty((b, h, 0, 1))
            self.value_scale = value_states.new_empty((b, h, 0, 1))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, q, _ = key_states.shape
        self._new_kv = None
        if self.quantized:
            # Stored as int8 with one scale per token and head. A decode step: sparsekv's
            # attention reads the int8 store itself (`int8_step`) and the step's own entry at full
            # precision, and the scoring dequantizes only if it reads. A multi-token step attends
            # over the dequantized past plus the new entries at full precision.
            decode = q == 1 and self.keys.shape[-2] > 0
            if not decode:
                keys = torch.cat([dequantize(self.keys, self.key_scale), key_states], dim=-2)
                values = torch.cat([dequantize(self.values, self.value_scale), value_states], dim=-2)
            kq, ks = quantize(key_states)
            vq, vs = quantize(value_states)
            self.keys, self.key_scale = torch.cat([self.keys, kq], -2), torch.cat([self.key_scale, ks], -2)
            self.values, self.value_scale = torch.cat([self.values, vq], -2), torch.cat([self.value_scale, vs], -2)
            if decode:
                keys, values = self.keys, self.values
                self._new_kv = (key_states, value_states)
        else:
            keys = self.keys = torch.cat([self.keys, key_states], dim=-2)
            values = self.values = torch.cat([self.values, value_states], dim=-2)
        self._live = (keys, values) if self._new_kv is None else None
        self._fresh = self._new_kv
        new_pos = torch.arange(self.seen, self.seen + q, device=self.device).expand(b, h, q)
        self.positions = torch.cat([self.positions, new_pos], dim=-1)
        self.seen += q
        self.num_new = q
        attn.announce_layer(self.layer_idx, self)
        # Memory peaks right after an append, before this layer's eviction.
        measure = self.shared.measure() if self.shared.measure is not None else None
        if measure is not None:
            self.shared.peak_bytes = max(self.shared.peak_bytes, measure())
        return keys, values

    @property
    def _live(self):
        """This step's keys and values at full precision (`dense`). After an INT8 decode step
        they are built on the first read only: the dequantized store with the step's own entry,
        the last one, put back at full precision (what attention saw)."""
        if self._fresh is not None:
            self._live = self._dequantized_with(*self._fresh)
        return self._live_kv

    @_live.setter
    def _live(self, kv) -> None:
        self._fresh = None
        self._live_kv = kv

    def int8_step(self) -> tuple | None:
        """The operands of `sparsekv.cache.int8_attention.decode_attention` (after the mask's `valid`)
        for the INT8 decode step being attended, or None."""
        if self._new_kv is None:
            return None
        slot = torch.full((1,), self.keys.shape[-2] - 1, dtype=torch.long, device=self.device)
        return (self.keys, self.key_scale, self.values, self.value_scale, *self._new_kv, slot)

    def dequantized_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The store of the INT8 decode step being attended, dequantized, with the step's own
        entry at full precision: for an attention that cannot read int8 (eager, dropout, sinks)."""
        return self._dequantized_with(*self._new_kv)

    def _dequantized_with(self, new_k: torch.Tensor, new_v: torch.Tensor) -> tuple:
        """The dequantized store with its last entry, a decode step's own, at full precision."""
        return self._dequantized(0, new_k), self._dequantized(1, new_v)

    def _dequantized(self, which: int, own: torch.Tensor | None = None) -> torch.Tensor:
        """The INT8 store's keys (`which` 0) or values (1) dequantized (`own`: its last entry)."""
        q, scale = (self.keys, self.key_scale) if which == 0 else (self.values, self.value_scale)
        return dequantize_with(q, scale, own)

    def _dense_one(self, which: int) -> torch.Tensor:
        """`dense()[which]` (0: keys, 1: values) without building the other one."""
        if self._fresh is not None:  # an INT8 decode step's store, its own entry last
            return self._dequantized(which, self._fresh[which])
        if self._live_kv is not None:
            return self._live_kv[which]
        if self.quantized:
            return self._dequantized(which)
        return self.keys if which == 0 else self.values

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept keys and values in the model's dtype `(batch, kv_heads, stored, head_dim)`."""
        if self._live is not None:  # (an INT8 decode step's pair is built here, then kept)
            return self._live
        return self._dense_one(0), self._dense_one(1)

    def nbytes(self) -> int:
        """Bytes held by this layer's key and value storage (int8 scales included)."""
        if not self.is_initialized:
            return 0
        extra = 0 if self.key_scale is None else self.key_scale.nbytes + self.value_scale.nbytes
        return self.keys.nbytes + self.values.nbytes + extra

    def bookkeeping_nbytes(self) -> int:
        """Bytes held besides keys and values: per-entry positions, scores and observed
        attention, and what `SparseKVCache(record=...)` keeps."""
        held = [getattr(self, n) for n in ("positions", "scores", "observed")] if self.is_initialized else []
        held += list(self.recorded.values())
        return sum(t.nbytes for t in held if isinstance(t, torch.Tensor))

    def stored(self) -> int:
        """Entries stored per KV head (0 before the first step)."""
        return self.keys.shape[-2] if self.is_initialized else 0

    def get_seq_length(self) -> int:
        """Tokens seen (not stored): what positions and generation need."""
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Only used if a standard mask is ever built for this layer; sparsekv's attention
        # builds its own from `positions`.
        stored = self.keys.shape[-2] if self.is_initialized else 0
        return stored + query_length, 0

    def reset(self) -> None:
        super().reset()
        self.shared.core = None
        self.__init__(self.shared, self.layer_idx, self.budget_rank, self.fraction)

    def crop(self, tokens_to_remove: int) -> None:
        if self.evicted:
            raise RuntimeError(
                "SparseKVCache.crop() after eviction is not supported: the evicted entries are gone. "
                "Crop before the first eviction, or rebuild the cache."
            )
        n = abs(tokens_to_remove)
        if n == 0 or not self.is_initialized:
            return
        self._take(slice(None, -n))
        self.seen -= n
        if self.shared.core is not None:  # cropped positions leave the core
            self.shared.core[..., self.seen :] = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(BEAM_SEARCH)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            for name in _PER_ENTRY:
                t = getattr(self, name)
                if t is not None:
                    setattr(self, name, t.repeat_interleave(repeats, dim=0))
            if self.budget_rank == 0 and self.shared.core is not None:
                self.shared.core = self.shared.core.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            for name in _PER_ENTRY:
                t = getattr(self, name)
                if t is not None:
                    setattr(self, name, t[indices])
            if self.budget_rank == 0 and self.shared.core is not None:
                self.shared.core = self.shared.core[indices]

    # ---- masks ------------------------------------------------------------------------------
    def note_padding(self, padding: torch.Tensor | None) -> None:
        """Mark the new entries that are padding (`padding`: `(batch, seen)` bool, True = real)."""
        # Decode steps append real tokens (generate extends the mask with ones); checking them
        # would cost a host sync per layer and step, so only multi-token steps are inspected,
        # and the single-token chunks of a prompt that `prefill_chunk` splits (marked there).
        q = self.num_new
        real = self._real_new(padding, self.seen, q)
        if real is None:
            return
        new = self.positions[..., -q:]
        self.positions[..., -q:] = torch.where(real[:, None, :], new, torch.full_like(new, -1))
        self.has_padding = True

    def _real_new(self, padding: torch.Tensor | None, seen: int, q: int) -> torch.Tensor | None:
        """`attention.real_new_entries` for this layer (noting the leading pads, `first_valid`)."""
        got = attn.real_new_entries(padding, seen, q, self.shared.padding_check_until, self.device)
        if got is None:
            return None
        real, self.shared.first_valid = got
        return real

    def attention_mask(self, q: int, explicit_causal: bool) -> torch.Tensor | None:
        """Mask for the last `q` queries over the stored entries (True = attend), or None
        (`sparsekv.cache.attention.entry_mask`)."""
        return attn.entry_mask(
            self.positions if self.has_padding else None, self.seen, q, self.stored(),
            explicit_causal, self.device,
        )

    # ---- scoring and eviction ---------------------------------------------------------------
    def capacity(self) -> int:
        return layer_capacity(self.shared.config, self.fraction, self.seen)

    def scoring_keys(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The kept keys as `received_attention` reads them, with no dequantized copy of the
        layer: `(keys, None, None)` in the model's dtype, or for an INT8 store `(int8 keys,
        scales, None)`, and after an INT8 decode step `(int8 keys, scales, own key)`, its own
        entry (the last) at full precision, as attention saw it (what `dense` would build)."""
        if self._fresh is not None:
            return self.keys, self.key_scale, self._fresh[0]
        if self._live_kv is not None:
            return self._live_kv[0], None, None
        if self.quantized:
            return self.keys, self.key_scale, None
        return self.keys, None, None

    def _set_scores(self, scores: torch.Tensor) -> None:
        self.scores = checked_scores(self.shared.policy, scores, self.positions.shape)

    def observe(self, module, query, kv_mask, scaling, softcap) -> None:
        """After attention: score the new entries, then evict as the step's phase requires."""
        self._new_kv = None  # attended
        phase = "prefill" if self.num_new > 1 else "decode"
        repeat = self.shared.repeat
        if repeat is not None or (phase == "prefill" and self.shared.policy.scores_after_prefill):
            if repeat is not None:  # a repeat forward: hand its queries over; restored afterwards
                repeat.collect(self, query, scaling, softcap)
            else:  # scored (and evicted) by the repeat pass once this forward returns
                self.pending += self.num_new
            self.num_new, self.hidden, self._live = 0, None, None
            return
        if self.shared.record:
            inputs.record(self, query, kv_mask, scaling, softcap)
        att = inputs.attention_stats(self, query, kv_mask, scaling, softcap)
        self._score_and_evict(phase, query, att)

    def load_from(self, src: EvictingLayer) -> None:
        """Start from `src`'s recorded prefill: score every entry as one prefill step would
        have, then evict (what the same prefill through this layer would have kept)."""
        policy = self.shared.policy
        keys, values = src.dense()
        self.is_initialized, self.device = True, src.device
        self.seen, self.has_padding, self.positions = src.seen, src.has_padding, src.positions
        self.shared.first_valid = src.shared.first_valid
        if self.quantized:
            (self.keys, self.key_scale), (self.values, self.value_scale) = quantize(keys), quantize(values)
        else:
            self.keys, self.values = keys, values
        self._live, self.num_new = (keys, values), keys.shape[-2]
        self.hidden = src.recorded.get("hidden")
        if policy.scores_after_prefill:  # scored by the repeat pass `fork` runs next
            self.pending, self.num_new, self.hidden, self._live = self.num_new, 0, None, None
            return
        which = policy.attention_queries or ("all" if policy.tracks_observed else None)
        att = None if which is None else src.recorded[which]
        self._score_and_evict("prefill", None, att)

    def finish_repeat(self, attention: torch.Tensor) -> None:
        """Score the pending entries with the repeat pass's `attention` `(batch, kv_heads, stored)`
        (what the repeat paid to each entry; 0 for older ones), then evict as after a prefill."""
        self.num_new, self.pending = self.pending, 0
        self._score_and_evict("prefill", None, attention)

    def _score_and_evict(self, phase: str, query, att) -> None:
        policy = self.shared.policy
        if policy.tracks_observed and att is not None:
            grown = torch.zeros_like(att)
            if self.observed is not None:
                grown[..., : self.observed.shape[-1]] = self.observed
            self.observed = grown + att
        self._set_scores(policy.score(inputs.score_context(self, phase, query, att)))
        self.num_new, self.hidden, self._live = 0, None, None
        self._evict_after(phase)

    def _evict_after(self, phase: str) -> None:
        """Once a step's entries are scored: evict as its phase requires (see the module
        docstring), counting decode steps towards the next re-rank."""
        policy, cfg = self.shared.policy, self.shared.config
        if not policy.evicts:
            return
        if phase == "prefill":
            self.evict(self.capacity())
            return
        self.decode_steps += 1
        if cfg.rerank_every and self.decode_steps >= cfg.rerank_every:
            self.rerank()
        elif self.stored() > self.capacity() + cfg.evict_slack:
            self.evict(self.capacity())

    def rerank(self) -> None:
        """Global re-rank: rescore every kept entry (with the attention observed since the last
        re-rank), evict down to capacity, and start a new observation period."""
        self._set_scores(self.shared.policy.score(inputs.score_context(self, "rerank")))
        self.evict(self.capacity())
        if self.observed is not None:
            self.observed = torch.zeros_like(self.observed)
        self.decode_steps = 0

    def protected(self) -> torch.Tensor:
        """`(batch, kv_heads, stored)` bool: sinks and the recent window, and in the budgeted
        layers after the first the shared core (`EvictionConfig.shared_core`)."""
        cfg = self.shared.config
        core = None if self.budget_rank == 0 else self.shared.core
        return selection.protected(
            self.positions, self.seen, cfg.sink_tokens, cfg.recent_window,
            self.shared.first_valid, core,
        )

    def _update_core(self, prot: torch.Tensor) -> None:
        """The first budgeted layer marks the core every later layer keeps: its best-scored
        entries besides the protected ones, ceil(shared_core x tokens seen) of them, at most
        what the smallest layer has room for beside its sinks and recent window."""
        cfg, shared = self.shared.config, self.shared
        room = layer_capacity(cfg, shared.min_fraction, self.seen) - cfg.sink_tokens - cfg.recent_window
        k = min(math.ceil(cfg.shared_core * self.seen), room, self.stored())
        shared.core = selection.core_marks(self.scores, self.positions, prot, self.seen, k)

    def evict(self, capacity: int) -> None:
        """Keep the `capacity` best entries per head (at least the protected ones)."""
        stored = self.stored()
        prot = self.protected() if stored > capacity or self.shared.config.shared_core else None
        if self.budget_rank == 0 and self.shared.config.shared_core and self.scores is not None:
            self._update_core(prot)
        if stored <= capacity:
            return
        # Enough room for every protected entry, computed on the host side (no device sync).
        cfg = self.shared.config
        k = min(stored, max(capacity, cfg.sink_tokens + cfg.recent_window))
        if k == stored:
            return
        self._take(selection.keep_indices(self.scores, self.positions, prot, k))
        self.evicted = True

    def _take(self, index) -> None:
        """Keep entries `index` (a slice, or `(batch, heads, k)` indices) of every per-entry tensor."""
        for name in _PER_ENTRY:
            if getattr(self, name) is not None:
                setattr(self, name, selection.gather_entries(getattr(self, name), index))
