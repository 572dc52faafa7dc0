"""The numbers of an evaluation folder: from result rows to one summary row per (source, task,
length, protocol, method, budget), and per protocol and length the at-a-glance statistics with
their bootstrap intervals. `report.py` writes them as tables, `plots.py` draws them.

Aggregation is per (source, task, length, protocol, policy, budget) over samples. The fraction
of the full cache's accuracy (`score_frac`) and of its KV memory (`kv_frac`) are taken on the
same samples and protocol as the policy's rows, against this harness's own full-cache rows, so
rows ingested from a peer are compared with the same reference. A label that ran several
adapters (distinct `adapter_hash`) is split into one method per adapter first.

The retrieval share comes with a 95% bootstrap interval: each task's samples are resampled
(paired: a method's score with the full cache's on the same prompt), the share recomputed,
2,000 times with a fixed seed, and the 2.5th and 97.5th percentiles of the averaged share
reported. It says how far the share can move with other prompts of the same kind.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import torch

from sparsekv.evaluation.config import REFERENCE, budget_label, policy_name
from sparsekv.evaluation.metrics import mean
from sparsekv.evaluation.tasks import TASKS

SUMMARY_FIELDS = (
    "source",
    "task",
    "length",
    "protocol",
    "policy",
    "budget",
    "n",
    "errors",
    "score",
    "score_frac",
    "kl",
    "kl_right",
    "n_right",
    "kl_mean",
    "ppl",
    "top1",
    "agreement",
    "repetition",
    "kv_mib",
    "kv_mib_end",
    "kv_peak_mib",
    "kv_frac",
    "peak_rss_mb",
    "prefill_s",
    "decode_tok_s",
)
MIB = 2**20
LOWER_IS_BETTER = {"perplexity"}


def _num(x: Any) -> float:
    return float("nan") if x is None else float(x)


def budget_key(b: Any) -> float:
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
            hashes.setdefault(
                (r.get("source") or "sparsekv", r["protocol"], r["policy"]), set()
            ).add(r["adapter_hash"])
    mixed = {k for k, v in hashes.items() if len(v) > 1}
    if not mixed:
        return rows
    out = []
    for r in rows:
        if (
            r.get("adapter_hash")
            and (r.get("source") or "sparsekv", r["protocol"], r["policy"]) in mixed
        ):
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
        k = (
            r.get("source") or "sparsekv",
            r["task"],
            int(r["length"]),
            r["protocol"],
            r["policy"],
            r["budget"],
        )
        groups.setdefault(k, []).append(r)
    out = []
    for (source, task, length, protocol, policy, budget), rs in groups.items():
        scores = [_num(r.get("score")) for r in rs]
        paired = [
            (r, ref[(r["sample_id"], protocol)]) for r in rs if (r["sample_id"], protocol) in ref
        ]
        ref_sum = sum(_num(f.get("score")) for _, f in paired)
        pol_sum = sum(_num(r.get("score")) for r, _ in paired)
        kv_ref = mean([_num(f.get("kv_bytes_compressed")) for _, f in paired])
        kv_pol = mean([_num(r.get("kv_bytes_compressed")) for r, _ in paired])
        nll = mean([_num(r.get("nll")) for r in rs])
        pairs = [(_num(r.get("score")), _num(f.get("score"))) for r, f in paired]
        spec = TASKS.get(task)
        right = (
            [_num(r.get("kl")) for r, f in paired if _num(f.get("score")) >= 1.0]
            if spec and spec.kind == "answer"
            else []
        )
        kls = [k for k in (_num(r.get("kl")) for r in rs) if not math.isnan(k)]
        out.append(
            {
                "_pairs": [p for p in pairs if not (math.isnan(p[0]) or math.isnan(p[1]))],
                "_kls": kls,
                "source": source,
                "task": task,
                "length": length,
                "protocol": protocol,
                "policy": policy,
                "_family": _family(source, policy, rs[0].get("policy_spec")),
                "budget": budget,
                "n": len(rs),
                "errors": sum(1 for r in rs if r.get("error")),
                "score": mean(scores),
                "score_frac": pol_sum / ref_sum if paired and ref_sum > 0 else float("nan"),
                "kl": mean(kls),
                "kl_right": mean(right) if right else float("nan"),
                "n_right": len(right),
                "kl_mean": mean([_num(r.get("kl_mean")) for r in rs]),
                "ppl": math.exp(nll) if not math.isnan(nll) else float("nan"),
                "top1": mean([_num(r.get("top1")) for r in rs]),
                "agreement": mean([_num(r.get("agreement")) for r in rs]),
                "repetition": mean([_num(r.get("repetition")) for r in rs]),
                "kv_mib": mean([_num(r.get("kv_bytes_compressed")) for r in rs]) / MIB,
                "kv_mib_end": mean([_num(r.get("kv_bytes_end")) for r in rs]) / MIB,
                "kv_peak_mib": mean([_num(r.get("kv_bytes_peak")) for r in rs]) / MIB,
                "kv_frac": kv_pol / kv_ref if paired and kv_ref > 0 else float("nan"),
                "peak_rss_mb": max((_num(r.get("peak_rss_mb")) for r in rs), default=float("nan")),
                "prefill_s": mean([_num(r.get("prefill_s")) for r in rs]),
                "decode_tok_s": mean([_num(r.get("decode_tok_s")) for r in rs]),
            }
        )
    return out


def quality(s: dict[str, Any]) -> float:
    """The number plotted for a summary row: perplexity for ppl, else the score."""
    return (
        s["ppl"] if TASKS.get(s["task"]) and TASKS[s["task"]].metric == "perplexity" else s["score"]
    )


def method_name(s: dict[str, Any]) -> str:
    if s["policy"] == REFERENCE and s["source"] == "sparsekv":
        return "full cache"
    return f"{s['policy']} @ {budget_label(s['budget'])}"  # "512 tokens" for a token count


def method_order(summary: list[dict[str, Any]]) -> list[tuple[str, str, Any]]:
    """(source, policy, budget) in display order: the full cache first, then as first seen."""
    seen: OrderedDict[tuple, None] = OrderedDict()
    for s in summary:
        seen[(s["source"], s["policy"], s["budget"])] = None
    keys = list(seen)
    order = {k[:2]: i for i, k in reversed(list(enumerate(keys)))}
    return sorted(keys, key=lambda k: (k[1] != REFERENCE, order[k[:2]], budget_key(k[2])))


def bootstrap_draws(samples: list, resamples: int, generator: torch.Generator) -> torch.Tensor:
    """`resamples` resamples (with replacement) of one task's samples (scalars, or pairs),
    float64: shape (resamples, n) or (resamples, n, 2)."""
    t = torch.tensor(samples, dtype=torch.float64)
    return t[torch.randint(len(samples), (resamples, len(samples)), generator=generator)]


def interval95(x: torch.Tensor) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of the finite values of `x` (NaN, NaN if none)."""
    x = x[torch.isfinite(x)]
    if not len(x):
        return float("nan"), float("nan")
    lo, hi = torch.quantile(x, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return lo, hi


def mean_interval(
    samples_by_task: list[list[float]], resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean over tasks of each task's mean, from each
    task's samples (e.g. a method's KL per prompt), resampled within the task."""
    g = torch.Generator().manual_seed(seed)
    means = [bootstrap_draws(xs, resamples, g).mean(1) for xs in samples_by_task]
    return interval95(torch.stack(means).mean(0))


def share_interval(
    pairs_by_task: list[list[tuple[float, float]]], resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean over tasks of sum(method) / sum(full), from
    each task's paired (method score, full-cache score) samples, resampled within the task."""
    g = torch.Generator().manual_seed(seed)
    shares = []
    for pairs in pairs_by_task:
        sums = bootstrap_draws(pairs, resamples, g).sum(1)  # (resamples, 2)
        shares.append(sums[:, 0] / sums[:, 1])  # inf / nan where a resample's full cache scores 0
    return interval95(torch.stack(shares).mean(0))


def glance_stats(
    ss: list[dict[str, Any]], tasks: list[str], methods: list[tuple], idx: dict
) -> tuple[list[dict[str, Any]], list[str]]:
    """Per method and budget of one protocol and length (the full cache left out): `share` (the
    retrieval accuracy as a share of the full cache's, averaged over the question tasks the full
    cache answers at all, NaN if none) with its 95% interval `lo`-`hi`, `kl` (the mean over every
    task) with its 95% interval `kl_lo`-`kl_hi` (`mean_interval`), `kl_right` (the mean over
    those question tasks of the KL on the samples the full cache answers right), `lowest` (in
    how many tasks it has the lowest KL of all methods at the same budget) of `tasks_kl`
    (variants of one policy, e.g. its ablations, are not compared with each other), and `n`
    (samples). Returns those and the tasks the share averages over."""
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
        fracs = [
            cells[t]["score_frac"]
            for t in scored
            if cells[t] and not math.isnan(cells[t]["score_frac"])
        ]
        pairs = [cells[t]["_pairs"] for t in scored if cells[t] and cells[t].get("_pairs")]
        lo = hi = float("nan")
        if fracs and len(pairs) == len(fracs) and min(len(p) for p in pairs) > 1:
            lo, hi = share_interval(pairs)
        kl_samples = [c["_kls"] for c in cells.values() if c and c["_kls"]]  # the cells with a KL
        kls = [c["kl"] for c in cells.values() if c and c["_kls"]]
        kl_lo = kl_hi = float("nan")
        if kl_samples and min(len(k) for k in kl_samples) > 1:
            kl_lo, kl_hi = mean_interval(kl_samples)
        right = [
            cells[t]["kl_right"]
            for t in scored
            if cells[t] and not math.isnan(cells[t]["kl_right"])
        ]
        stats.append(
            {
                "source": m[0],
                "policy": m[1],
                "budget": m[2],
                "name": method_name(next(c for c in cells.values() if c)),
                "share": mean(fracs) if fracs else float("nan"),
                "lo": lo,
                "hi": hi,
                "kl": mean(kls) if kls else float("nan"),
                "kl_lo": kl_lo,
                "kl_hi": kl_hi,
                "tasks_kl": len(kls),
                "kl_right": mean(right) if right else float("nan"),
                "lowest": sum(1 for t, c in cells.items() if lowest(c, m[2], t)),
                "n": min((c["n"] for c in cells.values() if c), default=0),
            }
        )
    return stats, scored


def views(summary: list[dict[str, Any]]) -> OrderedDict[tuple, tuple]:
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
        views[key] = (ss, tasks, method_order(ss), idx)
    return views
