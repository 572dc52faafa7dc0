"""The `lora:` section of a training config: `LoraTrainConfig`, its fields (with the help text
`python train.py --help` prints) and their checks. The LoRA training itself is `train.lora`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
USES = ("agnostic", "aware")


@dataclass
class LoraTrainConfig:
    """The `lora:` section of a training config (empty = no LoRA)."""

    adapter: str | None = None
    """A trained adapter (folder or Hub id) whose gate the LoRA is trained for, without training
    a head first; None = train the LoRA right after the head of this run."""
    r: int = 8
    """LoRA rank."""
    alpha: float = 16.0
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    dropout: float = 0.0
    """Dropout on the LoRA input, in [0, 1)."""
    target_modules: list[str] = field(default_factory=lambda: list(MODULES))
    """Attention projections that get a LoRA: any of q_proj, k_proj, v_proj, o_proj."""
    layers: list[int] | None = None
    """Decoder layers whose projections get a LoRA; None = the full-attention layers."""
    budget: float = 0.2
    """Fraction of the context each budgeted layer keeps while training, in (0, 1]."""
    use: str = "agnostic"
    """Which recorded settings of the gate the learned policy scores with: agnostic or aware."""
    eviction: dict = field(default_factory=dict)
    """Other `EvictionConfig` fields of the training cache (schedule, sink_tokens, ...)."""
    steps: int = 40
    """Optimizer steps (one block per step)."""
    lr: float = 5e-4
    """Peak learning rate (AdamW), with linear warm-up and cosine decay to 0."""
    warmup_steps: int = 4
    """Linear warm-up steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    context_len: int = 512
    """Tokens compressed per block (prefilled through the evicting cache)."""
    continuation_len: int = 64
    """Tokens teacher-forced after the context; the KL is taken on these positions only."""
    eval_sequences: int = 4
    """Blocks held out of training on which the KL is measured before and after."""

    def __post_init__(self) -> None:
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise ValueError(
                f"adapter={self.adapter!r} must be an adapter folder or Hub id, or null"
            )
        for name, low in (
            ("r", 1),
            ("steps", 1),
            ("context_len", 8),
            ("continuation_len", 1),
            ("warmup_steps", 0),
            ("eval_sequences", 0),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name}={v!r} must be an int >= {low}")
        for name, low, high in (("alpha", 0.0, math.inf), ("lr", 0.0, math.inf)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (low < v < high):
                raise ValueError(f"{name}={v!r} must be a finite number > {low:g}")
        for name, low, high in (("dropout", 0.0, 1.0), ("weight_decay", 0.0, math.inf)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (low <= v < high):
                raise ValueError(f"{name}={v!r} must be a finite number in [{low:g}, {high:g})")
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not (0.0 < b <= 1.0):
            raise ValueError(f"budget={b!r} must be a fraction in (0, 1]")
        mods = self.target_modules
        if not isinstance(mods, list) or not mods or any(m not in MODULES for m in mods):
            raise ValueError(
                f"target_modules={mods!r} must be a non-empty list of {', '.join(MODULES)}"
            )
        if self.layers is not None and (
            not isinstance(self.layers, list)
            or not self.layers
            or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in self.layers)
        ):
            raise ValueError(
                f"layers={self.layers!r} must be null or a non-empty list of ints >= 0"
            )
        if self.use not in USES:
            raise ValueError(
                f"use={self.use!r} is not supported; allowed values: {', '.join(USES)}"
            )
        if not isinstance(self.eviction, dict) or "budget" in self.eviction:
            raise ValueError(
                f"eviction={self.eviction!r} must be a mapping of EvictionConfig fields "
                "other than budget (set lora.budget)"
            )
        self.eviction_config()  # validates the fields

    def eviction_config(self):
        from sparsekv.config import EvictionConfig

        return EvictionConfig.from_dict({"budget": float(self.budget), **self.eviction})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
