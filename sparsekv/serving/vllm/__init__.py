"""Serving a sparsekv `CompressedContext` inside vLLM 0.32.0 (extra `[vllm]`, in its own environment):
compress once with sparsekv, answer many questions in vLLM.

- `context`: a self-contained reader of a saved context (torch + safetensors + json, no vLLM and no
  transformers): its placeholder prompt and its KV per layer in vLLM's slots.
- `connector`: `SparseKVConnector`, the vLLM KV connector that serves it as the first K tokens of a
  request; `kv_transfer_config()`.
- `_patch_vllm_0_32`: the only patch of vLLM's private code (true RoPE positions N + i for the new
  tokens), for vLLM 0.32.0 only.
- `api`: `engine_kwargs()`, `ask_many(llm, ctx_path, questions, sampling_params)`,
  `prompts_for(ctx_path, question_ids)`.
- `compress`: the compress side (sparsekv's environment): `compress_for_vllm(model, ids, config,
  policy)`, one K for every budgeted layer (a per-layer schedule's largest budget, rounded up to a
  block); `prepare`: the test and benchmark contexts.

Importing this package imports neither vLLM nor transformers; the names below load on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {
    "compress_for_vllm": "sparsekv.serving.vllm.compress",
    "slots_for_vllm": "sparsekv.serving.vllm.compress",
    "ask_many": "sparsekv.serving.vllm.api",
    "engine_kwargs": "sparsekv.serving.vllm.api",
    "prompts_for": "sparsekv.serving.vllm.api",
    "kv_transfer_config": "sparsekv.serving.vllm.connector",
    "SparseKVConnector": "sparsekv.serving.vllm.connector",
    "SavedContext": "sparsekv.serving.vllm.context",
    "load_context": "sparsekv.serving.vllm.context",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sparsekv.serving.vllm' has no attribute {name!r}")
