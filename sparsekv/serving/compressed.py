"""Compress once, ask many: a context prefilled once through a `SparseKVCache`, then asked any
number of questions, each from its own copy of the compressed cache.

This is the query-agnostic use (the evaluation's "agnostic" protocol as an API): the cache
compresses the document before any question is known, and every question (and its answer)
then goes through a fresh copy of that compressed cache under the same eviction config, so
one question never changes what the next one sees and the context is never prefilled again.

    ctx = sparsekv.compress(model, context_ids, EvictionConfig(budget=0.3), adapter)
    out = ctx.generate(question_ids, max_new_tokens=32)   # (1, question + new) token ids
    ctx.save("doc.ctx"); ctx = CompressedContext.load("doc.ctx", model, policy=adapter)

    doc = sparsekv.compress_text(model, tokenizer, text, EvictionConfig(budget=0.3), "snapkv")
    doc.ask("Who wrote it?"); doc.ask_many(["When?", "Where?"])
    doc.save("doc.ctx"); doc = TextContext.load("doc.ctx", model, tokenizer)  # asks again
    ctx.ask_many(["When?"], tokenizer=tokenizer)  # a context from token ids asks text too

A policy is a name (`policies.available()`, "learned:DIR"), a `Policy`, or a `ScorerAdapter`:
an adapter (or "learned:DIR") scores with its recorded "agnostic" use settings, since
compressing before the question is that use.

What a compressed context holds (batch 1): the context ids `(1, n)` and, per cache layer, the
state a cache layer carries between steps: for budgeted layers `keys`/`values`
`(1, kv_heads, kept, head_dim)` (int8 plus `key_scale`/`value_scale` `(1, kv_heads, kept, 1)`
under `quantize="int8"`), `positions`, `scores` and `observed` `(1, kv_heads, kept)`, and the
counters `seen`, `decode_steps`, `evicted`; for the other layers (sliding windows) their keys
and values. `save` writes them as `context.safetensors` plus `context.json` (eviction config,
policy spec, model shape and a fingerprint of its weights, token counts, kept entries per
layer, a digest of the tensors) into a folder, atomically; `load` refuses another model, dtype
or policy, tensors that do not match the digest, and keys or values that are not finite.

It owns the compressed context; its folder (atomic writes, recovery, reading with every part
checked) lives in `sparsekv.serving.context_files`, the policy's record and checks in
`sparsekv.serving.context_policy`, the checks of its inputs in `sparsekv.serving.context_inputs`, the snapshot and restore of a cache's state in
`sparsekv.cache.state`, the cache's own rules (what is kept, positions, masks) in
`sparsekv.cache`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from sparsekv.cache import SparseKVCache
from sparsekv.cache.state import model_dtype, model_fingerprint, restore, snapshot
from sparsekv.config import EvictionConfig
from sparsekv.io import as_path
from sparsekv.models.families import model_shape
from sparsekv.policies import Policy
from sparsekv.serving.context_files import (  # noqa: F401  (the private names: patched here by tests)
    _IN_PROGRESS,
    DIGEST_KEY,
    FORMAT_VERSION,
    KV_SUFFIXES,
    META_FILE,
    TENSORS_FILE,
    _check_tensors,
    _digest,
    _exchange,
    check_layers,
    read_meta,
    read_tensors,
    recover,
    write_folder,
)
from sparsekv.serving.context_inputs import (
    as_ids,
    check_one_sequence,
    check_tokenizer,
    tokenizer_record,
    vocab_size,
    warn_positions,
)
from sparsekv.serving.context_policy import adapter_lora as _adapter_lora
from sparsekv.serving.context_policy import lora_applied as _lora_applied
from sparsekv.serving.context_policy import policy_for_load as _policy_for_load
from sparsekv.serving.context_policy import resolve_policy as _resolve_policy

__all__ = ["CompressedContext", "TextContext", "compress", "compress_text", "recover"]

# ---------------------------------------------------------------------- the compressed context


class CompressedContext:
    """A context compressed once through a `SparseKVCache`; `generate` answers questions given
    as token ids from copies of it, `ask` / `ask_many` questions given as text (with the
    tokenizer). Build it with `compress`, `compress_text` or `CompressedContext.load`."""

    def __init__(
        self,
        model,
        config: EvictionConfig,
        policy: Policy,
        policy_spec: dict[str, Any],
        context_ids: torch.Tensor,
        tensors: dict[str, torch.Tensor],
        meta: dict[str, Any],
        tokenizer: Any = None,
    ):
        self.model = model
        self.config = config
        self.policy = policy
        self.policy_spec = policy_spec
        self.context_ids = context_ids  # (1, n)
        self._tensors = tensors
        self._meta = meta
        self._dtype = model_dtype(model)
        self.tokenizer = tokenizer
        """The tokenizer of a context compressed from text (`ask` uses it), else None."""
        # the adapter's LoRA of the model, when the context was compressed with it applied
        self.lora = _adapter_lora(policy) if policy_spec.get("lora") else None

    # ---- what it holds ------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Tokens of the context (seen by the cache), not the entries kept."""
        return int(self.context_ids.shape[1])

    def kept(self) -> list[int]:
        """Entries stored per cache layer (budgeted and sliding layers alike)."""
        return [0 if m["empty"] else m["kept"] for m in self._meta["layers"]]

    def kv_bytes(self) -> int:
        """Bytes of the compressed keys and values (int8 scales included)."""
        return sum(t.nbytes for k, t in self._tensors.items() if k.endswith(KV_SUFFIXES))

    def state(self) -> dict[str, torch.Tensor]:
        """The compressed state by name (read-only view for inspection and tests)."""
        return dict(self._tensors)

    def cache(self) -> SparseKVCache:
        """A fresh `SparseKVCache` holding a copy of the compressed context: pass it as `cache=`
        with `input_ids` = context + new tokens (`generate` does this). Close it when done."""
        dtype = model_dtype(self.model)
        if dtype != self._dtype:
            raise ValueError(
                f"the context holds {str(self._dtype).removeprefix('torch.')} keys and values but "
                f"the model now runs in {str(dtype).removeprefix('torch.')} (its dtype changed "
                f"after compress or load): move it back with model.to({self._dtype}), or "
                "compress the context again"
            )
        return restore(
            SparseKVCache(self.model, self.config, self.policy), self._tensors, self._meta, dtype
        )

    # ---- asking -------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, question_ids: Any, **generate_kwargs: Any):
        """Answer one question: `model.generate` on context + question over a fresh copy of the
        compressed cache (the question's tokens and the answer's go through it under the same
        eviction config and policy). `question_ids`: `(1, q)`, a 1-D tensor or a list of ints.
        One sequence per call: `num_beams` and `num_return_sequences` above 1 are refused.

        Returns what `model.generate` returns with the context cut off: `(1, q + new)` token ids
        (or its output object with `.sequences` so cut, under `return_dict_in_generate=True`).
        """
        for key in ("input_ids", "attention_mask", "cache", "past_key_values"):
            if key in generate_kwargs:
                raise ValueError(
                    f"generate(..., {key}=...) is set by the compressed context; leave it out"
                )
        if generate_kwargs.get("use_cache", True) is not True:
            raise ValueError(
                f"generate(..., use_cache={generate_kwargs['use_cache']!r}): the answer is read "
                "through the compressed cache, so use_cache must stay True; leave it out"
            )
        check_one_sequence(self.model, generate_kwargs)
        device = next(self.model.parameters()).device
        q = as_ids(question_ids, "question_ids", device, vocab_size(self.model))
        ids = torch.cat([self.context_ids.to(device), q], dim=1)
        mask = torch.ones_like(ids)
        with _lora_applied(self.model, self.lora):
            cache = self.cache()
            try:
                out = self.model.generate(
                    input_ids=ids, attention_mask=mask, cache=cache, **generate_kwargs
                )
            finally:
                cache.close()
        n = self.num_tokens
        if isinstance(out, torch.Tensor):
            return out[:, n:]
        out.sequences = out.sequences[:, n:]
        return out

    def ask(
        self, question: str, max_new_tokens: int = 64, tokenizer: Any = None, **generate_kwargs: Any
    ) -> str:
        """The answer to `question` (greedy unless `do_sample=True` is passed), special tokens
        dropped. The question's text is appended to the context's as is: include the separator
        (a newline or a space) the prompt needs. `tokenizer`: the model's (default: the one the
        context was compressed or loaded with)."""
        tok = self._tokenizer(tokenizer, "ask")
        if not isinstance(question, str) or not question:
            raise ValueError(f"question={question!r} must be a non-empty string")
        ids = tok(question, add_special_tokens=False)["input_ids"]
        generate_kwargs.setdefault("do_sample", False)
        out = self.generate(ids, max_new_tokens=max_new_tokens, **generate_kwargs)
        return tok.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)

    def ask_many(self, questions: Sequence[str], **kwargs: Any) -> list[str]:
        """`ask` for each question, each from its own copy of the compressed context."""
        if isinstance(questions, str):
            raise ValueError("questions must be a list of strings (got one string); use ask()")
        if not isinstance(questions, (list, tuple)):
            raise ValueError(
                f"questions={questions!r:.80} must be a list (or tuple) of strings, in the order "
                f"of the answers wanted; got a {type(questions).__name__}"
                + (" (a set has no order)" if isinstance(questions, (set, frozenset)) else "")
            )
        self._tokenizer(kwargs.get("tokenizer"), "ask_many")
        return [self.ask(q, **kwargs) for q in questions]

    def _tokenizer(self, given: Any, what: str) -> Any:
        tok = self.tokenizer if given is None else given
        if tok is None:
            raise ValueError(
                f"{what}() takes text, so it needs the model's tokenizer: {what}(..., "
                "tokenizer=tok), CompressedContext.load(path, model, tokenizer=tok) or "
                "compress_text(...); for token ids use generate(question_ids)"
            )
        if not callable(tok) or not hasattr(tok, "decode"):
            raise ValueError(f"tokenizer={tok!r} must be a Hugging Face tokenizer (text <-> ids)")
        return tok

    # ---- persistence --------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write the context into folder `path` (`context.safetensors` + `context.json`),
        atomically: a complete folder or the previous one, never half of each. The files are
        written and fsynced into a temporary sibling, which takes the old folder's place in one
        atomic exchange (Linux `renameat2`; elsewhere two renames, the old folder kept aside
        as `.NAME.old-PID-...` between them). A save or load after a killed save puts that old
        folder back and removes the temporary folders of saves whose process is gone
        (`recover`). A text context records its tokenizer's name and size."""
        meta = {
            "format_version": FORMAT_VERSION,
            "config": self.config.to_dict(),
            "policy": self.policy_spec,
            "model_shape": model_shape(self.model).to_dict(),
            "model_fingerprint": model_fingerprint(self.model),
            "dtype": str(self._dtype).removeprefix("torch."),
            "num_tokens": self.num_tokens,
            "kept": self.kept(),
            **self._meta,
        }
        if self.tokenizer is not None:
            meta["tokenizer"] = tokenizer_record(self.tokenizer)
        tensors = {k: v.detach().cpu().contiguous() for k, v in self._tensors.items()}
        tensors["context_ids"] = self.context_ids.cpu().contiguous()
        return write_folder(as_path(path, "path"), tensors, meta, exchange=_exchange)

    @classmethod
    def load(
        cls, path: str | os.PathLike, model, policy: Any = None, tokenizer: Any = None
    ) -> CompressedContext:
        """A context written by `save`, for `model` (the same model: shape, weights and dtype are
        checked). `policy`: needed again when the context was compressed with a `ScorerAdapter`
        or a `Policy` instance (a name or "learned:DIR" is rebuilt from the record).
        `tokenizer`: the model's, for `ask` / `ask_many` (a text context records its size, which
        must match). Every part of the folder is checked (`sparsekv.serving.context_files`)."""
        folder = as_path(path, "path")
        if tokenizer is not None and (not callable(tokenizer) or not hasattr(tokenizer, "decode")):
            raise ValueError(
                f"tokenizer={tokenizer!r:.80} must be a Hugging Face tokenizer (text <-> ids: "
                "callable, with decode), e.g. AutoTokenizer.from_pretrained(...), or None"
            )
        meta = read_meta(folder)
        shape = model_shape(model)
        recorded = meta["model_shape"]
        if recorded != shape.to_dict():
            diff = sorted(k for k, v in shape.to_dict().items() if recorded.get(k) != v)
            raise ValueError(
                f"{folder}: the context was compressed by another model "
                f"({recorded.get('model_type')}, differing in {', '.join(diff)}); load it "
                "onto the model that compressed it"
            )
        dtype = str(model_dtype(model)).removeprefix("torch.")
        if meta["dtype"] != dtype:
            raise ValueError(
                f"{folder}: the context holds {meta['dtype']} keys and values but the "
                f"model runs in {dtype}; load the model in {meta['dtype']}"
            )
        if meta["model_fingerprint"] != model_fingerprint(model):
            raise ValueError(
                f"{folder}: the context was compressed by another model of the same shape (its "
                "key/value projection weights differ); load it onto the model that compressed it"
            )
        tensors = read_tensors(folder, meta)
        ids = tensors.pop("context_ids", None)
        where = folder / TENSORS_FILE
        if ids is None or ids.shape != (1, meta["num_tokens"]) or ids.is_floating_point():
            got = "no context_ids" if ids is None else f"context_ids {ids.dtype} {tuple(ids.shape)}"
            raise ValueError(
                f"{where}: {got}, expected integer context_ids of shape (1, {meta['num_tokens']})"
            )
        check_layers(meta, tensors, shape, where)
        try:
            config = EvictionConfig.from_dict(meta["config"])
        except ValueError as e:
            raise ValueError(f"{folder / META_FILE}: config: {e}") from None
        built = _policy_for_load(meta["policy"], policy, folder)
        check_tokenizer(meta.get("tokenizer"), tokenizer, folder)
        device = next(model.parameters()).device
        tensors = {k: v.to(device) for k, v in tensors.items()}
        layers = {"layers": meta["layers"]}
        return cls(model, config, built, meta["policy"], ids.to(device), tensors, layers, tokenizer)

    def __repr__(self) -> str:
        return (
            f"CompressedContext(tokens={self.num_tokens}, kept={self.kept()}, "
            f"policy={self.policy!r}, budget={self.config.budget})"
        )


