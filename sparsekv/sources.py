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

import ast
import bz2
import functools
import gzip
import html
import importlib.util
import re
import sysconfig
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

LICENSE_DIR = Path("/usr/share/common-licenses")
INFO_DIR = Path("/usr/share/info")
DOC_DIR = Path("/usr/share/doc")
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


# ---------------------------------------------------------------- training families


def _pydoc() -> list[tuple[str, str]]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - some distributions strip pydoc_data
        return []
    return [(f"pydoc:{k}", v) for k, v in sorted(topics.items())]


def stdlib_files() -> list[Path]:
    """The standard library's `.py` files, tests and vendored packages left out, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}
    files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)]
    return sorted(files)


def docstrings_text(path: Path) -> str:
    """Module, class and function docstrings of one source file, as one document."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
        return ""
    parts = []
    doc = ast.get_docstring(tree)
    if doc:
        parts.append(f"Module {path.stem}.\n\n{doc}")
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            d = ast.get_docstring(node)
            if d and len(d) > 40:
                parts.append(f"{node.name}: {d}")
    return "\n\n".join(parts)


def _docstrings() -> list[tuple[str, str]]:
    return [(f"docstrings:{p.stem}", docstrings_text(p)) for p in stdlib_files()]


def _licenses() -> list[tuple[str, str]]:
    if not LICENSE_DIR.is_dir():
        return []
    out = []
    for p in sorted(LICENSE_DIR.iterdir()):
        if p.is_file():
            out.append((f"license:{p.name}", p.read_text(encoding="utf-8", errors="replace")))
    return out


# Distributions and packages whose text is evaluation material (gensim's corpora and code) or
# quotes it (sparsekv's own README and docs hold evaluation prompts and results).
_EVAL_PACKAGES = frozenset({"gensim", "sparsekv"})
# Training documents that quote evaluation text, found by tests/test_text_split.py and left out:
# numpy's numeric.py docstrings share parameter wordings with gensim's code; libpng(3) is the
# libpng manual of /usr/share/doc whose procedures the evaluation reads.
_QUOTES_EVALUATION = frozenset({"packages:numpy/_core/numeric", "manpages:man3/libpng.3.gz"})
PACKAGE_FILES = 40
"""At most this many `.py` files (the first in path order) per third-party package."""
MAN_DIR = Path("/usr/share/man")
MAN_MAX_BYTES = 200_000
"""Compressed man pages larger than this are skipped (generated reference dumps)."""
MAN_MAX_CHARS = 6_000_000
"""The man pages read stop at this many characters of text: pages are taken in the order of a
hash of their names (a spread over every section and letter, the same on every machine with the
same pages), so the family stays a few MB where a machine has 70 MB of manuals."""


def _metadata() -> list[tuple[str, str]]:
    import importlib.metadata as md

    out, seen = [], set()
    for dist in md.distributions():
        name = (dist.metadata.get("Name") or "").strip()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if not name or key in seen or key in _EVAL_PACKAGES:
            continue
        seen.add(key)
        text = dist.metadata.get("Description") or ""
        if not text.strip() and hasattr(dist.metadata, "get_payload"):
            text = dist.metadata.get_payload() or ""
        if isinstance(text, str) and len(text.strip()) >= 500:
            out.append((f"metadata:{key}", text))
    return sorted(out)


