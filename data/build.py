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
import json
import os
import random
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from sparsekv import sources
from sparsekv.configfile import field_docs

if __package__ in (None, ""):  # run as `python data/build.py`: the repository root holds `data`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data.needles import NEEDLE_KINDS, make_needle, prose_window, vocabulary  # noqa: E402

# The training side of the split: only families that sparsekv.sources marks "train" (the
# evaluation reads the "eval" ones), checked at import.
SOURCES = tuple(f.name for f in sources.families(split="train", kind="prose"))
# What `sources` defaults to: the first three families; the later ones (metadata, packages,
# manpages) are opted into (configs/train/gemma3-270m-store.yaml), so the corpus of every
# recorded run stays byte-identical.
DEFAULT_SOURCES = ("pydoc", "docstrings", "licenses")
KINDS = ("passkey", "kv", "vars", "words", "uuid", "pairs", "tally", "quote", "multi")
assert set(KINDS) == set(NEEDLE_KINDS), "every kind has its needle maker (data/needles.py)"
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


def synthetic_samples(cfg: BuildConfig, prose: list[str]) -> list[dict]:
    """`cfg.synthetic` retrieval samples: prose window + needle(s) + question + answer."""
    if not prose or cfg.synthetic == 0:
        return []
    rng = random.Random(cfg.seed + 1)
    vocab = vocabulary(tuple(prose))
    out = []
    for _ in range(cfg.synthetic):
        kind = rng.choice(cfg.kinds)
        window = prose_window(rng, prose, cfg.context_chars)
        body, question, answer = make_needle(kind, rng, window, vocab)
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="output JSONL path")
    docs, defaults = field_docs(BuildConfig), asdict(BuildConfig())
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
