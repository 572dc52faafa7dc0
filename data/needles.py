"""The training corpus's synthetic retrieval needles (`data/build.py` puts them in prose): one
maker per kind (a number, key-value lines, a chain of assignments, words, UUID-like strings, two
keys at once, a tally, a sentence quoted back, several values under one key), each returning the
window with its needle(s), the question and the answer, with wordings of their own
(`TEMPLATES`, disjoint from the evaluation's: tests/test_text_split.py). Deterministic from the
`random.Random` it is given; no files."""

from __future__ import annotations

import functools
import random
import re
import uuid
from collections import Counter


def prose_window(rng: random.Random, prose: list[str], n: int) -> str:
    """`n` characters of prose starting at a paragraph of a random document (wrapping docs)."""
    out = ""
    while len(out) < n:
        doc = prose[rng.randrange(len(prose))]
        paras = [m.end() for m in re.finditer(r"\n\n", doc[: 50 * 400])][:50]
        start = rng.choice([0] + paras)
        out += ("\n\n" if out else "") + doc[start:]
    return out[:n]


def _insert(context: str, needles: list[str], depths: list[float]) -> str:
    """Insert each needle as its own paragraph at the word break nearest its relative depth."""
    cuts = []
    for d in depths:
        pos = int(d * len(context))
        while 0 < pos < len(context) and not context[pos - 1].isspace():
            pos -= 1
        cuts.append(pos)
    out, last = [], 0
    for pos, needle in sorted(zip(cuts, needles), key=lambda t: t[0]):
        out += [context[last:pos], f"\n\n{needle}\n\n"]
        last = pos
    out.append(context[last:])
    return "".join(out)


def _digits(rng: random.Random, n: int = 5) -> str:
    return str(rng.randrange(10 ** (n - 1), 10**n))


# Needle wordings. None of them is the evaluation's (sparsekv/evaluation/tasks.py): the head must
# learn that a short, isolated fact matters, not memorise one sentence. Each passkey entry is
# (needle, question, answer) with {k} for the number.
_PASSKEY_TEMPLATES = (
    ("The access code is {k}. Do not forget it.", "What is the access code?",
     "The access code is {k}."),
    ("Note for later: the secret number is {k}.", "What is the secret number?",
     "The secret number is {k}."),
    ("Locker combination: {k}. Keep it safe.", "What is the locker combination?",
     "The locker combination is {k}."),
    ("The ticket issued today carries the number {k}.", "Which number does today's ticket carry?",
     "Today's ticket carries the number {k}."),
    ("Remember this PIN: {k}.", "What PIN were you asked to remember?", "The PIN is {k}."),
    ("Order {k} is the one to ship first.", "Which order ships first?", "Order {k} ships first."),
)
# key-value lines and the question of the multi-hop chains ({k} key, {v} value)
_KV_TEMPLATE = ("The value of key {k} is {v}.", "What is the value of key {k}?")
_VAR_QUESTION = ("What is the value of {k}?", "{k} is {v}.")
# (first assignment, copy) wordings of the variable chains, with {a}, {b} names and {v} a number.
_VAR_TEMPLATES = (
    ("Let {a} be {v}.", "Let {b} be equal to {a}."),
    ("{a} := {v}", "{b} := {a}"),
    ("Set {a} to {v}.", "Set {b} to the value of {a}."),
)


def _passkey(rng: random.Random, context: str) -> tuple[str, str, str]:
    key = _digits(rng)
    needle, question, answer = (t.format(k=key) for t in rng.choice(_PASSKEY_TEMPLATES))
    text = _insert(context, [needle], [rng.random()])
    return text, question, answer


def _kv(rng: random.Random, context: str) -> tuple[str, str, str]:
    n = rng.randint(3, 6)
    keys = [f"{rng.getrandbits(32):08x}" for _ in range(n)]
    vals = [_digits(rng) for _ in range(n)]
    lines = [_KV_TEMPLATE[0].format(k=k, v=v) for k, v in zip(keys, vals)]
    text = _insert(context, lines, [rng.random() for _ in range(n)])
    i = rng.randrange(n)
    return text, _KV_TEMPLATE[1].format(k=keys[i]), lines[i]


def _vars(rng: random.Random, context: str) -> tuple[str, str, str]:
    hops = rng.randint(2, 4)
    names = rng.sample([a + b + c for a in "BCDFGH" for b in "KLMNPR" for c in "STVWXZ"], hops + 2)
    first, copy = rng.choice(_VAR_TEMPLATES)
    value = _digits(rng)
    lines = [first.format(a=names[0], v=value)]
    lines += [copy.format(a=names[i - 1], b=names[i]) for i in range(1, hops)]
    lines += [first.format(a=names[-1], v=_digits(rng)), copy.format(a=names[-1], b=names[-2])]
    depths = sorted(rng.random() for _ in range(hops))  # the chain appears in reading order
    depths += [rng.random(), rng.random()]
    text = _insert(context, lines, depths)
    q, a = (t.format(k=names[hops - 1], v=value) for t in _VAR_QUESTION)
    return text, q, a


