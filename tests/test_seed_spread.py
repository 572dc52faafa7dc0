"""eval/seed_spread.py: seeds grouped into recipes, shares of the full cache, mean and spread,
recomputed from rows (synthetic rows: no model)."""

from __future__ import annotations

import json

from eval import seed_spread
from eval.generalize_targets import Grid


def _rows():
    rows = []
    for task in ("qa", "uuidkey"):
        for i in range(10):
            sid = f"{task}-4096-{i}"
            base = {"protocol": "agnostic", "task": task, "sample_id": sid, "kl": 0.1}
            rows.append({**base, "policy": "full", "budget": 1.0, "score": 1.0})
            # recipe "a": seed 0 answers 8/10, seed 1 answers 6/10 of each family
            rows.append({**base, "policy": "a s0", "budget": 0.3, "score": float(i < 8)})
            rows.append({**base, "policy": "a s1", "budget": 0.3, "score": float(i < 6)})
            rows.append(
                {**base, "policy": "b ens2", "budget": 0.3, "score": float(i < 9), "kl": 0.3}
            )
    return rows


def test_recipes_means_and_spread(tmp_path):
    lines, numbers = seed_spread.report(Grid(_rows()), 0.3)
    assert numbers["methods"]["a s0"]["mean"] == 0.8 and numbers["methods"]["a s1"]["mean"] == 0.6
    rec = numbers["recipes"]["a"]
    assert rec["seeds"] == 2 and abs(rec["mean"] - 0.7) < 1e-9 and abs(rec["spread"] - 0.2) < 1e-9
    assert numbers["recipes"]["b ens2"]["seeds"] == 1
    assert abs(numbers["methods"]["b ens2"]["kl"] - 0.3) < 1e-9
    assert any("| a | 0, 1 | 70% | 20 points |" in line for line in lines)
    out = tmp_path / "g"
    out.mkdir()
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    assert seed_spread.main(["--out", str(out)]) == 0
    assert "20 points" in (out / "seeds.md").read_text()


def test_a_family_the_full_cache_misses_is_left_out():
    rows = [r for r in _rows() if not (r["task"] == "uuidkey" and r["policy"] == "full")]
    rows += [
        {**r, "score": 0.0} for r in _rows() if r["task"] == "uuidkey" and r["policy"] == "full"
    ]
    lines, numbers = seed_spread.report(Grid(rows), 0.3)
    assert list(numbers["methods"]["a s0"]["families"]) == ["qa"]
    assert "left out: uuidkey" in lines[2]
