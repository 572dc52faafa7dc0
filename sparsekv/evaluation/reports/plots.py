"""The figures of an evaluation folder, drawn from its summary (`summary.py`).

Diagnostic plots (every method), one figure per protocol and length, one panel per task:
- `quality_<protocol>_<length>.png`: each task's quality number (accuracy, recall, perplexity,
  top-1, agreement) against the KV memory held after compression; one line per method through
  its budgets, the full cache as a star and a dashed line.
- `kl_<protocol>_<length>.png`: KL divergence from the full cache (log scale) against KV memory.

README plots (`readme_plots`, a few chosen methods), one figure per protocol and length:
`readme_<protocol>_<length>.png`, the retrieval share of the full cache's answers with its 95%
bootstrap interval as error bars, and the mean KL over tasks, both against the budget.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from itertools import pairwise
from pathlib import Path
from typing import Any

from sparsekv.evaluation.config import REFERENCE, budget_label, is_token_budget
from sparsekv.evaluation.reports.summary import LOWER_IS_BETTER, budget_key, method_order, quality
from sparsekv.evaluation.tasks import TASKS


def plot(summary: list[dict[str, Any]], out: Path) -> list[Path]:
    """Write the quality and KL figures; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    written = []
    methods = [(s, p) for s, p, _ in method_order(summary)]
    methods = list(OrderedDict.fromkeys(methods))
    cmap = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20")
    others = [m for m in methods if m[1] != REFERENCE]
    colors = {m: cmap(i % cmap.N) for i, m in enumerate(others)}
    markers = {
        m: "osD^vPXh<>"[i % 10] for i, m in enumerate(others)
    }  # overlapping lines stay visible
    views: OrderedDict[tuple, list] = OrderedDict()
    for s in sorted(summary, key=lambda s: (s["protocol"], s["length"])):
        views.setdefault((s["protocol"], s["length"]), []).append(s)
    for (protocol, length), ss in views.items():
        tasks = [t for t in TASKS if any(s["task"] == t for s in ss)]
        tasks += sorted({s["task"] for s in ss} - set(tasks))
        for kind in ("quality", "kl"):
            n = len(tasks)
            ncols = min(4, n)
            nrows = math.ceil(n / ncols)
            fig, axes = plt.subplots(
                nrows,
                ncols,
                figsize=(4.2 * ncols, 3.3 * nrows + 1.0),
                squeeze=False,
                layout="constrained",
            )
            handles: OrderedDict[str, Any] = OrderedDict()
            for ax, task in zip(axes.flat, tasks):
                metric = TASKS[task].metric if task in TASKS else "score"
                rows_t = [s for s in ss if s["task"] == task]
                for source, policy in methods:
                    pts = sorted(
                        (s for s in rows_t if s["source"] == source and s["policy"] == policy),
                        key=lambda s: budget_key(s["budget"]),
                    )
                    if not pts:
                        continue
                    x = [p["kv_mib"] for p in pts]
                    y = [quality(p) if kind == "quality" else p["kl"] for p in pts]
                    if policy == REFERENCE and source == "sparsekv":
                        if kind == "quality":
                            h = ax.scatter(x, y, marker="*", s=160, color="black", zorder=5)
                            ax.axhline(y[0], color="black", lw=0.8, ls="--", alpha=0.6)
                            handles.setdefault("full cache", h)
                        continue
                    if kind == "kl":
                        y = [
                            max(v, 1e-6) if v is not None and not math.isnan(v) else float("nan")
                            for v in y
                        ]
                    style = "-" if source == "sparsekv" else "--"
                    label = policy if source == "sparsekv" else f"{policy} ({source})"
                    (h,) = ax.plot(
                        x,
                        y,
                        style,
                        marker=markers[(source, policy)],
                        ms=5,
                        lw=1.5,
                        color=colors[(source, policy)],
                        mfc="none" if source != "sparsekv" else None,
                    )
                    handles.setdefault(label, h)
                ax.set_title(task, fontsize=11)
                ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(5))
                ax.set_xlabel("KV cache after compression (MiB)", fontsize=9)
                if kind == "quality":
                    ylabel = metric + (" (lower is better)" if metric in LOWER_IS_BETTER else "")
                    ax.set_ylabel(ylabel, fontsize=9)
                    if metric not in LOWER_IS_BETTER:
                        ax.set_ylim(-0.03, 1.03)
                else:
                    ax.set_yscale("log")
                    ax.set_ylabel("KL(full || method), nats", fontsize=9)
                if kind == "kl":
                    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
                ax.grid(alpha=0.3, which="both" if kind == "kl" else "major")
                ax.tick_params(labelsize=8)
            for ax in list(axes.flat)[n:]:
                ax.set_visible(False)
            title = "Quality" if kind == "quality" else "KL divergence from the full cache"
            fig.suptitle(
                f"{title} vs KV memory - protocol {protocol}, {length} tokens "
                f"(points: budgets, left = smallest)",
                fontsize=12,
            )
            fig.legend(
                list(handles.values()),
                list(handles.keys()),
                loc="outside lower center",
                ncol=min(6, max(1, len(handles))),
                fontsize=9,
                frameon=False,
            )
            p = out / f"{kind}_{protocol}_{length}.png"
            fig.savefig(p, dpi=110)
            plt.close(fig)
            written.append(p)
    return written