# Keyed needles of the other value types, as (needle, question, answer) with {k} the key and
# {v} the value: ordinary words, UUID-like strings, and two keys asked at once.
_WORD_TEMPLATES = (
    ("Pinned to the door: the motto chosen by {k} is '{v}'.", "Which motto did {k} choose?",
     "{k} chose the motto '{v}'."),
    ("In the inventory, crate {k} is marked with the word {v}.", "Which word marks crate {k}?",
     "Crate {k} is marked {v}."),
    ("Agent {k} went by the nickname {v}.", "What nickname did agent {k} go by?",
     "Agent {k} went by {v}."),
)
_UUID_TEMPLATES = (
    ("Ticket {k} carries the reference {v}.", "Which reference does ticket {k} carry?",
     "Ticket {k} carries {v}."),
    ("Checksum recorded for archive {k}: {v}", "Give the checksum recorded for archive {k}.",
     "Archive {k} has checksum {v}."),
    ("The token issued to user {k} reads {v}.", "Which token was issued to user {k}?",
     "User {k} was issued {v}."),
)
# (needle with {k}, {v}; question with {k1}, {k2}; answer with {k1}, {v1}, {k2}, {v2}).
_PAIR_TEMPLATES = (
    ("Shelf {k} holds {v} books.", "How many books do shelves {k1} and {k2} hold?",
     "Shelf {k1} holds {v1} books and shelf {k2} holds {v2}."),
    ("Key {k} maps to {v}.", "Look up keys {k1} and {k2}.",
     "{k1} maps to {v1}; {k2} maps to {v2}."),
    ("Runner {k} finished in {v} seconds.", "How long did runners {k1} and {k2} take?",
     "Runner {k1} took {v1} seconds, runner {k2} took {v2} seconds."),
)
# (introduction of the word block, question, answer with {words}).
_TALLY_TEMPLATES = (
    ("Tally sheet:", "Which three words are listed most often on the tally sheet?",
     "Most often listed: {words}."),
    ("Cipher stream:", "Name the three cipher tokens that recur most.", "They are {words}."),
)
# (question with {cue}, answer: "rest" = the words after the cue, "all" = the whole sentence).
_QUOTE_TEMPLATES = (
    ('Quote the sentence of the passage that begins with "{cue}".', "all"),
    ('How does the sentence starting "{cue}" end?', "rest"),
    ("Finish the line from the document: {cue}", "rest"),
)
# Several numbers under one key, every one asked: (needle with {k}, {v}; question with {k};
# answer with {k} and {vs}, the values in reading order).
_MULTI_TEMPLATES = (
    ("Batch {k} includes lot {v}.", "Which lots does batch {k} include?",
     "Batch {k} includes lots {vs}."),
    ("Sensor {k} logged a reading of {v}.", "List every reading that sensor {k} logged.",
     "Sensor {k} logged {vs}."),
    ("Room {k} was booked under reservation {v}.", "Which reservations were made for room {k}?",
     "Room {k} has reservations {vs}."),
)
TEMPLATES: tuple[str, ...] = tuple(
    t
    for group in (_PASSKEY_TEMPLATES, _VAR_TEMPLATES, _WORD_TEMPLATES, _UUID_TEMPLATES,
                  _PAIR_TEMPLATES, _TALLY_TEMPLATES, _MULTI_TEMPLATES,
                  (_KV_TEMPLATE, _VAR_QUESTION))
    for row in group
    for t in row
) + tuple(q for q, _ in _QUOTE_TEMPLATES)


def _train_key(rng: random.Random) -> str:
    return f"{rng.choice('BCDFGHJKLMNPRSTVWXZ')}{rng.choice('AEIOUY')}{rng.randrange(10, 100)}"


def _train_keys(rng: random.Random, n: int) -> list[str]:
    """`n` distinct keys, drawn from 4n candidates."""
    return rng.sample(sorted({_train_key(rng) for _ in range(4 * n)}), n)


@functools.lru_cache(maxsize=4)
def vocabulary(prose: tuple[str, ...]) -> tuple[str, ...]:
    """Lower-case words of 4-9 letters used at least five times in the training prose, sorted."""
    counts: Counter[str] = Counter()
    for doc in prose:
        counts.update(re.findall(r"\b[a-z]{4,9}\b", doc))
    return tuple(sorted(w for w, c in counts.items() if c >= 5))


