"""`EvictionConfig`: what the evicting cache keeps, and when it re-ranks. Validation only.

The config is plain data: it round-trips through JSON (`to_dict` / `from_dict`) and every field
is checked in `__post_init__` with an error that names the field and its allowed values.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

SCHEDULES = ("uniform", "pyramid")
QUANTIZE = (None, "int8")


@dataclass
class EvictionConfig:
    budget: float | int
    """Per budgeted layer: a float in (0, 1] keeps that fraction of the tokens seen; an int >= 1
    keeps that many tokens. The schedule spreads it across layers."""
    schedule: str | list[float] = "uniform"
    """"uniform" (every budgeted layer keeps `budget`), "pyramid" (shallow layers keep more, deep
    layers less, same total; see `pyramid_slope`) or an explicit list of per-layer fractions, one
    per budgeted layer."""
    rerank_every: int = 16
    """Decode steps between global re-ranks (0 = never). Between them new tokens are scored on
    arrival and the lowest entries go when a layer exceeds its budget by `evict_slack`."""
    sink_tokens: int = 4
    """The first real (non-padding) tokens of each sequence are always kept."""
    recent_window: int = 64
    """The most recent tokens are always kept."""
    prefill_chunk: int | None = None
    """Prefill the prompt this many tokens at a time, evicting after each chunk, so peak KV memory
    is bounded by budget + chunk. None = one forward for the whole prompt."""
    pyramid_slope: float = 0.5
    """For schedule="pyramid": the first budgeted layer keeps budget*(1+slope), the last
    budget*(1-slope), linear in between (clipped to (0, 1], total preserved)."""
    evict_slack: int = 8
    """During decoding a layer may exceed its budget by this many entries before the lowest go."""
    quantize: str | None = None
    """None (keep the model's dtype) or "int8" (kept entries of the budgeted layers stored as
    int8 with one scale per token and KV head). The budget applies to full-attention layers;
    sliding-window layers stay as transformers keeps them."""

    def __post_init__(self) -> None:
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise ValueError(f"budget={b!r} must be a float in (0, 1] or an int >= 1")
        if isinstance(b, float) and not (0.0 < b <= 1.0):
            raise ValueError(f"budget={b!r}: a float budget is a fraction in (0, 1]; use an int for a token count")
        if isinstance(b, int) and b < 1:
            raise ValueError(f"budget={b!r}: an int budget is a token count >= 1")
        s = self.schedule
        if isinstance(s, (list, tuple)):
            if not s or not all(isinstance(x, (int, float)) and 0.0 < float(x) <= 1.0 for x in s):
                raise ValueError(f"schedule={s!r}: an explicit schedule is a non-empty list of fractions in (0, 1]")
            self.schedule = [float(x) for x in s]
        elif s not in SCHEDULES:
            raise ValueError(f"schedule={s!r} is not supported; allowed values: {', '.join(SCHEDULES)} or a list of fractions")
        for name in ("rerank_every", "sink_tokens", "recent_window", "evict_slack"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}={v!r} must be an int >= 0")
        if self.prefill_chunk is not None and (
            isinstance(self.prefill_chunk, bool) or not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 1
        ):
            raise ValueError(f"prefill_chunk={self.prefill_chunk!r} must be None or an int >= 1")
        if not isinstance(self.pyramid_slope, (int, float)) or not (0.0 <= self.pyramid_slope < 1.0):
            raise ValueError(f"pyramid_slope={self.pyramid_slope!r} must be in [0, 1)")
        if self.quantize not in QUANTIZE:
            raise ValueError(f"quantize={self.quantize!r} is not supported; allowed values: None, 'int8'")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EvictionConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown EvictionConfig field(s) {unknown}; allowed: {', '.join(sorted(known))}")
        return cls(**d)
