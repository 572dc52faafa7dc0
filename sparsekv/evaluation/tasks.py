"""Task generators: deterministic samples built from real prose, fitted to a length in tokens.

`make_sample(task, codec, length, index, seed, **options)` returns a `Sample`; the same
arguments give the same sample (Python's `random.Random` seeded with a string is stable across
runs and processes). The haystack is real text from `sparsekv.evaluation.text`; lengths count
the model's own tokens (`Codec`), prompt = `bos + context` then `question`, and the context is
filled with whole sentences so that the prompt (plus the continuation, for the continuation
tasks) holds at most `length` tokens and falls short of it by less than one sentence.

Tasks (`TASKS`):
- passkey: one pass key at a depth of 10-90% (the depth cycles over a seeded order of
  10%, 20%, ..., 90% across samples).
- multikey: several "special magic number for <key>" needles; the question asks for one.
- multivalue: one key with several values; the question asks for all (score = recall).
- vartrack: chains of variable assignments (`VAR X = 12345.`, `VAR Y = VAR X.`, ...) and a
  distractor chain; asks which variables hold the value (multi-hop, score = recall).
- qa: a real sentence from elsewhere in the corpus is placed in the context; the answer line
  starts with its first words and the model must copy the next words from the text.

Questions follow a "Question: ...\nAnswer: ..." layout that ends where the answer starts: with
a base model of this size that finds a pass key in 5 of 6 probes at 2K tokens where a
one-line question found 2 of 6.
- ppl: a long real text and its held-out continuation (teacher-forced): perplexity and the
  KL divergence from the full cache over the continuation.
- nexttok: a long real text followed by a short unrelated passage: top-1 next-token accuracy
  inside the passage (short-context ability after the long prefix is compressed).
- gen: a long real text, then free greedy generation: agreement with the full cache's output
  and repetition rate.

`kind` says how the runner executes a sample: "answer" (generate, then match the answer),
"continuation" (teacher-force `target_ids` after the context) or "generate" (generate, then
compare with the full cache's output). Continuation and generation tasks have no question, so
only the agnostic protocol applies to them.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from sparsekv.evaluation.codec import Codec
from sparsekv.evaluation.text import join_sentences, sentence_stream

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


def _register(name: str, kind: str, max_new_tokens: int, metric: str, protocols=PROTOCOLS, **defaults):
    def deco(fn):
        first = " ".join((fn.__doc__ or "").split()).split(". ")[0].rstrip(".") + "."
        TASKS[name] = TaskSpec(name, kind, fn, max_new_tokens, tuple(protocols), metric, defaults, first)
        return fn

    return deco


def task_names() -> list[str]:
    return list(TASKS)


def get_task(name: str) -> TaskSpec:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return TASKS[name]


def make_sample(task: str, codec: Codec, length: int, index: int, seed: int = 0, **options) -> Sample:
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


def _filler(rng: random.Random, min_chars: int, avoid: int | None = None) -> list[tuple[str, bool]]:
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


def _place(items: list[tuple[str, bool]], needles: list[tuple[float, str]]) -> list[tuple[str, bool]]:
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


def _fit(
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
        ctx = join_sentences(_place(items, needles))
        return ctx, codec.bos_ids + codec.encode(ctx)

    def fits(n: int, k: int):
        ctx, ids = build(n, k)
        return (ctx, ids) if len(ids) + len(q_ids) <= budget else None

    def search(lo: int, hi: int, make) -> tuple[int, tuple | None]:
        """Largest x in [lo, hi] with make(x) fitting (monotone), and its result."""
        best = (lo - 1, None)
        while lo <= hi:
            mid = (lo + hi) // 2
            r = make(mid)
            if r is not None:
                best, lo = (mid, r), mid + 1
            else:
                hi = mid - 1
        return best

    n, res = search(0, len(filler) - 1, lambda x: fits(x, 0))
    if res is None:
        raise ValueError(f"length={budget} tokens is too short for this task's needles and question")
    if n >= len(filler) - 1:
        raise ValueError(f"not enough prose for length={budget} tokens")
    k, res_k = search(1, len(filler[n][0].split()) - 1, lambda x: fits(n, x))
    if res_k is not None:
        res = res_k
    else:
        k = 0
    if not res[0]:
        raise ValueError(f"length={budget} tokens is too short for this task's needles and question")
    return res[0], res[1], q_ids, (n, k)


def _number(rng: random.Random, digits: int, taken: set[str], text: str = "") -> str:
    while True:
        v = str(rng.randrange(10 ** (digits - 1), 10**digits))
        if v not in taken and v not in text:
            taken.add(v)
            return v


def _key(rng: random.Random, taken: set[str]) -> str:
    while True:
        k = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if k not in taken:
            taken.add(k)
            return k


def _chars_for(length: int) -> int:
    return 6 * length + 400  # > 4 chars/token (subword) and > 1 char/token (ASCII codec)


def _depth_for(rng_seed: int, index: int) -> float:
    order = list(DEPTHS)
    random.Random(f"sparsekv-eval-depths:{rng_seed}").shuffle(order)
    return order[index % len(order)]


# --------------------------------------------------------------------------- retrieval tasks


@_register("passkey", "answer", max_new_tokens=12, metric="accuracy")
def _passkey(rng, codec, length, index, seed, digits: int = 5) -> Sample:
    """One pass key hidden in prose at a depth of 10-90%; asked for at the end."""
    depth = _depth_for(seed, index)
    filler = _filler(rng, _chars_for(length))
    key = _number(rng, digits, set(), join_sentences(filler))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    question = "\n\nQuestion: What is the pass key?\nAnswer: The pass key is"
    ctx, cids, qids, _ = _fit(codec, filler, [(depth, needle)], question, length)
    return Sample("passkey", f"passkey-{length}-{index}", "answer", ctx, question, key, cids, qids,
                  metadata={"depth": depth})


@_register("multikey", "answer", max_new_tokens=14, metric="accuracy", num_keys=4, digits=7)
def _multikey(rng, codec, length, index, seed, num_keys: int = 4, digits: int = 7) -> Sample:
    """Several keys with one magic number each (distractors); the question asks for one key."""
    if num_keys < 1:
        raise ValueError(f"num_keys={num_keys} must be >= 1")
    filler = _filler(rng, _chars_for(length))
    text = join_sentences(filler)
    keys, vals = set(), set()
    needles, pairs = [], []
    for _ in range(num_keys):
        k, v = _key(rng, keys), _number(rng, digits, vals, text)
        pairs.append((k, v))
        needles.append((rng.uniform(0.1, 0.9), f"One of the special magic numbers for {k} is: {v}."))
    target = rng.randrange(num_keys)
    k, v = pairs[target]
    question = (f"\n\nQuestion: What is the special magic number for {k} mentioned in the text above?\n"
                f"Answer: The special magic number for {k} mentioned in the text above is")
    ctx, cids, qids, _ = _fit(codec, filler, needles, question, length)
    return Sample("multikey", f"multikey-{length}-{index}", "answer", ctx, question, v, cids, qids,
                  metadata={"depth": round(needles[target][0], 3), "num_keys": num_keys})


@_register("multivalue", "answer", max_new_tokens=40, metric="recall", num_values=4, digits=6)
def _multivalue(rng, codec, length, index, seed, num_values: int = 4, digits: int = 6) -> Sample:
    """One key with several magic numbers spread over the text; the question asks for all."""
    if num_values < 1:
        raise ValueError(f"num_values={num_values} must be >= 1")
    filler = _filler(rng, _chars_for(length))
    text = join_sentences(filler)
    k = _key(rng, set())
    vals: set[str] = set()
    values = [_number(rng, digits, vals, text) for _ in range(num_values)]
    depths = sorted(rng.uniform(0.1, 0.9) for _ in values)
    needles = [(d, f"One of the special magic numbers for {k} is: {v}.") for d, v in zip(depths, values)]
    question = (f"\n\nQuestion: What are all the special magic numbers for {k} mentioned in the text "
                f"above?\nAnswer: The special magic numbers for {k} mentioned in the text above are")
    ctx, cids, qids, _ = _fit(codec, filler, needles, question, length)
    return Sample("multivalue", f"multivalue-{length}-{index}", "answer", ctx, question, values,
                  cids, qids, metadata={"depths": [round(d, 3) for d in depths]})


def _var_name(rng: random.Random, taken: set[str]) -> str:
    while True:
        n = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if n not in taken:
            taken.add(n)
            return n


@_register("vartrack", "answer", max_new_tokens=32, metric="recall", hops=3, chains=2, digits=5)
def _vartrack(rng, codec, length, index, seed, hops: int = 3, chains: int = 2, digits: int = 5) -> Sample:
    """Chains of assignments (VAR B = VAR A ...) spread in order over the text, plus distractor
    chains; the question asks for every variable holding the first chain's value (multi-hop)."""
    if hops < 1 or chains < 1:
        raise ValueError(f"hops={hops} and chains={chains} must be >= 1")
    filler = _filler(rng, _chars_for(length))
    text = join_sentences(filler)
    names: set[str] = set()
    vals: set[str] = set()
    needles, first = [], None
    for c in range(chains):
        v = _number(rng, digits, vals, text)
        chain = [_var_name(rng, names) for _ in range(hops + 1)]
        depths = sorted(rng.uniform(0.05, 0.95) for _ in chain)
        needles.append((depths[0], f"VAR {chain[0]} = {v}."))
        for a, b, d in zip(chain, chain[1:], depths[1:]):
            needles.append((d, f"VAR {b} = VAR {a}."))
        if first is None:
            first = (v, chain)
    v, chain = first
    question = (f"\n\nQuestion: Find all variables that are assigned the value {v} in the text "
                f"above.\nAnswer: According to the chain(s) of variable assignment in the text above, "
                f"{len(chain)} variables are assigned the value {v}, they are:")
    ctx, cids, qids, _ = _fit(codec, filler, needles, question, length)
    return Sample("vartrack", f"vartrack-{length}-{index}", "answer", ctx, question, chain, cids,
                  qids, metadata={"hops": hops, "chains": chains})


