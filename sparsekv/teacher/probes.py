"""The retrieval-probe target: what a later "recall this passage" request needs from the context.

For random spans of a training sequence's real tokens, a teacher-forced pass appends, after the
sequence, one probe per span: a recall prompt (one of `PROBE_PROMPTS`, wordings disjoint from the
evaluation's; `tests/test_teacher_store.py` checks), the span's first `cue` tokens, and its next
`answer` tokens. The attention that the queries *predicting* the answer tokens (the last cue token
and every answer token but the last) pay to the sequence marks what a later question about that
span needs, whatever the span holds (a sentence, a UUID, a number in a table): the "ask anything"
signal that later questions (`questions`) and a repeat of the whole context (`reconstruction`)
give only indirectly.

This module owns the probe layout (which spans, which prompt, where the answer queries sit) and
nothing else: the statistic is `sparsekv.teacher.reconstruction.repeat_received` at those query
positions, read on full-attention layers (a sliding window cannot see the sequence from the
probes), and the store (`sparsekv.teacher.store`) keeps it as `probe.<l>`.

Spans are drawn without overlap from positions `sink .. m - cue - answer`, by a generator seeded
from the sequence's tokens and `seed`: the same sequence gets the same probes in every build.
Probes follow one another in one pass; each answer query also sees the earlier probes, which
hold other spans' tokens only (no span is probed twice).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

PROBE_PROMPTS: tuple[str, ...] = (
    "\n\nRecall a passage. Earlier the document read:",
    "\n\nQuote from memory what appeared above, starting here:",
    "\n\nCopy out how the material went on after this:",
    "\n\nFrom the document, reproduce the line that began with:",
)
"""The recall prompts (each is followed by a span's cue, then its answer)."""


@dataclass(frozen=True)
class ProbeLayout:
    """One probe pass: `ids` = sequence + probes; `query_positions` `(q,)` ascending, the
    positions whose queries predict answer tokens; `spans` the `(start, end)` of each probed span
    in the sequence (`end - start = cue + answer`)."""

    ids: list[int]
    query_positions: list[int]
    spans: list[tuple[int, int]]


def probe_spans(
    context: Sequence[int], count: int, cue: int, answer: int, seed: int = 0, sink: int = 4
) -> list[tuple[int, int]]:
    """Up to `count` non-overlapping `(start, start + cue + answer)` spans of `context`, sorted,
    drawn from starts `sink .. len(context) - cue - answer` by a generator seeded from the tokens
    and `seed` (fewer when the sequence is short; none when no span fits)."""
    for name, v in (("count", count), ("cue", cue), ("answer", answer)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"probe {name}={v!r} must be an int >= 1")
    width = cue + answer
    last = len(context) - width
    if last < sink:
        return []
    digest = hashlib.sha256(
        b"".join(int(t).to_bytes(8, "little", signed=True) for t in context)
    ).digest()
    rng = random.Random(int.from_bytes(digest[:8], "little") ^ int(seed))
    # split the admissible starts into `width`-wide slots so draws never overlap
    slots = list(range(sink, last + 1, width))
    chosen = sorted(rng.sample(slots, min(count, len(slots))))
    return [(s, s + width) for s in chosen]


def probe_layout(
    context: Sequence[int],
    prompts: Sequence[Sequence[int]],
    *,
    count: int,
    cue: int,
    answer: int,
    seed: int = 0,
    sink: int = 4,
) -> ProbeLayout:
    """The probe pass for one sequence's real tokens `context`: `prompts` are the tokenized
    `PROBE_PROMPTS` (no special tokens); probe i uses prompt `i % len(prompts)` after a
    per-sequence rotation."""
    context = [int(t) for t in context]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    spans = probe_spans(context, count, cue, answer, seed, sink)
    ids = list(context)
    queries: list[int] = []
    offset = sum(context[:8]) + int(seed)
    for i, (s, e) in enumerate(spans):
        ids += [int(t) for t in prompts[(i + offset) % len(prompts)]]
        ids += context[s : s + cue]
        first_answer = len(ids)
        ids += context[s + cue : e]
        # the query at position p predicts the token at p + 1
        queries += list(range(first_answer - 1, len(ids) - 1))
    return ProbeLayout(ids=ids, query_positions=queries, spans=spans)
