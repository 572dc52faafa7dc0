"""Shared fixtures: tiny random models built in-process from configs (no downloads)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# transformers deprecation warnings fail the tests (also set in pyproject's filterwarnings).
warnings.filterwarnings("error", category=FutureWarning, module="transformers")
warnings.filterwarnings("error", category=DeprecationWarning, module="transformers")

FAMILIES = ("llama", "qwen3", "mistral", "gemma3")


def tiny_config(family: str, attn_implementation: str = "sdpa", **overrides):
    """A 4-layer config of `family` with GQA (4 query heads, 2 KV heads) and a small vocabulary."""
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if family == "llama":
        cfg = LlamaConfig(**common)
    elif family == "qwen2":
        cfg = Qwen2Config(**common, use_sliding_window=False)
    elif family == "qwen3":
        cfg = Qwen3Config(**common)
    elif family == "mistral":
        cfg = MistralConfig(**common, sliding_window=None)
    elif family == "gemma3":
        # Layers 0-2 slide (window 32), layer 3 is full: the same mix as gemma-3-270m in miniature.
        cfg = Gemma3TextConfig(
            **common,
            sliding_window=32,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            query_pre_attn_scalar=16,
        )
    else:
        raise ValueError(f"family={family!r}; allowed values: {', '.join(FAMILIES)}, qwen2")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    cfg._attn_implementation = attn_implementation
    return cfg


def tiny_model(family: str, attn_implementation: str = "sdpa", seed: int = 0, **overrides):
    """A deterministic tiny random causal LM of `family` in eval mode (float32, CPU)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(family, attn_implementation, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
    model.eval()
    model.requires_grad_(False)
    return model


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture
def make_tiny_model():
    return tiny_model


@pytest.fixture(scope="session")
def default_model():
    """The real gemma-3-270m (converted once into $SPARSEKV_CACHE)."""
    from sparsekv import load_default_model

    return load_default_model()
