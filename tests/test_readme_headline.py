"""The README's headline table ("What to expect") is the report grid's own numbers: every row
matches a row of the side-by-side table in the summary.md of the grid the section links to and
names by its report seed, and the row count it states is the grid's. Reads committed files only:
no model runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def _table(block: str) -> tuple[list[str], list[list[str]]]:
    """The first markdown table of a block: header cells and body rows."""
    lines = block.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("|")), len(lines))
    rows = []
    for ln in lines[start:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip().strip("|").split("|")])
    assert len(rows) >= 3, "no table (header, rule and at least one row) in the section"
    header, _rule, *body = rows
    return header, body


def _headline() -> tuple[str, list[str], list[list[str]]]:
    section = _section((ROOT / "README.md").read_text(), "What to expect")
    header, body = _table(section)
    return section, header, body


def _report_grid(section: str) -> Path:
    seed = re.search(r"\*\*report seed (\d+)\*\*", section)
    assert seed, "the headline names its report seed in bold"
    # The grid the headline is drawn from is the one whose row count it states ("(N rows, [..](..))");
    # other grids may be linked beside it (e.g. a seed-spread grid on the same seed).
    linked = re.findall(r"\([\d,]+ rows, \[[^\]]*\]\((docs/results/[^)/]+)/README\.md\)", section)
    grids = [
        ROOT / d
        for d in linked
        if (ROOT / d / "summary.md").exists()
        and re.search(rf"; seed: {seed.group(1)}\b", (ROOT / d / "summary.md").read_text())
    ]
    assert len(grids) == 1, f"one linked grid with a summary.md of seed {seed.group(1)}: {grids}"
    return grids[0]


def _side_by_side(grid: Path) -> tuple[list[str], list[list[str]]]:
    text = (grid / "summary.md").read_text()
    start = text.index("## Side by side")
    return _table(text[start:])


def test_headline_rows_are_the_report_grids_numbers():
    section, header, body = _headline()
    grid = _report_grid(section)
    s_header, s_body = _side_by_side(grid)
    # README column -> the summary's column of the same figure.
    wanted = {
        "agnostic share": "agnostic: retrieval share @ 0.1 / 0.2 / 0.3",
        "agnostic mean KL": "agnostic: mean KL @ 0.1 / 0.2 / 0.3",
        "aware share": "aware: retrieval share @ 0.1 / 0.2 / 0.3",
        "aware mean KL": "aware: mean KL @ 0.1 / 0.2 / 0.3",
    }
    cols = [(header.index(k), s_header.index(v)) for k, v in wanted.items()]
    summary_cells = [tuple(r[j] for _, j in cols) for r in s_body]
    assert len(body) == len(s_body), "the headline lists every method of the grid"
    for row in body:
        cells = tuple(row[i] for i, _ in cols)
        assert cells in summary_cells, f"README row {row[0]!r} is not in {grid.name}/summary.md"
    # Each summary row is used once: no README row repeats another method's numbers.
    assert sorted(tuple(row[i] for i, _ in cols) for row in body) == sorted(summary_cells)


def test_headline_states_the_grids_row_count():
    section, _, _ = _headline()
    grid = _report_grid(section)
    stated = re.search(r"\(([\d,]+) rows, \[" + re.escape(str(grid.relative_to(ROOT))), section)
    assert stated, "the headline states the grid's row count next to its link"
    with open(grid / "results.jsonl") as f:
        n = sum(1 for line in f if line.strip())
    assert int(stated.group(1).replace(",", "")) == n
