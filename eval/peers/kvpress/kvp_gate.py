"""The gate a peer's rows pass before they enter a table: the peer's own no-compression run
must reproduce sparsekv's full cache on the same prompts.

For every (sample, protocol) that both sides ran, the peer's reference row (policy "no-press")
is compared with sparsekv's full-cache row (policy "full"): the same generated tokens over the
answer that sparsekv's full cache produced (its decoding stops after the answer's line, the
pipeline's a few tokens later, so the peer's output is compared on that prefix). Teacher-forced
continuation rows have no generated tokens and are compared on top-1 accuracy instead (equal
to 1e-6). The gate passes when at least `threshold` (95%) of the compared prompts agree, over at
least `min_prompts` of them. Pure Python (no kvpress, no sparsekv import), so it runs in either
environment.

    python eval/peers/kvpress/kvp_gate.py --peer results/x/kvpress.jsonl \
        --reference results/x/results.jsonl --out results/x/kvpress-gate.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

PEER_REFERENCE = "no-press"
OURS_REFERENCE = "full"
THRESHOLD = 0.95
MIN_PROMPTS = 40


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file (`.gz` too); a torn last line (a killed writer) is skipped."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} does not exist")
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt") as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i >= len(lines) - 1:  # the last line: torn by a kill
                continue
            raise ValueError(f"{path}:{i} is not JSON") from None
    return rows


def _agrees(peer: dict[str, Any], ours: dict[str, Any]) -> bool:
    want = list(ours.get("output_ids") or [])
    if want:
        got = list(peer.get("output_ids") or [])
        return got[: len(want)] == want
    a, b = peer.get("top1"), ours.get("top1")
    return a is not None and b is not None and abs(a - b) <= 1e-6


def compare(
    peer_rows: list[dict[str, Any]],
    our_rows: list[dict[str, Any]],
    threshold: float = THRESHOLD,
    min_prompts: int = MIN_PROMPTS,
) -> dict[str, Any]:
    """The gate's verdict: `{"passed", "compared", "agree", "share", "mismatches", ...}`."""
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold={threshold!r} must be in (0, 1]")
    ours = {
        (r["sample_id"], r["protocol"]): r
        for r in our_rows
        if r.get("policy") == OURS_REFERENCE and not r.get("error")
    }
    peer = {
        (r["sample_id"], r["protocol"]): r
        for r in peer_rows
        if r.get("policy") == PEER_REFERENCE and not r.get("error")
    }
    keys = sorted(set(ours) & set(peer))
    bad = [k for k in keys if not _agrees(peer[k], ours[k])]
    n = len(keys)
    share = (n - len(bad)) / n if n else 0.0
    passed = n >= min_prompts and share >= threshold
    if n < min_prompts:
        reason = f"only {n} prompts ran on both sides; the gate needs at least {min_prompts}"
    elif not passed:
        reason = (
            f"the peer's no-compression run reproduces sparsekv's full cache on {n - len(bad)} of "
            f"{n} prompts ({share:.0%} < {threshold:.0%})"
        )
    else:
        reason = f"same tokens on {n - len(bad)} of {n} prompts ({share:.1%})"
    return {
        "passed": passed,
        "reason": reason,
        "compared": n,
        "agree": n - len(bad),
        "share": round(share, 4),
        "threshold": threshold,
        "min_prompts": min_prompts,
        "mismatches": [
            {
                "sample_id": k[0],
                "protocol": k[1],
                "peer": peer[k].get("output"),
                "ours": ours[k].get("output"),
            }
            for k in bad
        ],
        "peer_env": next((r.get("peer_env") for r in peer.values() if r.get("peer_env")), None),
    }


def write_json_atomic(path: str | Path, data: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvp_gate.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--peer", required=True, help="the peer's rows (with its no-press rows)")
    p.add_argument("--reference", required=True, help="sparsekv's rows (with the full cache's)")
    p.add_argument("--out", help="where to write the verdict (JSON)")
    p.add_argument("--threshold", type=float, default=THRESHOLD)
    p.add_argument("--min-prompts", type=int, default=MIN_PROMPTS)
    args = p.parse_args(argv)
    try:
        verdict = compare(
            read_jsonl(args.peer), read_jsonl(args.reference), args.threshold, args.min_prompts
        )
    except ValueError as e:
        print(f"kvp_gate.py: error: {e}", file=sys.stderr)
        return 2
    if args.out:
        write_json_atomic(args.out, verdict)
    print(f"[kvpress gate] {'PASSED' if verdict['passed'] else 'FAILED'}: {verdict['reason']}")
    for m in verdict["mismatches"][:10]:
        print(f"  {m['sample_id']} {m['protocol']}: peer {m['peer']!r} vs ours {m['ours']!r}")
    return 0 if verdict["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