_WORD = re.compile(r"^[A-Za-z][A-Za-z'\-]*[,;]?$")


@_register("qa", "answer", max_new_tokens=16, metric="accuracy", cue_words=6, answer_words=4)
def _qa(rng, codec, length, index, seed, cue_words: int = 6, answer_words: int = 4) -> Sample:
    """A real sentence from elsewhere in the corpus sits at a depth of 10-90%; the answer line
    starts with its first words and the model must copy the words that follow (extractive QA).
    The cue is not quoted in the question, so the only earlier copy to continue is the one in
    the context."""
    depth = _depth_for(seed + 1, index)
    filler = _filler(rng, _chars_for(length))
    text = join_sentences(filler)
    stream = sentence_stream()
    for _ in range(10_000):
        s, _par = stream[rng.randrange(len(stream))]
        words = s.split()
        if len(words) < cue_words + answer_words + 2 or s in text:
            continue
        span = words[: cue_words + answer_words]
        if not all(_WORD.match(w) for w in span[1:]):
            continue
        cue = " ".join(words[:cue_words])
        if cue.lower() in text.lower():
            continue
        break
    else:  # pragma: no cover - the corpus always has such sentences
        raise RuntimeError("no suitable sentence for the qa task")
    answer = " ".join(words[cue_words : cue_words + answer_words]).rstrip(",;")
    question = f"\n\nQuestion: Continue this sentence from the text above.\nAnswer: {cue}"
    ctx, cids, qids, _ = _fit(codec, filler, [(depth, s)], question, length)
    return Sample("qa", f"qa-{length}-{index}", "answer", ctx, question, answer, cids, qids,
                  metadata={"depth": depth, "sentence": s})


