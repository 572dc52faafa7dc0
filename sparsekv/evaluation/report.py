"""From `results.jsonl` to `summary.csv`, `summary.md` and the PNG plots of an evaluation folder.

Aggregation is per (source, task, length, protocol, policy, budget) over samples. The fraction
of the full cache's accuracy (`score_frac`) and of its KV memory (`kv_frac`) are taken on the
same samples and protocol as the policy's rows, against this harness's own full-cache rows, so
rows ingested from a peer are compared with the same reference.

summary.md opens with every method side by side (one row per method: per protocol, its retrieval
share and mean KL at each budget), then per protocol and length an at-a-glance table and the
per-task tables. The at-a-glance table's retrieval share comes with a 95% bootstrap interval: each task's
samples are resampled (paired: a method's score with the full cache's on the same prompt),
the share recomputed, 2,000 times with a fixed seed, and the 2.5th and 97.5th percentiles of the
averaged share reported. It says how far the share can move with other prompts of the same kind.
Next to the mean KL over tasks it gives the mean KL over the question tasks' samples that the full
cache answers right (`kl_right`): KL(full || method) measures how far a method moves the model from
the full cache's answer, and where that answer is wrong, moving towards the right one counts as
divergence. The second number says which of the two a method's KL is made of.

Plots, one figure per protocol and length, one panel per task:
- `quality_<protocol>_<length>.png`: each task's quality number (accuracy, recall, perplexity,
  top-1, agreement) against the KV memory held after compression; one line per method through
  its budgets, the full cache as a star and a dashed line.
- `kl_<protocol>_<length>.png`: KL divergence from the full cache (log scale) against KV memory.
"""

from __future__ import annotations

import csv
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import yaml

from sparsekv.evaluation.config import REFERENCE, policy_name
from sparsekv.evaluation.metrics import mean
from sparsekv.evaluation.rows import read_rows
from sparsekv.evaluation.tasks import TASKS

SUMMARY_FIELDS = (
    "source", "task", "length", "protocol", "policy", "budget", "n", "errors", "score", "score_frac",
    "kl", "kl_right", "n_right", "kl_mean", "ppl", "top1", "agreement", "repetition", "kv_mib", "kv_mib_end", "kv_peak_mib", "kv_frac",
    "peak_rss_mb", "prefill_s", "decode_tok_s",
)
_MIB = 2**20
_LOWER_IS_BETTER = {"perplexity"}


def _num(x: Any) -> float:
    return float("nan") if x is None else float(x)


def _budget_key(b: Any) -> float:
    try:
        return float(b)
    except (TypeError, ValueError):
        return float("inf")


def _family(source: str, policy: str, spec: str | None) -> tuple[str, str]:
    """The policy a method is a variant of: its spec's name (`learned:DIR@blend=0` and its
    ablations are all `learned`), or its label where the rows carry no spec (peers' rows)."""
    return source, policy_name(spec) if spec else policy


