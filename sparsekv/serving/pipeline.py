"""`pipeline("sparsekv-text-generation")`: compress a context once and answer its questions in one
call, as a transformers pipeline (the shape of kvpress's `kv-press-text-generation`).

    import sparsekv.serving.pipeline  # or: sparsekv.serving.pipeline.register()
    from transformers import pipeline

    pipe = pipeline("sparsekv-text-generation", model=model, tokenizer=tokenizer)
    pipe(context, question="\\nQuestion: Who signed it?\\nAnswer:", policy=adapter, budget=0.3)
    # -> {"answer": "..."}; questions=[...] -> {"answers": [...]}

Each call compresses `context` with `sparsekv.compress_text` (policy: a name, "learned:DIR", a
`Policy` or a `ScorerAdapter`; `budget` and any other `EvictionConfig` field as `eviction={...}`),
then answers every question from its own copy of the compressed cache (greedy by default;
`max_new_tokens`, `do_sample` and the other generate arguments pass through). The question's text
is appended to the context's as is: include the separator the prompt needs.

Registering is explicit: importing this module (or calling `register()`) adds the task to
transformers' `PIPELINE_REGISTRY`; nothing else in sparsekv registers it.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoModelForCausalLM, Pipeline
from transformers.pipelines import PIPELINE_REGISTRY

from sparsekv.config import EvictionConfig
from sparsekv.configfile import check_known
from sparsekv.serving.compressed import compress_text

TASK = "sparsekv-text-generation"
_GENERATE_KEYS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty")

__all__ = ["TASK", "SparseKVTextGeneration", "register"]


class SparseKVTextGeneration(Pipeline):
    """Compress once, answer many: `pipe(context, question=... | questions=[...], policy=...,
    budget=..., eviction={...}, max_new_tokens=...)`."""

    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _load_tokenizer = True

    def _sanitize_parameters(
        self,
        question: str | None = None,
        questions: list[str] | None = None,
        policy: Any = "snapkv",
        budget: float | int = 0.3,
        eviction: dict[str, Any] | None = None,
        **generate_kwargs: Any,
    ):
        unknown = sorted(set(generate_kwargs) - set(_GENERATE_KEYS))
        if unknown:
            raise ValueError(
                f"unknown argument(s) {unknown} for {TASK}; allowed: question, questions, policy, "
                f"budget, eviction, {', '.join(_GENERATE_KEYS)}"
            )
        if question is not None and questions is not None:
            raise ValueError("give question=... or questions=[...], not both")
        if eviction is not None and not isinstance(eviction, dict):
            raise ValueError(f"eviction={eviction!r} must be a mapping of EvictionConfig fields")
        if eviction and "budget" in eviction:
            raise ValueError("eviction={'budget': ...}: pass budget=... instead")
        check_known(EvictionConfig, eviction or {}, "eviction")
        if questions is not None:
            if isinstance(questions, str) or not isinstance(questions, (list, tuple)):
                raise ValueError(
                    f"questions={questions!r:.80} must be a list of strings (in order; a set has "
                    "none); for one question use question=..."
                )
            if not questions:
                raise ValueError(
                    "questions=[] is empty: give at least one question (the context would be "
                    "compressed for nothing)"
                )
        forward = {"question": question, "questions": questions, "policy": policy,
                   "config": EvictionConfig(budget=budget, **(eviction or {})),
                   "generate_kwargs": generate_kwargs}
        return {}, forward, {}

    def __call__(self, inputs: Any = None, *args: Any, **kwargs: Any):
        """`pipe(context, ...)` or `pipe([context, ...], ...)` (one result per context); each
        context is compressed on its own, so `batch_size` above 1 is refused."""
        batch = kwargs.get("batch_size")
        if batch is not None and (isinstance(batch, bool) or batch != 1):
            raise ValueError(
                f"batch_size={batch!r}: {TASK} compresses one context at a time (a cache holds "
                "one sequence); pass a list of contexts without batch_size, or batch_size=1"
            )
        if isinstance(inputs, (list, tuple)) and not inputs:
            raise ValueError(
                "context=[] is an empty list: give a non-empty string, or a list of them"
            )
        return super().__call__(inputs, *args, **kwargs)

    def preprocess(self, context: str) -> dict[str, Any]:
        if not isinstance(context, str) or not context:
            raise ValueError(f"context={context!r} must be a non-empty string")
        return {"context": context}

    def _forward(self, inputs: dict[str, Any], question=None, questions=None, policy="snapkv",
                 config: EvictionConfig | None = None, generate_kwargs=None) -> dict[str, Any]:
        if question is None and questions is None:
            raise ValueError(f"{TASK} needs question=... or questions=[...]")
        doc = compress_text(self.model, self.tokenizer, inputs["context"], config, policy)
        if questions is not None:
            return {"answers": doc.ask_many(questions, **generate_kwargs), "kept": doc.context.kept}
        return {"answer": doc.ask(question, **generate_kwargs), "kept": doc.context.kept}

    def postprocess(self, outputs: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in outputs.items() if k != "kept"}

    # transformers moves tensors between devices around _forward; the context stays text here
    def forward(self, model_inputs, **forward_params):
        return self._forward(model_inputs, **forward_params)


def register() -> None:
    """Add `sparsekv-text-generation` to transformers' pipeline registry (idempotent)."""
    if TASK not in PIPELINE_REGISTRY.get_supported_tasks():
        PIPELINE_REGISTRY.register_pipeline(
            TASK, pipeline_class=SparseKVTextGeneration, pt_model=AutoModelForCausalLM, type="text"
        )


register()
