"""The decode-heavy tasks: a short prompt, then a long teacher-forced continuation, so that an
evicting cache evicts at every generated step (issue 18).

- `decode_prose`, `decode_code`, `decode_steps`: `prompt_tokens` (<= 512) tokens of real text of
  that kind from the evaluation-only sources (`sparsekv.evaluation.tasks.text.eval_texts(kind)`), then
  the next `length` tokens of the same text teacher-forced; then `gen_tokens` tokens of free
  greedy generation after the continuation (compared with the full cache's).
- `decode_recall`: the same on prose, but the continuation itself states three facts (a name, a
  number, a definition) within its first few hundred tokens and refers back to each of them at
  least `gap` tokens later; the referring tokens (the fact's value after its cue) are scored
  teacher-forced (argmax == true token). Their indices into `target_ids` are in
  `metadata["recall_positions"]`, one list per fact.

For these tasks `length` is the number of continuation tokens (1,024-4,096 in the issue), not the
prompt length; the prompt is `bos + prompt_tokens` tokens. Samples are deterministic in all
arguments (see `tasks.make_sample`). This module registers the tasks into `tasks.TASKS`; running
them is `sparsekv.evaluation.running.decode`'s job.
"""

from __future__ import annotations

import random
import re

from sparsekv.evaluation.tasks.base import TASKS, Sample, TaskSpec
from sparsekv.evaluation.tasks.codec import Codec

DECODE_KIND = "decode"  # Sample.kind of every task here: run by sparsekv.evaluation.running.decode
TEXT_KINDS = {"decode_prose": "prose", "decode_code": "code", "decode_steps": "steps"}
MAX_PROMPT_TOKENS = 512

_FIRST = ["Oswin", "Maribel", "Tobiah", "Ysolde", "Corvin", "Elspeth", "Dario", "Philippa", "Lazlo", "Rosamund", "Ignatius", "Wren"]
_LAST = ["Hartley", "Quenby", "Vasquez", "Aldridge", "Montfort", "Pellerin", "Okonkwo", "Thistlewood", "Brennan", "Sokolov"]
_WORDS = ["glimmerwick", "tesserand", "quillock", "brannet", "florrowind", "marrowspan", "pellucite", "vantreld"]
_MEANINGS = (
    "a lamp that burns only while it rains",
    "a ledger kept in two colours of ink",
    "a bridge that is raised every evening",
    "a clock that runs one hour slow on purpose",
    "a letter that must be answered within a day",
    "a garden planted only with blue flowers",
)
# (kind, the sentence stating the fact, the cue that refers back to it); the value follows the
# cue directly, so the referring tokens are the value's tokens.
_FACTS = (
    ("name", "The keeper of the old archive in this account is named {v}.",
     "As was said earlier, the keeper of the old archive is named"),
    ("number", "The registration number of the harbour ship is {v}.",
     "Recall that the registration number of the harbour ship is"),
    ("definition", "In what follows, a {w} means {v}.", "Remember that a {w} means"),
)


def _register(name: str, builder, metric: str, doc: str, **defaults) -> None:
    # max_new_tokens 0: the sample's own (its `gen_tokens` option) is the generation length
    TASKS[name] = TaskSpec(name, DECODE_KIND, builder, 0, ("agnostic",), metric, defaults, doc)


def _texts(kind: str) -> list[tuple[str, str]]:
    """The evaluation-only texts of `kind` as `[(source, raw_text), ...]`."""
    from sparsekv.evaluation.tasks import text  # read at call time: tests substitute eval_texts

    if not hasattr(text, "eval_texts"):
        raise RuntimeError("sparsekv.evaluation.tasks.text.eval_texts is not available: the decode tasks "
                           "read the evaluation-only sources through it")
    texts = list(text.eval_texts(kind))
    if not texts:
        raise ValueError(f"eval_texts({kind!r}) returned no text")
    return texts


def _check(length: int, prompt_tokens: int, gen_tokens: int) -> None:
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or not (
        1 <= prompt_tokens <= MAX_PROMPT_TOKENS
    ):
        raise ValueError(f"prompt_tokens={prompt_tokens!r} must be an int in [1, {MAX_PROMPT_TOKENS}]")
    if isinstance(gen_tokens, bool) or not isinstance(gen_tokens, int) or gen_tokens < 0:
        raise ValueError(f"gen_tokens={gen_tokens!r} must be an int >= 0")
    if length < 2:
        raise ValueError(f"length={length!r} (continuation tokens) must be >= 2")


