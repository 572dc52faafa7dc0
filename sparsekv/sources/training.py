"""The readers of the training families (`sparsekv.sources`' docstring lists them): the Python
help topics, the standard library's and the installed third-party packages' docstrings, the
license texts, the distributions' long descriptions and the man pages."""

from __future__ import annotations

import ast
import re
import sysconfig
from pathlib import Path

from sparsekv.sources.markup import man_to_text, read_text

LICENSE_DIR = Path("/usr/share/common-licenses")


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
        raw = read_text(p)
        if raw is None:
            continue
        if raw.lstrip().startswith(".so "):  # a page that only points at another
            continue
        text = man_to_text(raw)
        name = f"manpages:{p.parent.name}/{p.name}"
        if len(text) >= 500 and name not in _QUOTES_EVALUATION:
            out.append((name, text))
            total += len(text)
    return sorted(out)
