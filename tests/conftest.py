"""Shared fixtures: tiny random models built in-process from configs (no downloads)."""

from __future__ import annotations

import os
import warnings

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# transformers deprecation warnings fail the tests (also set in pyproject's filterwarnings).
warnings.filterwarnings("error", category=FutureWarning, module="transformers")
warnings.filterwarnings("error", category=DeprecationWarning, module="transformers")

FAMILIES = ("llama", "qwen3", "mistral", "gemma3")


def tiny_model(family: str, attn_implementation: str = "sdpa", seed: int = 0, **overrides):
    """A deterministic tiny random causal LM (see `sparsekv.models.tiny`)."""
    from sparsekv.models.tiny import tiny_model as build

    return build(family, attn_implementation, seed, **overrides)


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