def package_dirs() -> list[Path]:
    """Top-level third-party package folders of the running interpreter's site-packages, in name
    order (the evaluation's packages and private or test folders left out)."""
    roots = {Path(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}
    found: dict[str, Path] = {}
    for root in sorted(roots):
        if not root.is_dir():
            continue
        for p in sorted(root.iterdir()):
            name = p.name
            if (not p.is_dir() or name.startswith(("_", ".")) or "." in name
                    or name in _EVAL_PACKAGES or name in ("test", "tests")
                    or not (p / "__init__.py").is_file()):
                continue
            found.setdefault(name, p)
    return [found[k] for k in sorted(found)]


def _packages() -> list[tuple[str, str]]:
    skip = {"test", "tests", "testing", "__pycache__", "_vendor", "vendored", "examples"}
    out = []
    for pkg in package_dirs():
        files = sorted(
            f for f in pkg.rglob("*.py") if not skip.intersection(f.relative_to(pkg).parts)
        )[:PACKAGE_FILES]
        for f in files:
            text = docstrings_text(f)
            if len(text) >= 300:
                name = f"packages:{f.relative_to(pkg.parent).with_suffix('').as_posix()}"
                if name not in _QUOTES_EVALUATION:
                    out.append((name, text))
    return out


_ROFF_FONT = re.compile(r"\\f(\(..|\[[^\]]*\]|.)")
_ROFF_ESCAPES = (
    (re.compile(r"\\\((em|en|hy)"), "-"),
    (re.compile(r"\\\((aq|cq|oq)"), "'"),
    (re.compile(r"\\\((dq|lq|rq)"), '"'),
    (re.compile(r"\\\(bu"), "*"),
    (re.compile(r"\\\(..|\\\[[^\]]*\]|\\\*(\(..|\[[^\]]*\]|.)"), ""),
    (re.compile(r"\\s[-+]?\d+|\\[&|^c%:]|\\n(\(..|\[[^\]]*\]|.)|\\k."), ""),
    (re.compile(r"\\[,/]"), ""),  # italic corrections
    (re.compile(r"\\[- ]"), lambda m: m.group(0)[1]),
    (re.compile(r"\\e"), "\\\\"),
)
_ROFF_TEXT_MACROS = {"B", "I", "BR", "RB", "IR", "RI", "BI", "IB", "SM", "SB", "UR", "MT", "Nm",
                     "Ar", "Fl", "Cm", "Pa", "Sy", "Em", "Nd", "Dq", "Qq", "Sq", "Li", "Xr"}
_ROFF_BREAKS = {"SH", "SS", "PP", "LP", "P", "TP", "IP", "HP", "sp", "br", "Sh", "Ss", "Pp", "It"}


def _roff_inline(text: str) -> str:
    text = _ROFF_FONT.sub("", text)
    for pattern, repl in _ROFF_ESCAPES:
        text = pattern.sub(repl, text)
    return text.replace("\\\\", "\\")


def man_to_text(roff: str) -> str:
    """Plain paragraphs from a man page's roff (man or mdoc macros): requests and comments
    dropped, headings and tagged items kept as their words, font and character escapes removed,
    tables and macro definitions left out."""
    paras: list[str] = []
    cur: list[str] = []
    skip_until = None

    def flush() -> None:
        if cur:
            para = " ".join(" ".join(cur).split())
            if para:
                paras.append(para)
            cur.clear()

    for line in roff.splitlines():
        if skip_until is not None:
            if line.startswith(skip_until):
                skip_until = None
            continue
        if line.startswith((".TS", "'TS")):
            skip_until = ".TE"
            continue
        if line.startswith((".de", "'de", ".ig")):
            skip_until = ".."
            continue
        if line.startswith((".", "'")):
            macro, _, args = line[1:].strip().partition(" ")
            if macro.startswith('\\"') or not macro:
                continue
            if macro in _ROFF_BREAKS:
                flush()
            if macro in _ROFF_TEXT_MACROS or macro in ("SH", "SS", "IP", "Sh", "Ss", "It"):
                words = re.findall(r'"([^"]*)"|(\S+)', args)
                parts = [a or b for a, b in words]
                joined = macro in ("BR", "RB", "IR", "RI", "BI", "IB")  # alternating fonts
                text = _roff_inline(("" if joined else " ").join(parts))
                if text.strip():
                    cur.append(text)
                if macro in ("SH", "SS", "Sh", "Ss"):
                    flush()
            continue
        if not line.strip():
            flush()
            continue
        cur.append(_roff_inline(line))
    flush()
    return "\n\n".join(p for p in paras if len(p) >= 2)


def man_files() -> list[Path]:
    """The English man pages (`/usr/share/man/man*/`), links and over-large pages left out."""
    if not MAN_DIR.is_dir():
        return []
    files = []
    for section in sorted(MAN_DIR.glob("man*")):
        for p in sorted(section.iterdir()):
            if p.is_file() and not p.is_symlink() and p.stat().st_size <= MAN_MAX_BYTES:
                files.append(p)
    return files


def _manpages() -> list[tuple[str, str]]:
    import hashlib

    out, total = [], 0
    order = sorted(man_files(), key=lambda p: hashlib.sha1(p.name.encode()).hexdigest())
    for p in order:
        if total >= MAN_MAX_CHARS:
            break
        try:
            if p.suffix == ".gz":
                with gzip.open(p, "rt", encoding="utf-8", errors="replace") as f:
                    raw = f.read()
            else:
                raw = p.read_text(encoding="utf-8", errors="replace")
        except (OSError, EOFError, ValueError):
            continue
        if raw.lstrip().startswith(".so "):  # a page that only points at another
            continue
        text = man_to_text(raw)
        name = f"manpages:{p.parent.name}/{p.name}"
        if len(text) >= 500 and name not in _QUOTES_EVALUATION:
            out.append((name, text))
            total += len(text)
    return sorted(out)


# ---------------------------------------------------------------- evaluation families


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
_WIKI_DROP_SECTIONS = re.compile(
    r"^(see also|references|notes|external links|further reading|bibliography|sources|"
    r"footnotes|citations|works cited|primary sources|secondary sources)$",
    re.IGNORECASE,
)


_WIKI_FILE_LINK = re.compile(
    r"\[\[(?:File|Image|Category|[a-z]{2,3}(?:-[a-z]+)?):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]"
)


def _strip_nested(text: str, open_: str, close: str) -> str:
    """Remove every (possibly nested) `open_ ... close` span."""
    out, depth, i = [], 0, 0
    while i < len(text):
        if text.startswith(open_, i):
            depth += 1
            i += len(open_)
        elif depth and text.startswith(close, i):
            depth -= 1
            i += len(close)
        else:
            if not depth:
                out.append(text[i])
            i += 1
    return "".join(out)


def wiki_to_text(markup: str) -> str:
    """Plain paragraphs from MediaWiki markup: templates, tables, references, files, headings,
    lists and the trailing reference sections dropped; links reduced to their label."""
    t = re.sub(r"<!--.*?-->", "", markup, flags=re.DOTALL)
    t = re.sub(r"<ref[^>/]*/>", "", t)
    t = re.sub(r"<ref[^>]*>.*?</ref>", "", t, flags=re.DOTALL)
    t = _strip_nested(t, "{{", "}}")
    t = _strip_nested(t, "{|", "|}")
    t = re.sub(r"<(math|gallery|timeline|source|syntaxhighlight|pre)[^>]*>.*?</\1>", "", t,
               flags=re.DOTALL)
    t = re.sub(r"<[^>]+>", "", t)
    # Files and categories can nest links in their captions: drop them whole.
    t = re.sub(_WIKI_FILE_LINK, "", t)
    t = re.sub(r"\[\[([^\]|]*)\|([^\]]*)\]\]", r"\2", t)
    t = re.sub(r"\[\[([^\]]*)\]\]", r"\1", t)
    t = re.sub(r"\[https?://[^\s\]]+ ?([^\]]*)\]", r"\1", t)
    t = re.sub(r"'{2,}", "", t)
    # What removed templates leave behind: "Albedo () or", "auts (, meaning", "ASD , a".
    t = re.sub(r" ?\(\s*[,;]?\s*\)", "", t)
    t = re.sub(r"\(\s*[,;]\s*", "(", t)
    t = re.sub(r"[ \t]+([,.;:])", r"\1", t)
    t = re.sub(r"[ \t]{2,}", " ", t)
    paras, out = re.split(r"\n\s*\n", t), []
    for par in paras:
        lines = []
        for line in par.split("\n"):
            s = line.strip()
            heading = re.match(r"^=+\s*(.*?)\s*=+$", s)
            if heading:
                if _WIKI_DROP_SECTIONS.match(heading.group(1)):
                    return "\n\n".join(out)
                if lines:
                    out.append(" ".join(lines))
                    lines = []
                continue
            if not s or s[0] in "*#:;|!{}" or s.startswith("__"):
                continue
            lines.append(s)
        if lines:
            out.append(" ".join(lines))
    return "\n\n".join(out)


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


_ITEM = re.compile(r"^(\s{0,8})(\d{1,2})[.)]\s+(\S.*)$")
_DOC_SKIP_NAME = re.compile(r"copyright|changelog|licen[cs]e|copying|authors|news", re.IGNORECASE)
_DOC_SUFFIXES = {"", ".gz", ".txt", ".md", ".rst", ".info"}


def procedures(text: str, max_item: int = 1500, max_chars: int = 6000) -> list[str]:
    """Numbered procedures of a plain-text document: a paragraph that introduces them, then
    items numbered 1., 2., 3., ... (>= 3 items, continuation lines folded into their item),
    rebuilt as `intro\n1. ...\n2. ...`. Lists with an over-long item or total are skipped."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _ITEM.match(lines[i])
        if not (m and m.group(2) == "1"):
            i += 1
            continue
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        intro: list[str] = []
        while k >= 0 and lines[k].strip() and not _ITEM.match(lines[k]):
            intro.insert(0, lines[k].strip())
            k -= 1
        items: list[str] = []
        expect, j, blank = 1, i, 0
        while j < len(lines):
            line = lines[j]
            m = _ITEM.match(line)
            if m and int(m.group(2)) == expect:
                items.append(m.group(3).strip())
                expect, blank = expect + 1, 0
            elif not line.strip():
                blank += 1
                if blank > 1:
                    break
            elif items and (blank == 0 or line.startswith((" ", "\t"))):
                items[-1] += " " + line.strip()
                blank = 0
            else:
                break
            j += 1
        block = "\n".join([" ".join(intro)] + [f"{n}. {t}" for n, t in enumerate(items, 1)])
        if (len(items) >= 3 and intro and sum(map(len, items)) >= 150
                and max(map(len, items)) <= max_item and len(block) <= max_chars):
            out.append(block)
        i = max(j, i + 1)
    return out


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
        try:
            if path.suffix == ".gz":
                with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
                    raw = f.read()
            else:
                raw = path.read_text(encoding="utf-8", errors="replace")
        except (OSError, EOFError, ValueError):  # a truncated or binary .gz
            continue
        if "GNU GENERAL PUBLIC LICENSE" in raw or "Permission is hereby granted" in raw:
            continue  # license texts are training material
        for k, proc in enumerate(procedures(raw)):
            out.append((f"manuals:{path}:{k}", proc))
    return out


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