@torch.no_grad()
def compress(
    model, context_ids: Any, config: EvictionConfig, policy: Any = "snapkv", lora: bool = True
) -> CompressedContext:
    """Prefill `context_ids` (`(1, n)`, a 1-D tensor or a list of ints) through a
    `SparseKVCache(model, config, policy)` and keep what it kept: a `CompressedContext` whose
    `generate` answers questions without compressing again. `policy`: a name, a `Policy`, or a
    `ScorerAdapter` (scoring with its recorded "agnostic" use settings). An adapter that carries
    a LoRA of the model (co-adaptation) has it applied to the prefill and to every question, as
    `ScorerAdapter.attach` does, unless `lora=False`. A context longer than the model's
    `max_position_embeddings` warns."""
    if not isinstance(config, EvictionConfig):
        raise ValueError(f"config must be an EvictionConfig, got {type(config).__name__}")
    if not hasattr(getattr(model, "config", None), "model_type"):
        raise TypeError(
            f"model={model!r:.60} must be a Hugging Face causal LM (a transformers model, e.g. "
            f"from sparsekv.load_default_model()), got {type(model).__name__}"
        )
    if not isinstance(lora, bool):
        raise ValueError(f"lora={lora!r} must be True (apply the adapter's LoRA, if any) or False")
    built, spec = _resolve_policy(policy)
    spec["lora"] = lora and _adapter_lora(built) is not None
    device = next(model.parameters()).device
    ids = as_ids(context_ids, "context_ids", device, vocab_size(model))
    warn_positions(model, ids.shape[1])
    with _lora_applied(model, _adapter_lora(built) if spec["lora"] else None):
        with SparseKVCache(model, config, built) as cache:
            model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            tensors, meta = snapshot(cache)
    return CompressedContext(model, config, built, spec, ids, tensors, meta)


