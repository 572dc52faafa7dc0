"""Which model the harness evaluates: the offline default, a tiny random model, or a local folder.

Model specs:
- "default": google/gemma-3-270m through `sparsekv.load_default_model` (offline).
- "tiny:<family>" (llama, qwen2, qwen3, mistral, gemma3): a 4-layer random model built from a
  config in-process (GQA 4/2 heads, head dim 16, vocabulary 128) with the ASCII codec; for tests
  and smoke runs, no download.
- a local Hugging Face model folder (loaded with `AutoModelForCausalLM` / `AutoTokenizer`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from sparsekv.evaluation.codec import AsciiCodec, Codec, HFCodec

TINY_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")


def tiny_config(family: str, attn_implementation: str = "sdpa"):
    """A 4-layer config of `family`: 4 query heads, 2 KV heads, head dim 16, vocabulary 128.
    Gemma 3 gets layers 0-2 sliding (window 32) and layer 3 full, like gemma-3-270m in miniature."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
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
        cfg = Gemma3TextConfig(
            **common, sliding_window=32,
            layer_types=["sliding_attention"] * 3 + ["full_attention"], query_pre_attn_scalar=16,
        )
    else:
        raise ValueError(f"tiny model family {family!r}; allowed values: {', '.join(TINY_FAMILIES)}")
    cfg._attn_implementation = attn_implementation
    return cfg


def validate_model_spec(spec: str) -> None:
    """Raise ValueError for a spec that can never load (checked before any work starts)."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"model={spec!r} must be 'default', 'tiny:<family>' or a local model folder")
    if spec.startswith("tiny:"):
        fam = spec.split(":", 1)[1]
        if fam not in TINY_FAMILIES:
            raise ValueError(f"model={spec!r}: tiny model family {fam!r}; allowed: {', '.join(TINY_FAMILIES)}")
    elif spec != "default" and not (Path(spec) / "config.json").is_file():
        raise ValueError(
            f"model={spec!r} is neither 'default', 'tiny:<family>' ({', '.join(TINY_FAMILIES)}) "
            "nor a local model folder with a config.json"
        )


def load_model(spec: str, dtype: str = "float32", attn_implementation: str = "sdpa", seed: int = 0):
    """Return `(model, codec)` for a model spec; the model is in eval mode without gradients."""
    from sparsekv.default_model import load_default_model, resolve_dtype

    validate_model_spec(spec)
    torch_dtype = resolve_dtype(dtype, "dtype")
    codec: Codec
    if spec == "default":
        model, tok = load_default_model(dtype=torch_dtype, attn_implementation=attn_implementation)
        codec = HFCodec(tok, _eos_ids(model), name="google/gemma-3-270m")
    elif spec.startswith("tiny:"):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        cfg = tiny_config(spec.split(":", 1)[1], attn_implementation)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
        model.to(torch_dtype)
        codec = AsciiCodec(cfg.vocab_size)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(spec, dtype=torch_dtype, attn_implementation=attn_implementation)
        tok = AutoTokenizer.from_pretrained(spec)
        codec = HFCodec(tok, _eos_ids(model), name=spec)
    model.eval()
    model.requires_grad_(False)
    return model, codec


def _eos_ids(model) -> list[int]:
    gc = getattr(model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None) if gc is not None else None
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]
