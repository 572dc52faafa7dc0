"""Plain-data settings, validation only: `EvictionConfig` (what the evicting cache keeps, and
when it re-ranks) and the learned policy's scoring settings (`check_learned_settings`).

The config is plain data: it round-trips through JSON (`to_dict` / `from_dict`), every field
is checked in `__post_init__` with an error that names the field and its allowed values, and it
is immutable once built (`dataclasses.replace` makes a changed copy); `validate()` checks it
again where it is used (`SparseKVCache`). The
learned policy's settings live here, not in `sparsekv.policies.learned`, because an adapter's
config records them too, and the adapter format must not import the policies (no import circle).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import FrozenInstanceError, asdict, dataclass
from typing import Any

from sparsekv.configfile import from_fields

SCHEDULES = ("uniform", "pyramid")
QUANTIZE = (None, "int8")
LAYOUTS = ("dynamic", "static")
BLEND_MODES = ("mix", "max")
HEAD_LAYERS = ("own", "first")
LEARNED_SETTINGS = (
    "recency", "kernel_size", "blend", "blend_mode", "head_layer", "span_fill", "span_peaks",
    "span_words",
)
"""The learned policy's scoring settings, which an adapter records per use (they do not change
training)."""
LEARNED_FALLBACK = {
    "recency": 0.0,
    "kernel_size": 1,
    "blend": 0.0,
    "blend_mode": "mix",
    "head_layer": "own",
    "span_fill": 0,
    "span_peaks": 0.0,
    "span_words": 0,
}
"""The settings of a learned policy whose scorer records none."""
LATER_SETTINGS = {k: LEARNED_FALLBACK[k] for k in ("span_fill", "span_peaks", "span_words")}
"""Settings added after the first adapters were written (which lack them), with the value that
leaves the policy as it was: an adapter records them only when they differ from it."""


def without_later_defaults(settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` less the `LATER_SETTINGS` that hold their "off" value: what an adapter writes
    and fingerprints, so adapters that do not use a later setting stay as they were."""
    return {k: v for k, v in settings.items() if k not in LATER_SETTINGS or v != LATER_SETTINGS[k]}


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_kernel_size(kernel_size: Any, name: str = "kernel_size") -> int:
    """An odd int >= 1 (a max-pooling width along the sequence)."""
    if (
        isinstance(kernel_size, bool)
        or not isinstance(kernel_size, int)
        or kernel_size < 1
        or kernel_size % 2 == 0
    ):
        raise ValueError(f"{name}={kernel_size!r} must be an odd int >= 1")
    return kernel_size


def check_learned_settings(
    blend: Any, blend_mode: Any, recency: Any, kernel_size: Any, head_layer: Any,
    span_fill: Any = 0, span_peaks: Any = 0.0, span_words: Any = 0,
) -> dict:
    """The learned policy's settings checked (shared by the policy and the adapter config, which
    records them per use); returns them normalized (`blend`, `recency`, `span_peaks` as float).
    `span_fill` (an int >= 0, 0 = off), `span_peaks` (in [0, 1)) and `span_words` (an int >= 0,
    0 = off) came later (`LATER_SETTINGS`)."""
    if not _is_number(blend) or not (0.0 <= blend <= 1.0):
        raise ValueError(f"blend={blend!r} must be a number in [0, 1]")
    if blend_mode not in BLEND_MODES:
        raise ValueError(
            f"blend_mode={blend_mode!r} is not supported; allowed values: {', '.join(BLEND_MODES)}"
        )
    if not _is_number(recency) or not (0.0 <= recency < float("inf")):
        raise ValueError(f"recency={recency!r} must be a finite number >= 0")
    if head_layer not in HEAD_LAYERS:
        raise ValueError(
            f"head_layer={head_layer!r} is not supported; allowed values: {', '.join(HEAD_LAYERS)}"
        )
    return {
        "blend": float(blend),
        "blend_mode": blend_mode,
        "recency": float(recency),
        "kernel_size": check_kernel_size(kernel_size),
        "head_layer": head_layer,
        "span_fill": _check_span_fill(span_fill),
        "span_peaks": _check_span_peaks(span_peaks),
        "span_words": _check_span_words(span_words),
    }


def _check_span_fill(span_fill: Any) -> int:
    if isinstance(span_fill, bool) or not isinstance(span_fill, int) or not 0 <= span_fill <= 4096:
        raise ValueError(f"span_fill={span_fill!r} must be an int in [0, 4096] (tokens; 0 = off)")
    return span_fill


def _check_span_words(span_words: Any) -> int:
    if isinstance(span_words, bool) or not isinstance(span_words, int) or not 0 <= span_words <= 4096:
        raise ValueError(
            f"span_words={span_words!r} must be an int in [0, 4096] (the longest word, in tokens, "
            "kept or dropped whole; 0 = off)"
        )
    return span_words


