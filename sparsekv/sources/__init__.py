"""Where every text of the project comes from, and which side of the train/evaluation split it
is on.

`FAMILIES` is the fixed list of source families. Each is `train` (read only by the training
corpus, `data/build.py`) or `eval` (read only by the evaluation tasks,
`sparsekv.evaluation.tasks.text`), and has a `kind`: `prose` (English paragraphs), `code` (source
files) or `steps` (numbered procedures in English). No family is read by both sides, so an
evaluation prompt never reuses text the gating head was trained on (`tests/test_text_split.py`
checks that no 64-character span of the evaluation text occurs in the default training corpus).

- train: the Python help topics (`pydoc_data.topics`), the docstrings of the standard library
  (read with `ast`, nothing imported) and the license texts of `/usr/share/common-licenses`;
  and, added later (not in `data/build.py`'s default `sources`, so the corpus of every recorded
  run is unchanged): the long descriptions in the installed distributions' metadata
  (`importlib.metadata`, "metadata"), the docstrings of the installed third-party packages
  ("packages", read with `ast` like the standard library's, at most `PACKAGE_FILES` files per
  package) and the English man pages of `/usr/share/man/man*` ("manpages", roff markup removed).
  The evaluation's own packages (gensim, and sparsekv itself, whose README quotes evaluation
  prompts) are left out of the first two.
- eval: two English corpora and the source code shipped inside the `gensim` wheel (pinned in
  `pyproject.toml`, so every machine reads the same bytes; gensim itself is never imported):
  the Lee news corpus (ABC news articles, `test_data/lee_background.cor` and `lee.cor`), 206
  English Wikipedia articles (`test_data/enwiki-...-shortened.bz2`, wiki markup removed here),
  gensim's own `.py` files (code); and, for steps, the numbered procedures ("To do X: 1. ...
  2. ... 3. ...") of the manuals that Debian installs in `/usr/share/info` and `/usr/share/doc`
  (files named like licenses, copyrights or changelogs, and any file quoting a license, are
  skipped: license texts are training material). The manuals depend on the Debian packages of
  the machine; the prose and code are the same everywhere.

Each reader returns `(document name, raw text)` pairs in a fixed order; cleaning prose into
sentences is `sparsekv.evaluation.tasks.text`'s job. This module knows nothing about tokenizers, tasks
or training.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from sparsekv.sources.evaluation import (
    _WIKI_FILE,
    DOC_DIR,
    INFO_DIR,
    _gensim_code,
    _manuals,
    _news,
    _wikipedia,
    gensim_dir,
)
from sparsekv.sources.markup import man_to_text, procedures, wiki_to_text
from sparsekv.sources.training import (
    LICENSE_DIR,
    MAN_DIR,
    PACKAGE_FILES,
    _docstrings,
    _licenses,
    _manpages,
    _metadata,
    _packages,
    _pydoc,
    docstrings_text,
    man_files,
    package_dirs,
    stdlib_files,
)

__all__ = [
    "DOC_DIR", "FAMILIES", "INFO_DIR", "KINDS", "LICENSE_DIR", "MAN_DIR", "PACKAGE_FILES",
    "SPLITS", "Family", "docstrings_text", "families", "gensim_dir", "get_family", "man_files",
    "man_to_text", "package_dirs", "procedures", "read", "stdlib_files", "wiki_to_text",
]

SPLITS = ("train", "eval")
KINDS = ("prose", "code", "steps")


@dataclass(frozen=True)
class Family:
    """One source family: its `name`, its `split` ("train" or "eval"), the `kind` of text it
    holds ("prose", "code" or "steps"), where it comes from, and its reader."""

    name: str
    split: str
    kind: str
    origin: str
    reader: Callable[[], list[tuple[str, str]]]


FAMILIES: tuple[Family, ...] = (
    Family("pydoc", "train", "prose", "pydoc_data.topics (the Python help topics)", _pydoc),
    Family("docstrings", "train", "prose", "standard-library docstrings, read with ast",
           _docstrings),
    Family("licenses", "train", "prose", str(LICENSE_DIR), _licenses),
    Family("metadata", "train", "prose",
           "long descriptions of the installed distributions (importlib.metadata)", _metadata),
    Family("packages", "train", "prose",
           "docstrings of the installed third-party packages, read with ast", _packages),
    Family("manpages", "train", "prose", f"English man pages of {MAN_DIR}/man*", _manpages),
    Family("news", "eval", "prose", "gensim test_data/lee_background.cor + lee.cor", _news),
    Family("wikipedia", "eval", "prose", f"gensim test_data/{_WIKI_FILE}", _wikipedia),
    Family("gensim-code", "eval", "code", "gensim's own .py files (tests left out)",
           _gensim_code),
    Family("manuals", "eval", "steps",
           f"numbered procedures of the manuals in {INFO_DIR} and {DOC_DIR}", _manuals),
)


def families(split: str | None = None, kind: str | None = None) -> tuple[Family, ...]:
    """The families of one `split` ("train" / "eval") and/or `kind` ("prose" / "code" /
    "steps"), in their fixed order."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of: {', '.join(SPLITS)}")
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind={kind!r} must be one of: {', '.join(KINDS)}")
    return tuple(
        f
        for f in FAMILIES
        if (split is None or f.split == split) and (kind is None or f.kind == kind)
    )


def get_family(name: str) -> Family:
    for f in FAMILIES:
        if f.name == name:
            return f
    known = ", ".join(f.name for f in FAMILIES)
    raise ValueError(f"unknown source family {name!r}; known: {known}")


@functools.cache
def read(name: str) -> tuple[tuple[str, str], ...]:
    """Every `(document name, raw text)` of the family `name`, in a fixed order (cached)."""
    return tuple(get_family(name).reader())
