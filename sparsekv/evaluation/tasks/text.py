"""The evaluation's text: English prose, code and procedures from evaluation-only sources.

Every text here comes from the `eval` families of `sparsekv.sources` (the Lee news corpus and
the Wikipedia articles shipped in the pinned gensim wheel for prose, gensim's own source files
for code, the numbered procedures of the installed manuals for steps); the training corpus reads
only the `train` families, so no evaluation prompt reuses training text.

Prose is cleaned into documents of sentences: code blocks, headings, tables and lists of short
items are dropped; typographic quotes are folded to ASCII. Sources are read in a fixed order, so
the corpus is the same on every run. Nothing is downloaded. This module knows nothing about
tokenizers or tasks.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from sparsekv import sources

_ASCII_FOLD = str.maketrans(
    {
        "\u2018": "'",
        "\u2019": "'",
        "\u201c": '"',
        "\u201d": '"',
        "\u2013": "-",
        "\u2014": "-",
        "\u2026": "...",
        "\u00a0": " ",
    }
)
# A sentence ends at . ! or ? followed by space and an upper-case letter, a quote or a bracket.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"(])")
_ABBREV = re.compile(r"\b(e\.g|i\.e|etc|vs|cf|Mr|Dr|No)\.$")


@dataclass(frozen=True)
class Document:
    """One source text: `sentences` are the prose sentences, `paragraph_starts` the indices of
    the sentences that open a paragraph (so text can be rebuilt with its paragraph breaks)."""

    source: str
    sentences: tuple[str, ...]
    paragraph_starts: frozenset[int]


def _is_prose(par: str) -> bool:
    lines = par.split("\n")
    if any(line.startswith("    ") for line in lines):  # code or grammar blocks
        return False
    text = " ".join(line.strip() for line in lines)
    if len(text) < 80 or not text.endswith("."):
        return False
    if text.startswith(("*", "-", "+", "|", ">>>", "...")) or "::=" in text:
        return False
    letters = sum(c.isalpha() or c == " " for c in text)
    return letters / len(text) >= 0.85


def _tidy(text: str) -> str:
    """Drop what removed non-ASCII words and templates leave behind: "Albedo () or", "auts (,
    meaning", "in 325 , and", double spaces."""
    text = re.sub(r" ?\(\s*[,;]?\s*[,;]?\s*\)", "", text)
    text = re.sub(r"\(\s*[,;]\s*", "(", text)
    text = re.sub(r" +([,.;:])", r"\1", text)
    return re.sub(r" {2,}", " ", text)


def _split_sentences(text: str) -> list[str]:
    parts = _SENTENCE_END.split(text)
    out: list[str] = []
    for p in parts:
        # Re-join splits made after an abbreviation ("e.g. The").
        if out and _ABBREV.search(out[-1]):
            out[-1] = f"{out[-1]} {p}"
        else:
            out.append(p)
    return [s for s in out if len(s) >= 3]


def clean_document(source: str, raw: str) -> Document | None:
    """Keep the prose paragraphs of `raw`, fold them to ASCII, split them into sentences."""
    raw = raw.translate(_ASCII_FOLD).replace("\r\n", "\n")
    sentences: list[str] = []
    starts: set[int] = set()
    for par in re.split(r"\n\s*\n", raw):
        par = par.strip("\n")
        if not _is_prose(par):
            continue
        text = re.sub(r"\s+", " ", par).strip()
        text = _tidy(text.encode("ascii", "ignore").decode())
        sents = _split_sentences(text)
        if not sents:
            continue
        starts.add(len(sentences))
        sentences.extend(sents)
    if not sentences:
        return None
    return Document(source, tuple(sentences), frozenset(starts))


@functools.lru_cache(maxsize=1)
def corpus() -> tuple[Document, ...]:
    """Every evaluation prose document, cleaned, in a fixed order (cached per process)."""
    docs = []
    for fam in sources.families(split="eval", kind="prose"):
        for source, raw in sources.read(fam.name):
            d = clean_document(source, raw)
            if d is not None:
                docs.append(d)
    if not docs:
        raise RuntimeError("no evaluation prose found (the gensim wheel is missing?)")
    return tuple(docs)


@functools.lru_cache(maxsize=1)
def sentence_stream() -> tuple[tuple[str, bool], ...]:
    """All sentences of the corpus in order, each with a flag: True if it opens a paragraph."""
    out = []
    for d in corpus():
        for i, s in enumerate(d.sentences):
            out.append((s, i in d.paragraph_starts))
    return tuple(out)


def join_sentences(items: list[tuple[str, bool]]) -> str:
    """Rebuild text from (sentence, opens_paragraph) pairs: paragraphs separated by a blank line."""
    parts: list[str] = []
    for i, (s, new_par) in enumerate(items):
        if i:
            parts.append("\n\n" if new_par else " ")
        parts.append(s)
    return "".join(parts)


def document_text(doc: Document) -> str:
    """A cleaned document rebuilt as text, paragraphs separated by a blank line."""
    return join_sentences([(s, i in doc.paragraph_starts) for i, s in enumerate(doc.sentences)])


def eval_texts(kind: str) -> list[tuple[str, str]]:
    """`(source name, text)` pairs of one kind of evaluation-only text, in a fixed order:
    "prose" (cleaned English documents, paragraphs separated by blank lines), "code" (whole
    source files, as shipped) or "steps" (numbered procedures: an introducing sentence, then
    one line per step, `1. ...`). None of them shares a 64-character span with the default
    training corpus (tests/test_text_split.py)."""
    if kind not in sources.KINDS:
        raise ValueError(f"kind={kind!r} must be one of: {', '.join(sources.KINDS)}")
    if kind == "prose":
        return [(d.source, document_text(d)) for d in corpus()]
    out = []
    for fam in sources.families(split="eval", kind=kind):
        out += [(name, raw.translate(_ASCII_FOLD)) for name, raw in sources.read(fam.name)]
    return out
