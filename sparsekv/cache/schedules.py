"""Retention schedules: how a global budget becomes one budget per layer.

Pure functions of an `EvictionConfig` and the list of budgeted layers; the cache asks
`layer_capacity` how many entries a layer may keep after seeing `tokens_seen` tokens.
"""

from __future__ import annotations

import math

from sparsekv.config import EvictionConfig


def layer_fractions(config: EvictionConfig, num_budgeted: int, schedule=None) -> list[float]:
    """Per budgeted layer, the fraction of the uniform budget's share it keeps (relative weights
    whose mean is the budget when the budget is a fraction).

    Returns fractions in (0, 1] for float budgets; for int budgets, the same shape with the
    budget read as a fraction of 1.0 and rescaled by `layer_capacity`.
    """
    schedule = config.schedule if schedule is None else schedule
    base = float(config.budget) if isinstance(config.budget, float) else 1.0
    if isinstance(schedule, list):
        if len(schedule) != num_budgeted:
            raise ValueError(
                f"schedule has {len(schedule)} entries but the model has {num_budgeted} budgeted layers; "
                "give one fraction per budgeted layer"
            )
        return list(schedule)
    if schedule == "uniform" or num_budgeted == 1:
        return [base] * num_budgeted
    if schedule != "pyramid":
        raise ValueError(f"schedule={schedule!r} is not supported; allowed values: uniform, pyramid")
    slope = config.pyramid_slope
    raw = [base * (1 + slope * (1 - 2 * i / (num_budgeted - 1))) for i in range(num_budgeted)]
    if isinstance(config.budget, int):
        return raw  # relative weights around 1.0, the token count rescales them
    # Clip to (0, 1] and hand what the clipped layers could not take to the others, so the total
    # equals the uniform schedule's.
    target = base * num_budgeted
    fr = [min(1.0, r) for r in raw]
    for _ in range(num_budgeted):
        deficit = target - sum(fr)
        free = [i for i, f in enumerate(fr) if f < 1.0]
        if deficit <= 1e-9 or not free:
            break
        for i in free:
            fr[i] = min(1.0, fr[i] + deficit / len(free))
    return fr


def layer_capacity(config: EvictionConfig, fraction: float, tokens_seen: int) -> int:
    """Entries a layer with schedule weight `fraction` may keep after `tokens_seen` tokens."""
    if isinstance(config.budget, int):
        return max(1, int(round(config.budget * fraction)))
    return max(1, math.ceil(fraction * tokens_seen))
