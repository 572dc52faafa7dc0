"""Put the quick head's rows beside the shipped head's on the same seed-13 prompts, for
eval/seed_spread.py (run from the repository root):

    python docs/results/generalize-4k-s13-quick/merge_with_report_grid.py \
        docs/results/generalize-4k-s13 docs/results/generalize-4k-s13-quick results/s13-heads 10
    python eval/seed_spread.py --out results/s13-heads --budget 0.3 --protocol agnostic

Takes the report grid's agnostic full-cache and `learned` rows of sample indices < N and this
folder's `learned (quick)` rows, and refuses to merge unless this folder's full-cache rows equal
the report grid's (same prompt hash, same answer tokens, same score).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root

from sparsekv.io import read_jsonl, write_atomic


def index(row: dict) -> int:
    return int(row["sample_id"].rsplit("-", 1)[1])


def main(grid: Path, quick: Path, out: Path, n: int) -> None:
    rows, quick_full = [], {}
    for r in read_jsonl(quick / "results.jsonl"):
        if index(r) < n:
            if r["policy"] == "full":
                quick_full[r["sample_id"]] = r
            else:
                rows.append(r)
    equal = 0
    for r in read_jsonl(grid / "results.jsonl"):
        if r["protocol"] != "agnostic" or index(r) >= n or r["policy"] not in ("full", "learned"):
            continue
        if r["policy"] == "full":
            q = quick_full[r["sample_id"]]
            same = (q["prompt_hash"], q["output_ids"], q["score"]) == (
                r["prompt_hash"],
                r["output_ids"],
                r["score"],
            )
            if not same:
                raise SystemExit(f"{r['sample_id']}: the two folders' full-cache rows differ")
            equal += 1
        rows.append(r)
    if equal != len(quick_full):
        raise SystemExit(f"{len(quick_full)} full-cache rows here, {equal} matched in {grid}")
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "results.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} rows; {equal} full-cache rows equal in both folders")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
