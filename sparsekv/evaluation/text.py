"""Real English prose available on every machine, cleaned into documents of sentences.

Sources, read in a fixed order so the corpus is the same on every run of one machine:
1. the Python language reference topics shipped with the interpreter (`pydoc_data.topics`),
2. the docstrings of the standard-library modules (read with `ast`, nothing is imported),
3. the license texts in `/usr/share/common-licenses/` where present (Debian and derivatives).

Only prose paragraphs are kept: code blocks, grammar rules, headings, tables and lists of short
items are dropped; typographic quotes are folded to ASCII. Nothing is downloaded. This module
knows nothing about tokenizers or tasks.
"""

from __future__ import annotations

import ast
import functools
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

LICENSE_DIR = Path("/usr/share/common-licenses")

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
        text = text.encode("ascii", "ignore").decode()
        sents = _split_sentences(text)
        if not sents:
            continue
        starts.add(len(sentences))
        sentences.extend(sents)
    if not sentences:
        return None
    return Document(source, tuple(sentences), frozenset(starts))


def _pydoc_topics() -> list[tuple[str, str]]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - stripped interpreters
        return []
    return [(f"pydoc:{k}", topics[k]) for k in sorted(topics)]


def _module_docstrings() -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py")) + sorted(root.glob("*/__init__.py"))
    out = []
    for f in files:
        if any(part.startswith("test") for part in f.relative_to(root).parts):
            continue
        try:
            doc = ast.get_docstring(ast.parse(f.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        if doc:
            out.append((f"stdlib:{f.relative_to(root)}", doc))
    return out


def _licenses() -> list[tuple[str, str]]:
    if not LICENSE_DIR.is_dir():
        return []
    out = []
    for f in sorted(LICENSE_DIR.iterdir()):
        if f.is_file() and not f.is_symlink():
            try:
                out.append((f"license:{f.name}", f.read_text(encoding="utf-8", errors="ignore")))
            except OSError:
                continue
    return out


@functools.lru_cache(maxsize=1)
def corpus() -> tuple[Document, ...]:
    """Every prose document available here, in a fixed order (cached per process)."""
    docs = []
    for source, raw in _pydoc_topics() + _module_docstrings() + _licenses():
        d = clean_document(source, raw)
        if d is not None:
            docs.append(d)
    if not docs:
        raise RuntimeError("no prose found: pydoc_data and the standard-library sources are missing")
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
