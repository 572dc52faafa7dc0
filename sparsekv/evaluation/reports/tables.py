"""From `results.jsonl` to `summary.csv`, `summary.md` and the PNG plots of an evaluation folder:
the tables are written here, the numbers come from `summary.py`, the figures from `plots.py`.

summary.md opens with every method side by side (one row per method: per protocol, its retrieval
share and mean KL at each budget), then per protocol and length an at-a-glance table and the
per-task tables. The at-a-glance table's retrieval share comes with its 95% bootstrap interval
(`summary.share_interval`). Next to the mean KL over tasks it gives the mean KL over the question
tasks' samples that the full cache answers right (`kl_right`): KL(full || method) measures how far
a method moves the model from the full cache's answer, and where that answer is wrong, moving
towards the right one counts as divergence. The second number says which of the two a method's
KL is made of.
"""

from __future__ import annotations

import csv
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import yaml

from sparsekv.evaluation.config import REFERENCE, budget_label
from sparsekv.evaluation.metrics import mean
from sparsekv.evaluation.reports.summary import (  # noqa: F401  (summarize, share_interval: public names)
    SUMMARY_FIELDS,
    budget_key,
    glance_stats,
    method_name,
    method_order,
    share_interval,
    summarize,
    views,
)
from sparsekv.evaluation.rows.store import read_own
from sparsekv.evaluation.tasks import TASKS


def write_csv(summary: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SUMMARY_FIELDS, extrasaction="ignore")  # private keys ("_pairs") stay out
        w.writeheader()
        for s in summary:
            w.writerow({k: ("" if isinstance(v, float) and math.isnan(v) else
                            (round(v, 6) if isinstance(v, float) else v)) for k, v in s.items()})


def _fmt(x: float, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) < 1e-3:
        return f"{x:.1e}"
    return f"{x:.{digits}g}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _share(st: dict[str, Any], interval: bool = True) -> str:
    if math.isnan(st["share"]):
        return "-"
    text = f"{100 * st['share']:.0f}%"
    if interval and not math.isnan(st["lo"]):
        text += f" ({100 * st['lo']:.0f}-{100 * st['hi']:.0f}%)"
    return text


def _kl(st: dict[str, Any]) -> str:
    """The mean KL over tasks with its 95% interval (`summary.mean_interval`) when it has one."""
    text = _fmt(st["kl"])
    lo, hi = st.get("kl_lo", float("nan")), st.get("kl_hi", float("nan"))
    if text != "-" and not (math.isnan(lo) or math.isnan(hi)):
        text += f" ({_fmt(lo)}-{_fmt(hi)})"
    return text


def glance(ss: list[dict[str, Any]], tasks: list[str], methods: list[tuple], idx: dict,
           computed: tuple[list[dict[str, Any]], list[str]] | None = None) -> list[str]:
    """Markdown lines of the at-a-glance table of one protocol and length (`glance_stats`, or
    what it already returned for this view: `computed`)."""
    stats, scored = computed if computed is not None else glance_stats(ss, tasks, methods, idx)
    if not stats:
        return []
    rows = [[st["name"], _share(st), _kl(st), _fmt(st["kl_right"]), f"{st['lowest']}/{st['tasks_kl']}",
             str(st["n"])] for st in stats]
    note = (f"Retrieval: accuracy as a share of the full cache's, averaged over {', '.join(scored)} "
            "(the question tasks the full cache answers at least once)" if scored else
            "Retrieval: - (the full cache answers none of the question tasks here)")
    return ["At a glance:", "", _table(["method", "retrieval, share of full (95% interval)", "mean KL over tasks (95% interval)",
                                         "KL where the full cache is right", "lowest KL at its budget (tasks)",
                                         "samples"], rows), "",
            f"{note}; KL: mean over {', '.join(tasks)}; KL where the full cache is right: the mean over "
            f"{', '.join(scored) or '-'} of the KL on the samples the full cache answers right (all of a "
            "multivalue's values); the lowest-KL count compares each method with "
            "every other policy at the same budget, task by task (variants of one policy, such as its "
            "ablations, are not compared with each other).", ""]


