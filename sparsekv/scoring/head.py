"""The gating head: per budgeted layer, a tiny module that scores each token as it enters the cache.

This module owns the head's architecture only (no training, no loading, no cache logic).

For a budgeted layer `l`, the head reads that layer's attention inputs `(batch, seq, hidden)`
(the hidden states entering `self_attn`, i.e. the output of the layer's input layernorm) and
returns one logit per KV head per token, `(batch, kv_heads, seq)`; higher = keep. It needs no
attention matrix, so it works with fused attention kernels, and each token is scored once.

Each layer's module is:

- `kind="linear"`: `RMSNorm -> Linear(hidden_size, kv_heads)`
- `kind="mlp"` (default): `RMSNorm -> Linear(hidden_size, hidden) -> GELU -> Linear(hidden, kv_heads)`
- `kind="kvzap"`: `Linear(hidden_size, hidden) -> GELU -> Linear(hidden, kv_heads)`, KVzap's MLP
  (NVIDIA kvpress, hidden 512 there) exactly: no norm, so it reads the raw attention inputs and
  can regress absolute log scores (its target divides by the query token's norm, not the key's).

The RMSNorm of "linear" and "mlp" has no learnable weight: it only rescales each token's vector to unit RMS, so the
head is insensitive to the base model's activation scale (Gemma's layernorm weights, bf16) and
trains stably with one learning rate. The head always computes in float32, whatever the dtype of
its input, so that rankings are not decided by bf16 rounding. With gemma-3-270m (hidden 640,
1 KV head, 3 full-attention layers) the default head has 3 x (640*64 + 64 + 64 + 1) = 123,267
parameters, 0.05% of the base model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

KINDS = ("linear", "mlp", "kvzap")


class _RMSNormNoWeight(nn.Module):
    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def _layer_module(kind: str, hidden_size: int, num_kv_heads: int, hidden: int) -> nn.Module:
    if kind == "linear":
        return nn.Sequential(_RMSNormNoWeight(), nn.Linear(hidden_size, num_kv_heads))
    if kind == "kvzap":
        return nn.Sequential(
            nn.Linear(hidden_size, hidden), nn.GELU(), nn.Linear(hidden, num_kv_heads)
        )
    return nn.Sequential(
        _RMSNormNoWeight(),
        nn.Linear(hidden_size, hidden),
        nn.GELU(),
        nn.Linear(hidden, num_kv_heads),
    )


class _Ensemble(nn.Module):
    """`k` modules of one layer, trained apart; their logits are averaged."""

    def __init__(self, members: list[nn.Module]):
        super().__init__()
        self.members = nn.ModuleList(members)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.members[0](x)
        for m in self.members[1:]:
            out = out + m(x)
        return out / len(self.members)


class GatingHead(nn.Module):
    """One small scorer per budgeted layer, in an `nn.ModuleDict` keyed by `str(layer_idx)`.

    Parameters are float32. State-dict keys are `heads.<layer>.<i>.weight|bias`; with `members`
    k > 1 (an ensemble: k heads whose logits are averaged, each layer's score the mean of its k
    modules' logits) they are `heads.<layer>.members.<m>.<i>.weight|bias`.
    """

    def __init__(
        self,
        hidden_size: int,
        num_kv_heads: int,
        layers: Sequence[int],
        kind: str = "mlp",
        hidden: int = 64,
        members: int = 1,
    ):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is not supported; allowed values: {', '.join(KINDS)}")
        for name, v in (
            ("hidden_size", hidden_size),
            ("num_kv_heads", num_kv_heads),
            ("hidden", hidden),
            ("members", members),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        layers = [int(x) for x in layers]
        if not layers or len(set(layers)) != len(layers) or min(layers) < 0:
            raise ValueError(
                f"layers={layers!r} must be a non-empty list of distinct layer indices >= 0"
            )
        self.hidden_size = hidden_size
        self.num_kv_heads = num_kv_heads
        self.layers = sorted(layers)
        self.kind = kind
        self.hidden = hidden
        self.members = members

        def layer_module() -> nn.Module:
            if members == 1:
                return _layer_module(kind, hidden_size, num_kv_heads, hidden)
            return _Ensemble(
                [_layer_module(kind, hidden_size, num_kv_heads, hidden) for _ in range(members)]
            )

        self.heads = nn.ModuleDict({str(i): layer_module() for i in self.layers})

    def forward_layer(self, layer_idx: int, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states `(batch, seq, hidden)` -> logits `(batch, kv_heads, seq)` (float32)."""
        key = str(layer_idx)
        if key not in self.heads:
            raise ValueError(
                f"the gating head has no module for layer {layer_idx}; its layers: {self.layers}"
            )
        if hidden_states.ndim != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states has shape {tuple(hidden_states.shape)}; expected (batch, seq, {self.hidden_size})"
            )
        param = next(self.heads[key].parameters())
        x = hidden_states.to(device=param.device, dtype=param.dtype)
        return self.heads[key](x).transpose(1, 2)

    def forward(self, hidden_states: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """layer -> `(batch, seq, hidden)` into layer -> `(batch, kv_heads, seq)` logits."""
        return {layer: self.forward_layer(layer, h) for layer, h in hidden_states.items()}

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def extra_repr(self) -> str:
        members = f", members={self.members}" if self.members > 1 else ""
        return f"kind={self.kind!r}, hidden={self.hidden}, layers={self.layers}, kv_heads={self.num_kv_heads}{members}"
