"""A report grid's headline into an adapter's model card: `headline` reads the grid's rows (per
family, the learned method's share of the full cache's answers and its mean KL at one protocol
and budget, as the grid's summary.md computes them), `write_card_results` records it in the
adapter folder's `config.json` (`eval_results`, `eval_table`) and rewrites its `README.md`
(`model-index` metadata and an "Evaluation" section, `sparsekv.scoring.card`). Only those two
files change: the weights, and so the adapter's fingerprint, stay as they are. The rows must have
run this adapter (their `adapter_hash` is its fingerprint).

    python -m sparsekv.evaluation.reports.card --grid docs/results/generalize-4k \\
        --adapter checkpoints/gemma3-270m-sparsekv            # learned, agnostic, budget 0.3
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

from sparsekv.evaluation.config import REFERENCE
from sparsekv.evaluation.reports.summary import glance_stats, summarize, views
from sparsekv.evaluation.rows.folder import read_config
from sparsekv.evaluation.rows.store import RESULTS, read_own, read_rows
from sparsekv.evaluation.tasks import TASKS

DEFAULTS = {"label": "learned", "protocol": "agnostic", "budget": 0.3}
COMMAND = "python -m sparsekv.evaluation.reports.card --grid {grid} --adapter {adapter}"


def _finite(x: Any) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def headline(
    grid: str | Path,
    label: str = DEFAULTS["label"],
    protocol: str = DEFAULTS["protocol"],
    budget: float = DEFAULTS["budget"],
    length: int | None = None,
) -> dict[str, Any]:
    """The headline of evaluation folder `grid` for method `label` at `budget` under `protocol`
    (and `length`, which may be left out when the grid has one): per family (task) the full
    cache's score, the method's share of it (None where the full cache answers none) and its
    mean KL; over the families the mean share and mean KL, as summary.md's at-a-glance table
    gives them; the grid's seed and samples from its config.yaml, and `adapter_hash`, the
    fingerprint of the adapter the rows ran (None if they record none). Raises ValueError naming
    what the grid does not hold."""
    grid = Path(grid)
    path = grid / RESULTS
    if not path.is_file():
        raise ValueError(f"--grid {grid} holds no {RESULTS}; give an evaluation folder")
    keep = {label, REFERENCE}
    rows = [
        r
        for r in read_own(path)
        if r["protocol"] == protocol
        and r["policy"] in keep
        and (r.get("source") or "sparsekv") == "sparsekv"
    ]
    lengths = sorted({int(r["length"]) for r in rows if r["policy"] == label})
    if not lengths:
        found = sorted({r["policy"] for r in read_rows(path)})
        raise ValueError(
            f"{path} holds no rows of label {label!r} under {protocol}; labels: {', '.join(found)}"
        )
    if length is None and len(lengths) > 1:
        raise ValueError(f"{path} holds {label!r} at lengths {lengths}; give --length")
    length = lengths[0] if length is None else int(length)
    rows = [r for r in rows if int(r["length"]) == length]
    view = views(summarize(rows)).get((protocol, length))
    stats, scored = glance_stats(*view) if view else ([], [])
    mine = [st for st in stats if st["policy"] == label and str(st["budget"]) == str(budget)]
    if not mine:
        have = sorted({str(st["budget"]) for st in stats if st["policy"] == label})
        raise ValueError(
            f"{path}: {label!r} under {protocol} at {length} tokens ran budgets "
            f"{', '.join(have) or 'none'}, not {budget}"
        )
    _, tasks, _, idx = view
    families = []
    for t in tasks:
        cell, full = (
            idx.get(("sparsekv", label, mine[0]["budget"], t)),
            idx.get(("sparsekv", REFERENCE, 1.0, t)),
        )
        if cell is None:
            continue
        answer = TASKS.get(t) is not None and TASKS[t].kind == "answer"
        families.append(
            {
                "task": t,
                "n": cell["n"],
                "kl": _finite(cell["kl"]),
                "full_score": _finite(full["score"]) if full and answer else None,
                "share": _finite(cell["score_frac"]) if t in scored else None,
            }
        )
    hashes = sorted(
        {r["adapter_hash"] for r in rows if r["policy"] == label and r.get("adapter_hash")}
    )
    if len(hashes) > 1:
        raise ValueError(
            f"{path}: rows of {label!r} ran {len(hashes)} adapters; give the label of one"
        )
    config = read_config(grid) or {}
    return {
        "grid": grid.name,
        "label": label,
        "protocol": protocol,
        "budget": mine[0]["budget"],
        "length": length,
        "seed": config.get("seed"),
        "samples": mine[0]["n"],
        "families": families,
        "share": _finite(mine[0]["share"]),
        "kl": _finite(mine[0]["kl"]),
        "adapter_hash": hashes[0] if hashes else None,
    }


def write_card_results(
    adapter_dir: str | Path, head: dict[str, Any], command: str | None = None
) -> Path:
    """Record `head` (`headline`) in the adapter folder: `eval_results` (model-index) and
    `eval_table` in its config.json, and its README.md rewritten from them; its weights are not
    touched. Refuses (ValueError) a headline whose rows ran another adapter. Returns the folder."""
    from sparsekv.scoring.adapter import ScorerAdapter
    from sparsekv.scoring.card import build_card, headline_eval_results, headline_table
    from sparsekv.scoring.files import CARD_NAME, CONFIG_NAME, adapter_files
    from sparsekv.scoring.folder import write_folder

    folder = Path(adapter_dir)
    adapter = ScorerAdapter.from_pretrained(folder)
    mine = adapter.fingerprint()
    if head.get("adapter_hash") and head["adapter_hash"] != mine:
        raise ValueError(
            f"the rows of {head['label']!r} in {head['grid']} ran adapter "
            f"{head['adapter_hash'][:12]}, not {folder} ({mine[:12]}); its card would "
            "carry another adapter's results"
        )
    config = dataclasses.replace(
        adapter.config,
        eval_results=headline_eval_results(head),
        eval_table=headline_table(head, command),
    )
    lora = adapter.lora.num_parameters() if adapter.lora is not None else None
    card = build_card(config, adapter.head.num_parameters(), lora)
    files = adapter_files(config, {}, card)
    write_folder(folder, {CARD_NAME: files[CARD_NAME], CONFIG_NAME: files[CONFIG_NAME]})
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m sparsekv.evaluation.reports.card",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--grid", required=True, help="the evaluation folder (results.jsonl, config.yaml)"
    )
    p.add_argument(
        "--adapter", required=True, help="the adapter folder whose card gets the results"
    )
    p.add_argument("--label", default=DEFAULTS["label"], help="the method's label in the rows")
    p.add_argument("--protocol", default=DEFAULTS["protocol"], help="agnostic or aware")
    p.add_argument(
        "--budget", default=str(DEFAULTS["budget"]), help="the budget as the rows hold it"
    )
    p.add_argument("--length", type=int, help="prompt length (when the grid has several)")
    args = p.parse_args(argv)
    try:
        from sparsekv.evaluation.config import parse_budget

        head = headline(
            args.grid, args.label, args.protocol, parse_budget(args.budget), args.length
        )
        command = COMMAND.format(grid=args.grid, adapter=args.adapter)
        if (args.label, args.protocol, args.budget) != (
            DEFAULTS["label"],
            DEFAULTS["protocol"],
            str(DEFAULTS["budget"]),
        ):
            command += f" --label '{args.label}' --protocol {args.protocol} --budget {args.budget}"
        write_card_results(args.adapter, head, command)
    except (ValueError, OSError) as e:
        print(f"sparsekv card: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    share = "-" if head["share"] is None else f"{100 * head['share']:.0f}%"
    kl = "-" if head["kl"] is None else f"{head['kl']:.3g}"
    print(
        f"{args.adapter}: card results from {args.grid} ({head['label']}, {head['protocol']}, "
        f"budget {head['budget']}): share {share}, mean KL {kl} over "
        f"{len(head['families'])} families"
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
