"""The frozen base model of a run, and the tiny random models used for smoke runs.

This module owns turning `TrainConfig.model` into `(model, tokenizer, base_model_id)`:
"default" is gemma-3-270m (offline, `sparsekv.load_default_model`), "tiny:<family>" is a
4-layer random model built in-process from the seed (with a byte-level tokenizer, so no
download is ever needed), anything else is an HF folder or Hub id. The model comes back in eval
mode with every parameter frozen. It knows nothing about heads, data or optimization.
"""

from __future__ import annotations

import torch
from torch import nn

from sparsekv.default_model import resolve_dtype
from sparsekv.tiny import tiny_config, tiny_model  # noqa: F401  (re-exported for train.loop)


class ByteTokenizer:
    """UTF-8 bytes folded into a small vocabulary: ids 0/1/2 are pad/bos/eos, text uses 3..vocab-1.

    Lossy (bytes share ids when the vocabulary is smaller than 259) but deterministic and
    offline: all a tiny random model needs. Called like an HF tokenizer on a list of texts.
    """

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __init__(self, vocab_size: int):
        if vocab_size < 4:
            raise ValueError(f"vocab_size={vocab_size!r} must be >= 4")
        self.vocab_size = vocab_size

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> dict:
        span = self.vocab_size - 3
        ids = [[3 + b % span for b in t.encode("utf-8")] for t in texts]
        if add_special_tokens:
            ids = [[self.bos_token_id, *x] for x in ids]
        return {"input_ids": ids}


def load_model(
    spec: str,
    dtype: str = "float32",
    attn_implementation: str = "sdpa",
    seed: int = 0,
    device: str | torch.device = "cpu",
):
    """`(model, tokenizer, base_model_id)` for a `TrainConfig.model` spec, frozen, in eval mode."""
    torch_dtype = resolve_dtype(dtype)
    if spec == "default":
        from sparsekv.default_model import DEFAULT_MODEL_ID, load_default_model

        model, tok = load_default_model(torch_dtype, attn_implementation, device)
        base_id = DEFAULT_MODEL_ID
    elif spec.startswith("tiny:"):
        model = tiny_model(spec.removeprefix("tiny:"), attn_implementation=attn_implementation, seed=seed).to(torch_dtype)
        tok, base_id = ByteTokenizer(model.config.vocab_size), spec
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(
            spec, dtype=torch_dtype, attn_implementation=attn_implementation
        )
        tok, base_id = AutoTokenizer.from_pretrained(spec), spec
    model.to(device).eval()
    model.requires_grad_(False)
    return model, tok, base_id
