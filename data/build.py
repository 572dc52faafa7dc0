"""Offline training text for the gating head: real prose every machine has + synthetic retrieval.

This module owns building the training corpus as JSONL records `{"text": ..., "source": ...}`:

- prose of the `train` source families of `sparsekv.sources` (by default the
  `pydoc_data.topics` help pages, the docstrings of the standard library and Debian's license
  texts; on request the installed packages' metadata descriptions and docstrings and the man
  pages); the evaluation
  reads only the `eval` families, so no evaluation prompt repeats training text;
- synthetic long-context samples hidden in that prose, so that the head learns that a needle
  matters, with values of every type the evaluation asks for but wordings of their own
  (`TEMPLATES`, disjoint from the evaluation's): a number ("passkey"), key-value lines ("kv"), a
  chain of assignments ("vars", multi-hop), ordinary words ("words"), UUID-like strings
  ("uuid"), two keys asked at once ("pairs"), the most frequent words of a block ("tally") and a
  sentence of the prose quoted back ("quote"), and several numbers filed under one key, all of
  them asked ("multi"). Each ends with its question and answer, so the
  frozen model's attention from the answer back to the needle is part of the teacher signal.

Everything is deterministic from `seed`. The module knows nothing about tokenizers or models;
the trainer packs the text into token blocks. Output is written atomically (temp file + rename).

    python data/build.py --out data/train.jsonl                 # defaults (~8 MB of text)
    python data/build.py --out data/small.jsonl --max_prose_chars 200000 --synthetic 100
"""

from __future__ import annotations

import argparse
import ast
import functools
import itertools
import json
import os
import random
import re
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from sparsekv import sources

# The training side of the split: only families that sparsekv.sources marks "train" (the
# evaluation reads the "eval" ones), checked at import.
SOURCES = tuple(f.name for f in sources.families(split="train", kind="prose"))
# What `sources` defaults to: the first three families; the later ones (metadata, packages,
# manpages) are opted into (configs/train/gemma3-270m-store.yaml), so the corpus of every
# recorded run stays byte-identical.
DEFAULT_SOURCES = ("pydoc", "docstrings", "licenses")
KINDS = ("passkey", "kv", "vars", "words", "uuid", "pairs", "tally", "quote", "multi")
# What `kinds` defaults to: every kind but "multi", which came later; leaving it out of the
# default keeps the corpus of every recorded run (and its checkpoint) byte-identical.
DEFAULT_KINDS = tuple(k for k in KINDS if k != "multi")


