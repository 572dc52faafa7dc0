"""The benchmark scripts run (small shapes on CPU) and report what they measured."""

from __future__ import annotations

import json

import pytest

from eval import bench_gpu, bench_int8_step, bench_step_ops, bench_teacher


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


def test_bench_int8_step_reports_no_layer_copy_on_cpu(tmp_path):
    """One static INT8 decode step of the tiny shape at 8K slots: its largest allocation is a
    block of the torch kernel, well under one layer's dequantized keys (measured, not assumed)."""
    out = tmp_path / "row.json"
    rc = bench_int8_step.main(["--dtype", "float32", "--batch", "2", "--max-length", "8192",
                               "--prompt", "32", "--steps", "2", "--json", str(out)])
    assert rc == 0
    row = json.loads(out.read_text())
    # 4 budgeted layers x (K, V) x batch 2 x 2 KV heads x slots x (32 int8 + a float32 scale)
    assert row["int8_store_bytes"] == 4 * 2 * 2 * 2 * row["slots"] * (32 + 4)
    assert row["layer_dequantized_key_bytes"] == 2 * 2 * row["slots"] * 32 * 4
    assert 0 < row["step_largest_allocation"] < row["layer_dequantized_key_bytes"] // 2
    assert row["step_allocated_bytes"] >= row["step_largest_allocation"] and row["ms_per_step"] > 0


@pytest.mark.parametrize("policy", ["learned", "knorm"])
def test_bench_step_ops_counts_the_work_between_decode_steps(tmp_path, policy):
    """The learned policy (blend 0) scores decode steps inside the forward: between two steps
    that evict nothing the cache dispatches no tensor op; key-norm is scored after the forward.
    Eviction steps do work for both (measured: the counts come from a dispatch mode)."""
    out = tmp_path / "row.json"
    rc = bench_step_ops.main(["--layers", "2", "--batch", "2", "--prompt", "512", "--chunk", "64",
                              "--steps", "20", "--json", str(out)] + ["--policy", policy])
    assert rc == 0
    ops = json.loads(out.read_text())["ops"]
    assert ops["steps"] == 20 and 0 < ops["evicting_steps"] < 20
    assert ops["after_ops_evicting"] > 0 and ops["forward_ops_other"] > 0
    keys = ops["layer_key_bytes"]
    if policy == "learned":  # evictions gather no key or value: nothing near a layer's keys
        assert ops["after_ops_other"] == 0 and ops["scored_in_forward"] == ops["layer_steps"] == 40
        assert ops["after_allocated_bytes_other"] == 0
        assert 0 < ops["after_largest_allocation_evicting"] < keys // 8
    else:  # knorm reads the keys in the kept order: its evictions gather them
        assert ops["after_ops_other"] > 0 and ops["scored_in_forward"] == 0
        assert ops["after_largest_allocation_evicting"] > keys // 2


def test_bench_int8_step_rejects_bad_counts():
    with pytest.raises(SystemExit, match="--batch=0 must be >= 1"):
        bench_int8_step.main(["--batch", "0"])
