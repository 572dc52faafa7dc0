"""What a kvpress peer run is made of: the presses, the grid of runs (`Plan`) and how one
sample's prompt is fed to kvpress's pipeline. Pure Python: imports neither kvpress nor sparsekv.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

REPO = Path(__file__).resolve().parents[3]
EVAL_SRC = REPO / "sparsekv" / "evaluation"
SOURCE = "kvpress"
REFERENCE_LABEL = "no-press"

# name -> (kvpress class, keyword arguments, needs eager attention)
PRESSES: dict[str, tuple[str, dict[str, Any], bool]] = {
    "snapkv": ("SnapKVPress", {}, False),
    "expected_attention": ("ExpectedAttentionPress", {}, False),
    "tova": ("TOVAPress", {}, False),
    "knorm": ("KnormPress", {}, False),
    "streaming_llm": ("StreamingLLMPress", {}, False),
    "pyramidkv": ("PyramidKVPress", {}, False),
    "observed_attention": ("ObservedAttentionPress", {}, True),
}
LAYER_MODES = ("all", "full")
PROTOCOLS = ("agnostic", "aware")


@dataclass(frozen=True)
class PressSpec:
    """One kvpress method: a press from `PRESSES` applied to `layers` ("all" or "full")."""

    press: str
    layers: str

    def __post_init__(self) -> None:
        if self.press not in PRESSES:
            raise ValueError(f"press={self.press!r}; allowed values: {', '.join(PRESSES)}")
        if self.layers not in LAYER_MODES:
            raise ValueError(f"layers={self.layers!r}; allowed values: {', '.join(LAYER_MODES)}")

    @property
    def label(self) -> str:
        return f"{self.press}-{self.layers}"

    @property
    def needs_eager(self) -> bool:
        return PRESSES[self.press][2]


def compression_ratio(budget: float, n_tokens: int) -> float:
    """kvpress's compression ratio for a harness budget: 1 - fraction, or 1 - tokens / n_tokens."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"budget={budget!r} must be a fraction in (0, 1] or a token count >= 1")
    if isinstance(budget, float) and 0 < budget <= 1:
        return max(0.0, 1.0 - budget)
    if isinstance(budget, int) and budget >= 1:
        return max(0.0, 1.0 - budget / max(1, n_tokens))
    raise ValueError(f"budget={budget!r} must be a fraction in (0, 1] or a token count >= 1")


TOKENS = re.compile(r"(\d+)\s*(?:tok|tokens)", re.IGNORECASE)
BUDGET_RULE = (
    "a fraction in (0, 1] (a float such as 0.3, or 1.0 for the whole context), a token count "
    ">= 2 (an int such as 512), or a count spelled Ntok (1tok, 512tok)"
)


def parse_budget(b: Any) -> float | int:
    """One budget by the harness's rule (`sparsekv.config.check_budget`, which this file
    cannot import): a float is a fraction in (0, 1], so `2.0` is refused, not read as two
    tokens; an int >= 2 or "Ntok" is a token count ("1tok" is one token); a bare `1` is refused
    as ambiguous beside `1.0`; bools are refused. Strings are read as YAML and the command line
    write them ("0.3", "512", "512tok")."""
    if isinstance(b, str):
        s = b.strip()
        m = TOKENS.fullmatch(s)
        if m is not None:
            if int(m.group(1)) < 1:
                raise ValueError(f"budget {s!r}: a token count is >= 1; allowed: {BUDGET_RULE}")
            return int(m.group(1))
        try:
            b = int(s) if s.isdigit() else float(s)
        except ValueError:
            raise ValueError(f"budget {s!r} is not a number; allowed: {BUDGET_RULE}") from None
    if isinstance(b, bool) or not isinstance(b, (int, float)):
        raise ValueError(f"budget {b!r} is not a number; allowed: {BUDGET_RULE}")  # noqa: TRY004
    if isinstance(b, float) and not 0.0 < b <= 1.0:
        hint = f" (for {int(b)} tokens write {int(b)} or {int(b)}tok)" if b > 1 and b.is_integer() else ""
        raise ValueError(f"budget {b!r}: a float budget is a fraction in (0, 1]{hint}; allowed: {BUDGET_RULE}")
    if isinstance(b, int) and b == 1:
        raise ValueError(f"budget 1 is ambiguous (one token, or 1.0 = the whole context?); write 1.0 "
                         f"or 1tok; allowed: {BUDGET_RULE}")
    if isinstance(b, int) and b < 1:
        raise ValueError(f"budget {b!r}: a token count is >= 1; allowed: {BUDGET_RULE}")
    return b


