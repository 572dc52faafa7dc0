"""The calls a vLLM user makes: an engine that serves compressed contexts, and questions asked
against one.

    from vllm import LLM, SamplingParams
    from sparsekv.serving.vllm import ask_many, engine_kwargs

    llm = LLM(model=MODEL_DIR, dtype="float32", **engine_kwargs())
    outs = ask_many(llm, "doc.ctx", ["\\nQuestion: Who?\\nAnswer:", ...],
                    SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)

The context folder is written by `CompressedContext.save` in sparsekv's own environment; this
module needs vLLM (and torch, safetensors), not sparsekv's transformers-dependent modules.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from sparsekv.serving.vllm.context import load_context

__all__ = ["ask_many", "engine_kwargs", "prompts_for"]


def engine_kwargs(
    stats_path: str | os.PathLike | None = None, hybrid: bool = True, **overrides: Any
) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM(...)` (or `AsyncEngineArgs`) that serve compressed
    contexts: the `SparseKVConnector` as KV transfer config, prefix caching on (the context's
    blocks are shared by every question about it). `hybrid=False` turns vLLM's hybrid KV-cache
    manager off (`SparseKVConnectorOneGroup`). `overrides` win."""
    from sparsekv.serving.vllm.connector import kv_transfer_config

    kwargs: dict[str, Any] = {
        "kv_transfer_config": kv_transfer_config(stats_path, hybrid),
        "enable_prefix_caching": True,
    }
    kwargs.update(overrides)
    return kwargs


def _question_ids(tokenizer, question: Any) -> list[int]:
    if isinstance(question, str):
        if not question:
            raise ValueError("a question is an empty string")
        return list(tokenizer(question, add_special_tokens=False)["input_ids"])
    ids = [int(t) for t in question]
    if not ids:
        raise ValueError("a question is an empty list of token ids")
    return ids


def prompts_for(ctx_path: str | os.PathLike, question_ids: Sequence[Sequence[int]]):
    """vLLM token prompts (`{"prompt_token_ids": [...], "cache_salt": ...}`) for questions (token
    ids) about the context saved in `ctx_path`: its placeholders, then each question, under the
    context's `cache_salt` (the request must also name the context in its `kv_transfer_params`,
    as `ask_many` does)."""
    ctx = load_context(ctx_path)
    return [ctx.prompt(q) for q in question_ids]


def ask_many(
    llm,
    ctx_path: str | os.PathLike,
    questions: Sequence[str | Sequence[int]],
    sampling_params=None,
    **generate_kwargs: Any,
):
    """Ask every question (text, tokenized without special tokens and appended to the context as
    is, as `TextContext.ask` does, or token ids) about the compressed context saved in `ctx_path`,
    in one `llm.generate` batch: returns its `RequestOutput`s, in order.

    `llm` must run with `engine_kwargs()` (the connector). `sampling_params`: one
    `SamplingParams` for all, a list of one per question, or None (vLLM's defaults); they are
    copied with the context named in their `extra_args["kv_transfer_params"]`. Every prompt
    carries the context's `cache_salt` (`SavedContext.prompt`), so vLLM's prefix cache never
    gives these requests blocks that a request without the context computed."""
    from vllm import SamplingParams

    from sparsekv.serving.vllm.connector import PARAM

    if isinstance(questions, str):
        raise TypeError("questions must be a list (got one string)")
    cfg = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    kv = getattr(cfg, "kv_transfer_config", None)
    if kv is None or kv.kv_connector not in ("SparseKVConnector", "SparseKVConnectorOneGroup"):
        raise ValueError(
            "llm does not run the SparseKVConnector: build it as LLM(..., **engine_kwargs())"
        )
    tokenizer = llm.get_tokenizer()
    ids = [_question_ids(tokenizer, q) for q in questions]
    ctx = load_context(ctx_path)
    if sampling_params is None:
        sampling_params = SamplingParams()
    per = (
        list(sampling_params)
        if isinstance(sampling_params, (list, tuple))
        else [sampling_params] * len(ids)
    )
    if len(per) != len(ids):
        raise ValueError(f"{len(per)} sampling_params for {len(ids)} questions")
    params = []
    for sp in per:
        sp = sp.clone()
        extra = dict(sp.extra_args or {})
        extra["kv_transfer_params"] = {
            **dict(extra.get("kv_transfer_params") or {}),
            PARAM: str(ctx.path),
        }
        sp.extra_args = extra
        params.append(sp)
    prompts = [ctx.prompt(q) for q in ids]
    return llm.generate(prompts, params, **generate_kwargs)