def side_by_side(summary: list[dict[str, Any]], computed: dict[tuple, tuple] | None = None) -> list[str]:
    """Markdown lines of one table per length with every method in a row and, per protocol, its
    retrieval share, mean KL and KL where the full cache is right at each of the grid's budgets
    ("x / y / z"; "-" where the method did not run at a budget): the whole comparison in one place. `computed`: `glance_stats` per
    (protocol, length) when the caller has it already."""
    if computed is None:
        computed = {key: glance_stats(*view) for key, view in views(summary).items()}
    out: list[str] = []
    for length in sorted({length for _, length in computed}):
        protocols = sorted(pr for pr, n in computed if n == length)
        per: dict[str, dict[tuple, dict]] = {}
        order: OrderedDict[tuple, None] = OrderedDict()
        budgets: set = set()
        for pr in protocols:
            stats, _ = computed[(pr, length)]
            per[pr] = {(st["source"], st["policy"], st["budget"]): st for st in stats}
            for st in stats:
                order[(st["source"], st["policy"])] = None
                budgets.add(st["budget"])
        if not order:
            continue
        grid = sorted(budgets, key=budget_key)
        head = ["method"]
        for pr in protocols:
            b = " / ".join(budget_label(x) for x in grid)
            head += [f"{pr}: retrieval share @ {b}", f"{pr}: mean KL @ {b}", f"{pr}: KL where full is right @ {b}"]
        rows = []
        for source, policy in order:
            name = policy if source == "sparsekv" else f"{policy} ({source})"
            row = [name]
            for pr in protocols:
                got = [per[pr].get((source, policy, b)) for b in grid]
                row += [" / ".join(_share(st, interval=False) if st else "-" for st in got),
                        " / ".join(_fmt(st["kl"]) if st else "-" for st in got),
                        " / ".join(_fmt(st["kl_right"]) if st else "-" for st in got)]
            rows.append(row)
        out += [f"## Side by side, {length} tokens", "", _table(head, rows), "",
                "Retrieval share and the two KL figures as in each protocol's at-a-glance table below "
                "(intervals there).", ""]
    return out


