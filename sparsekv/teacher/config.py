"""`TargetConfig`: the definition of the teacher target (which statistic, which queries count,
how layers and heads combine, which signals: later questions, a repeat of the context, KVzip+),
with the allowed values of each field and their checks. The formulas are in
`sparsekv.teacher.statistics`; this module computes nothing."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sparsekv.configfile import from_fields

STATS = ("mass", "max")
CROSS_LAYER = ("cumulative", "per_layer")
SOURCE_LAYERS = ("all", "budgeted", "all_budgeted")
NORMALIZE = ("none", "length", "uniform")
CROSS_HEAD = ("mean", "same")
SIGNALS = ("questions", "reconstruction", "both")
TARGET_KINDS = ("attention", "kvzip_plus")


@dataclass
class TargetConfig:
    """Definition of the teacher target (see the module docstring for the formulas)."""

    stat: str = "mass"
    """"mass": summed attention a key receives from later queries; "max": the largest share any
    one later query gives it."""
    cross_layer: str = "cumulative"
    """"cumulative": mix of the layer's own statistic and the later layers', weighted by
    `decay`; "per_layer": the layer's own statistic only."""
    decay: float = 0.5
    """Weight of a source layer at rank distance d after the budgeted layer: decay**d; in [0, 1]
    (0 = the layer alone, 1 = all sources equal)."""
    source_layers: str = "all"
    """Which other layers contribute: "all" later layers, "budgeted" (later full-attention layers
    only) or "all_budgeted" (every full-attention layer, earlier ones too, at rank distance |d|:
    the last budgeted layer borrows from the earlier ones)."""
    normalize: str = "length"
    """"none", "length" (divide mass by the number of queries that could see the key) or
    "uniform" (attention relative to a uniform spread, averaged over those queries)."""
    exclude_self: bool = True
    """Leave out the attention a token's own query pays to it (only later queries count)."""
    cross_head: str = "mean"
    """How later layers' KV heads map onto this layer's: "mean" over heads, or "same" index."""
    signal: str = "questions"
    """Whose attention makes the target: "questions" (the later queries of the sequence itself),
    "reconstruction" (the queries of a teacher-forced repeat of the context, question-free; full-
    attention layers only) or "both" (a mix of the two targets, weighted by
    `reconstruction_weight`). See sparsekv.teacher.reconstruction."""
    kind: str = "attention"
    """"attention": the statistics above (stat, normalize, cross_layer, ...), a distribution per
    row; "kvzip_plus": KVzap's regression target, per layer and KV head, log of the max over the
    repeated copy's queries and the group's heads of attention x ||W_O^h v_i|| / ||h_j|| (needs
    signal=reconstruction; the attention-statistic fields are then unused)."""
    reconstruction_weight: float = 0.5
    """Under signal=both: target = (1 - w) x questions target + w x reconstruction target, both
    distributions over the sequence; in [0, 1]."""
    probe_weight: float = 0.0
    """The retrieval-probe target's share (`sparsekv.teacher.probes`): target = (1 - p) x the
    `signal`'s target + p x the probe target (the attention that recalling random spans of the
    sequence pays to it; full-attention layers). In [0, 1]; above 0 it is read from a teacher
    store built with the probe signal (`dataset: store:PATH`), not from text."""
    min_distance: int = 0
    """Only queries at least this many positions after a key count towards its statistic (and
    towards the "length" / "uniform" count): the decode-time target, e.g. 64 = the attention a
    token receives after it has left a 64-token recent window. 0 = every query that may see the
    key. Combines with `exclude_self` as `i - j >= max(min_distance, 1 if exclude_self else 0)`.
    Applies to the attention of the sequence's own queries (signal questions, and the questions
    part of both); a repeat of the context is always counted whole. An int >= 0."""

    def __post_init__(self) -> None:
        for name, allowed in (
            ("stat", STATS),
            ("cross_layer", CROSS_LAYER),
            ("source_layers", SOURCE_LAYERS),
            ("normalize", NORMALIZE),
            ("cross_head", CROSS_HEAD),
            ("signal", SIGNALS),
            ("kind", TARGET_KINDS),
        ):
            v = getattr(self, name)
            if v not in allowed:
                raise ValueError(
                    f"{name}={v!r} is not supported; allowed values: {', '.join(allowed)}"
                )
        d = self.decay
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not (0.0 <= d <= 1.0):
            raise ValueError(f"decay={d!r} must be a number in [0, 1]")
        self.decay = float(d)
        if not isinstance(self.exclude_self, bool):
            raise ValueError(f"exclude_self={self.exclude_self!r} must be true or false")
        w = self.reconstruction_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (0.0 <= w <= 1.0):
            raise ValueError(f"reconstruction_weight={w!r} must be a number in [0, 1]")
        self.reconstruction_weight = float(w)
        p = self.probe_weight
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 <= p <= 1.0):
            raise ValueError(f"probe_weight={p!r} must be a number in [0, 1]")
        self.probe_weight = float(p)
        if self.probe_weight and self.kind == "kvzip_plus":
            raise ValueError(
                "probe_weight mixes attention distributions: it needs kind='attention', not "
                "kind='kvzip_plus'"
            )
        md = self.min_distance
        if isinstance(md, bool) or not isinstance(md, int) or md < 0:
            raise ValueError(
                f"min_distance={md!r} must be an int >= 0 (0 = every later query counts; "
                "64 = only queries at least 64 positions after the key)"
            )
        if self.kind == "kvzip_plus" and self.signal != "reconstruction":
            raise ValueError(
                f"kind='kvzip_plus' is read from the reconstruction pass: it needs "
                f"signal='reconstruction', not signal={self.signal!r}"
            )

    @property
    def log_scale(self) -> bool:
        """True when targets are log scores (kvzip_plus), False when they are distributions."""
        return self.kind == "kvzip_plus"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not d["probe_weight"]:  # targets without probes keep the keys (and digests) they had
            del d["probe_weight"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TargetConfig:
        return from_fields(cls, d)

    def describe(self) -> str:
        """One line for model cards and logs."""
        if self.kind == "kvzip_plus":
            return (
                "KVzip+ (KVzap): log max over the repeated copy's queries and the group's heads of "
                "attention x ||W_O v|| / ||h||, per layer and KV head"
            )
        if self.cross_layer == "per_layer":
            mix = "the layer's own attention only"
        else:
            mix = (
                f"cumulative over {self.source_layers} later layers, weight {self.decay:g}**rank distance, "
                f"later layers' KV heads: {self.cross_head}"
            )
        own = "excluding" if self.exclude_self else "including"
        if self.min_distance > 1 or (self.min_distance == 1 and not self.exclude_self):
            own = f"from queries >= {self.min_distance} positions later only"
        else:
            own = f"{own} self-attention"
        line = f"attention {self.stat} ({self.normalize}-normalized, {own}); {mix}"
        if self.signal == "both":
            w = self.reconstruction_weight
            line = f"{line}; {1 - w:g} x later queries + {w:g} x a repeat of the context"
        elif self.signal == "reconstruction":
            line = f"{line}; from the queries of a repeat of the context (full-attention layers)"
        if self.probe_weight:
            p = self.probe_weight
            line = f"{line}; mixed {1 - p:g} : {p:g} with recall probes of random spans"
        return line
