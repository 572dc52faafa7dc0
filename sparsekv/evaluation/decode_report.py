"""Tables and plots of a decode grid (`decode_grid`): `decode-summary.md` and PNGs beside the rows.

- one table per task and budget: per method its `rerank_every`, samples, mean KL(full ||
  method), perplexity, top-1, recall of the referring tokens (decode_recall), greedy agreement
  with the full cache, ms per decode step, the re-rank's share of the decode time and the KV
  MiB held at the end;
- the mean KL per 256-token window of the continuation, per method;
- `kl-position-<task>-<budget>.png`: KL against position, one line per method (64-position means
  averaged over samples); `kv-position-<budget>.png`: KV MiB against position per method.

Reads only `results.jsonl`; knows nothing about models.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

REFERENCE = "full"


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else float("nan")


def _fmt(x, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def _rows(out: Path) -> list[dict[str, Any]]:
    path = out / "results.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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
        lines += [f"## {task}, budget {budget} tokens", ""]
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
               title=f"{task}, budget {budget} tokens")
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        path = out / f"kl-position-{task}-{budget}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
        if budget in kv_done:
            continue
        kv_done.add(budget)
        fig, ax = plt.subplots(figsize=(7, 4))
        for s in rows:
            pts = s["kv_curve"]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] / 2**20 for p in pts], label=s["policy"], lw=1.2)
        ax.set(xlabel="continuation position (tokens)", ylabel="KV MiB (all layers)",
               title=f"KV bytes held, budget {budget} tokens ({task})")
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        path = out / f"kv-position-{budget}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def write_decode_report(out: str | Path) -> Path:
    """Write `decode-summary.md` and the plots of the decode rows in `out` (other tasks' rows are
    left to `report.py`); returns the summary's path."""
    out = Path(out)
    summary = summarize([r for r in _rows(out) if str(r.get("task", "")).startswith("decode_")])
    path = out / "decode-summary.md"
    tmp = out / ".decode-summary.md.tmp"
    tmp.write_text(markdown(summary))
    tmp.replace(path)
    if summary:
        plot(summary, out)
    return path