def label_adapters_apart(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of one label (per source and protocol) that ran more than one adapter (distinct
    `adapter_hash`) are two methods: each gets its label suffixed with the hash's first 8
    characters, `learned [1a2b3c4d]`. Rows without a hash (written before rows recorded it)
    keep their label."""
    hashes: dict[tuple, set] = {}
    for r in rows:
        if r.get("adapter_hash"):
            hashes.setdefault((r.get("source") or "sparsekv", r["protocol"], r["policy"]), set()).add(r["adapter_hash"])
    mixed = {k for k, v in hashes.items() if len(v) > 1}
    if not mixed:
        return rows
    out = []
    for r in rows:
        if r.get("adapter_hash") and (r.get("source") or "sparsekv", r["protocol"], r["policy"]) in mixed:
            r = {**r, "policy": f"{r['policy']} [{r['adapter_hash'][:8]}]"}
        out.append(r)
    return out


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One summary row per (source, task, length, protocol, policy, budget); a label that ran
    several adapters is split first (`label_adapters_apart`)."""
    rows = label_adapters_apart(rows)
    ref: dict[tuple, dict] = {}
    for r in rows:
        if r["policy"] == REFERENCE and r.get("source", "sparsekv") == "sparsekv":
            ref[(r["sample_id"], r["protocol"])] = r
    groups: OrderedDict[tuple, list[dict]] = OrderedDict()
    for r in rows:
        k = (r.get("source") or "sparsekv", r["task"], int(r["length"]), r["protocol"], r["policy"], r["budget"])
        groups.setdefault(k, []).append(r)
    out = []
    for (source, task, length, protocol, policy, budget), rs in groups.items():
        scores = [_num(r.get("score")) for r in rs]
        paired = [(r, ref[(r["sample_id"], protocol)]) for r in rs if (r["sample_id"], protocol) in ref]
        ref_sum = sum(_num(f.get("score")) for _, f in paired)
        pol_sum = sum(_num(r.get("score")) for r, _ in paired)
        kv_ref = mean([_num(f.get("kv_bytes_compressed")) for _, f in paired])
        kv_pol = mean([_num(r.get("kv_bytes_compressed")) for r, _ in paired])
        nll = mean([_num(r.get("nll")) for r in rs])
        pairs = [(_num(r.get("score")), _num(f.get("score"))) for r, f in paired]
        spec = TASKS.get(task)
        right = ([_num(r.get("kl")) for r, f in paired if _num(f.get("score")) >= 1.0]
                 if spec and spec.kind == "answer" else [])
        out.append({
            "_pairs": [p for p in pairs if not (math.isnan(p[0]) or math.isnan(p[1]))],
            "source": source, "task": task, "length": length, "protocol": protocol, "policy": policy,
            "_family": _family(source, policy, rs[0].get("policy_spec")),
            "budget": budget, "n": len(rs), "errors": sum(1 for r in rs if r.get("error")),
            "score": mean(scores),
            "score_frac": pol_sum / ref_sum if paired and ref_sum > 0 else float("nan"),
            "kl": mean([_num(r.get("kl")) for r in rs]),
            "kl_right": mean(right) if right else float("nan"), "n_right": len(right),
            "kl_mean": mean([_num(r.get("kl_mean")) for r in rs]),
            "ppl": math.exp(nll) if not math.isnan(nll) else float("nan"),
            "top1": mean([_num(r.get("top1")) for r in rs]),
            "agreement": mean([_num(r.get("agreement")) for r in rs]),
            "repetition": mean([_num(r.get("repetition")) for r in rs]),
            "kv_mib": mean([_num(r.get("kv_bytes_compressed")) for r in rs]) / _MIB,
            "kv_mib_end": mean([_num(r.get("kv_bytes_end")) for r in rs]) / _MIB,
            "kv_peak_mib": mean([_num(r.get("kv_bytes_peak")) for r in rs]) / _MIB,
            "kv_frac": kv_pol / kv_ref if paired and kv_ref > 0 else float("nan"),
            "peak_rss_mb": max((_num(r.get("peak_rss_mb")) for r in rs), default=float("nan")),
            "prefill_s": mean([_num(r.get("prefill_s")) for r in rs]),
            "decode_tok_s": mean([_num(r.get("decode_tok_s")) for r in rs]),
        })
    return out


def quality(s: dict[str, Any]) -> float:
    """The number plotted for a summary row: perplexity for ppl, else the score."""
    return s["ppl"] if TASKS.get(s["task"]) and TASKS[s["task"]].metric == "perplexity" else s["score"]


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


def _method(s: dict[str, Any]) -> str:
    if s["policy"] == REFERENCE and s["source"] == "sparsekv":
        return "full cache"
    return f"{s['policy']} @ {s['budget']}"


def _methods(summary: list[dict[str, Any]]) -> list[tuple[str, str, Any]]:
    """(source, policy, budget) in display order: the full cache first, then as first seen."""
    seen: OrderedDict[tuple, None] = OrderedDict()
    for s in summary:
        seen[(s["source"], s["policy"], s["budget"])] = None
    keys = list(seen)
    order = {k[:2]: i for i, k in reversed(list(enumerate(keys)))}
    return sorted(keys, key=lambda k: (k[1] != REFERENCE, order[k[:2]], _budget_key(k[2])))


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def share_interval(pairs_by_task: list[list[tuple[float, float]]], resamples: int = 2000,
                   seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean over tasks of sum(method) / sum(full), from
    each task's paired (method score, full-cache score) samples, resampled within the task."""
    g = torch.Generator().manual_seed(seed)
    shares = []
    for pairs in pairs_by_task:
        t = torch.tensor(pairs, dtype=torch.float64)  # (n, 2)
        idx = torch.randint(len(pairs), (resamples, len(pairs)), generator=g)
        sums = t[idx].sum(1)  # (resamples, 2)
        shares.append(sums[:, 0] / sums[:, 1])  # inf / nan where a resample's full cache scores 0
    mean_share = torch.stack(shares).mean(0)
    mean_share = mean_share[torch.isfinite(mean_share)]
    if not len(mean_share):
        return float("nan"), float("nan")
    lo, hi = torch.quantile(mean_share, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return lo, hi


def glance_stats(ss: list[dict[str, Any]], tasks: list[str], methods: list[tuple],
                 idx: dict) -> tuple[list[dict[str, Any]], list[str]]:
    """Per method and budget of one protocol and length (the full cache left out): `share` (the
    retrieval accuracy as a share of the full cache's, averaged over the question tasks the full
    cache answers at all, NaN if none) with its 95% interval `lo`-`hi`, `kl` (the mean over every
    task), `kl_right` (the mean over those question tasks of the KL on the samples the full cache
    answers right), `lowest` (in how many tasks it has the lowest KL of all methods at the same
    budget) of `tasks_kl` (variants of one policy, e.g. its ablations, are not compared with each other), and
    `n` (samples). Returns those and the tasks the share averages over."""
    retrieval = [t for t in tasks if TASKS.get(t) and TASKS[t].kind == "answer"]
    full = {t: idx.get(("sparsekv", REFERENCE, 1.0, t)) for t in tasks}
    scored = [t for t in retrieval if full[t] and full[t]["score"] > 0]
    kl_at: dict[tuple, list[tuple[tuple, float]]] = {}  # (budget, task) -> [(family, KL)]
    for m in methods:
        if m[1] == REFERENCE:
            continue
        for t in tasks:
            c = idx.get((*m, t))
            if c and not math.isnan(c["kl"]):
                kl_at.setdefault((str(m[2]), t), []).append((c["_family"], c["kl"]))

    def lowest(c: dict[str, Any] | None, budget: Any, task: str) -> bool:
        """Its KL is the lowest at its budget on this task, against every method that is not a
        variant of the same policy (ablations are not compared with the policy they vary)."""
        if not c or math.isnan(c["kl"]):
            return False
        return all(c["kl"] <= kl for f, kl in kl_at[(str(budget), task)] if f != c["_family"])
    stats = []
    for m in methods:
        if m[1] == REFERENCE:
            continue
        cells = {t: idx.get((*m, t)) for t in tasks}
        fracs = [cells[t]["score_frac"] for t in scored if cells[t] and not math.isnan(cells[t]["score_frac"])]
        pairs = [cells[t]["_pairs"] for t in scored if cells[t] and cells[t].get("_pairs")]
        lo = hi = float("nan")
        if fracs and len(pairs) == len(fracs) and min(len(p) for p in pairs) > 1:
            lo, hi = share_interval(pairs)
        kls = [c["kl"] for c in cells.values() if c and not math.isnan(c["kl"])]
        right = [cells[t]["kl_right"] for t in scored if cells[t] and not math.isnan(cells[t]["kl_right"])]
        stats.append({
            "source": m[0], "policy": m[1], "budget": m[2], "name": _method(next(c for c in cells.values() if c)),
            "share": mean(fracs) if fracs else float("nan"), "lo": lo, "hi": hi,
            "kl": mean(kls) if kls else float("nan"), "tasks_kl": len(kls),
            "kl_right": mean(right) if right else float("nan"),
            "lowest": sum(1 for t, c in cells.items() if lowest(c, m[2], t)),
            "n": min((c["n"] for c in cells.values() if c), default=0),
        })
    return stats, scored


def _share(st: dict[str, Any], interval: bool = True) -> str:
    if math.isnan(st["share"]):
        return "-"
    text = f"{100 * st['share']:.0f}%"
    if interval and not math.isnan(st["lo"]):
        text += f" ({100 * st['lo']:.0f}-{100 * st['hi']:.0f}%)"
    return text


def glance(ss: list[dict[str, Any]], tasks: list[str], methods: list[tuple], idx: dict,
           computed: tuple[list[dict[str, Any]], list[str]] | None = None) -> list[str]:
    """Markdown lines of the at-a-glance table of one protocol and length (`glance_stats`, or
    what it already returned for this view: `computed`)."""
    stats, scored = computed if computed is not None else glance_stats(ss, tasks, methods, idx)
    if not stats:
        return []
    rows = [[st["name"], _share(st), _fmt(st["kl"]), _fmt(st["kl_right"]), f"{st['lowest']}/{st['tasks_kl']}",
             str(st["n"])] for st in stats]
    note = (f"Retrieval: accuracy as a share of the full cache's, averaged over {', '.join(scored)} "
            "(the question tasks the full cache answers at least once)" if scored else
            "Retrieval: - (the full cache answers none of the question tasks here)")
    return ["At a glance:", "", _table(["method", "retrieval, share of full (95% interval)", "mean KL over tasks",
                                         "KL where the full cache is right", "lowest KL at its budget (tasks)",
                                         "samples"], rows), "",
            f"{note}; KL: mean over {', '.join(tasks)}; KL where the full cache is right: the mean over "
            f"{', '.join(scored) or '-'} of the KL on the samples the full cache answers right (all of a "
            "multivalue's values); the lowest-KL count compares each method with "
            "every other policy at the same budget, task by task (variants of one policy, such as its "
            "ablations, are not compared with each other).", ""]


def _views(summary: list[dict[str, Any]]) -> OrderedDict[tuple, tuple]:
    """Per (protocol, length), in that order: its summary rows, its tasks (registry order
    first), its methods in display order, and its rows by (source, policy, budget, task): the
    arguments of `glance_stats` and `glance`."""
    rows: OrderedDict[tuple, list] = OrderedDict()
    for s in sorted(summary, key=lambda s: (s["protocol"], s["length"])):
        rows.setdefault((s["protocol"], s["length"]), []).append(s)
    views: OrderedDict[tuple, tuple] = OrderedDict()
    for key, ss in rows.items():
        tasks = [t for t in TASKS if any(s["task"] == t for s in ss)]
        tasks += sorted({s["task"] for s in ss} - set(tasks))
        idx = {(s["source"], s["policy"], s["budget"], s["task"]): s for s in ss}
        views[key] = (ss, tasks, _methods(ss), idx)
    return views


def side_by_side(summary: list[dict[str, Any]], computed: dict[tuple, tuple] | None = None) -> list[str]:
    """Markdown lines of one table per length with every method in a row and, per protocol, its
    retrieval share, mean KL and KL where the full cache is right at each of the grid's budgets
    ("x / y / z"; "-" where the method did not run at a budget): the whole comparison in one place. `computed`: `glance_stats` per
    (protocol, length) when the caller has it already."""
    if computed is None:
        computed = {key: glance_stats(*view) for key, view in _views(summary).items()}
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
        grid = sorted(budgets, key=_budget_key)
        head = ["method"]
        for pr in protocols:
            b = " / ".join(str(x) for x in grid)
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


def write_markdown(summary: list[dict[str, Any]], path: Path, config: dict[str, Any] | None = None) -> None:
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
    views = _views(summary)
    computed = {key: glance_stats(*view) for key, view in views.items()}  # the bootstrap runs once per view
    parts += side_by_side(summary, computed)
    for (protocol, length), (ss, tasks, methods, idx) in views.items():
        q_rows, kl_rows, cost_rows = [], [], []
        for m in methods:
            cells = [idx.get((*m, t)) for t in tasks]
            present = [c for c in cells if c]
            name = _method(present[0])
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


def plot(summary: list[dict[str, Any]], out: Path) -> list[Path]:
    """Write the quality and KL figures; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    written = []
    methods = [(s, p) for s, p, _ in _methods(summary)]
    methods = list(OrderedDict.fromkeys(methods))
    cmap = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20")
    others = [m for m in methods if m[1] != REFERENCE]
    colors = {m: cmap(i % cmap.N) for i, m in enumerate(others)}
    markers = {m: "osD^vPXh<>"[i % 10] for i, m in enumerate(others)}  # overlapping lines stay visible
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
            fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.3 * nrows + 1.0), squeeze=False,
                                     layout="constrained")
            handles: OrderedDict[str, Any] = OrderedDict()
            for ax, task in zip(axes.flat, tasks):
                metric = TASKS[task].metric if task in TASKS else "score"
                rows_t = [s for s in ss if s["task"] == task]
                for (source, policy) in methods:
                    pts = sorted((s for s in rows_t if s["source"] == source and s["policy"] == policy),
                                 key=lambda s: _budget_key(s["budget"]))
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
                        y = [max(v, 1e-6) if v is not None and not math.isnan(v) else float("nan") for v in y]
                    style = "-" if source == "sparsekv" else "--"
                    label = policy if source == "sparsekv" else f"{policy} ({source})"
                    (h,) = ax.plot(x, y, style, marker=markers[(source, policy)], ms=5, lw=1.5,
                                   color=colors[(source, policy)], mfc="none" if source != "sparsekv" else None)
                    handles.setdefault(label, h)
                ax.set_title(task, fontsize=11)
                ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(5))
                ax.set_xlabel("KV cache after compression (MiB)", fontsize=9)
                if kind == "quality":
                    ylabel = metric + (" (lower is better)" if metric in _LOWER_IS_BETTER else "")
                    ax.set_ylabel(ylabel, fontsize=9)
                    if metric not in _LOWER_IS_BETTER:
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
            fig.suptitle(f"{title} vs KV memory - protocol {protocol}, {length} tokens "
                         f"(points: budgets, left = smallest)", fontsize=12)
            fig.legend(list(handles.values()), list(handles.keys()), loc="outside lower center",
                       ncol=min(6, max(1, len(handles))), fontsize=9, frameon=False)
            p = out / f"{kind}_{protocol}_{length}.png"
            fig.savefig(p, dpi=110)
            plt.close(fig)
            written.append(p)
    return written


def write_reports(out: str | Path) -> dict[str, Any]:
    """Rewrite summary.csv, summary.md and the plots of an evaluation folder from its results."""
    out = Path(out)
    rows = read_rows(out / "results.jsonl")
    if not rows:
        raise ValueError(f"{out / 'results.jsonl'} holds no rows")
    config = None
    if (out / "config.yaml").exists():
        config = yaml.safe_load((out / "config.yaml").read_text())
    summary = summarize(rows)
    write_csv(summary, out / "summary.csv")
    write_markdown(summary, out / "summary.md", config)
    plots = plot(summary, out)
    return {"summary": summary, "plots": plots}
