"""The policy contract: a policy only scores; the cache selects, gathers and keeps positions.

`Policy.score(ctx)` returns a float tensor of shape `(batch, kv_heads, seq)` with one score per
entry currently stored in the layer (old entries first, then the `ctx.num_new` new ones), higher
= keep. Scores may be -inf/+inf; the cache overrides them for protected entries (sinks, recent
window) and padding. A policy keeps no state of its own: what it needs from the past comes in
`ctx.prev_scores` (its own scores from the previous call, already gathered to the kept entries)
and `ctx.observed` (attention received since the last re-rank, tracked by the cache).

The cache computes only the statistics a policy asks for through its class attributes:
- `attention_queries`: None, "last", "window" or "all": which of the new queries' attention
  probabilities are summed into `ctx.attention` `(batch, kv_heads, seq)` (over the queries and
  over the query heads sharing each KV head).
- `window`: the number of queries for "window" (SnapKV's observation window).
- `needs_hidden_states`: the layer's attention inputs `(batch, new, hidden)` in `ctx.hidden_states`.
- `hidden_from_first`: with `needs_hidden_states`, hand every budgeted layer the attention inputs
  of the *first* budgeted layer for the same tokens instead of its own (one score per token,
  shared across layers; layers run in order, so they are always available).
- `needs_input_ids`: the token ids of the new entries `(batch, new)` in `ctx.input_ids` (None
  when the forward had no ids, e.g. `inputs_embeds`).
- `tracks_observed`: keep `ctx.observed`, the attention each kept entry received from every query
  since the last re-rank (costs one extra q·K per decode step).
- `evicts`: False for the full cache.
- `schedule`: a schedule this method implies (PyramidKV), else None (the config's is used).
- `scores_after_prefill`: the cache does not evict during a multi-token forward; when that
  forward returns it runs `sparsekv.policies.repeat_pass` (KVzip's context reconstruction), which hands
  the policy, in `ctx.attention`, what the repeat paid to each new entry, then evicts. Such a
  policy provides `repeat_inputs(ids) -> [(ids, start, end), ...]` (see `sparsekv.policies.reconstruction`).

`Policy.score_arrival(layer_idx, hidden_states, positions)` (optional, None by default): the
decode-phase score of one new entry from its own inputs, for policies whose decode score leaves
the old entries' scores unchanged and reads no attention (the learned one at blend 0,
StreamingLLM); the static layout then scores decode steps inside the model's forward.

`Policy.check_model(shape)` is called by the cache when it is built, with the model's
`sparsekv.models.families.ModelShape`: a policy that was fitted to one model shape (the learned one)
raises a ValueError there naming the mismatch; the heuristics accept any model.

Constructor arguments are checked by the helpers below (`check_int`, `check_number`), so a
wrong type fails in `policies.get` with an error naming the argument, not later in a forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from sparsekv.config import check_kernel_size

__all__ = ["Policy", "ScoreContext", "available", "check_int", "check_kernel_size", "check_number",
           "checked_scores", "close_words", "fill_spans", "get", "max_pool_seq", "register"]


@dataclass
class ScoreContext:
    """Everything a policy may read for one layer at one step. Shapes in the field comments."""

    layer_idx: int
    phase: str  # "prefill" (a multi-token chunk), "decode" (one token) or "rerank"
    keys: torch.Tensor  # (batch, kv_heads, seq, head_dim), after RoPE, all stored entries
    values: torch.Tensor  # (batch, kv_heads, seq, head_dim)
    positions: torch.Tensor  # (batch, kv_heads, seq) absolute slot index; -1 = padding
    num_new: int  # the last `num_new` entries arrived in this step (0 at a re-rank)
    tokens_seen: int  # absolute number of tokens processed, this step included
    prev_scores: torch.Tensor | None = None  # (batch, kv_heads, seq - num_new) or None at the start
    attention: torch.Tensor | None = None  # (batch, kv_heads, seq) see `attention_queries`
    observed: torch.Tensor | None = None  # (batch, kv_heads, seq) attention since the last re-rank
    queries: torch.Tensor | None = None  # (batch, heads, new, head_dim) the new queries, after RoPE
    hidden_states: torch.Tensor | None = None  # (batch, new, hidden) attention inputs of new tokens
    input_ids: torch.Tensor | None = None  # (batch, new) token ids of the new entries, see `needs_input_ids`
    budget_rank: int = 0  # index of this layer among the budgeted layers (0 = shallowest)
    num_budgeted: int = 1
    model: Any = None  # the causal LM the cache serves (for policies that read its weights)

    def carry(self, fill: float = 0.0) -> torch.Tensor:
        """`prev_scores` extended with `fill` for the new entries: `(batch, kv_heads, seq)`."""
        b, h, n = self.positions.shape
        out = self.positions.new_full((b, h, n), fill, dtype=torch.float32)
        if self.prev_scores is not None and self.prev_scores.shape[-1]:
            out[..., : self.prev_scores.shape[-1]] = self.prev_scores
        return out


class _Deferred:
    """A `ScoreContext` field that may also be given as a zero-argument callable, called on the
    first read (then kept). The cache hands `keys` and `values` this way: for an INT8 layer they
    are a dequantized copy of the whole layer, which most policies (the learned one among them)
    never read."""

    def __set_name__(self, owner, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        value = obj.__dict__[self.slot]
        if callable(value) and not isinstance(value, torch.Tensor):
            value = obj.__dict__[self.slot] = value()
        return value

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.slot] = value


for _name in ("keys", "values"):  # after @dataclass: its __init__ assigns through these
    _field = _Deferred()
    _field.__set_name__(ScoreContext, _name)
    setattr(ScoreContext, _name, _field)


def max_pool_seq(x: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """Max over a centred window of `kernel_size` (odd) entries along the last axis of
    `(batch, heads, seq)`: a token scores at least as high as its best neighbour, so spans
    (a number split into digit tokens, a key and its value) survive together."""
    if kernel_size <= 1 or x.shape[-1] == 0:
        return x
    import torch.nn.functional as F

    b, h, n = x.shape
    return F.max_pool1d(x.reshape(b * h, 1, n), kernel_size, stride=1, padding=kernel_size // 2).reshape(b, h, n)


def fill_spans(x: torch.Tensor, reach: int, peaks: float = 0.0) -> torch.Tensor:
    """Fill the gaps between high scores along the last axis of `(batch, heads, seq)`: each entry
    is raised to the lower of the best score among the `reach` entries before it and the best
    among the `reach` entries after it (a morphological closing). A run of tokens whose two ends
    the scorer ranks high (a UUID, a quoted clause) then scores as high as its weaker end, so it
    is kept or dropped whole, while tokens beyond the last high one keep their own scores (unlike
    a wider `max_pool_seq`, which raises both flanks of every high token). 0 = unchanged.
    `peaks` in [0, 1): only entries at or above that quantile of their row's finite scores count
    as the ends of a gap (0 = every entry)."""
    if reach <= 0 or x.shape[-1] < 3:
        return x
    import torch.nn.functional as F

    b, h, n = x.shape
    y = x.reshape(b * h, 1, n)
    if peaks > 0:
        finite = torch.isfinite(y)
        cut = torch.nanquantile(torch.where(finite, y, float("nan")).float(), peaks, dim=-1, keepdim=True)
        ends = torch.where(finite & (y >= cut.to(y.dtype)), y, float("-inf"))
    else:
        ends = y
    before = F.max_pool1d(F.pad(ends, (reach, 0), value=float("-inf")), reach, stride=1)[..., :n]
    after = F.max_pool1d(F.pad(ends, (0, reach), value=float("-inf")), reach, stride=1)[..., 1 : n + 1]
    return torch.maximum(y, torch.minimum(before, after)).reshape(b, h, n)


def close_words(x: torch.Tensor, starts: torch.Tensor, longest: int) -> torch.Tensor:
    """Raise every token of a word to its word's best score along the last axis of `(batch, heads,
    seq)`, so that a word (a number split into digit tokens, a UUID of 36 tokens) is kept or
    dropped whole. `starts` `(batch, seq)` bool marks where words begin (`sparsekv.policies.words.
    word_starts`); a word longer than `longest` tokens (text without spaces) keeps its own
    scores. The first word of `x` may continue one that began earlier: only its part here is
    closed."""
    if longest <= 0 or x.shape[-1] < 2:
        return x
    b, h, n = x.shape
    word = starts.to(x.device).long().cumsum(-1)  # (batch, seq): 1 for the first word, ...
    size = torch.zeros(b, n + 1, dtype=torch.long, device=x.device).scatter_add_(
        1, word, torch.ones_like(word)
    )
    short = size.gather(1, word) <= longest
    index = word[:, None, :].expand(b, h, n)
    best = x.new_full((b, h, n + 1), float("-inf")).scatter_reduce(2, index, x, "amax")
    return torch.where(short[:, None, :], best.gather(2, index), x)


def check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """`value` as an int (bools refused) in [`minimum`, `maximum`]; the error names the argument."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or (minimum is not None and value < minimum)
        or (maximum is not None and value > maximum)
    ):
        if maximum is None:
            bound = "" if minimum is None else f" >= {minimum}"
        else:
            bound = f" <= {maximum}" if minimum is None else f" in [{minimum}, {maximum}]"
        raise ValueError(f"{name}={value!r} must be an int{bound}")
    return value


def check_number(name: str, value: Any, low: float, high: float) -> float:
    """`value` as a finite float in [low, high] (bools refused); the error names the argument."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low <= value <= high):
        raise ValueError(f"{name}={value!r} must be a number in [{low:g}, {high:g}]")
    return float(value)


class Policy:
    """Base class of every scoring method. Subclasses set `name` and implement `score`."""

    name: ClassVar[str] = "base"
    attention_queries: ClassVar[str | None] = None
    window: int = 1
    needs_hidden_states: ClassVar[bool] = False
    hidden_from_first: bool = False
    needs_input_ids: bool = False
    tracks_observed: bool = False
    evicts: ClassVar[bool] = True
    schedule: ClassVar[str | None] = None
    scores_after_prefill: ClassVar[bool] = False

    def repeat_key(self) -> Any:
        """For a `scores_after_prefill` policy: a hashable value equal for two policies whose
        repeat pass pays the same attention on the same cache (`SparseKVCache.fork` then runs
        that repeat once per recorded prefill); None: never shared."""
        return None

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """Return `(batch, kv_heads, seq)` scores for every stored entry; higher = keep."""
        raise NotImplementedError

    def score_arrival(
        self, layer_idx: int, hidden_states: torch.Tensor | None, positions: torch.Tensor
    ) -> torch.Tensor | None:
        """The score of a decode step's one new entry from that entry's own inputs, `(batch,
        kv_heads, 1)`, or None (the default) when this policy's decode score needs more.

        Returning a tensor promises that `score(ctx)` at a decode step whose context carries no
        attention equals `ctx.carry()` with this tensor in the new entry's place: the old entries
        keep their scores. The static layout then scores decode steps inside the model's forward
        (fixed shapes, so a compiled or graph-captured step includes the scoring) and runs no
        scoring between steps; it asks only when the cache computes no attention statistics for
        the step (`attention_queries` None, no `tracks_observed`). So it must not read host values
        that change from step to step. `hidden_states` `(batch, 1, hidden)`: the layer's attention
        inputs (the first budgeted layer's with `hidden_from_first`), None unless
        `needs_hidden_states`; `positions` `(batch, kv_heads, 1)`: the entry's absolute position
        (-1 = padding)."""
        return None

    def check_model(self, shape: Any) -> None:
        """Raise ValueError if this policy cannot score `shape` (a `ModelShape`); the cache calls
        it when built. Policies not fitted to a model accept any."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def checked_scores(
    policy: Policy, scores: torch.Tensor, expected: tuple[int, ...], what: str = "scores",
    axes: str = "(batch, kv_heads, seq)",
) -> torch.Tensor:
    """`scores` as the cache keeps them: float32, NaN read as -inf. A shape other than `expected`
    is a ValueError naming the policy (`what` it returned, and the `axes` expected)."""
    if tuple(scores.shape) != tuple(expected):
        raise ValueError(
            f"policy {policy.name!r} returned {what} of shape {tuple(scores.shape)}; "
            f"expected {axes} = {tuple(expected)}"
        )
    return torch.nan_to_num(scores.float(), nan=float("-inf"))


_REGISTRY: dict[str, Callable[..., Policy]] = {}


def register(name: str) -> Callable:
    """Class decorator: `@register("h2o")` makes `policies.get("h2o", **kwargs)` build it."""

    def deco(cls):
        if not name or not name.replace("_", "").isalnum() or name != name.lower():
            raise ValueError(f"policy name {name!r} must be lower-case letters, digits and '_'")
        if name in _REGISTRY:
            raise ValueError(f"policy {name!r} is already registered")
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return deco


def available() -> list[str]:
    """Names `get` accepts."""
    return sorted(_REGISTRY)


def get(name: str | Policy, **kwargs) -> Policy:
    """Build a policy by name (`policies.get("snapkv", window=32)`); a Policy passes through.

    `"learned:<dir or hub id>"` loads a `ScorerAdapter` and wraps it in the learned policy.
    """
    if isinstance(name, Policy):
        if kwargs:
            raise ValueError("kwargs are not accepted with a Policy instance")
        return name
    if not isinstance(name, str):
        raise ValueError(f"policy={name!r} must be a name; known policies: {', '.join(available())}")
    if name.startswith("learned:"):
        kwargs = {"adapter": name.split(":", 1)[1], **kwargs}
        name = "learned"
    if name not in _REGISTRY:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(available())}")
    accepted = _arguments(_REGISTRY[name])
    bad = sorted(set(kwargs) - set(accepted)) if accepted is not None else []
    if bad:
        raise ValueError(
            f"policy {name!r} takes no argument(s) {bad}; allowed: {', '.join(accepted) or 'none'}"
        )
    try:
        return _REGISTRY[name](**kwargs)
    except TypeError as e:
        raise ValueError(f"bad arguments for policy {name!r}: {e}") from e


def _arguments(factory: Callable[..., Policy]) -> list[str] | None:
    """The keyword arguments `factory` accepts, or None when it takes `**kwargs`."""
    import inspect

    params = list(inspect.signature(factory).parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