README_MAX_SERIES = 6


def series_name(source: str, policy: str) -> str:
    """A method's name in the tables (the side-by-side table, the README's): its label, with
    the producer in brackets for a peer's rows."""
    return policy if source == "sparsekv" else f"{policy} ({source})"


def readme_series(
    computed: dict[tuple, tuple], series: list[str]
) -> dict[tuple, list[dict[str, Any]]]:
    """Per (protocol, length) of `computed` (`summary.glance_stats` per view), the points of the
    chosen `series`, in the order given: name, budget, share with its 95% interval lo-hi, mean
    KL over tasks with its interval kl_lo-kl_hi, samples n. Views where none of the series ran
    are left out. Raises ValueError naming the unknown names and the available ones, or when
    more than 6 series are asked for."""
    if not series or len(series) > README_MAX_SERIES:
        raise ValueError(
            f"readme plots take 1 to {README_MAX_SERIES} series (a reader tells about as many "
            f"lines apart), got {len(series)}"
        )
    available = list(
        OrderedDict.fromkeys(
            series_name(st["source"], st["policy"])
            for stats, _ in computed.values()
            for st in stats
        )
    )
    unknown = [s for s in series if s not in available]
    if unknown:
        raise ValueError(
            f"readme plot series {unknown} are not methods of this folder; available: "
            f"{', '.join(repr(a) for a in available)}"
        )
    out: dict[tuple, list[dict[str, Any]]] = OrderedDict()
    for key, (stats, _) in computed.items():
        pts = [
            {
                "name": series_name(st["source"], st["policy"]),
                **{k: st[k] for k in ("budget", "share", "lo", "hi", "kl", "kl_lo", "kl_hi", "n")},
            }
            for st in stats
            if series_name(st["source"], st["policy"]) in series
        ]
        if pts:
            pts.sort(key=lambda p: (series.index(p["name"]), budget_key(p["budget"])))
            out[key] = pts
    return out