# ---------------------------------------------------------------------- text convenience


class TextContext:
    """A `CompressedContext` with its tokenizer: questions and answers as text. Saved with
    `save`, it loads back as one with `TextContext.load(path, model, tokenizer)`."""

    def __init__(self, context: CompressedContext, tokenizer):
        self.context = context
        self.tokenizer = tokenizer
        if context.tokenizer is None:
            context.tokenizer = tokenizer

    def ask(self, question: str, max_new_tokens: int = 64, **generate_kwargs: Any) -> str:
        """The answer to `question` (`CompressedContext.ask` with this tokenizer)."""
        return self.context.ask(question, max_new_tokens, tokenizer=self.tokenizer, **generate_kwargs)

    def ask_many(self, questions: Sequence[str], **kwargs: Any) -> list[str]:
        """`ask` for each question, each from its own copy of the compressed context."""
        return self.context.ask_many(questions, tokenizer=self.tokenizer, **kwargs)

    def generate(self, question_ids: Any, **generate_kwargs: Any):
        """`CompressedContext.generate`: a question as token ids."""
        return self.context.generate(question_ids, **generate_kwargs)

    def save(self, path: str | os.PathLike) -> Path:
        return self.context.save(path)

    @classmethod
    def load(cls, path: str | os.PathLike, model, tokenizer, policy: Any = None) -> TextContext:
        """A text context written by `save`, back with its tokenizer (`CompressedContext.load`
        checks the rest)."""
        if tokenizer is None:
            raise ValueError("TextContext.load needs tokenizer= (the model's); "
                             "CompressedContext.load reads a context without one")
        return cls(CompressedContext.load(path, model, policy=policy, tokenizer=tokenizer), tokenizer)

    def __repr__(self) -> str:
        return f"TextContext({self.context!r})"


def compress_text(
    model,
    tokenizer,
    context: str,
    config: EvictionConfig,
    policy: Any = "snapkv",
    add_special_tokens: bool = True,
) -> TextContext:
    """`compress` for text: `context` is tokenized (with the tokenizer's special tokens, e.g.
    BOS, unless `add_special_tokens=False`) and compressed; ask it with `.ask` / `.ask_many`."""
    if not isinstance(context, str) or not context:
        raise ValueError(f"context={context!r} must be a non-empty string")
    if not callable(tokenizer):
        raise TypeError(f"tokenizer={tokenizer!r} must be a Hugging Face tokenizer (text -> ids)")
    if not isinstance(add_special_tokens, bool):
        raise TypeError(
            f"add_special_tokens={add_special_tokens!r} must be True or False, got "
            f"{type(add_special_tokens).__name__}"
        )
    ids = tokenizer(context, add_special_tokens=add_special_tokens)["input_ids"]
    return TextContext(compress(model, ids, config, policy), tokenizer)
