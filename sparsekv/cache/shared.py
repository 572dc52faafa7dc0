"""`SharedState`: what every budgeted layer of one `SparseKVCache` shares (its eviction config and
policy, the first real token of each sequence, the peak-bytes probe, recording settings, the
attention inputs and token ids of the current step). It holds no tensors of the model."""

from __future__ import annotations

from typing import Any

import torch

from sparsekv.config import EvictionConfig
from sparsekv.policies import Policy


class SharedState:
    """State common to all layers of one cache (no tensors of the model)."""

    def __init__(self, config: EvictionConfig, policy: Policy, num_budgeted: int):
        self.config = config
        self.policy = policy
        self.num_budgeted = num_budgeted
        self.first_valid: torch.Tensor | None = None  # (batch,) index of the first real token
        self.measure: Any = None  # callable returning the cache's current KV bytes
        self.peak_bytes = 0
        self.record: tuple[str, ...] = ()
        self.record_window = 0
        # attention inputs of the first budgeted layer for the tokens of the current step, for
        # policies that score every budgeted layer from them (`Policy.hidden_from_first`)
        self.first_hidden: torch.Tensor | None = None
        # single-token steps are checked for padding while tokens_seen <= this (a prompt chunked
        # one token at a time, where the mask is known); decode steps never are (no host sync)
        self.padding_check_until = 0
        self.model: Any = None  # weak reference to the model, handed to policies in ScoreContext
        self.repeat: Any = None  # the active `repeat_pass` collector while a repeat forward runs
        # token ids `(batch, new)` of the current forward, for policies that read them
        # (`Policy.needs_input_ids`); None when the forward had none
        self.input_ids: torch.Tensor | None = None
        # `EvictionConfig.shared_core`: the smallest schedule weight of any budgeted layer (what
        # bounds the core), and the core itself, `(batch, kv_heads, positions)` bool over
        # absolute positions, set by the first budgeted layer whenever it evicts
        self.min_fraction = 1.0
        self.core: torch.Tensor | None = None
