"""Fixed slot buffers for the static layout: how many slots a budgeted layer gets, and the
buffers whose prefixes stand in for a layer's per-entry tensors.

`SlotBuffers` holds one buffer per per-entry tensor (`ENTRY_NAMES`); `Entry` is the descriptor
that makes `layer.keys` (etc.) a view of a buffer's prefix and an assignment a copy into it.
Capacity (`slot_count`): the largest number of entries a layer may keep, max(budget at
`max_length` tokens, sink_tokens + recent_window), plus room for one step's entries before they
are evicted: `static_slack`, default max(prefill_chunk or 0, evict_slack + 1). A prefill chunk
(or an unchunked prompt) that needs more free slots than that, or a sequence longer than
`max_length`, raises a ValueError naming the setting to change. The "full" policy keeps every
token, so it needs `max_length` slots."""

from __future__ import annotations

import torch

from sparsekv.cache.schedules import layer_capacity
from sparsekv.config import EvictionConfig

ENTRY_NAMES = ("keys", "values", "key_scale", "value_scale", "positions", "scores", "observed")
"""The per-entry tensors of a budgeted layer (the cache's `_PER_ENTRY`), each held in a buffer."""
KV_NAMES = ("keys", "values", "key_scale", "value_scale")


def step_room(config: EvictionConfig) -> int:
    """Free slots one step may need before eviction: `static_slack`, else
    max(prefill_chunk or 0, evict_slack + 1)."""
    if config.static_slack is not None:
        return config.static_slack
    return max(config.prefill_chunk or 0, config.evict_slack + 1)


def overflow_message(
    config: EvictionConfig, layer_idx: int, slots: int, seen: int, need: int, q: int = 1
) -> str:
    """The error of a step that needs `need` slots (`q` of them new) where a layer has `slots`."""
    return (
        f"layout='static': layer {layer_idx} has {slots} slots per KV head "
        f"but this step needs {need} ({need - q} kept + {q} new, after {seen} tokens). "
        f"A prefill chunk must fit in the free room: set prefill_chunk <= {step_room(config)} "
        f"(static_slack={config.static_slack}, "
        f"evict_slack={config.evict_slack}), or raise static_slack; a sequence must not outgrow "
        f"max_length={config.max_length}"
    )


def slot_count(config: EvictionConfig, fraction: float, evicts: bool = True) -> int:
    """Slots per KV head of a budgeted layer with schedule weight `fraction`."""
    if not evicts:
        if config.max_length is None:
            raise ValueError(
                "layout='static' with a policy that keeps every token (full) needs max_length"
            )
        return config.max_length
    if isinstance(config.budget, float):
        cap = layer_capacity(config, fraction, config.max_length)
    else:
        cap = layer_capacity(config, fraction, 0)  # a token count does not depend on the length
    slots = max(cap, config.sink_tokens + config.recent_window) + step_room(config)
    return slots if config.max_length is None else min(slots, max(config.max_length, 1))


def flat_rows(t: torch.Tensor) -> torch.Tensor:
    """A contiguous `(batch, heads, slots, ...)` buffer seen as `(batch * heads * slots, rest)`."""
    return t.view(-1, t.shape[-1])


def identity_slots(like: torch.Tensor) -> torch.Tensor:
    """Slot i for entry i: int32 `arange(slots)` broadcast to `like`'s `(batch, heads, slots)`."""
    return torch.arange(like.shape[-1], dtype=torch.int32, device=like.device).expand(like.shape)


def static_address(t: torch.Tensor) -> torch.Tensor:
    """Tell torch.compile that `t` keeps its address (written in place between steps), so CUDA
    graphs can capture steps that mutate it (transformers' StaticLayer does the same)."""
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(t)
    return t


class SlotBuffers:
    """Growable per-entry tensors in fixed buffers: `view(name)` is the first `length(name)`
    entries (axis 2) of buffer `name`; `assign(name, t)` copies `t` into that prefix."""

    def __init__(self, slots: int):
        self.slots = slots
        self.buf: dict[str, torch.Tensor] = {}
        self.len: dict[str, int] = {}
        self.changed = True  # the keys' length changed on the host since the last `refresh`

    def length(self, name: str = "keys") -> int:
        return self.len.get(name, 0)

    def view(self, name: str) -> torch.Tensor | None:
        b = self.buf.get(name)
        return None if b is None else b[:, :, : self.len[name]]

    def _buffer_for(self, name: str, value: torch.Tensor) -> torch.Tensor:
        b = self.buf.get(name)
        same = (
            b is not None
            and b.shape[:2] == value.shape[:2]
            and b.shape[3:] == value.shape[3:]
            and b.dtype == value.dtype
            and b.device == value.device
        )
        if not same:  # first use, or a new batch size (batch_repeat_interleave): allocate once
            b = value.new_full(
                (*value.shape[:2], self.slots, *value.shape[3:]), -1 if name == "positions" else 0
            )
            static_address(b)
            self.buf[name], self.len[name] = b, 0
        return b

    def assign(self, name: str, value: torch.Tensor | None) -> None:
        # unset (transformers' placeholder is a 1-D empty tensor)
        if value is None or value.ndim < 3:
            self.buf.pop(name, None)
            self.len.pop(name, None)
            self.changed |= name == "keys"
            return
        n = value.shape[2]
        if n > self.slots:
            raise ValueError(f"{name}: {n} entries do not fit in {self.slots} static slots")
        b = self._buffer_for(name, value)
        old = self.len[name]
        prefix = value.data_ptr() == b.data_ptr() and value.stride() == b.stride()
        if not prefix:  # (the prefix itself needs no copy)
            if value.untyped_storage().data_ptr() == b.untyped_storage().data_ptr():
                value = value.clone()  # another part of the same buffer
            b[:, :, :n].copy_(value)
        if name == "positions" and old > n:
            b[:, :, n:old].fill_(-1)  # freed slots: masked from now on
        self.len[name] = n
        self.changed |= name == "keys" and n != old

    def write(self, name: str, start: int, value: torch.Tensor) -> None:
        """Copy `value` `(batch, heads, q, ...)` into entries [start, start + q), extending it."""
        b = self.buf[name]
        b[:, :, start : start + value.shape[2]].copy_(value)
        self.len[name] = start + value.shape[2]
        self.changed |= name == "keys"


class Entry:
    """A per-entry attribute of a static layer: reads the buffer's prefix; assigning copies
    into it."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        if self.name in KV_NAMES and getattr(obj, "_mapped", False):
            obj._normalize()  # a read of the kept keys/values in their order (rare: see `_take`)
        return obj._slots.view(self.name)

    def __set__(self, obj, value) -> None:
        if self.name in KV_NAMES and getattr(obj, "_mapped", False):
            obj._normalize()
        obj._slots.assign(self.name, value)
