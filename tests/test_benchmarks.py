"""The benchmark scripts run (small shapes on CPU) and report what they measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))

import bench_gpu  # noqa: E402


def test_bench_gpu_small_shape_on_cpu(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rc = bench_gpu.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--lengths", "192",
                         "--chunk", "64", "--new-tokens", "3", "--json", str(out)])
    assert rc == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"full", "0.3", "0.3+int8"}
    full, sparse, int8 = rows["full"]["kv_bytes"], rows["0.3"]["kv_bytes"], rows["0.3+int8"]["kv_bytes"]
    # 4 layers x 2 heads x 32 dims x 4 bytes x 2 (K, V) per token.
    assert full == 4 * 2 * 32 * 4 * 2 * (192 + 3)
    assert 0.25 < sparse / full < 0.4 and int8 < sparse * 0.35
    assert rows["0.3"]["max_batch_est"] > rows["full"]["max_batch_est"]
    assert all(r["decode_tok_s"] > 0 and r["prefill_s"] > 0 for r in rows.values())
    assert "| 192 | 0.3+int8 |" in capsys.readouterr().out