@dataclass
class BuildConfig:
    seed: int = 0
    """Seed for the document order, the prose windows and every synthetic value."""
    max_prose_chars: int = 4_000_000
    """Stop adding prose documents once this many characters are collected."""
    max_doc_chars: int = 20_000
    """Longer prose documents are split (at paragraph breaks) into pieces of at most this size."""
    synthetic: int = 1000
    """Number of synthetic retrieval samples."""
    context_chars: int = 4000
    """Characters of prose around the needles of one synthetic sample (about 4 per token)."""
    kinds: list[str] = field(default_factory=lambda: list(DEFAULT_KINDS))
    """Synthetic sample kinds to draw from: passkey, kv, vars, words, uuid, pairs, tally, quote,
    multi (default: all but multi)."""
    sources: list[str] = field(default_factory=lambda: list(DEFAULT_SOURCES))
    """Prose sources: pydoc, docstrings, licenses (the default), metadata (installed
    distributions' long descriptions), packages (third-party docstrings), manpages."""

    def __post_init__(self) -> None:
        for name in ("max_prose_chars", "max_doc_chars", "context_chars"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be an int >= 1")
        if not isinstance(self.synthetic, int) or self.synthetic < 0:
            raise ValueError(f"synthetic={self.synthetic!r} must be an int >= 0")
        for name, allowed in (("kinds", KINDS), ("sources", SOURCES)):
            vals = getattr(self, name)
            bad = [v for v in vals if v not in allowed] if isinstance(vals, list) else [vals]
            if bad or not vals:
                raise ValueError(
                    f"{name}={vals!r} must be a non-empty list of: {', '.join(allowed)}"
                )


# ---------------------------------------------------------------- prose


def _split_doc(text: str, limit: int) -> list[str]:
    """Cut `text` at paragraph breaks into pieces of at most `limit` characters."""
    pieces, cur = [], ""
    for para in text.split("\n\n"):
        while len(para) > limit:
            pieces.append(para[:limit])
            para = para[limit:]
        if cur and len(cur) + len(para) + 2 > limit:
            pieces.append(cur)
            cur = ""
        cur = f"{cur}\n\n{para}" if cur else para
    if cur.strip():
        pieces.append(cur)
    return pieces


def collect_prose(cfg: BuildConfig) -> list[dict]:
    """Prose records in a seed-shuffled document order, up to `cfg.max_prose_chars`."""
    items: list[tuple[str, str]] = []
    for family in SOURCES:  # the fixed order of the families, then a seeded shuffle
        if family in cfg.sources:
            items += sources.read(family)
    random.Random(cfg.seed).shuffle(items)
    records, total = [], 0
    for name, text in items:
        if total >= cfg.max_prose_chars:
            break
        text = text.strip()
        if len(text) < 200:
            continue
        for piece in _split_doc(text, cfg.max_doc_chars):
            records.append({"text": piece, "source": name.split(":")[0], "doc": name})
            total += len(piece)
    return records


# ---------------------------------------------------------------- synthetic retrieval


def _window(rng: random.Random, prose: list[str], n: int) -> str:
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
def _vocabulary(prose: tuple[str, ...]) -> tuple[str, ...]:
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



def synthetic_samples(cfg: BuildConfig, prose: list[str]) -> list[dict]:
    """`cfg.synthetic` retrieval samples: prose window + needle(s) + question + answer."""
    if not prose or cfg.synthetic == 0:
        return []
    rng = random.Random(cfg.seed + 1)
    vocab = _vocabulary(tuple(prose))
    out = []
    for _ in range(cfg.synthetic):
        kind = rng.choice(cfg.kinds)
        window = _window(rng, prose, cfg.context_chars)
        if kind in _MAKERS:
            body, question, answer = _MAKERS[kind](rng, window)
        else:
            body, question, answer = _VOCAB_MAKERS[kind](rng, window, vocab)
        text = f"{body}\n\nQuestion: {question}\nAnswer: {answer}"
        out.append({"text": text, "source": f"synthetic:{kind}", "answer": answer})
    return out


# ---------------------------------------------------------------- output


def build(cfg: BuildConfig) -> list[dict]:
    """All records (prose + synthetic) in a seed-shuffled order."""
    prose = collect_prose(cfg)
    records = prose + synthetic_samples(cfg, [r["text"] for r in prose])
    random.Random(cfg.seed + 2).shuffle(records)
    return records


def write_jsonl(records: list[dict], out: str | os.PathLike) -> Path:
    """Write records as JSONL atomically: a temp file in the same folder, then a rename."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from sparsekv.io import atomic_path

    with atomic_path(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return out


def build_file(out: str | os.PathLike, cfg: BuildConfig | None = None) -> Path:
    """Build the corpus with `cfg` and write it to `out`; returns the path."""
    return write_jsonl(build(cfg or BuildConfig()), out)


def _field_docs(cls) -> dict[str, str]:
    """The docstring written under each dataclass field (used as CLI help)."""
    import inspect

    body = ast.parse(inspect.getsource(cls)).body[0].body
    return {
        a.target.id: " ".join(b.value.value.split())
        for a, b in itertools.pairwise(body)
        if isinstance(a, ast.AnnAssign)
        and isinstance(b, ast.Expr)
        and isinstance(b.value, ast.Constant)
        and isinstance(b.value.value, str)
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="output JSONL path")
    docs, defaults = _field_docs(BuildConfig), asdict(BuildConfig())
    for f in fields(BuildConfig):
        is_list = isinstance(defaults[f.name], list)
        shown = ",".join(defaults[f.name]) if is_list else defaults[f.name]
        p.add_argument(
            f"--{f.name}",
            type=(lambda s: s.split(",")) if is_list else int,
            default=None,
            help=f"{docs.get(f.name, '')} (default: {shown})",
        )
    return p


def main(argv: list[str] | None = None) -> int:
    args = vars(_parser().parse_args(argv))
    out = args.pop("out")
    cfg = BuildConfig(**{k: v for k, v in args.items() if v is not None})
    records = build(cfg)
    path = write_jsonl(records, out)
    counts = Counter(r["source"] for r in records)
    chars = sum(len(r["text"]) for r in records)
    print(f"wrote {len(records)} records ({chars} characters) to {path}")
    print(json.dumps({"config": asdict(cfg), "records_by_source": dict(sorted(counts.items()))}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