def _check_span_peaks(span_peaks: Any) -> float:
    if not _is_number(span_peaks) or not 0.0 <= span_peaks < 1.0:
        raise ValueError(
            f"span_peaks={span_peaks!r} must be a number in [0, 1) (a quantile; 0 = every token)"
        )
    return float(span_peaks)


TOKENS_SUFFIX = "tok"
"""The explicit spelling of a token-count budget: "512tok" (or "512tokens", "512 tok")."""
TOKENS_PATTERN = re.compile(r"(\d+)\s*(?:tok|tokens)", re.IGNORECASE)


class Tokens(int):
    """A budget given as a token count on purpose: `Tokens(1)` keeps one token per layer, where
    a plain `1` is refused (ambiguous beside `1.0`, the whole context). It is the int it holds
    (arithmetic, JSON, formatting); `check_budget` makes one of "1tok"."""

    def __new__(cls, n: Any) -> Tokens:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"Tokens({n!r}): a token count is an int >= 1")
        return super().__new__(cls, n)


MIN_FRACTION = 1e-4
"""The smallest fractional budget: below it a layer keeps less than one token in 10,000 (at
the longest contexts any model here reads, fewer tokens than its sinks and recent window)."""


def check_budget(b: Any) -> float | int:
    """A budget checked by the one rule the API (`EvictionConfig.budget`) and the command line
    (`sparsekv eval --budget`) share: a float in (0, 1] is a fraction of the tokens seen; an int
    >= 2 is a token count; `Tokens(n)` or the string "Ntok" is a token count n >= 1 (the only
    spelling of one token); `1` (an int), floats outside (0, 1] and bools are refused. Returns
    the float, the int, or a `Tokens`."""
    if isinstance(b, str):
        m = TOKENS_PATTERN.fullmatch(b.strip())
        if m is None:
            raise ValueError(
                f"budget={b!r} must be a float in (0, 1], an int >= 2, or a token count spelled "
                f'"N{TOKENS_SUFFIX}" such as "512{TOKENS_SUFFIX}"'
            )
        if int(m.group(1)) < 1:
            raise ValueError(f"budget={b!r}: a token budget is a count >= 1")
        return Tokens(int(m.group(1)))
    if isinstance(b, bool) or not isinstance(b, (int, float)):
        raise ValueError(f"budget={b!r} must be a float in (0, 1] or an int >= 1")
    if isinstance(b, float) and not (0.0 < b <= 1.0):
        raise ValueError(
            f"budget={b!r}: a float budget is a fraction in (0, 1]; use an int for a token "
            "count"
        )
    if isinstance(b, float) and b < MIN_FRACTION:
        raise ValueError(
            f"budget={b!r} keeps less than one token in {round(1 / MIN_FRACTION):,} (every "
            "layer would keep only its sinks and recent window); a fraction is at least "
            f"{MIN_FRACTION:g}: give a fraction such as 0.1, or a token count such as "
            f'"64{TOKENS_SUFFIX}"'
        )
    if isinstance(b, int) and b < 1:
        raise ValueError(f"budget={b!r}: an int budget is a token count >= 1")
    if isinstance(b, int) and b == 1 and not isinstance(b, Tokens):
        raise ValueError(
            f"budget={b!r} is ambiguous: an int budget is a token count, so it would keep one "
            "token per layer, while 1.0 keeps the whole context. Write budget=1.0 to keep "
            f'everything, or budget="1{TOKENS_SUFFIX}" (sparsekv.config.Tokens(1)) for one '
            "token per layer"
        )
    return b


def budget_from_text(text: str) -> float | int:
    """A budget written on a command line, read by `check_budget`'s rule: "0.3" is a fraction,
    "512" a token count, "512tok" an explicit one (the only spelling of one token, "1tok"); "2.0"
    is refused as a float above 1 and "1" as ambiguous, as the API refuses them. ValueError
    names the text and the allowed spellings."""
    if not isinstance(text, str):
        return check_budget(text)
    s = text.strip()
    if TOKENS_PATTERN.fullmatch(s):
        return check_budget(s)
    try:
        value: float | int = int(s) if s.isdigit() else float(s)
    except ValueError:
        raise ValueError(
            f"budget {text!r} is not a number; allowed: a fraction in (0, 1] such as 0.3, a token "
            f'count >= 2 such as 512, or a token count spelled "N{TOKENS_SUFFIX}" such as '
            f'"1{TOKENS_SUFFIX}"'
        ) from None
    return check_budget(value)


