"""The `sparsekv` console script."""

from __future__ import annotations

import json

import pytest

from sparsekv.cli import main


@pytest.mark.integration
def test_model_info_json(capsys, default_model):
    assert main(["model-info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_layers"] == 18 and info["num_kv_heads"] == 1 and info["head_dim"] == 256
    # 2 (K,V) x 18 layers x 1 head x 256 x 4 bytes
    assert info["kv_bytes_per_token_all_layers"] == 2 * 18 * 256 * 4
    assert info["kv_bytes_per_token_full_layers"] == 2 * 3 * 256 * 4


def test_model_info_bad_dtype(capsys):
    assert main(["model-info", "--dtype", "float13"]) == 2
    assert "--dtype='float13'" in capsys.readouterr().err


def test_eval_refuses_a_head_trained_for_another_model(tmp_path, capsys):
    """`sparsekv eval --policy learned:DIR` with a head for another model: exit 2 before any run,
    the error naming the policy, and no result rows."""
    from sparsekv.models.tiny import tiny_model
    from sparsekv.scoring.adapter import ScorerAdapter

    ScorerAdapter.for_model(tiny_model("llama")).save_pretrained(tmp_path / "llama-head")
    out = tmp_path / "eval"
    argv = ["eval", "--model", "tiny:qwen3", "--policy", f"learned:{tmp_path / 'llama-head'}",
            "--tasks", "passkey", "--lengths", "128", "--samples", "1", "--budget", "0.5",
            "--out", str(out), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "learned:" in err and "llama-head" in err
    assert not (out / "results.jsonl").exists() or not (out / "results.jsonl").read_text().strip()