def parse_budgets(text: str | Iterable) -> list[float | int]:
    """Comma-separated budgets (the command line's --budget) or a list (config.yaml's `budgets`,
    where a one-token budget is written "1tok"), each by `parse_budget`."""
    items = [b.strip() for b in text.split(",")] if isinstance(text, str) else list(text)
    out: list[float | int] = []
    for b in items:
        if b == "" or b is None:
            continue
        out.append(parse_budget(b))
    if not out:
        raise ValueError("no budgets given: --budget 0.1,0.3 (or a config.yaml with budgets)")
    return out


def parse_list(text: str, allowed: Iterable[str], what: str) -> list[str]:
    allowed = list(allowed)
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise ValueError(f"{what}={text!r}; allowed values: {', '.join(allowed)}")
    return items


def read_prompts(path: str | Path) -> list[dict[str, Any]]:
    """Samples of `prompts.jsonl` (plain dicts, the harness's `Sample` fields + `protocols`)."""
    out = []
    need = ("task", "sample_id", "kind", "context_ids", "question_ids", "answer", "metadata")
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            d = json.loads(line)
            missing = [k for k in need if k not in d]
            if missing:
                raise ValueError(
                    f"{path}:{i}: missing field(s) {missing}; is this a sparsekv prompts.jsonl?"
                )
            d.setdefault("target_ids", [])
            d.setdefault("protocols", ["agnostic"])
            out.append(d)
    return out


def split_prompt(sample: dict[str, Any], protocol: str) -> tuple[list[int], list[int], int]:
    """(ids compressed by the press, ids fed after it as the question, max new tokens)."""
    ctx, q = list(sample["context_ids"]), list(sample["question_ids"])
    kind = sample["kind"]
    if kind == "continuation":
        return ctx, list(sample["target_ids"][:-1]), 1
    max_new = int(sample.get("max_new_tokens") or 1)
    if q and protocol == "agnostic":
        return ctx, q, max_new
    full = ctx + q  # aware, or no question: the last prompt token is the pipeline's question
    return full[:-1], full[-1:], max_new


def skip_reason(sample: dict[str, Any], protocol: str, spec: PressSpec | None) -> str | None:
    """Why a run is not made (None: it is made)."""
    if protocol not in sample.get("protocols", ["agnostic"]):
        return f"protocol {protocol} does not apply to task {sample['task']}"
    return None


@dataclass
class RawRun:
    """What one pipeline run produced, before metrics. `step_logprobs` is `(steps, vocab)`: one
    row per generated token (answer/generate) or per teacher-forced position predicting
    `target_ids[1:]` (continuation)."""

    output_ids: list[int]
    output: str
    step_logprobs: Any
    kv_bytes_compressed: int
    kv_bytes_end: int
    prefill_s: float
    decode_s: float
    peak_rss_mb: float
    extra: dict[str, Any] = field(default_factory=dict)


class PressRunner(Protocol):
    def run(
        self, sample: dict[str, Any], protocol: str, spec: PressSpec | None, budget
    ) -> RawRun: ...


@dataclass
class Plan:
    samples: list[dict[str, Any]]
    specs: list[PressSpec]
    budgets: list[float | int]
    protocols: list[str]
    reference: bool = True

    def runs(self) -> list[tuple[dict[str, Any], str, PressSpec | None, Any]]:
        """(sample, protocol, spec or None for the reference, budget), in execution order."""
        out = []
        for s in self.samples:
            for p in self.protocols:
                if skip_reason(s, p, None):
                    continue
                if self.reference:
                    out.append((s, p, None, 1.0))
                for spec in self.specs:
                    if skip_reason(s, p, spec):
                        continue
                    out.extend((s, p, spec, b) for b in self.budgets)
        return out

    def skipped(self) -> dict[str, int]:
        """Reason -> number of runs left out (protocols that do not apply are not counted)."""
        out: dict[str, int] = {}
        for s in self.samples:
            for p in self.protocols:
                if skip_reason(s, p, None):
                    continue
                for spec in self.specs:
                    r = skip_reason(s, p, spec)
                    if r:
                        out[r] = out.get(r, 0) + len(self.budgets)
        return out
