"""Tiny random models built in-process from configs: for tests, smoke runs and CI, no download.

One definition serves the tests, the training smoke runs ("tiny:<family>") and the evaluation
harness. Every family gets 4 layers, 4 query heads sharing 2 KV heads (GQA), head dim 16 and a
128-token vocabulary; Gemma 3 gets layers 0-2 sliding (window 32) and layer 3 full, the mix of
gemma-3-270m in miniature.
"""

from __future__ import annotations

import torch
from torch import nn

TINY_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")


def tiny_config(family: str, attn_implementation: str = "sdpa", **overrides):
    """The config of a tiny `family` model; `overrides` set any config attribute."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 8192,
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
        "gemma3": lambda: Gemma3TextConfig(
            **common,
            sliding_window=32,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
        ),
    }
    if family not in builders:
        raise ValueError(f"tiny model family {family!r} is not supported; allowed values: {', '.join(builders)}")
    cfg = builders[family]()
    unknown = sorted(k for k in overrides if not hasattr(cfg, k))
    if unknown:
        raise ValueError(
            f"tiny_model override(s) {unknown} are not attributes of the {family} config (they "
            f"would be ignored); allowed: its attributes, e.g. num_hidden_layers, hidden_size, "
            f"max_position_embeddings, sliding_window"
        )
    for key, value in overrides.items():
        setattr(cfg, key, value)
    cfg._attn_implementation = attn_implementation
    return cfg


def tiny_model(family: str, attn_implementation: str = "sdpa", seed: int = 0, **overrides) -> nn.Module:
    """A deterministic tiny random causal LM (float32, eval mode, frozen). The caller's RNG
    stream is left untouched."""
    from transformers import AutoModelForCausalLM

    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed={seed!r} must be an int (the random weights' seed), got "
                         f"{type(seed).__name__}")
    cfg = tiny_config(family, attn_implementation, **overrides)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
    model.eval()
    model.requires_grad_(False)
    return model
