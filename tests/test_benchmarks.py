"""The benchmark scripts run (small shapes on CPU) and report what they measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))

import bench_gpu  # noqa: E402
import bench_teacher  # noqa: E402


def test_bench_gpu_small_shape_on_cpu(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rc = bench_gpu.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--lengths", "192",
                         "--chunk", "64", "--new-tokens", "3", "--warmup", "64", "--profile", "2",
                         "--json", str(out)])
    assert rc == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"dynamic", "full", "0.3", "0.3+int8"}
    assert rows["dynamic"]["kv_bytes"] == rows["full"]["kv_bytes"]  # transformers' cache holds the same
    full, sparse, int8 = rows["full"]["kv_bytes"], rows["0.3"]["kv_bytes"], rows["0.3+int8"]["kv_bytes"]
    # 4 layers x 2 heads x 32 dims x 4 bytes x 2 (K, V) per token.
    assert full == 4 * 2 * 32 * 4 * 2 * (192 + 3)
    assert 0.25 < sparse / full < 0.4 and int8 < sparse * 0.35
    assert rows["0.3"]["max_batch_est"] > rows["full"]["max_batch_est"]
    assert all(r["decode_tok_s"] > 0 and r["prefill_s"] > 0 for r in rows.values())
    assert all(r["step_ms"] > 0 and "launches_per_step" in r for r in rows.values())
    printed = capsys.readouterr().out
    assert "| 192 | 0.3+int8 |" in printed and "kernels launched" in printed


def test_bench_teacher_small_shape_on_cpu(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rc = bench_teacher.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--lengths", "160,320",
                             "--block-size", "32", "--json", str(out)])
    assert rc == 0
    rows = {r["length"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {160, 320}
    for n, r in rows.items():
        assert r["naive_bytes"] == 8 * n * n * 4  # 8 query heads, float32
        assert r["block_rel_diff"] < 1e-5  # the block size does not change the statistics
        assert abs(r["mass_per_query"] - 1) < 1e-4  # each query hands out one unit of attention
        assert r["layers"] == 4 and r["target_sum_err"] < 1e-4
        assert r["kernel_s"] > 0 and r["forward_s"] > 0
    assert "| 320 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--block-size"):
        bench_teacher.main(["--shape", "tiny", "--device", "cpu", "--block-size", "0"])
