"""Markup removed from the texts the source families read: roff (man pages, `man_to_text`),
MediaWiki (`wiki_to_text`) and the numbered procedures found in plain-text manuals
(`procedures`); and `read_text`, the one reader of a plain or gzipped text file the families
read (None for one that cannot be read). No split."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

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

_ITEM = re.compile(r"^(\s{0,8})(\d{1,2})[.)]\s+(\S.*)$")


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


def read_text(path: Path) -> str | None:
    """The text of a plain or `.gz` file (bytes that are not UTF-8 replaced), or None for a file
    that cannot be read (a truncated or binary .gz, a permission error)."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
                return f.read()
        return path.read_text(encoding="utf-8", errors="replace")
    except (OSError, EOFError, ValueError):
        return None