# --------------------------------------------------------------------------- language-model tasks


def _continuation(rng, codec, length, target_tokens, far: bool):
    """(context, context_ids, target_ids): prose fitted to `length - target_tokens`, then
    `target_tokens` tokens of either the same text continued or (far) an unrelated passage."""
    if target_tokens < 2 or target_tokens >= length // 2:
        raise ValueError(f"target_tokens={target_tokens} must be in [2, length/2)")
    filler = _filler(rng, _chars_for(length))
    ctx, cids, _, (n, k) = _fit(codec, filler, [], "", length - target_tokens)
    if far:  # an unrelated passage from elsewhere in the corpus
        nxt = _filler(rng, 6 * target_tokens + 200, avoid=None)
    elif k:  # the same text, continued from the middle of the sentence where the context stops
        nxt = [(" ".join(filler[n][0].split()[k:]), False)] + filler[n + 1 :]
    else:  # the same text, continued (the filler always extends well past what fits)
        nxt = filler[n:]
    cont = ("\n\n" if nxt[0][1] else " ") + join_sentences(nxt)
    target = codec.encode(cont)[:target_tokens]
    if len(target) < target_tokens:
        raise ValueError(f"not enough prose for a {target_tokens}-token continuation")
    return ctx, cids, target


@_register("ppl", "continuation", max_new_tokens=0, metric="perplexity", protocols=("agnostic",),
           target_tokens=64)
def _ppl(rng, codec, length, index, seed, target_tokens: int = 64) -> Sample:
    """A long real text; its next `target_tokens` tokens are teacher-forced after the prefix is
    compressed: perplexity and mean KL from the full cache over the continuation."""
    ctx, cids, target = _continuation(rng, codec, length, target_tokens, far=False)
    return Sample("ppl", f"ppl-{length}-{index}", "continuation", ctx, "", codec.decode(target),
                  cids, [], target_ids=target)


@_register("nexttok", "continuation", max_new_tokens=0, metric="top1", protocols=("agnostic",),
           target_tokens=48)
def _nexttok(rng, codec, length, index, seed, target_tokens: int = 48) -> Sample:
    """A long real text, then a short unrelated real passage: top-1 next-token accuracy inside
    the passage (its own few tokens are the only context that matters)."""
    ctx, cids, target = _continuation(rng, codec, length, target_tokens, far=True)
    return Sample("nexttok", f"nexttok-{length}-{index}", "continuation", ctx, "",
                  codec.decode(target), cids, [], target_ids=target)


@_register("gen", "generate", max_new_tokens=48, metric="agreement", protocols=("agnostic",))
def _gen(rng, codec, length, index, seed) -> Sample:
    """A long real text, then free greedy generation: token agreement with the full cache's
    output and repetition rate."""
    filler = _filler(rng, _chars_for(length))
    ctx, cids, _, _ = _fit(codec, filler, [], "", length - TASKS["gen"].max_new_tokens)
    return Sample("gen", f"gen-{length}-{index}", "generate", ctx, "", None, cids, [])
