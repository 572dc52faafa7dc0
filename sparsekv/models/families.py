"""Model-family specifics: which layers hold growing KV, where the attention inputs live.

Everything the rest of sparsekv needs to know about a particular transformers architecture is
answered here, from the model's config and module tree. Supported: Llama, Mistral, Qwen2,
Qwen3 and Gemma 3 (text). Nothing here touches caches or scores.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3")


@dataclass(frozen=True)
class ModelShape:
    """The shape facts an adapter records and a cache needs.

    `layer_types[i]` is "full_attention" or "sliding_attention"; KV memory that grows with the
    context lives in the full-attention layers (sliding layers are capped by their window).
    """

    model_type: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    layer_types: tuple[str, ...]
    sliding_window: int | None

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    def kv_bytes_per_token(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of K and V one token adds to a full cache across all layers (sliding included)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["layer_types"] = list(self.layer_types)
        return d


def text_config(model_or_config):
    cfg = getattr(model_or_config, "config", model_or_config)
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def model_shape(model_or_config) -> ModelShape:
    """Read the `ModelShape` of a supported model (or its config); unsupported types raise."""
    if not isinstance(getattr(getattr(model_or_config, "config", model_or_config), "model_type", None), str):
        raise TypeError(
            "model must be a Hugging Face causal LM (a transformers model, e.g. from "
            "sparsekv.load_default_model() or AutoModelForCausalLM.from_pretrained), or its "
            f"config; got {type(model_or_config).__name__}"
            + (f" {model_or_config!r} (load it first)" if isinstance(model_or_config, str) else "")
        )
    cfg = text_config(model_or_config)
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type={cfg.model_type!r} is not supported; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    n = cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layer_types = getattr(cfg, "layer_types", None)
    sliding = getattr(cfg, "sliding_window", None)
    if layer_types is None:
        # Mistral-style configs with a global sliding window slide in every layer.
        kind = "sliding_attention" if sliding else "full_attention"
        layer_types = [kind] * n
    return ModelShape(
        model_type=cfg.model_type,
        num_layers=n,
        num_attention_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        hidden_size=cfg.hidden_size,
        layer_types=tuple(layer_types),
        sliding_window=sliding,
    )


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of decoder blocks (`model.model.layers` for every supported family)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None and hasattr(inner, "language_model"):
        layers = inner.language_model.layers
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of every decoder layer, indexed by layer."""
    return [layer.self_attn for layer in decoder_layers(model)]


def eager_attention_function(module: nn.Module) -> Callable:
    """The family's own eager attention function (Gemma's handles soft-capping, for example)."""
    mod = sys.modules[type(module).__module__]
    fn = getattr(mod, "eager_attention_forward", None)
    if fn is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    return fn


def softcap(module: nn.Module) -> float | None:
    """Attention logit soft-capping value of the module's config, if any (Gemma 2/3 style)."""
    return getattr(getattr(module, "config", None), "attn_logit_softcapping", None)


def pre_rope_queries(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The queries of attention `module` before RoPE, after its QK-norm if it has one (Qwen3,
    Gemma 3): `hidden_states` `(batch, seq, hidden)` -> `(batch, heads, seq, head_dim)`."""
    b, n, _ = hidden_states.shape
    q = module.q_proj(hidden_states).view(b, n, -1, module.head_dim).transpose(1, 2)
    norm = getattr(module, "q_norm", None)
    return norm(q) if norm is not None else q


def rotary_cos_sin(model: nn.Module, layer_idx: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE `cos`, `sin` `(n, head_dim)` of layer `layer_idx` at absolute `positions` `(n,)`, with
    the layer type's own rotary base and scaling (Gemma 3: full and sliding layers differ)."""
    inner = getattr(model, "model", model)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None and hasattr(inner, "language_model"):
        rotary = inner.language_model.rotary_emb
    if rotary is None:
        raise ValueError(f"cannot find the rotary embedding of {type(model).__name__}")
    x = next(model.parameters())
    pos = positions.to(x.device)[None]
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        cos, sin = rotary(x, pos, model_shape(model).layer_types[layer_idx])
    else:
        cos, sin = rotary(x, pos)
    return cos[0], sin[0]


def attention_scaling(module: nn.Module) -> float:
    """The factor attention `module` multiplies its logits by (Gemma 3:
    `query_pre_attn_scalar ** -0.5`; otherwise `head_dim ** -0.5`)."""
    return float(getattr(module, "scaling", None) or module.head_dim**-0.5)
