"""Scorer adapters: a trained gating head packaged for one base model, saved, loaded and attached.

This module owns applying an adapter: `ScorerAdapter` is a `TrainedScorer`
(`sparsekv.scoring.scorer`: building, saving, loading, pushing, checking, scoring) that also
builds its learned policy and applies the head (and its optional LoRA, `sparsekv.scoring.lora`)
to `model.generate`. It does not train (see `train.py`) and does not
evict (see `sparsekv.cache`).

A folder holds `config.json` (type tag, format version 2, the base model's shape, the target, the
learned policy's settings per use), `model.safetensors` (the head), `README.md` (the card) and
optionally `lora/` (a standard PEFT LoRA folder). Format-1 folders (`adapter_config.json` +
`adapter_model.safetensors`) still load. Saving is atomic (a temporary sibling renamed into place).

Uses: the settings that serve a kind of use are recorded in the adapter and applied by naming it:
`"aware"` (the default: the question is in the prompt when the cache is compressed),
`"agnostic"` (a context compressed before its question), optionally `"decode"`.

LoRA: `adapter.save_pretrained(folder, lora=peft_model)` (a trained `peft.PeftModel`, a
`LoraWeights`, or a PEFT folder) stores a LoRA of the base model beside the head, in `lora/`;
`from_pretrained` loads it into `adapter.lora`; `attach` injects it into the model for the
`with` block and removes it on exit (the model's outputs afterwards are bitwise those from
before); `attach(..., lora=False)` runs the head alone.

Usage::

    adapter = ScorerAdapter.from_pretrained("user/gemma3-270m-sparsekv")   # Hub id or folder
    with adapter.attach(model, budget=0.3, schedule="pyramid", rerank_every=16):
        out = model.generate(**inputs, max_new_tokens=64)
    with adapter.attach(model, use="agnostic", budget=0.3):   # context compressed first
        ...
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from sparsekv.cache import SparseKVCache
from sparsekv.config import EvictionConfig
from sparsekv.configfile import check_known
from sparsekv.models.families import text_config
from sparsekv.policies import get as get_policy
from sparsekv.policies.learned import LearnedPolicy
from sparsekv.scoring.adapter_config import FORMAT_VERSION, POLICY_DEFAULTS, USES, AdapterConfig
from sparsekv.scoring.files import ADAPTER_FILES, CARD_NAME, CONFIG_NAME, WEIGHTS_NAME
from sparsekv.scoring.lora import LoraWeights, apply_lora
from sparsekv.scoring.scorer import TrainedScorer

__all__ = [
    "ADAPTER_FILES",
    "CARD_NAME",
    "CONFIG_NAME",
    "FORMAT_VERSION",
    "POLICY_DEFAULTS",
    "USES",
    "WEIGHTS_NAME",
    "AdapterConfig",
    "Attachment",
    "LoraWeights",
    "ScorerAdapter",
    "TrainedScorer",
]


@dataclass
class Attachment:
    """What `ScorerAdapter.attach` yields: the settings in use and the last generate's cache."""

    model: nn.Module
    config: Any  # EvictionConfig
    policy: Any  # Policy
    last_cache: Any = None  # the SparseKVCache of the most recent generate call (closed)

    def __repr__(self) -> str:  # the model's repr is its whole module tree: name it instead
        return (
            f"Attachment(model={type(self.model).__name__}, config={self.config!r}, "
            f"policy={self.policy!r}, last_cache={'set' if self.last_cache is not None else None})"
        )


class ScorerAdapter(TrainedScorer):
    """A `GatingHead` (`.head`), its `AdapterConfig` (`.config`) and optionally a LoRA of the base
    model (`.lora`, a `LoraWeights`), with its learned policy and `attach`."""

    def policy(self, use: str | None = None, **kwargs: Any) -> LearnedPolicy:
        """The "learned" policy backed by this adapter; unset settings (blend, blend_mode,
        recency, kernel_size, head_layer) take those recorded for `use` (default "aware")."""
        return get_policy("learned", adapter=self, use=use, **kwargs)

    @contextmanager
    def attach(
        self,
        model: nn.Module,
        budget: float = 0.3,
        schedule: str | list[float] = "pyramid",
        rerank_every: int = 16,
        blend: float | None = None,
        use: str | None = None,
        lora: bool = True,
        tokenizer: Any = None,
        **eviction_kwargs: Any,
    ) -> Iterator[Attachment]:
        """Inside the `with` block, plain `model.generate(...)` runs with a fresh
        `SparseKVCache(model, EvictionConfig(budget=..., ...), self.policy(use, ...))` per call
        (closed after the call). `use` ("aware" by default, "agnostic" for a context compressed
        before its question, "decode" when recorded) picks the recorded settings; keyword
        arguments named in `POLICY_DEFAULTS` (`blend`, `blend_mode`, `kernel_size`, `recency`,
        `head_layer`, `span_fill`, `span_peaks`, `span_words`) override them, the others go to
        `EvictionConfig`; `tokenizer` (the model's) serves `span_words`, which otherwise loads it
        from the model's `name_or_path`. When the adapter carries a LoRA and `lora` is True, it is injected into
        the model for the block and removed on exit. A call that passes its own `cache=` (or `past_key_values=`) is left alone (`cache=None` is as if left out). On exit
        `model.generate`, the LoRA and the model's attention implementation are restored, also
        after an error. Yields an `Attachment` (its `last_cache` is the most recent call's
        cache, for `kv_bytes()` and friends)."""
        self.check_compatible(model)
        if not isinstance(lora, bool):
            raise ValueError(
                f"lora={lora!r} must be True (apply the adapter's LoRA, if any) or False"
            )
        settings = {k: eviction_kwargs.pop(k) for k in POLICY_DEFAULTS if k in eviction_kwargs}
        check_known(EvictionConfig, eviction_kwargs, "attach(**kwargs)", also=tuple(POLICY_DEFAULTS))
        if blend is not None:
            settings["blend"] = blend
        config = EvictionConfig(
            budget=budget, schedule=schedule, rerank_every=rerank_every, **eviction_kwargs
        )
        policy = self.policy(use=use, tokenizer=tokenizer, **settings)
        attachment = Attachment(model=model, config=config, policy=policy)
        had_own = "generate" in vars(model)
        own = vars(model).get("generate")
        attn_before = text_config(model)._attn_implementation
        with ExitStack() as stack:
            if lora and self.lora is not None:
                stack.enter_context(apply_lora(model, self.lora))
            original = model.generate

            @functools.wraps(original)
            def generate(*args: Any, **kwargs: Any):
                for key in ("cache", "past_key_values"):  # None, generate's default: as left out
                    if key in kwargs and kwargs[key] is None:
                        del kwargs[key]
                if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
                    return original(*args, **kwargs)
                cache = SparseKVCache(model, config, policy)
                attachment.last_cache = cache
                try:
                    return original(*args, cache=cache, **kwargs)
                finally:
                    cache.close()

            model.generate = generate
            try:
                yield attachment
            finally:
                if had_own:
                    model.generate = own
                else:
                    del model.generate
                if (
                    text_config(model)._attn_implementation != attn_before
                    and attn_before is not None
                ):
                    model.set_attn_implementation(attn_before)
