"""The task machinery: samples, the task registry, and haystacks fitted to a length in tokens.

`make_sample(task, codec, length, index, seed, **options)` returns a `Sample`; the same
arguments give the same sample (Python's `random.Random` seeded with a string is stable across
runs and processes). The haystack is evaluation-only prose from `sparsekv.evaluation.tasks.text`;
lengths count the model's own tokens (`Codec`), prompt = `bos + context` then `question`, and the
context is filled with whole sentences so that the prompt (plus the continuation, for the
continuation tasks) holds at most `length` tokens and falls short of it by less than one
sentence (`fit`).

The task families themselves live in `tasks` (digits, qa and the language-model tasks) and
`tasks_words` (words, UUIDs, multi-query, common and frequent words); each registers itself
with `register`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from sparsekv.evaluation.tasks.codec import Codec
from sparsekv.evaluation.tasks.text import join_sentences, sentence_stream

PROTOCOLS = ("agnostic", "aware")
DEPTHS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)

_ADJECTIVES = (
    "amber brave calm dusty eager faint gentle hollow icy jolly keen lively misty narrow odd "
    "pale quiet rapid silver tidy upper vivid wild yellow zesty bitter cosy dark early fancy"
).split()
_NOUNS = (
    "anchor badger candle dolphin engine falcon garden harbor island jacket kettle lantern "
    "meadow needle orchard pepper quarry river saddle tunnel umbrella valley window yacht "
    "zebra bridge castle desert forest glacier"
).split()


@dataclass
class Sample:
    """One prompt of a task. Ids are what the model sees; texts are kept for peers and reading.

    `context_ids` starts with the tokenizer's BOS; `question_ids` follows it (empty for tasks
    without a question); `target_ids` are the teacher-forced continuation tokens (continuation
    tasks only). `answer` is a string, a list of strings (all must appear), or None (generation
    tasks, compared with the full cache's output).
    """

    task: str
    sample_id: str
    kind: str
    context: str
    question: str
    answer: str | list[str] | None
    context_ids: list[int]
    question_ids: list[int]
    target_ids: list[int] = field(default_factory=list)
    max_new_tokens: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_ids(self) -> list[int]:
        return self.context_ids + self.question_ids

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        return cls(**d)


@dataclass(frozen=True)
class TaskSpec:
    name: str
    kind: str
    builder: Callable[..., Sample]
    max_new_tokens: int
    protocols: tuple[str, ...]
    metric: str  # the name of the quality number in tables and plots
    defaults: dict[str, Any]
    doc: str


TASKS: dict[str, TaskSpec] = {}


def register(name: str, kind: str, max_new_tokens: int, metric: str, protocols=PROTOCOLS,
             **defaults):
    """Decorator: register a sample builder as task `name` (its docstring's first sentence is
    the task's one-line description in `sparsekv eval --list`)."""

    def deco(fn):
        first = " ".join((fn.__doc__ or "").split()).split(". ")[0].rstrip(".") + "."
        TASKS[name] = TaskSpec(name, kind, fn, max_new_tokens, tuple(protocols), metric, defaults,
                               first)
        return fn

    return deco


def task_names() -> list[str]:
    return list(TASKS)


def get_task(name: str) -> TaskSpec:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return TASKS[name]


def make_sample(task: str, codec: Codec, length: int, index: int, seed: int = 0,
                **options) -> Sample:
    """Build sample `index` of `task` at `length` tokens; deterministic in all arguments."""
    spec = get_task(task)
    unknown = sorted(set(options) - set(spec.defaults))
    if unknown:
        allowed = ", ".join(spec.defaults) or "none"
        raise ValueError(f"unknown option(s) {unknown} for task {task!r}; allowed: {allowed}")
    if not isinstance(length, int) or length < 64:
        raise ValueError(f"length={length!r} must be an int >= 64 (tokens)")
    opts = {**spec.defaults, **options}
    rng = random.Random(f"sparsekv-eval:{seed}:{task}:{length}:{index}")
    sample = spec.builder(rng=rng, codec=codec, length=length, index=index, seed=seed, **opts)
    sample.max_new_tokens = sample.max_new_tokens or spec.max_new_tokens
    sample.metadata.update(
        target_length=length,
        n_tokens=len(sample.prompt_ids) + len(sample.target_ids),
        seed=seed,
        index=index,
    )
    return sample


# --------------------------------------------------------------------------- haystack building


Sentences = list[tuple[str, bool]]  # (sentence, opens a paragraph)


def prose_filler(rng: random.Random, min_chars: int, avoid: int | None = None) -> Sentences:
    """Contiguous sentences from a seeded place in the corpus (wrapping), >= `min_chars` long."""
    stream = sentence_stream()
    start = rng.randrange(len(stream))
    if avoid is not None and abs(start - avoid) < len(stream) // 4:
        start = (start + len(stream) // 2) % len(stream)
    out, total, i = [], 0, start
    while total < min_chars:
        s, par = stream[i % len(stream)]
        out.append((s, par if out else True))
        total += len(s) + 2
        i += 1
        if i - start > len(stream):
            break
    return out


def place(items: Sentences, needles: list[tuple[float, str]]) -> Sentences:
    """Insert each needle as a sentence of its own at the sentence boundary nearest to its depth,
    measured in characters of the filler (so long and short sentences count for what they are)."""
    starts, total = [], 0
    for text, _ in items:
        starts.append(total)
        total += len(text) + 1
    starts.append(total)
    slots = []
    for depth, text in needles:
        pos = min(range(len(starts)), key=lambda i: abs(starts[i] - depth * total))
        slots.append((pos, depth, text))
    out = list(items)
    for pos, _, text in sorted(slots, key=lambda x: (-x[0], -x[1])):
        out.insert(pos, (text, False))
    return out


_TOO_SHORT = "length={budget} tokens is too short for this task's needles and question"


def search(lo: int, hi: int, make: Callable[[int], Any]) -> tuple[int, Any]:
    """Largest x in [lo, hi] whose `make(x)` is not None (monotone), and that result; (lo - 1,
    None) when none fits."""
    best: tuple[int, Any] = (lo - 1, None)
    while lo <= hi:
        mid = (lo + hi) // 2
        r = make(mid)
        if r is not None:
            best, lo = (mid, r), mid + 1
        else:
            hi = mid - 1
    return best


def fit_items(
    codec: Codec, make_context: Callable[[int], str], question: str, budget: int, most: int
) -> tuple[int, str, list[int], list[int]]:
    """The largest n in [1, most] whose `make_context(n)` (a context of n items: words of a
    list, coded words) fits bos + context + question in `budget` tokens; returns (n, context,
    context_ids, question_ids). `make_context` must grow with n."""
    q_ids = codec.encode(question) if question else []

    def fits(n: int):
        ctx = make_context(n)
        ids = codec.bos_ids + codec.encode(ctx)
        return (ctx, ids) if len(ids) + len(q_ids) <= budget else None

    n, res = search(1, most, fits)
    if res is None:
        raise ValueError(f"length={budget} tokens is too short for this task's question")
    if n >= most:
        raise ValueError(f"not enough items for length={budget} tokens (at most {most})")
    return n, res[0], res[1], q_ids


def fit(
    codec: Codec,
    filler: list[tuple[str, bool]],
    needles: list[tuple[float, str]],
    question: str,
    budget: int,
) -> tuple[str, list[int], list[int], tuple[int, int]]:
    """Fill the context with prose so that bos + context + question fits in `budget` tokens.

    The context is the longest prefix of `filler` (whole sentences, then the first words of the
    next one) with `needles` ((depth in [0, 1], sentence) pairs) inserted at their depths.
    Returns (context, context_ids, question_ids, (whole sentences used, words of the next)).
    """
    q_ids = codec.encode(question) if question else []

    def build(n: int, k: int):
        items = list(filler[:n])
        if k:
            items.append((" ".join(filler[n][0].split()[:k]), filler[n][1]))
        ctx = join_sentences(place(items, needles))
        return ctx, codec.bos_ids + codec.encode(ctx)

    def fits(n: int, k: int):
        ctx, ids = build(n, k)
        return (ctx, ids) if len(ids) + len(q_ids) <= budget else None

    n, res = search(0, len(filler) - 1, lambda x: fits(x, 0))
    if res is None:
        raise ValueError(_TOO_SHORT.format(budget=budget))
    if n >= len(filler) - 1:
        raise ValueError(f"not enough prose for length={budget} tokens")
    k, res_k = search(1, len(filler[n][0].split()) - 1, lambda x: fits(n, x))
    if res_k is not None:
        res = res_k
    else:
        k = 0
    if not res[0]:
        raise ValueError(_TOO_SHORT.format(budget=budget))
    return res[0], res[1], q_ids, (n, k)


def number(rng: random.Random, digits: int, taken: set[str], text: str = "") -> str:
    while True:
        v = str(rng.randrange(10 ** (digits - 1), 10**digits))
        if v not in taken and v not in text:
            taken.add(v)
            return v


def magic_key(rng: random.Random, taken: set[str]) -> str:
    while True:
        k = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if k not in taken:
            taken.add(k)
            return k


def chars_for(length: int) -> int:
    return 6 * length + 400  # > 4 chars/token (subword) and > 1 char/token (ASCII codec)


def depth_for(rng_seed: int, index: int) -> float:
    order = list(DEPTHS)
    random.Random(f"sparsekv-eval-depths:{rng_seed}").shuffle(order)
    return order[index % len(order)]