def write_markdown(summary: list[dict[str, Any]], path: Path, config: dict[str, Any] | None = None,
                   computed: dict[tuple, tuple] | None = None) -> None:
    """summary.md; `computed`: `glance_stats` per (protocol, length) when the caller has it."""
    parts = ["# Evaluation summary", ""]
    if config:
        env = config.get("environment", {})
        have = sorted({s["n"] for s in summary if s["source"] == "sparsekv"})  # a stopped run: some fewer
        n = "-" if not have else str(have[0]) if len(have) == 1 else f"{have[0]}-{have[-1]}"
        planned = config.get("samples")
        n += "" if str(planned) == n else f" (the grid asks for {planned}: a stopped run, `--resume` continues it)"
        parts += [
            f"- model: `{config.get('model')}` ({config.get('dtype')}, {config.get('attn_implementation')}); "
            f"samples per task and length: {n}; seed: {config.get('seed')}",
            f"- machine: {env.get('processor', '?')}, torch {env.get('torch', '?')} "
            f"({env.get('torch_threads', '?')} threads), transformers {env.get('transformers', '?')}; "
            f"{env.get('date', '')}",
            "- quality: accuracy (recall for multivalue/vartrack; top-1 for nexttok; agreement with "
            "the full cache's tokens for gen; perplexity for ppl), with its fraction of the full "
            "cache's on the same samples in brackets. KL: KL(full || method) in nats on the first "
            "next-token distribution computed from the compressed cache (ppl, nexttok: mean over "
            "the continuation). KV MiB: bytes held by the cache right after compression.",
            "",
        ]
    by_view = views(summary)
    if computed is None:  # the bootstrap runs once per view
        computed = {key: glance_stats(*view) for key, view in by_view.items()}
    parts += side_by_side(summary, computed)
    for (protocol, length), (ss, tasks, methods, idx) in by_view.items():
        q_rows, kl_rows, cost_rows = [], [], []
        for m in methods:
            cells = [idx.get((*m, t)) for t in tasks]
            present = [c for c in cells if c]
            name = method_name(present[0])
            q = []
            for c in cells:
                if c is None:
                    q.append("-")
                elif TASKS.get(c["task"]) and TASKS[c["task"]].metric == "perplexity":
                    q.append(_fmt(c["ppl"]))
                elif m[1] == REFERENCE:
                    q.append(_fmt(c["score"], 2))
                else:
                    frac = c["score_frac"]
                    q.append(f"{_fmt(c['score'], 2)} ({'-' if math.isnan(frac) else f'{100 * frac:.0f}%'})")
            kv = mean([c["kv_mib"] for c in present])
            kvf = mean([c["kv_frac"] for c in present])
            err = sum(c["errors"] for c in present)
            q_rows.append([name, *q, _fmt(kv), "-" if math.isnan(kvf) else f"{100 * kvf:.0f}%"]
                          + ([str(err)] if err else []))
            kl_rows.append([name, *[_fmt(c["kl"]) if c else "-" for c in cells]])
            cost_rows.append([name, _fmt(kv), _fmt(mean([c["kv_mib_end"] for c in present])),
                              _fmt(max(c["peak_rss_mb"] for c in present)),
                              _fmt(mean([c["prefill_s"] for c in present])),
                              _fmt(mean([c["decode_tok_s"] for c in present]))])
        any_err = any(len(r) > len(tasks) + 3 for r in q_rows)
        if any_err:
            q_rows = [r if len(r) > len(tasks) + 3 else [*r, "0"] for r in q_rows]
        heads = [f"{t} ({TASKS[t].metric})" if t in TASKS else t for t in tasks]
        parts += [f"## Protocol: {protocol}, {length} tokens", ""]
        parts += glance(ss, tasks, methods, idx, computed[(protocol, length)])
        parts += ["Quality (fraction of the full cache's):", ""]
        parts += [_table(["method", *heads, "KV MiB", "KV vs full"] + (["errors"] if any_err else []), q_rows), ""]
        parts += ["KL divergence from the full cache (nats):", "", _table(["method", *tasks], kl_rows), ""]
        parts += ["Cost (mean over tasks):", ""]
        parts += [_table(["method", "KV MiB after compression", "KV MiB at end", "peak RSS MiB",
                          "prefill s", "decode tok/s"], cost_rows), ""]
    path.write_text("\n".join(parts))


def write_reports(out: str | Path, readme_series: list[str] | None = None) -> dict[str, Any]:
    """Rewrite summary.csv, summary.md and the plots of an evaluation folder from its results;
    with `readme_series` (method names as in the tables) also the README plots of those methods
    (`plots.readme_plots`)."""
    from sparsekv.evaluation.reports.plots import plot, readme_plots

    out = Path(out)
    rows = read_own(out / "results.jsonl")  # checked; a repeated row counts once
    if not rows:
        raise ValueError(f"{out / 'results.jsonl'} holds no rows")
    config = None
    if (out / "config.yaml").exists():
        config = yaml.safe_load((out / "config.yaml").read_text())
    summary = summarize(rows)
    computed = {key: glance_stats(*view) for key, view in views(summary).items()}
    write_csv(summary, out / "summary.csv")
    write_markdown(summary, out / "summary.md", config, computed)
    plots = plot(summary, out)
    if readme_series:
        plots += readme_plots(summary, out, readme_series, computed)
    if any(str(r.get("task", "")).startswith("decode_") for r in rows):
        from sparsekv.evaluation.reports.decode import write_decode_report

        write_decode_report(out)  # per-window KL, KV bytes and KL against position
    return {"summary": summary, "plots": plots}