def _token_stream(rng: random.Random, codec: Codec, kind: str, need: int) -> tuple[list[int], list[str]]:
    """At least `need` token ids of consecutive texts of `kind` from a seeded start (wrapping),
    documents separated by a blank line; returns (ids, sources used)."""
    texts = _texts(kind)
    start = rng.randrange(len(texts))
    ids: list[int] = []
    sources: list[str] = []
    for i in range(len(texts)):
        src, raw = texts[(start + i) % len(texts)]
        raw = raw.strip()
        if not raw:
            continue
        # Enough characters for `need` tokens at > 1 char/token; long documents are cut.
        piece = ("\n\n" if ids else "") + raw[: 8 * (need - len(ids)) + 64]
        ids += codec.encode(piece)
        sources.append(src)
        if len(ids) >= need:
            return ids, sources
    raise ValueError(f"eval_texts({kind!r}) holds only {len(ids)} tokens; {need} are needed "
                     "(prompt_tokens + length): use a shorter length")


def _decode_sample(task: str, rng, codec: Codec, length: int, index: int, prompt_tokens: int,
                   gen_tokens: int) -> Sample:
    _check(length, prompt_tokens, gen_tokens)
    ids, sources = _token_stream(rng, codec, TEXT_KINDS[task], prompt_tokens + length)
    prompt, target = ids[:prompt_tokens], ids[prompt_tokens : prompt_tokens + length]
    return Sample(task, f"{task}-{length}-{index}", DECODE_KIND, codec.decode(prompt), "", None,
                  codec.bos_ids + prompt, [], target_ids=target, max_new_tokens=gen_tokens,
                  metadata={"sources": sources, "prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens})


def _decode_prose(rng, codec, length, index, seed, prompt_tokens: int = 256, gen_tokens: int = 64) -> Sample:
    return _decode_sample("decode_prose", rng, codec, length, index, prompt_tokens, gen_tokens)


def _decode_code(rng, codec, length, index, seed, prompt_tokens: int = 256, gen_tokens: int = 64) -> Sample:
    return _decode_sample("decode_code", rng, codec, length, index, prompt_tokens, gen_tokens)


def _decode_steps(rng, codec, length, index, seed, prompt_tokens: int = 256, gen_tokens: int = 64) -> Sample:
    return _decode_sample("decode_steps", rng, codec, length, index, prompt_tokens, gen_tokens)


# --------------------------------------------------------------------------- decode_recall

_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def _sentences(rng: random.Random, codec: Codec, need: int) -> list[list[int]]:
    """Token ids of consecutive prose sentences (each encoded with a leading space), >= `need`
    tokens in all."""
    texts = _texts("prose")
    start = rng.randrange(len(texts))
    out: list[list[int]] = []
    total = 0
    for i in range(len(texts)):
        raw = " ".join(texts[(start + i) % len(texts)][1].split())
        for s in _SENTENCE.split(raw[: 8 * (need - total) + 64]):
            if s:
                ids = codec.encode(" " + s)
                out.append(ids)
                total += len(ids)
        if total >= need:
            return out
    raise ValueError(f"eval_texts('prose') holds only {total} tokens; {need} are needed: use a shorter length")


def _facts(rng: random.Random) -> list[tuple[str, str, str, str]]:
    """(kind, statement, cue, value) of the three facts of one sample."""
    out = []
    for kind, statement, cue in _FACTS:
        word = rng.choice(_WORDS)
        if kind == "name":
            value = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
        elif kind == "number":
            value = str(rng.randrange(10_000, 100_000))
        else:
            value = rng.choice(_MEANINGS)
        out.append((kind, statement.format(v=value, w=word), cue.format(w=word), value))
    return out


def _decode_recall(rng, codec, length, index, seed, prompt_tokens: int = 256, gen_tokens: int = 64,
                   gap: int = 1000) -> Sample:
    """Prose whose continuation states a name, a number and a definition early and refers back to
    each `gap`+ tokens later; scored on the referring tokens (teacher-forced argmax accuracy)."""
    _check(length, prompt_tokens, gen_tokens)
    if isinstance(gap, bool) or not isinstance(gap, int) or gap < 1:
        raise ValueError(f"gap={gap!r} must be an int >= 1 (tokens between a fact and its reference)")
    early = min(300, length // 4)  # facts within the continuation's first few hundred tokens
    need_len = early + gap + 96
    if length < need_len:
        raise ValueError(f"length={length} is too short for decode_recall with gap={gap}: "
                         f"use length >= {need_len} (or a smaller gap)")
    facts = _facts(rng)
    stream = _sentences(rng, codec, prompt_tokens + 2 * length + 64)
    flat = [t for s in stream for t in s]
    prompt = flat[:prompt_tokens]
    # The continuation is built from whole sentences after the prompt (the first one cut).
    first_cut = prompt_tokens
    sents: list[list[int]] = []
    pos = 0
    for s in stream:
        if pos + len(s) <= first_cut:
            pos += len(s)
            continue
        sents.append(s[max(0, first_cut - pos) :])
        pos += len(s)
    # Fact j is stated after the sentence that ends past offset f_j, and referred to after the
    # sentence that ends past f_j + gap (offsets in continuation tokens, stated facts included).
    f_at = sorted(rng.sample(range(8, early), 3))
    order = list(range(3))
    rng.shuffle(order)
    statements = [codec.encode(" " + facts[j][1]) for j in order]
    refs = [(codec.encode(" " + facts[j][2]), codec.encode(" " + facts[j][3]), codec.encode("."))
            for j in order]
    target: list[int] = []
    positions: list[list[int]] = [[] for _ in range(3)]
    stated = [None, None, None]
    ref_at = [None, None, None]
    it = iter(sents)
    while len(target) < length or not all(positions):
        s = next(it, None)
        if s is None:
            raise ValueError(f"not enough prose for a decode_recall continuation of {length} tokens")
        target += s
        for k in range(3):
            if stated[k] is None and len(target) >= f_at[k]:
                stated[k] = len(target)
                target += statements[k]
                ref_at[k] = len(target) + gap
            elif stated[k] is not None and not positions[k] and len(target) >= ref_at[k]:
                cue, value, end = refs[k]
                target += cue
                positions[k] = list(range(len(target), len(target) + len(value)))
                target += value + end
    end = max(p[-1] for p in positions) + 2  # the last reference, its full stop included
    if end > length:
        raise ValueError(f"length={length} is too short for decode_recall with gap={gap} on this "
                         f"sample: its last reference ends at token {end}; use a longer length")
    target = target[:length]
    facts_meta = [{"kind": facts[j][0], "value": facts[j][3], "stated_at": stated[k],
                   "referred_at": positions[k][0], "distance": positions[k][0] - stated[k]}
                  for k, j in enumerate(order)]
    return Sample("decode_recall", f"decode_recall-{length}-{index}", DECODE_KIND, codec.decode(prompt), "",
                  [f[3] for f in facts], codec.bos_ids + prompt, [], target_ids=target,
                  max_new_tokens=gen_tokens,
                  metadata={"prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens, "gap": gap,
                            "recall_positions": positions, "facts": facts_meta})


_DOC = ("A {}-token prompt of real {} then `length` tokens of its continuation teacher-forced one "
        "at a time: KL from the full cache and perplexity per 256-token window, then greedy "
        "agreement.")
_register("decode_prose", _decode_prose, "perplexity", _DOC.format(256, "prose"), prompt_tokens=256, gen_tokens=64)
_register("decode_code", _decode_code, "perplexity", _DOC.format(256, "code"), prompt_tokens=256, gen_tokens=64)
_register("decode_steps", _decode_steps, "perplexity", _DOC.format(256, "numbered procedures"),
          prompt_tokens=256, gen_tokens=64)
_register("decode_recall", _decode_recall, "recall",
          "Prose whose continuation states a name, a number and a definition early and refers back "
          "to each 1,000+ tokens later: teacher-forced accuracy of the referring tokens.",
          prompt_tokens=256, gen_tokens=64, gap=1000)
