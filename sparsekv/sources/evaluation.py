"""The readers of the evaluation families (`sparsekv.sources`' docstring lists them): the news
and Wikipedia corpora and the code of the gensim wheel, and the numbered procedures of the
machine's manuals."""

from __future__ import annotations

import bz2
import html
import importlib.util
import re
import xml.etree.ElementTree as ET
from pathlib import Path

from sparsekv.sources.markup import procedures, read_text, wiki_to_text

INFO_DIR = Path("/usr/share/info")
DOC_DIR = Path("/usr/share/doc")


def gensim_dir() -> Path:
    """The installed gensim package's folder (found without importing gensim)."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the evaluation texts come from the gensim wheel (pinned in pyproject.toml): "
            "pip install -e . installs it"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _news() -> list[tuple[str, str]]:
    data = gensim_dir() / "test" / "test_data"
    out, seen = [], set()
    for name in ("lee_background.cor", "lee.cor"):
        lines = (data / name).read_text(encoding="utf-8", errors="replace").splitlines()
        for i, line in enumerate(lines):
            line = line.strip()
            if len(line) >= 200 and line not in seen:
                seen.add(line)
                out.append((f"news:{name.split('.')[0]}:{i}", line))
    return out


_WIKI_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
def _wikipedia() -> list[tuple[str, str]]:
    path = gensim_dir() / "test" / "test_data" / _WIKI_FILE
    out = []
    with bz2.open(path, "rb") as f:
        for _, elem in ET.iterparse(f):
            if not elem.tag.endswith("}page"):
                continue
            ns = {"m": elem.tag[: -len("page")]}
            title = elem.findtext(f"{ns['m']}title") or ""
            body = ""
            rev = elem.find(f"{ns['m']}revision")
            if rev is not None:
                body = rev.findtext(f"{ns['m']}text") or ""
            elem.clear()
            if not body or body.lstrip().upper().startswith("#REDIRECT"):
                continue
            text = wiki_to_text(html.unescape(body))
            if len(text) >= 500:
                out.append((f"wikipedia:{title}", text))
    return out


# gensim files that copy standard-library text (textcorpus.py quotes os.walk's docstring),
# found by tests/test_text_split.py: left out, since the stdlib docstrings are training text.
_GENSIM_QUOTES_TRAINING = frozenset({"corpora/textcorpus.py"})


def _gensim_code() -> list[tuple[str, str]]:
    root = gensim_dir()
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        skip = rel.as_posix() in _GENSIM_QUOTES_TRAINING or p.name == "__init__.py"
        if skip or "test" in rel.parts:
            continue
        text = p.read_text(encoding="utf-8", errors="replace")
        if len(text) >= 1000:
            out.append((f"gensim:{rel.as_posix()}", text))
    return out


_DOC_SKIP_NAME = re.compile(r"copyright|changelog|licen[cs]e|copying|authors|news", re.IGNORECASE)
_DOC_SUFFIXES = {"", ".gz", ".txt", ".md", ".rst", ".info"}


def _manual_files() -> list[Path]:
    files = sorted(INFO_DIR.glob("*.info*.gz")) if INFO_DIR.is_dir() else []
    if DOC_DIR.is_dir():
        files += sorted(
            p for p in DOC_DIR.rglob("*")
            if p.is_file() and not p.is_symlink() and p.suffix in _DOC_SUFFIXES
            and not _DOC_SKIP_NAME.search(p.name)
        )
    return files


def _manuals() -> list[tuple[str, str]]:
    out = []
    for path in _manual_files():
        raw = read_text(path)
        if raw is None:  # a truncated or binary .gz
            continue
        if "GNU GENERAL PUBLIC LICENSE" in raw or "Permission is hereby granted" in raw:
            continue  # license texts are training material
        for k, proc in enumerate(procedures(raw)):
            out.append((f"manuals:{path}:{k}", proc))
    return out
