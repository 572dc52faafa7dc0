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