def _check_schedule(s: Any) -> str | list[float]:
    """A schedule name or an explicit list of per-layer fractions, checked (a list of floats)."""
    if isinstance(s, str):
        if s not in SCHEDULES:
            raise ValueError(
                f"schedule={s!r} is not supported; allowed values: {', '.join(SCHEDULES)} or a "
                "list of fractions in (0, 1]"
            )
        return s
    if not isinstance(s, (list, tuple)):
        hint = " (convert it with .tolist())" if hasattr(s, "tolist") else ""
        raise ValueError(  # noqa: TRY004  (every config error is a ValueError naming the field)
            f"schedule={s!r} (type {type(s).__name__}) is not supported; allowed values: "
            f"{', '.join(SCHEDULES)} or a list of fractions in (0, 1]{hint}"
        )
    if not s or not all(_is_number(x) and 0.0 < float(x) <= 1.0 for x in s):
        raise ValueError(
            f"schedule={s!r}: an explicit schedule is a non-empty list of fractions in (0, 1]"
        )
    return [float(x) for x in s]


@dataclass
class EvictionConfig:
    """What a `SparseKVCache` keeps and when it re-ranks. Immutable once built (a cache reads it
    at every step): `dataclasses.replace(config, budget=0.5)` makes a changed copy."""

    budget: float | int
    """Per budgeted layer: a float in (0, 1] keeps that fraction of the tokens seen (`1.0` =
    the whole context, nothing evicted); an int >= 2 keeps that many tokens. The schedule spreads
    it across layers. `1` (an int) is refused as ambiguous beside `1.0`: a one-token budget is
    spelled `budget="1tok"` or `budget=Tokens(1)` (any count may be: "512tok" is 512). A float
    above 1 (`2.0`) is refused, not read as a count; a bool is refused. The command line
    (`sparsekv eval --budget`) follows the same rule (`check_budget`). Every layer keeps at
    least `sink_tokens + recent_window` entries: a token budget below that is raised to it, with
    a warning."""
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
    layout: str = "dynamic"
    """How budgeted layers store their entries: "dynamic" (each eviction gathers the kept entries
    into new, smaller tensors) or "static" (buffers of a fixed number of slots, allocated once
    and written in place, so tensor shapes never change while decoding and the decode step can
    be compiled; see `sparsekv.cache.static`). Both keep the same entries."""
    max_length: int | None = None
    """layout="static": the longest sequence (prompt + generated tokens) the buffers are sized
    for. Needed with a fractional budget (capacity = budget x max_length) and with the "full"
    policy; a sequence that outgrows it is an error, not a silent reallocation."""
    static_slack: int | None = None
    """layout="static": slots beyond the largest budget, room for the entries of one step
    before they are evicted (a prefill chunk, or evict_slack + 1 decode tokens). None =
    max(prefill_chunk or 0, evict_slack + 1)."""
    shared_core: float = 0.0
    """A fraction of the tokens seen that every budgeted layer keeps in common: the entries the
    first budgeted layer's scores rank highest (besides its sinks and recent window), counted
    within each layer's own budget, so the schedule's total is unchanged; the rest of each
    layer's budget follows its own scores. 0.0 = off (each layer ranks on its own). At most the
    smallest layer's share of the schedule; a layer with less room keeps the core's best entries
    that fit. With `prefill_chunk`, each chunk's core is kept: an entry that joins the core in a
    later chunk may already be gone from a deeper layer."""

    def __post_init__(self) -> None:
        for name, value in self._checked().items():
            object.__setattr__(self, name, value)
        self._warn_floor()
        object.__setattr__(self, "_sealed", True)

    def __setattr__(self, name: str, value: Any) -> None:
        # Immutable once built: a cache reads its config at every step, so a field changed
        # afterwards (`c.budget = -1`, `c.layout = "paged"`) would be used unchecked.
        if self.__dict__.get("_sealed"):
            raise FrozenInstanceError(
                f"EvictionConfig is immutable: cannot set {name}={value!r} on a built config "
                f"(caches read it at every step); build a new one, e.g. "
                f"dataclasses.replace(config, {name}=...)"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self.__dict__.get("_sealed"):
            raise FrozenInstanceError(f"EvictionConfig is immutable: cannot delete {name}")
        object.__delattr__(self, name)

    def validate(self) -> EvictionConfig:
        """Check every field again and return the config: `SparseKVCache` calls it, so a config
        changed behind the immutability (`object.__setattr__`, an edited schedule list) fails
        with the field's error where it is used. Raises ValueError naming the field."""
        for name, value in self._checked().items():
            if getattr(self, name) != value or type(getattr(self, name)) is not type(value):
                raise ValueError(
                    f"{name}={getattr(self, name)!r} was changed after the config was built; "
                    "build a new EvictionConfig"
                )
        return self

    def _checked(self) -> dict[str, Any]:
        """Every field checked (ValueError naming the field and its allowed values); returns the
        normalized `budget` and `schedule`."""
        budget = check_budget(self.budget)
        schedule = _check_schedule(self.schedule)
        for name in ("rerank_every", "sink_tokens", "recent_window", "evict_slack"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}={v!r} must be an int >= 0")
        if self.prefill_chunk is not None and (
            isinstance(self.prefill_chunk, bool)
            or not isinstance(self.prefill_chunk, int)
            or self.prefill_chunk < 1
        ):
            raise ValueError(f"prefill_chunk={self.prefill_chunk!r} must be None or an int >= 1")
        if not _is_number(self.pyramid_slope) or not (0.0 <= self.pyramid_slope < 1.0):
            raise ValueError(f"pyramid_slope={self.pyramid_slope!r} must be in [0, 1)")
        if not _is_number(self.shared_core) or not (0.0 <= self.shared_core < 1.0):
            raise ValueError(
                f"shared_core={self.shared_core!r} must be a number in [0, 1) (a fraction of the "
                "tokens seen; 0 = off)"
            )
        if not (self.quantize is None or isinstance(self.quantize, str)) or (
            self.quantize not in QUANTIZE
        ):
            raise ValueError(
                f"quantize={self.quantize!r} is not supported; allowed values: None, 'int8'"
            )
        self._check_layout(budget)
        return {"budget": budget, "schedule": schedule, "shared_core": float(self.shared_core)}

    def _warn_floor(self) -> None:
        """Warn when a token budget is below the entries every layer keeps (sinks + recent
        window), which then win (`SparseKVCache` keeps at least them)."""
        floor = self.sink_tokens + self.recent_window
        if isinstance(self.budget, float) or not floor:
            return
        s = self.schedule
        weight, who = 1.0, None
        if isinstance(s, list):
            weight, who = min(s), "the schedule's smallest layer share"
        elif s == "pyramid":
            weight, who = 1.0 - self.pyramid_slope, "the pyramid's last layer"
        smallest = max(1, round(self.budget * weight))
        if smallest < floor:
            what = f"budget={int(self.budget)} tokens" + (
                f" gives {who} {smallest} tokens, which" if who else ""
            )
            warnings.warn(
                f"{what} is below sink_tokens + recent_window = {self.sink_tokens} + "
                f"{self.recent_window} = {floor}, the entries every budgeted layer keeps: the "
                f"budget is raised to {floor} there; lower sink_tokens / recent_window to keep "
                "fewer",
                UserWarning,
                stacklevel=4,
            )

    def _check_layout(self, budget: Any) -> None:
        if not isinstance(self.layout, str) or self.layout not in LAYOUTS:
            raise ValueError(
                f"layout={self.layout!r} is not supported; allowed values: {', '.join(LAYOUTS)}"
            )
        for name in ("max_length", "static_slack"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name}={v!r} must be None or an int >= 1")
        if self.layout != "static":
            return
        floor = self.sink_tokens + self.recent_window
        if self.max_length is not None and self.max_length <= floor and budget != 1.0:
            raise ValueError(
                f"max_length={self.max_length} is not above sink_tokens + recent_window = "
                f"{self.sink_tokens} + {self.recent_window} = {floor}, the entries every layer "
                "keeps: nothing could ever be evicted. Give a larger max_length (the longest "
                "sequence the buffers hold) or lower sink_tokens / recent_window"
            )
        if self.max_length is not None and not isinstance(budget, float) and budget > self.max_length:
            raise ValueError(
                f"budget={int(budget)} tokens is more than max_length={self.max_length} (the "
                "longest sequence the static buffers hold): nothing would be evicted. Give a "
                "budget below max_length, or a larger max_length"
            )
        if isinstance(budget, float) and self.max_length is None:
            raise ValueError(
                f"layout='static' with a fractional budget={budget!r} needs max_length "
                "(the longest "
                "sequence the buffers hold), or give the budget as a token count"
            )
        need = max(self.prefill_chunk or 0, self.evict_slack + 1)
        if self.static_slack is not None and self.static_slack < need:
            raise ValueError(
                f"static_slack={self.static_slack!r} is too small: one step needs "
                "max(prefill_chunk, "
                f"evict_slack + 1) = {need} free slots"
            )

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data; `shared_core` only when it is on (configs written before it
        existed stay as they were)."""
        d = asdict(self)
        if not d["shared_core"]:
            del d["shared_core"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EvictionConfig:
        if isinstance(d, dict) and type(d.get("budget")) is int and d["budget"] == 1:
            d = {**d, "budget": Tokens(1)}  # a written config (`to_dict`) writes Tokens(1) as 1
        return from_fields(cls, d)
