"""Tables and plots of a decode grid (`decode_grid`): `decode-summary.md` and PNGs beside the rows.

- one table per task and budget: per method its `rerank_every`, samples, mean KL(full ||
  method), perplexity, top-1, recall of the referring tokens (decode_recall), greedy agreement
  with the full cache, ms per decode step, the re-rank's share of the decode time and the KV
  MiB held at the end;
- the mean KL per 256-token window of the continuation, per method;
- `kl-position-<task>-<budget>.png`: KL against position, one line per method (64-position means
  averaged over samples); `kv-position-<budget>.png`: KV MiB against position per method;
- the re-rank study, where a policy ran at several `rerank_every` (its labels differing only in a
  `-r<R>` suffix): per task and budget, its mean KL at each R (0 = never re-ranked), the change
  at each R against never re-ranking, paired per sample, and the re-rank's share of the decode
  time; `rerank-<task>.png` draws KL against R per policy, one panel per budget.

Reads only `results.jsonl`; knows nothing about models.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from sparsekv.evaluation.config import budget_label
from sparsekv.io import read_jsonl, write_atomic

REFERENCE = "full"


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else float("nan")


def _fmt(x, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def _rows(out: Path) -> list[dict[str, Any]]:
    """The folder's rows, one per (sample, method, budget): processes that share a grid (each
    with its own `--only`) each write the full cache's row of a sample they start together; the
    first is kept."""
    path = out / "results.jsonl"
    rows, seen = [], set()
    for r in read_jsonl(path):
        key = (r.get("sample_id"), r.get("policy"), str(r.get("budget")), bool(r.get("error")))
        if key not in seen:
            seen.add(key)
            rows.append(r)
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """(task, budget) -> one summary dict per method (reference first, then in row order)."""
    groups: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    refs: dict[str, list[dict]] = defaultdict(list)
    order: list[str] = []
    for r in rows:
        if r.get("error"):
            continue
        if r["policy"] == REFERENCE:
            refs[r["task"]].append(r)
            continue
        groups[(r["task"], str(r["budget"]), r["policy"])].append(r)
        if r["policy"] not in order:
            order.append(r["policy"])
    out: dict[tuple[str, str], list[dict]] = {}
    for task, budget in sorted({(t, b) for t, b, _ in groups}):
        lines = [_summary(REFERENCE, refs[task])]
        for label in order:
            if (task, budget, label) in groups:
                lines.append(_summary(label, groups[(task, budget, label)]))
        out[(task, budget)] = lines
    return out


def _summary(label: str, rs: list[dict]) -> dict[str, Any]:
    n_windows = max((len(r.get("windows") or []) for r in rs), default=0)
    return {
        "policy": label,
        "rerank_every": rs[0].get("rerank_every") if label != REFERENCE else None,
        "n": len(rs),
        "kl": _mean(r.get("kl_mean") for r in rs),
        "ppl": math.exp(_mean(r.get("nll") for r in rs)) if rs else float("nan"),
        "top1": _mean(r.get("top1") for r in rs),
        "recall": _mean(r.get("recall") for r in rs),
        "recall_first": _mean(r.get("recall_first") for r in rs),
        "agreement": _mean(r.get("agreement") for r in rs),
        "prefix": _mean(r.get("prefix_match") for r in rs),
        "ms": _mean(r.get("decode_ms_per_token") for r in rs),
        "rerank_pct": _mean(r.get("rerank_pct") for r in rs),
        "kv_mib": _mean(r.get("kv_bytes_end") for r in rs) / 2**20,
        "kv_budgeted_mib": _mean((r.get("kv_curve") or [[0, 0, None]])[-1][2] for r in rs) / 2**20,
        "windows": [_mean((r.get("windows") or [{}] * n_windows)[w].get("kl") if w < len(r.get("windows") or [])
                          else None for r in rs) for w in range(n_windows)],
        "window_starts": [w["start"] for w in max((r.get("windows") or [] for r in rs), key=len)],
        "kl_curve": _mean_curve([r.get("kl_curve") or [] for r in rs]),
        "kv_curve": rs[0].get("kv_curve") or [],
    }


def _mean_curve(curves: list[list[float]]) -> list[float]:
    n = max((len(c) for c in curves), default=0)
    return [_mean(c[i] if i < len(c) else None for c in curves) for i in range(n)]


def markdown(summary: dict[tuple[str, str], list[dict[str, Any]]]) -> str:
    lines = ["# Decode-heavy tasks: eviction at every generated token", ""]
    for (task, budget), rows in summary.items():
        recall = task == "decode_recall"
        lines += [f"## {task}, budget {budget_label(budget)}", ""]
        head = "| method | rerank_every | n | KL mean | ppl | top-1 |"
        head += " recall | recall 1st |" if recall else ""
        head += " gen agreement | gen prefix | ms/step | re-rank % of decode | KV MiB end (budgeted layers) |"
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for s in rows:
            r = "-" if s["rerank_every"] is None else str(s["rerank_every"])
            line = (f"| {s['policy']} | {r} | {s['n']} | {_fmt(s['kl'])} | {_fmt(s['ppl'], 2)} | "
                    f"{_fmt(s['top1'], 3)} |")
            if recall:
                line += f" {_fmt(s['recall'], 3)} | {_fmt(s['recall_first'], 3)} |"
            line += (f" {_fmt(s['agreement'], 3)} | {_fmt(s['prefix'], 1)} | {_fmt(s['ms'], 1)} | "
                     f"{_fmt(s['rerank_pct'], 3)} | {_fmt(s['kv_mib'], 1)} ({_fmt(s['kv_budgeted_mib'], 2)}) |")
            lines.append(line)
        starts = rows[-1]["window_starts"] if rows else []
        if starts:
            lines += ["", "KL per 256-token window of the continuation (nats):", ""]
            lines.append("| method | " + " | ".join(f"{s}-{s + 255}" for s in starts) + " |")
            lines.append("|---|" + "---|" * len(starts))
            for s in rows[1:]:
                lines.append(f"| {s['policy']} | " + " | ".join(_fmt(x) for x in s["windows"]) + " |")
        lines.append("")
    return "\n".join(lines)


_R_SUFFIX = re.compile(r"-r\d+$")


def rerank_study(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, dict[int, dict[str, Any]]]]:
    """(task, budget) -> policy (label without `-r<R>`) -> R -> {kl, n, rerank_pct, vs_never,
    lower}: mean KL, samples, re-rank % of decode time, the relative change of KL against R=0
    on the same samples (their summed KL at R over their summed KL at R=0, minus 1) and on how
    many of them it is lower. Only policies that ran at
    two or more R are kept."""
    cells: dict[tuple, dict[str, dict[int, list[dict]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in rows:
        if r.get("error") or r["policy"] == REFERENCE or r.get("rerank_every") is None:
            continue
        base = _R_SUFFIX.sub("", r["policy"])
        cells[(r["task"], str(r["budget"]))][base][int(r["rerank_every"])].append(r)
    out: dict[tuple, dict] = {}
    for key in sorted(cells):
        for base, by_r in cells[key].items():
            if len(by_r) < 2:
                continue
            never = {r["sample_id"]: r.get("kl_mean") for r in by_r.get(0, [])}
            stats = {}
            for rr in sorted(by_r):
                rs = by_r[rr]
                pairs = [(r["kl_mean"], never[r["sample_id"]]) for r in rs
                         if rr and never.get(r["sample_id"]) and r.get("kl_mean") is not None]
                stats[rr] = {"kl": _mean(r.get("kl_mean") for r in rs), "n": len(rs),
                             "rerank_pct": _mean(r.get("rerank_pct") for r in rs),
                             "vs_never": (sum(a for a, _ in pairs) / sum(b for _, b in pairs) - 1
                                          if pairs else float("nan")),
                             "lower": (sum(1 for a, b in pairs if a < b), len(pairs))}
            out.setdefault(key, {})[base] = stats
    return out


def rerank_markdown(study: dict[tuple[str, str], dict[str, dict[int, dict[str, Any]]]]) -> list[str]:
    lines: list[str] = []
    for (task, budget), by_base in study.items():
        rs = sorted({rr for stats in by_base.values() for rr in stats})
        lines += [f"## Re-rank study: {task}, budget {budget_label(budget)}", "",
                  ("Mean KL(full || method) at each re-rank interval R (never = 0); in brackets the "
                   "change against never re-ranking on the same samples (summed KL over summed KL) "
                   "and on how many samples it is lower; then the re-rank's share of decode time at each R."), ""]
        head = "| policy | " + " | ".join("never" if rr == 0 else f"R={rr}" for rr in rs)
        head += " | " + " | ".join(f"re-rank % @ R={rr}" for rr in rs if rr) + " | n |"
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for base, stats in by_base.items():
            cells = []
            for rr in rs:
                c = stats.get(rr)
                if c is None:
                    cells.append("-")
                    continue
                txt = _fmt(c["kl"])
                if rr and not math.isnan(c["vs_never"]):
                    lo, n = c["lower"]
                    txt += f" ({100 * c['vs_never']:+.0f}%, {lo}/{n} lower)"
                cells.append(txt)
            pct = [_fmt(stats[rr]["rerank_pct"], 2) if rr in stats else "-" for rr in rs if rr]
            n = min(c["n"] for c in stats.values())
            lines.append(f"| {base} | " + " | ".join(cells) + " | " + " | ".join(pct) + f" | {n} |")
        lines.append("")
    return lines


def _save(fig, path: Path) -> Path:
    """Lay out, write (PNG, 110 dpi) and close a figure; returns its path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_rerank(study: dict[tuple[str, str], dict[str, dict[int, dict[str, Any]]]], out: Path) -> list[Path]:
    """`rerank-<task>.png`: mean KL against R per policy, one panel per budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for task in sorted({t for t, _ in study}):
        budgets = [b for t, b in study if t == task]
        fig, axes = plt.subplots(1, len(budgets), figsize=(4.2 * len(budgets), 3.6), squeeze=False)
        for ax, budget in zip(axes[0], budgets):
            by_base = study[(task, budget)]
            rs = sorted({rr for stats in by_base.values() for rr in stats})
            for base, stats in by_base.items():
                xs = [i for i, rr in enumerate(rs) if rr in stats]
                ax.plot(xs, [stats[rs[i]]["kl"] for i in xs], marker="o", lw=1.2, label=base)
            ax.set_xticks(range(len(rs)), ["never" if rr == 0 else str(rr) for rr in rs])
            ax.set(xlabel="re-rank every R steps", ylabel="mean KL(full || method), nats",
                   title=f"{task}, budget {budget_label(budget)}")
            ax.legend(fontsize=7)
        written.append(_save(fig, out / f"rerank-{task}.png"))
    return written


def plot(summary: dict[tuple[str, str], list[dict[str, Any]]], out: Path, curve_step: int = 64) -> list[Path]:
    """KL against position per (task, budget), KV MiB against position per budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    kv_done = set()
    for (task, budget), rows in summary.items():
        fig, ax = plt.subplots(figsize=(7, 4))
        for s in rows[1:]:
            ys = s["kl_curve"]
            ax.plot([curve_step * (i + 0.5) for i in range(len(ys))], ys, label=s["policy"], lw=1.2)
        ax.set(xlabel="continuation position (tokens)", ylabel="KL(full || method), nats",
               title=f"{task}, budget {budget_label(budget)}")
        ax.legend(fontsize=6, ncol=2)
        written.append(_save(fig, out / f"kl-position-{task}-{budget}.png"))
        if budget in kv_done:
            continue
        kv_done.add(budget)
        fig, ax = plt.subplots(figsize=(7, 4))
        for s in rows:
            pts = s["kv_curve"]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] / 2**20 for p in pts], label=s["policy"], lw=1.2)
        ax.set(xlabel="continuation position (tokens)", ylabel="KV MiB (all layers)",
               title=f"KV bytes held, budget {budget_label(budget)} ({task})")
        ax.legend(fontsize=6, ncol=2)
        written.append(_save(fig, out / f"kv-position-{budget}.png"))
    return written


def write_decode_report(out: str | Path) -> Path:
    """Write `decode-summary.md` and the plots of the decode rows in `out` (other tasks' rows are
    left to `report.py`); returns the summary's path."""
    out = Path(out)
    rows = [r for r in _rows(out) if str(r.get("task", "")).startswith("decode_")]
    summary = summarize(rows)
    study = rerank_study(rows)
    path = out / "decode-summary.md"
    write_atomic(path, markdown(summary) + ("\n" + "\n".join(rerank_markdown(study)) if study else ""))
    if summary:
        plot(summary, out)
    if study:
        plot_rerank(study, out)
    return path
