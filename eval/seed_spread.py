"""Head seeds as a measured quantity: each candidate recipe's seeds side by side, their mean and
their spread, judged from a grid's rows (issue 34, item 3).

    python eval/seed_spread.py --out docs/results/store-seeds-tune-s1
    python eval/seed_spread.py --out docs/results/store-seeds-tune-s1 --budget 0.3 --protocol agnostic

A method label `"<recipe> s<N>"` is seed N of a recipe (e.g. `store s0`, `store s1`); any
other label (`store ens3`, `learned`) is a candidate of its own. Per family and method: the share
of the full cache's answers on the same prompts (`sum(method) / sum(full cache)`, paired, with
its 95% bootstrap interval, as `eval/generalize_targets.py` computes it); per method the mean
share over the answer families the full cache answers at least 30% of the time, and the mean KL
over all tasks. Per recipe: the mean of its seeds' mean shares and their **spread** (max - min;
issue 34's target is <= 5 points for the shipped recipe), and the worst family. Choices are made
on the recipe means. Writes `seeds.md` into the folder (atomically) and prints it; every number
is recomputed from `results.jsonl`.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `eval` as a package

from eval.generalize_targets import SHARE_FLOOR, Grid, _iv, _pct, read_rows, share
from sparsekv.evaluation.config import REFERENCE
from sparsekv.evaluation.metrics import mean
from sparsekv.io import write_atomic

SEED_LABEL = re.compile(r"^(?P<recipe>.+) s(?P<seed>\d+)$")


def recipes(methods: list[str]) -> dict[str, list[tuple[int | None, str]]]:
    """recipe -> [(seed or None, method label)], seeds in order; labels without `sN` stand alone."""
    out: dict[str, list[tuple[int | None, str]]] = defaultdict(list)
    for m in methods:
        hit = SEED_LABEL.match(m)
        if hit:
            out[hit["recipe"]].append((int(hit["seed"]), m))
        else:
            out[m].append((None, m))
    return {k: sorted(v, key=lambda x: (x[0] is None, x[0] or 0)) for k, v in out.items()}


def report(grid: Grid, budget: float, protocol: str = "agnostic") -> tuple[list[str], dict]:
    """The markdown lines and the numbers: {method: {"families": {task: share}, "mean": ...,
    "kl": ...}, "recipes": {recipe: {"mean": ..., "spread": ..., "seeds": n}}}."""
    families = [
        t
        for t in grid.answer_tasks()
        if grid.full(protocol, t) and mean(grid.full(protocol, t)) >= SHARE_FLOOR
    ]
    dropped = [t for t in grid.answer_tasks() if t not in families]
    methods = grid.methods(protocol)
    numbers: dict = {"methods": {}, "recipes": {}}
    lines = [
        f"# Head seeds: {protocol}, budget {budget:g}",
        "",
        "Share of the full cache's answers on the same prompts (paired; 95% bootstrap interval), "
        f"per family the full cache answers >= {SHARE_FLOOR:.0%} of the time"
        + (f" (left out: {', '.join(dropped)})" if dropped else "")
        + "; `mean` = mean over those families; KL = mean over tasks of the mean KL.",
        "",
        "| method | " + " | ".join(f"{t} (n)" for t in families) + " | mean | KL |",
        "|---|" + "---|" * (len(families) + 2),
    ]
    for m in methods:
        fam, cells = {}, []
        for t in families:
            pairs = grid.paired(protocol, t, (m, budget), (REFERENCE, 1.0))
            p, lo, hi = share(pairs)
            fam[t] = p
            cells.append(f"{_pct(p)}{_iv(lo, hi)} ({len(pairs)})")
        kls = [grid.kl(protocol, m, budget, t)[0] for t in grid.tasks]
        kls = [k for k in kls if not math.isnan(k)]
        mshare = mean([v for v in fam.values() if not math.isnan(v)])
        kl = mean(kls)
        numbers["methods"][m] = {"families": fam, "mean": mshare, "kl": kl}
        kl_text = "-" if math.isnan(kl) else f"{kl:.3f}"
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {_pct(mshare)} | {kl_text} |")
    lines += [
        "",
        "| recipe | seeds | mean of the seeds' means | spread (max - min) | worst family (mean over seeds) |",
        "|---|---|---|---|---|",
    ]
    for name, members in recipes(methods).items():
        means = [numbers["methods"][m]["mean"] for _, m in members]
        means = [x for x in means if not math.isnan(x)]
        if not means:
            continue
        spread = max(means) - min(means) if len(means) > 1 else float("nan")
        by_fam = {
            t: mean(
                [
                    numbers["methods"][m]["families"][t]
                    for _, m in members
                    if not math.isnan(numbers["methods"][m]["families"][t])
                ]
            )
            for t in families
        }
        worst = min(by_fam, key=lambda t: by_fam[t]) if by_fam else None
        numbers["recipes"][name] = {
            "mean": mean(means),
            "spread": spread,
            "seeds": len(means),
            "worst": (worst, by_fam.get(worst, float("nan"))),
        }
        seeds = ", ".join("-" if s is None else str(s) for s, _ in members)
        spread_text = "-" if math.isnan(spread) else f"{100 * spread:.0f} points"
        worst_text = f"{worst} {_pct(by_fam[worst])}" if worst else "-"
        lines.append(f"| {name} | {seeds} | {_pct(mean(means))} | {spread_text} | {worst_text} |")
    return lines, numbers


def check_asked(grid: Grid, budget: float, protocol: str) -> None:
    """Refuse (SystemExit naming the flag and what the grid has) a protocol or budget the grid's
    rows do not hold: the report would be a table of nothing."""
    protocols = sorted({k[0] for k in grid.cells})
    if protocol not in protocols:
        raise SystemExit(f"--protocol {protocol}: the grid's rows have none; they have: "
                         f"{', '.join(protocols) or 'no rows'}")
    budgets = sorted({k[2] for k in grid.cells if k[0] == protocol and k[1] != REFERENCE})
    if budget not in budgets:
        raise SystemExit(f"--budget {budget}: no {protocol} rows at that budget; the grid's "
                         f"budgets: {', '.join(f'{b:g}' for b in budgets) or 'none'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python eval/seed_spread.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", type=Path, required=True, help="a grid's folder (its results.jsonl)")
    p.add_argument("--budget", type=float, default=0.3, help="the budget judged (default 0.3)")
    p.add_argument("--protocol", choices=("agnostic", "aware"), default="agnostic")
    args = p.parse_args(argv)
    grid = Grid(read_rows(args.out))
    check_asked(grid, args.budget, args.protocol)
    lines, _ = report(grid, args.budget, args.protocol)
    text = "\n".join(lines) + "\n"
    write_atomic(args.out / "seeds.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
