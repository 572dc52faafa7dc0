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


def tiny_config(family: str, attn_implementation: str = "sdpa"):
    """A 4-layer config of `family` with GQA (4 query heads, 2 KV heads), vocabulary 128."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    builders = {
        "llama": lambda: LlamaConfig(**common),
        "qwen2": lambda: Qwen2Config(**common, use_sliding_window=False),
        "qwen3": lambda: Qwen3Config(**common),
        "mistral": lambda: MistralConfig(**common, sliding_window=None),
        # Layers 0-2 slide (window 32), layer 3 is full: gemma-3-270m's mix in miniature.
        "gemma3": lambda: Gemma3TextConfig(
            **common,
            sliding_window=32,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
        ),
    }
    if family not in builders:
        raise ValueError(
            f"model='tiny:{family}' is not supported; allowed families: {', '.join(builders)}"
        )
    cfg = builders[family]()
    cfg._attn_implementation = attn_implementation
    return cfg


def tiny_model(family: str, seed: int = 0, attn_implementation: str = "sdpa") -> nn.Module:
    """A deterministic tiny random causal LM of `family` (float32, eval mode, frozen)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family, attn_implementation)
    fork = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=fork):  # the caller's RNG stream is left untouched
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
    return model


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
        model = tiny_model(spec.removeprefix("tiny:"), seed, attn_implementation).to(torch_dtype)
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