def readme_figure(
    points: list[dict[str, Any]], protocol: str, length: int, order: list[str] | None = None
):
    """The README figure of one protocol and length (`readme_series` points): retrieval share of
    the full cache's and the mean KL over tasks, each with its 95% bootstrap interval as error
    bars, against the budget. `order`: every series' name, so that a series keeps its colour and
    marker across figures. Returns the matplotlib figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    names = list(OrderedDict.fromkeys(p["name"] for p in points))
    budgets = sorted({budget_key(p["budget"]) for p in points})
    step = min((b - a for a, b in pairwise(budgets)), default=max(budgets[0], 1e-9))
    ns = sorted({p["n"] for p in points})
    n = str(ns[0]) if len(ns) == 1 else f"{ns[0]}-{ns[-1]}"
    fig, (ax_s, ax_k) = plt.subplots(1, 2, figsize=(10.5, 4.8), layout="constrained")
    cmap = plt.get_cmap("tab10")
    order = order or names
    for i, name in enumerate(names):
        pts = [p for p in points if p["name"] == name]
        c = order.index(name)
        # side by side at each budget, so intervals do not hide each other
        x = [budget_key(p["budget"]) + (i - (len(names) - 1) / 2) * 0.08 * step for p in pts]
        share = [100 * p["share"] for p in pts]
        err = [
            [100 * (p["share"] - p["lo"]) if not math.isnan(p["lo"]) else 0.0 for p in pts],
            [100 * (p["hi"] - p["share"]) if not math.isnan(p["hi"]) else 0.0 for p in pts],
        ]
        style = {
            "color": cmap(c % 10),
            "marker": "osD^vP"[c % 6],
            "ms": 6,
            "lw": 1.6,
            "label": name,
        }
        ax_s.errorbar(x, share, yerr=err, capsize=4, elinewidth=1.1, **style)
        kl = [p["kl"] if p["kl"] > 0 else float("nan") for p in pts]
        known = [p["kl"] > 0 and not math.isnan(p["kl_lo"]) for p in pts]  # else no bar
        kl_err = [
            [p["kl"] - p["kl_lo"] if ok else 0.0 for p, ok in zip(pts, known, strict=True)],
            [p["kl_hi"] - p["kl"] if ok else 0.0 for p, ok in zip(pts, known, strict=True)],
        ]
        ax_k.errorbar(x, kl, yerr=kl_err, capsize=4, elinewidth=1.1, **style)
    ax_s.axhline(100, color="black", ls="--", lw=0.9, alpha=0.7, label="full cache")
    ax_s.set_ylabel("retrieval: share of the full cache's answers (%)")
    ax_s.set_ylim(bottom=0)
    ax_k.set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax_k.yaxis.set_major_formatter(plain)
    ax_k.yaxis.set_minor_locator(matplotlib.ticker.LogLocator(subs=(2.0, 5.0)))
    ax_k.yaxis.set_minor_formatter(plain)
    ax_k.tick_params(axis="y", which="minor", labelsize=7)
    ax_k.set_ylabel("KL(full || method), nats, mean over tasks")
    tokens = {budget_key(p["budget"]) for p in points if is_token_budget(p["budget"])}
    for ax in (ax_s, ax_k):
        ax.set_xticks(budgets)
        if not tokens:
            ax.set_xlabel("budget: share of the context kept in the budgeted layers")
        elif len(tokens) == len(budgets):
            ax.set_xlabel("budget (tokens per budgeted layer)")
        else:  # fractions and token counts on one axis: each tick says which it is
            ax.set_xticklabels([budget_label(int(b)) if b in tokens else f"{b:g}" for b in budgets])
            ax.set_xlabel("budget: a share of the context, or tokens per budgeted layer")
        ax.grid(alpha=0.3, which="both")
    handles, labels = ax_s.get_legend_handles_labels()
    fig.legend(
        handles,
        labels,
        loc="outside lower center",
        ncol=min(len(labels), 4),
        fontsize=9,
        frameon=False,
    )
    fig.suptitle(
        f"{protocol} protocol, {length} tokens, n = {n} samples per task "
        "(error bars: 95% bootstrap interval over prompts)",
        fontsize=11,
    )
    return fig


def readme_plots(
    summary: list[dict[str, Any]],
    out: Path,
    series: list[str],
    computed: dict[tuple, tuple] | None = None,
) -> list[Path]:
    """Write `readme_<protocol>_<length>.png` into `out` for the chosen `series` (method names
    as in the tables, 1-6 of them); `computed`: `glance_stats` per view when the caller has it.
    Returns the paths."""
    import matplotlib.pyplot as plt

    from sparsekv.evaluation.reports.summary import glance_stats, views

    if computed is None:
        computed = {key: glance_stats(*view) for key, view in views(summary).items()}
    written = []
    for (protocol, length), pts in readme_series(computed, list(series)).items():
        fig = readme_figure(pts, protocol, length, list(series))
        path = Path(out) / f"readme_{protocol}_{length}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
