"""The static-capacity layout (`EvictionConfig(layout="static")`): a budgeted layer whose entries
live in buffers allocated once, written in place, so tensor shapes never change while decoding.

This module owns the layer class of that layout, `StaticEvictingLayer`, a subclass of
`EvictingLayer` (`sparsekv.cache.layer`) whose scoring and eviction logic runs unchanged; the
buffers and the capacity rule live in `sparsekv.cache.slots`. Per budgeted layer every per-entry tensor is a buffer of `slots` entries:

    keys, values  (batch, kv_heads, slots, head_dim)   int8 when quantized
    key_scale, value_scale  (batch, kv_heads, slots, 1) when quantized
    positions     (batch, kv_heads, slots)             absolute position; -1 = padding or empty
    scores, observed  (batch, kv_heads, slots)          float32

How it stays exact and static at once:
- The first `n` slots hold exactly the entries the default ("dynamic") layout holds, in the same
  order; `layer.keys` etc. are views of those prefixes (`SlotBuffers`), so the policies and the
  cache's selection read the same tensors as with the default layout and keep the same set
  (keys and values: once in that order again, see the last point).
  Assigning `layer.keys = t` copies `t` into the buffer's prefix: an eviction's gather writes the
  kept entries back to the front in place (the freed slots are marked -1), nothing is allocated.
- A decode step inside the model's forward touches only fixed shapes: the new key/value goes
  into the next free slot (`index_copy_` at a slot index held on the device), and attention runs
  over all `slots` with a mask of the occupied, non-padding slots: softmax over slots in any
  order with the empty ones masked equals attention over the kept entries. The new query is
  kept, and the step's scoring and eviction run after the forward returns (`finish_step`, from a
  forward hook the cache installs): per layer that is the same computation the default layout
  does inside attention, since nothing in the rest of the forward reads this layer's entries.
  So `model.forward` can be compiled (`torch.compile`, or CUDA graphs) for decode steps that
  pass `position_ids` (else transformers reads `get_seq_length()`, a host int); eviction stays
  eager Python outside the captured region.
- A policy that scores a decode step's entry from that entry's own inputs
  (`Policy.score_arrival`: the learned policy at blend 0, StreamingLLM) is scored inside the
  forward instead (the score goes into the entry's slot), and its evictions move no key or
  value: the kept keys and values stay in their slots, `slot_of` maps each kept entry (in the
  default layout's order) to its slot, freed slots go to a free list the next decode tokens
  are written to, and a read of `keys`/`values` in the kept order (a prefill chunk, a batch
  operation, a policy that reads keys) first gathers them back into that order (`_normalize`).
  Between two decode steps that evict nothing the cache then runs no tensor op.
- Multi-token steps (prefill chunks) are not captured: they append after the prefix and attend
  over the prefix, exactly as the default layout does.

Capacity: `sparsekv.cache.slots` (a step that needs more free slots than a layer has, or a
sequence longer than `max_length`, raises a ValueError naming the setting to change).
"""

from __future__ import annotations

from typing import Any

import torch

import sparsekv.cache.attention as attn
import sparsekv.cache.policy_inputs as inputs
from sparsekv.cache.int8 import dequantize, dequantize_with, quantize
from sparsekv.cache.layer import EvictingLayer
from sparsekv.cache.slots import (
    KV_NAMES,
    Entry,
    SlotBuffers,
    flat_rows,
    identity_slots,
    overflow_message,
    slot_count,
    static_address,
)
from sparsekv.policies.base import Policy, checked_scores


