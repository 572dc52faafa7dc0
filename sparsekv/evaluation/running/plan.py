"""Planning an evaluation grid: which samples it holds, which runs each (sample, protocol) group
asks for, which of those fork from the group's shared prefill, and how big the grid is.

Nothing here runs a model or touches result rows: `runner.py` executes the plan, `rows/` keeps
what it produced. `check_eviction` refuses, before any run, eviction settings that every run of a
method would fail on. A run is named by its method key `(label, budget)` (budget as text, so 0.3 and
"0.3" are one key); the full-cache reference is `(REFERENCE, "1.0")` and belongs to every group.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any

from sparsekv.evaluation.config import REFERENCE, EvalConfig, PolicySpec
from sparsekv.evaluation.tasks import Sample, make_sample
from sparsekv.evaluation.tasks.codec import Codec

REFERENCE_KEY = (REFERENCE, str(1.0))


def build_samples(cfg: EvalConfig, codec: Codec) -> list[Sample]:
    """Every sample of the grid, in order index -> task -> length (deterministic): a run stopped
    early (or resumed later) has covered every task equally far."""
    out = []
    for i in range(cfg.samples):
        for task in cfg.tasks:
            opts = dict(cfg.task_options.get(task, {}))
            max_new = opts.pop("max_new_tokens", None)
            for length in cfg.lengths:
                s = make_sample(task, codec, length, i, seed=cfg.seed, **opts)
                if max_new is not None:
                    s.max_new_tokens = int(max_new)
                out.append(s)
    return out


def method_keys(cfg: EvalConfig, protocol: str) -> set[tuple[str, str]]:
    """(label, budget) of every run of one group under `protocol`, the reference included."""
    return {REFERENCE_KEY} | {
        (p.label, str(b)) for p in cfg.policy_specs for b in cfg.budgets_of(p, protocol)
    }


def grid_size(cfg: EvalConfig, samples: list[Sample]) -> tuple[int, int]:
    """(number of runs, number of prompt tokens processed) of the whole grid."""
    runs = tokens = 0
    for s in samples:
        k = sum(len(method_keys(cfg, pr)) for pr in cfg.protocols_for(s.task))
        runs += k
        tokens += k * s.metadata["n_tokens"]
    return runs, tokens


def groups_to_run(
    cfg: EvalConfig, samples: list[Sample], done: dict[tuple[str, str], set[tuple[str, str]]]
) -> list[tuple[Sample, str, frozenset]]:
    """The (sample, protocol, finished method keys) groups that still have a run to do, in grid
    order. `done` maps (sample_id, protocol) to the method keys whose rows are already kept;
    a group whose every key is there is left out, the others run only their missing keys (the
    reference is recomputed for their KL, and written only if it is missing too)."""
    todo = []
    for s in samples:
        for pr in cfg.protocols_for(s.task):
            have = done.get((s.sample_id, pr), set())
            if not method_keys(cfg, pr) <= have:
                todo.append((s, pr, frozenset(have)))
    return todo


def runs_left(cfg: EvalConfig, todo: list[tuple[Sample, str, frozenset]]) -> int:
    """Rows the groups of `groups_to_run` will write."""
    return sum(len(method_keys(cfg, pr) - have) for _, pr, have in todo)


@dataclass(frozen=True)
class ForkPlan:
    """Which methods start from the shared prefill of a group, and what that prefill records.

    `forkable[spec.spec]` is True for a method that forks; `record` are the attention statistics
    the shared prefill keeps ("all", "window", "last"); `record_window` its observation window."""

    forkable: dict[str, bool]
    record: tuple[str, ...]
    record_window: int


def needs(policy: Any) -> str | None:
    """The attention statistic a policy reads at prefill ("all", "window", "last" or None)."""
    return policy.attention_queries or ("all" if policy.tracks_observed else None)


def uses_lora(spec: PolicySpec, policy: Any) -> bool:
    """True when `spec` runs with its adapter's LoRA applied to the model (a learned adapter that
    carries one, unless `lora: false`)."""
    return bool(spec.lora) and getattr(getattr(policy, "adapter", None), "lora", None) is not None


def plan_forks(cfg: EvalConfig, built: dict[str, Any]) -> ForkPlan:
    """Decide which methods fork from the one recorded prefill of each sample. `built` maps each
    spec text to its built policy. Methods with `prefill_chunk`, or whose observation window
    differs from the most common one, prefill live; `shared_prefill: false` makes all live. A
    method that runs its adapter's LoRA (`uses_lora`: the LoRA changes the hidden states, so the
    plain model's prefill is not its own) forks from a prefill recorded with that LoRA applied
    (`execute.Runner.run_group` makes one per LoRA and prompt)."""
    windows = Counter(p.window for p in built.values() if needs(p) == "window")
    record_window = windows.most_common(1)[0][0] if windows else 32
    forkable = {
        spec.spec: bool(cfg.shared_prefill)
        and prefill_chunk(cfg, spec) is None
        and (needs(built[spec.spec]) != "window" or built[spec.spec].window == record_window)
        for spec in cfg.policy_specs
    }
    wanted = {needs(built[key]) for key, ok in forkable.items() if ok}
    record = tuple(sorted(n for n in wanted if n)) or ("last",)
    return ForkPlan(forkable, record, record_window)


def prefill_chunk(cfg: EvalConfig, spec: PolicySpec | None) -> int | None:
    """The `prefill_chunk` a method runs with (None: the prompt in one forward)."""
    if spec is None:
        return None
    return {**cfg.eviction, **spec.eviction}.get("prefill_chunk")


def check_eviction(cfg: EvalConfig, spec: PolicySpec, policy: Any, num_budgeted: int) -> None:
    """Refuse (ValueError, before any run) eviction settings that every run of `spec` would fail
    on with the grid's model, which has `num_budgeted` budgeted layers (e.g. `schedule=[0.5]`,
    one fraction for three layers): its `EvictionConfig` at each of its budgets and the
    per-layer schedule that resolves to (`policy` may bring its own schedule)."""
    from sparsekv.cache.schedules import layer_fractions
    from sparsekv.config import EvictionConfig

    settings = {**cfg.eviction, **spec.eviction}
    budgets = {str(b): b for pr in cfg.protocols for b in cfg.budgets_of(spec, pr)}
    for budget in budgets.values():
        try:
            with warnings.catch_warnings():  # a run warns (e.g. a floor above the budget) itself
                warnings.simplefilter("ignore")
                config = EvictionConfig(budget=budget, **settings)
            layer_fractions(config, num_budgeted, getattr(policy, "schedule", None) or config.schedule)
        except (TypeError, ValueError) as e:
            where = f"policy {spec.spec!r}" if spec.eviction else "--eviction (eviction:)"
            raise ValueError(
                f"{where} settings {settings} at budget {budget} on model {cfg.model}: {e}"
            ) from None