def _keyed(rng, context, templates, values) -> tuple[str, str, str]:
    keys = _train_keys(rng, len(values))
    needle, question, answer = rng.choice(templates)
    lines = [needle.format(k=k, v=v) for k, v in zip(keys, values)]
    text = _insert(context, lines, [rng.random() for _ in values])
    i = rng.randrange(len(values))
    return text, question.format(k=keys[i]), answer.format(k=keys[i], v=values[i])


def _words(rng: random.Random, context: str, vocab: tuple[str, ...]) -> tuple[str, str, str]:
    return _keyed(rng, context, _WORD_TEMPLATES, rng.sample(vocab, rng.randint(1, 4)))


def _uuid(rng: random.Random, context: str, vocab: tuple[str, ...]) -> tuple[str, str, str]:
    values = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(rng.randint(1, 3))]
    return _keyed(rng, context, _UUID_TEMPLATES, values)


def _pairs(rng: random.Random, context: str, vocab: tuple[str, ...]) -> tuple[str, str, str]:
    n = rng.randint(3, 6)
    keys = _train_keys(rng, n)
    vals = [_digits(rng, rng.randint(3, 7)) for _ in range(n)]
    needle, question, answer = rng.choice(_PAIR_TEMPLATES)
    text = _insert(context, [needle.format(k=k, v=v) for k, v in zip(keys, vals)],
                   [rng.random() for _ in range(n)])
    i, j = sorted(rng.sample(range(n), 2))
    return (text, question.format(k1=keys[i], k2=keys[j]),
            answer.format(k1=keys[i], v1=vals[i], k2=keys[j], v2=vals[j]))


def _tally(rng: random.Random, context: str, vocab: tuple[str, ...]) -> tuple[str, str, str]:
    intro, question, answer = rng.choice(_TALLY_TEMPLATES)
    if intro.startswith("Cipher"):  # made-up tokens
        pool = ["".join(rng.choice("bcdfghjklmnpqrstvwxz") + rng.choice("aeiouy")
                        for _ in range(rng.randint(2, 3))) for _ in range(30)]
        pool = sorted(set(pool))
    else:
        pool = rng.sample(vocab, 30)
    top = rng.sample(pool, 3)
    items = [w for k, w in enumerate(top) for _ in range(12 - 3 * k)]  # 12, 9, 6 times
    rare = rng.sample([p for p in pool if p not in top], 20)
    items += [w for w in rare for _ in range(rng.randint(1, 3))]
    rng.shuffle(items)
    text = _insert(context, [f"{intro} {' '.join(items)}"], [rng.random()])
    return text, question, answer.format(words=", ".join(top))


def _quote(rng: random.Random, context: str, vocab: tuple[str, ...]) -> tuple[str, str, str]:
    sentences = [  # hard-wrapped lines are fine; blank lines, tables and code are not
        s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", context)
        if 10 <= len(s.split()) <= 40 and s.endswith(".") and "\n\n" not in s
        and not re.search(r"[|=<>{}\[\]]|\.\.\.|  ", s.replace("\n", " "))
    ]
    if not sentences:  # a window of code or tables: fall back to a pass key
        return _passkey(rng, context)
    sentence = rng.choice(sentences)
    words = sentence.split()
    cue = " ".join(words[:6])
    question, mode = rng.choice(_QUOTE_TEMPLATES)
    return context, question.format(cue=cue), sentence if mode == "all" else " ".join(words[6:])


def _multi(rng: random.Random, context: str, vocab: tuple[str, ...]) -> tuple[str, str, str]:
    """2-5 numbers filed under one key, one distracting number under another; all are asked."""
    key, other = _train_keys(rng, 2)
    needle, question, answer = rng.choice(_MULTI_TEMPLATES)
    digits = rng.randint(4, 7)
    n, values = rng.randint(2, 5), []
    while len(values) < n:
        v = _digits(rng, digits)
        if v not in values:
            values.append(v)
    depths = sorted(rng.random() for _ in values)  # reading order = the answer's order
    lines = [needle.format(k=key, v=v) for v in values]
    lines.append(needle.format(k=other, v=_digits(rng, digits)))
    text = _insert(context, lines, [*depths, rng.random()])
    return text, question.format(k=key), answer.format(k=key, vs=", ".join(values))


_MAKERS = {"passkey": _passkey, "kv": _kv, "vars": _vars}
_VOCAB_MAKERS = {"words": _words, "uuid": _uuid, "pairs": _pairs, "tally": _tally, "quote": _quote,
                 "multi": _multi}


def make_needle(
    kind: str, rng: random.Random, window: str, vocab: tuple[str, ...]
) -> tuple[str, str, str]:
    """(text with the needle(s) inside `window`, question, answer) of one sample of `kind`."""
    if kind in _MAKERS:
        return _MAKERS[kind](rng, window)
    return _VOCAB_MAKERS[kind](rng, window, vocab)


NEEDLE_KINDS = (*_MAKERS, *_VOCAB_MAKERS)