class StaticEvictingLayer(EvictingLayer):
    """`EvictingLayer` over preallocated slots written in place (`layout="static"`): its
    per-entry tensors are views of fixed buffers and decode steps write in place (see the
    module docstring)."""

    codec = (quantize, dequantize)
    keys = Entry()
    values = Entry()
    key_scale = Entry()
    value_scale = Entry()
    positions = Entry()
    scores = Entry()
    observed = Entry()

    def __init__(self, shared, layer_idx: int, budget_rank: int, fraction: float):
        if getattr(shared.policy, "scores_after_prefill", False):
            raise ValueError(
                f"layout='static' does not support policy {shared.policy.name!r}: its repeat "
                "pass appends a repeat prompt to every layer and restores the layers from a "
                "shallow snapshot, which in-place buffers do not allow; use layout='dynamic'"
            )
        self._slots = SlotBuffers(slot_count(shared.config, fraction, shared.policy.evicts))
        self._step: tuple | None = None  # what a decode step left for `finish_step`
        self._slot: torch.Tensor | None = None  # (1,) long on the device: the next free slot
        self._pos: torch.Tensor | None = None  # (1, 1, 1) long on the device: its absolute position
        self._full = False  # no free slot is left for another decode token
        self._ready = False  # a first step was stored: decode steps may take the in-place path
        # Where the entries physically are (see `_take`): while `_mapped`, the key/value slots
        # are not in the kept order; `slot_of` (a SlotBuffers entry) maps each kept entry to its
        # slot, `_free` lists the free slots first, `_valid` marks the slots to attend.
        self._mapped = False
        self._free: torch.Tensor | None = None  # (batch, kv_heads, slots) int32
        self._valid: torch.Tensor | None = None  # (batch, kv_heads, slots) bool
        self._take_at: torch.Tensor | None = None  # (1,) long: the next decode token's index in _free
        self._phys: torch.Tensor | None = None  # (batch, kv_heads, 1) long: its slot, this step
        self._row_start: torch.Tensor | None = None  # (batch, kv_heads, 1) long: see `_flat`
        super().__init__(shared, layer_idx, budget_rank, fraction)

    @property
    def slots(self) -> int:
        return self._slots.slots

    def stored(self) -> int:
        return self._slots.length()

    def _scores_arrivals(self) -> bool:
        """The policy scores a decode step's entry from its own inputs (`Policy.score_arrival`)
        and the cache computes no attention statistics: decode steps are scored in the forward
        and evictions move no key or value (`_take`)."""
        shared, policy = self.shared, self.shared.policy
        return (
            policy.evicts
            and type(policy).score_arrival is not Policy.score_arrival
            and not policy.tracks_observed
            and policy.attention_queries is None
            and not shared.record
            and shared.repeat is None
        )

    # ---- writing ----------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append this step's keys/values `(batch, kv_heads, q, head_dim)`; returns what the
        step attends over: the kept prefix plus the new entries for a multi-token step, all
        `slots` (masked by position) for a decode step."""
        if self._step is not None:  # the forward hook did not run (e.g. the base model was called)
            self.finish_step()
        # (only flags are read on the decode path: a compiled forward must not specialize on counts)
        if key_states.shape[-2] > 1 or not self._ready:
            return self._append(key_states, value_states)
        if self._slots.changed:
            self._refresh()
        if self._full:
            cfg, need = self.shared.config, self._slots.length() + 1
            raise ValueError(overflow_message(cfg, self.layer_idx, self.slots, self.seen, need))
        return self._decode(key_states, value_states)

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._normalize()  # a multi-token step appends after the kept entries, in their order
        if self._slot is None:  # first step (or the first after `load_from`)
            self._slot = static_address(torch.zeros(1, dtype=torch.long, device=self.device))
            self._pos = static_address(torch.zeros(1, 1, 1, dtype=torch.long, device=self.device))
            self._take_at = static_address(torch.zeros(1, dtype=torch.long, device=self.device))
        b, h, q, _ = key_states.shape
        s, n = self._slots, self._slots.length()
        if n + q > s.slots:
            cfg = self.shared.config
            raise ValueError(overflow_message(cfg, self.layer_idx, s.slots, self.seen, n + q, q))
        if self.quantized:
            quantize, dequantize = self.codec
            keys = torch.cat([dequantize(self.keys, self.key_scale), key_states], dim=-2)
            values = torch.cat([dequantize(self.values, self.value_scale), value_states], dim=-2)
            (kq, ks), (vq, vs) = quantize(key_states), quantize(value_states)
            for name, t in (("keys", kq), ("key_scale", ks), ("values", vq), ("value_scale", vs)):
                s.write(name, n, t)
        else:
            s.write("keys", n, key_states)
            s.write("values", n, value_states)
            keys, values = self.keys, self.values
        s.write(
            "positions",
            n,
            torch.arange(self.seen, self.seen + q, device=self.device).expand(b, h, q),
        )
        self._live = (keys, values)
        if self._map_fits():  # the slots are in the kept order: entry i is in slot i
            s.len["slot_of"] = s.length()
        self.seen += q
        self._pos.fill_(self.seen)  # exact outside a decode step in flight (`query_offset`)
        self.num_new = q
        self._ready = True
        attn.announce_layer(self.layer_idx, self)
        measure = self.shared.measure() if self.shared.measure is not None else None
        if measure is not None:
            self.shared.peak_bytes = max(self.shared.peak_bytes, measure())
        return keys, values

    def _decode(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """One token into the next free slot; fixed shapes, no host reads of changing values.
        `slot` is its index among the kept entries (positions, scores, `slot_of`), `phys` the
        slot its key and value go to (the same while the slots are in the kept order)."""
        buf, slot = self._slots.buf, self._slot
        b, h = key_states.shape[:2]
        phys = self._phys = self._free.index_select(2, self._take_at).long()  # (b, h, 1)
        if self.quantized:
            quantize = self.codec[0]
            (kq, ks), (vq, vs) = quantize(key_states), quantize(value_states)
            pairs = (("keys", kq), ("key_scale", ks), ("values", vq), ("value_scale", vs))
            # sparsekv's attention reads the int8 slots themselves (`int8_step`); this step
            # attends to its own entry at full precision, as the dynamic layout does
            self._new_kv = (key_states, value_states)
        else:
            pairs = (("keys", key_states), ("values", value_states))
        # one row per (sequence, KV head) of each buffer seen flat: `index_copy_` writes in place
        # when compiled (a `scatter_` into a graph input copies the whole buffer every step)
        flat = self._flat(phys)
        for name, t in pairs:
            flat_rows(buf[name]).index_copy_(0, flat, t.reshape(b * h, -1))
        keys, values = buf["keys"], buf["values"]
        buf["positions"].index_copy_(2, slot, self._pos.expand(b, h, 1))
        buf["slot_of"].index_copy_(2, slot, phys.to(torch.int32))
        self._valid.view(-1).index_fill_(0, flat, True)
        self._step = (keys, values)
        self.num_new = 1
        attn.announce_layer(self.layer_idx, self)
        return keys, values

    def int8_step(self) -> tuple | None:
        """The operands of `sparsekv.cache.int8_attention.decode_attention` for the INT8 decode step in
        flight (after the mask's `valid`), or None when there is none."""
        if self._new_kv is None:  # set by an INT8 decode step, cleared by its `finish_step`
            return None
        buf = self._slots.buf
        return (buf["keys"], buf["key_scale"], buf["values"], buf["value_scale"], *self._new_kv, self._phys)

    def dequantized_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All slots of the INT8 decode step in flight, dequantized, with the step's own entry at
        full precision: for an attention that cannot read int8 (eager, dropout, sinks)."""
        buf, (new_k, new_v) = self._slots.buf, self._new_kv
        return (
            dequantize_with(buf["keys"], buf["key_scale"], new_k, self._phys),
            dequantize_with(buf["values"], buf["value_scale"], new_v, self._phys),
        )

    def query_offset(self) -> torch.Tensor | None:
        """Tokens seen, as a 0-d device tensor (what transformers' mask preparation reads; a
        host int there would make a compiled forward recompile at every step); None before the
        first step."""
        return self._pos.view(()) if self._ready else None

    def _refresh(self) -> None:
        """Point the device-side indices at the next entry and its slot (no host sync)."""
        n = self._slots.length()
        self._full = n >= self._slots.slots
        if not self._full:
            self._slot.fill_(n)
        self._pos.fill_(self.seen)
        if not self._mapped:
            self._reset_map()
        self._slots.changed = False

    def _reset_map(self) -> None:
        """The slots are in the kept order: entry i in slot i, the free slots after the last,
        the slots to attend those whose position is >= 0 (allocated on first use and when the
        batch changes)."""
        s = self._slots
        pos = s.buf.get("positions")
        if pos is None:
            return
        if self._free is None or self._free.shape != pos.shape or self._free.device != pos.device:
            self._free = static_address(identity_slots(pos).contiguous())
            s.buf["slot_of"] = static_address(identity_slots(pos).contiguous())
            self._valid = static_address(torch.zeros(pos.shape, dtype=torch.bool, device=pos.device))
            b, h, n = pos.shape
            start = torch.arange(b * h, device=pos.device).view(b, h, 1) * n
            self._row_start = static_address(start)  # where each (sequence, head) row begins
        s.len["slot_of"] = s.length()
        torch.ge(pos, 0, out=self._valid)
        self._take_at.fill_(s.length())

    def _flat(self, phys: torch.Tensor) -> torch.Tensor:
        """`(batch, kv_heads, 1)` slots -> their indices in the buffers' rows seen flat
        (`(batch * kv_heads * slots, ...)`)."""
        return (self._row_start + phys).view(-1)

    def _map_fits(self) -> bool:
        """The slot map exists for the buffers' batch (`_reset_map` makes it at a refresh)."""
        pos = self._slots.buf.get("positions")
        return self._free is not None and pos is not None and self._free.shape == pos.shape

    def _normalize(self) -> None:
        """Put the kept keys and values back in the kept order (slot i holds entry i): one
        gather of the layer, for a step that reads them in that order (a multi-token step, a
        policy or a batch operation that reads `keys`)."""
        if not self._mapped:
            return
        self._mapped = False
        s = self._slots
        n = s.length("slot_of")
        where = s.buf["slot_of"][:, :, :n].long()
        for name in KV_NAMES:
            b = s.buf.get(name)
            if b is not None:
                b[:, :, :n] = b.gather(2, where[..., None].expand(-1, -1, -1, b.shape[-1]))
        self._free.copy_(identity_slots(self._free))
        s.buf["slot_of"].copy_(identity_slots(self._free))
        self._reset_map()

    def _take(self, index) -> None:
        """Keep entries `index` (`(batch, heads, k)` sorted indices, or a slice). When decode steps
        are scored in the forward (`_scores_arrivals`), the kept keys and values stay in their
        slots: only the per-entry scalars (positions, scores, `slot_of`) are gathered into the
        kept order, the freed slots join the free list and are masked, and the next decode tokens
        go there (`_decode`). Other policies read the keys in the kept order, so their evictions
        gather every per-entry tensor (`EvictingLayer._take`)."""
        if isinstance(index, slice) or not self._scores_arrivals() or not self._map_fits():
            super()._take(index)
            return
        s = self._slots
        for name in ("positions", "scores", "observed", "slot_of"):
            t = s.view(name)
            if t is not None:
                s.assign(name, t.gather(2, index))
        for name in KV_NAMES:
            if name in s.buf:
                s.len[name] = index.shape[-1]
        s.changed = True
        where = s.view("slot_of").long()
        occupied = torch.zeros_like(self._valid).scatter_(2, where, True)
        self._valid.zero_().scatter_(2, where, s.view("positions") >= 0)  # padding stays masked
        self._free.copy_(torch.sort(occupied.to(torch.uint8), dim=-1, stable=True).indices)
        self._take_at.zero_()
        self._mapped = True

    # ---- attention and scoring --------------------------------------------------------------
    def note_padding(self, padding: torch.Tensor | None) -> None:
        """As `EvictingLayer.note_padding`; a single-token step that takes the decode path (a
        prompt chunked one token at a time, whose mask is checked) marks its own entry, which
        sits in the next slot (this layer counts it in `seen` only after the forward)."""
        if self._step is None:
            super().note_padding(padding)
            return
        real = self._real_new(padding, self.seen + 1, 1)  # None for a decode step: unchecked
        if real is None:
            return
        buf = self._slots.buf
        b, h = buf["positions"].shape[:2]
        real = real[:, None, :].expand(b, h, 1)
        pos = buf["positions"].index_select(2, self._slot)
        buf["positions"].index_copy_(2, self._slot, torch.where(real, pos, torch.full_like(pos, -1)))
        self._valid.view(-1).index_copy_(0, self._flat(self._phys), real.reshape(-1))
        self.has_padding = True

    def attention_mask(self, q: int, explicit_causal: bool) -> torch.Tensor | None:
        if self._step is not None:  # a decode step over all slots: empty and padding ones masked
            return self._valid[:, :, None, :]
        return super().attention_mask(q, explicit_causal)

    def observe(self, module, query, kv_mask, scaling, softcap) -> None:
        if self._step is not None:  # decode: keep the query; scored here or after the forward
            scored = self._score_arrival()
            self._step = (*self._step[:2], query, scaling, softcap, scored)
            # the next entry, slot and position, on the device (`finish_step` counts on the host)
            self._slot.add_(1)
            self._take_at.add_(1)
            self._pos.add_(1)
            return
        super().observe(module, query, kv_mask, scaling, softcap)

    def _score_arrival(self) -> bool:
        """Inside a decode step's forward: write the policy's score of the new entry into its
        slot when the policy scores an arrival from its own inputs (`Policy.score_arrival`) and
        the step needs no attention statistics; True if written (then nothing is scored after
        the forward)."""
        policy = self.shared.policy
        if not self._scores_arrivals() or "scores" not in self._slots.buf:
            return False
        hidden = inputs.hidden_states(self) if policy.needs_hidden_states else None
        if policy.needs_hidden_states and hidden is None:
            return False
        buf = self._slots.buf
        new = policy.score_arrival(self.layer_idx, hidden, buf["positions"].index_select(2, self._slot))
        if new is None:
            return False
        expected = (*buf["scores"].shape[:2], 1)
        new = checked_scores(policy, new, expected, "an arrival score", "(batch, kv_heads, 1)")
        buf["scores"].index_copy_(2, self._slot, new)
        return True

    def finish_step(self) -> None:
        """Score and evict the decode step the forward left: the default layout's computation,
        on the kept prefix (host bookkeeping first: the new entry is the prefix's last)."""
        step, self._step = self._step, None
        if step is None:  # a multi-token step (scored in the forward), or no step at all
            if self._ready and self._slots.changed:
                self._refresh()  # here, eagerly, not inside the next (compiled) decode step
            return
        if len(step) != 6:
            raise RuntimeError(
                f"layer {self.layer_idx}: a decode step was written but never attended over"
            )
        keys, values, query, scaling, softcap, scored = step
        s = self._slots
        n = s.length() + 1
        for name in ("keys", "values", "positions", "slot_of") + (
            ("key_scale", "value_scale") if self.quantized else ()
        ) + (("scores",) if scored else ()):
            s.len[name] = n
        self.seen += 1
        if scored:  # scored inside the forward: only the eviction decision is left
            self.arrivals_in_forward += 1
            self._new_kv, self._live = None, None
            self.num_new, self.hidden = 0, None
            self._evict_after("decode")
        else:
            if self.quantized:  # `keys` are the int8 slots (or their dequantized copy)
                self._live, self._fresh, self._new_kv = None, self._new_kv, None
            elif self._mapped:  # read through `keys` (in the kept order) if the policy reads
                self._live = None
            else:
                self._live = (keys[:, :, :n], values[:, :, :n])
            kv_mask = super().attention_mask(1, explicit_causal=False)
            super().observe(None, query, kv_mask, scaling, softcap)
        if s.changed:  # an eviction moved the entries: point the slot index at the new end
            self._refresh()
        else:  # the forward advanced the slot index and position on the device
            self._full = s.length() >= s.slots

    # ---- measurements and transformers' protocol --------------------------------------------
    def nbytes(self) -> int:
        """Bytes of the key/value buffers held (all slots, int8 scales included)."""
        return sum(self._slots.buf[n].nbytes for n in KV_NAMES if n in self._slots.buf)

    def bookkeeping_nbytes(self) -> int:
        """Bytes of the per-entry buffers besides keys and values (positions, scores, observed,
        the slot map `slot_of`; all slots), of the free list and the mask of slots to attend."""
        held = [t for n, t in self._slots.buf.items() if n not in KV_NAMES]
        held += [self._free, self._valid, self._row_start, *self.recorded.values()]
        return sum(t.nbytes for t in held if isinstance(t, torch.Tensor))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Constant, so that a compiled forward does not specialize on the kept length; sparsekv's
        # attention builds its own masks from the positions.
        return self._slots.slots + query_length, 0


def finish_steps(cache: Any) -> None:
    """Score and evict the decode step every static layer of `cache` has pending."""
    for layer in cache.layers:
        if isinstance(layer, StaticEvictingLayer):
            layer.finish_step()


def slots_per_layer(cache: Any) -> dict[int, int]:
    """Slots per KV head of each static layer of `cache`, by layer index."""
    return {
        i: cache.layers[i].slots
        for i in cache.budgeted_layers
        if isinstance(cache.layers[i], StaticEvictingLayer)
    }

