"""`SparseKVCache`: a transformers cache whose budgeted layers keep only the entries a policy
scores highest, and free the rest.

The cache only selects, gathers and keeps positions right; scores come from a `Policy`
(`sparsekv.policies`). Per budgeted layer an `EvictingLayer` stores

    keys, values  (batch, kv_heads, stored, head_dim)   dense, after RoPE
    positions     (batch, kv_heads, stored)             absolute slot index, -1 = padding
    scores        (batch, kv_heads, stored)             the policy's latest scores
    observed      (batch, kv_heads, stored)             attention received since the last re-rank

and keeps `seen` (tokens processed) apart from `stored`, so positions and masks stay right after
eviction: `get_seq_length()` reports tokens seen (what generation and RoPE need), while the
attention mask of each layer is rebuilt from its own positions (`sparsekv.cache.attention`).

Life of a step: `update` appends the new keys/values; attention runs over them with a per-layer,
per-head mask; then `observe` asks the policy for scores and evicts:
- after a multi-token (prefill) step: down to the layer's capacity;
- after a decode step: only once the layer exceeds capacity by `evict_slack` (incremental);
- every `rerank_every` decode steps: a global re-rank (the policy rescored with the attention
  the kept entries received since the last re-rank), then down to capacity.
Sinks (first real tokens) and the recent window are always kept; padding never displaces a
real token. Eviction gathers the kept rows into new tensors: memory is freed, not masked.

A policy with `scores_after_prefill` (KVzip) is not scored during a multi-token forward: its new
entries wait (`pending`) until the forward returns, when a forward hook runs
`sparsekv.policies.repeat_pass` over the forward's input ids, then scores and evicts them.

With `prefill_chunk=N` a forward pre-hook on the model splits long prompts into N-token
forwards, evicting after each, so peak KV memory is bounded by budget + chunk. The returned
logits then cover the last chunk only.

Files: `container` (`SparseKVCache`), `shared` (what its layers share), `layer` (`EvictingLayer`, the dynamic layout), `static`
and `slots` (the static layout), `int8` and `int8_attention` (INT8 storage and decode
attention over it), `attention` (per-layer attention and masks), `hooks` (forward hooks),
`schedules` (per-layer budgets), `state` (snapshot and restore of a cache's state).
"""

from sparsekv.cache.container import SparseKVCache
from sparsekv.cache.int8 import dequantize, quantize
from sparsekv.cache.layer import EvictingLayer
from sparsekv.cache.static import StaticEvictingLayer

__all__ = ["EvictingLayer", "SparseKVCache", "StaticEvictingLayer", "dequantize", "quantize"]
