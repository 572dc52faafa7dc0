"""A few cases per surface of eval/sweep_bad_inputs.py, with the outcome each must have, and the
classifier itself (so a regression in an error message, or a classifier that calls everything
clear, fails here)."""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sweep():
    mod = importlib.import_module("eval.sweep_bad_inputs")
    yield mod
    shutil.rmtree(mod.TMP, ignore_errors=True)


def _case(sweep, surface: str, name: str):
    hits = [c for c in sweep.CASES if c.surface == surface and c.name == name]
    assert len(hits) == 1, (surface, name, len(hits))
    return hits[0]


CLEAR = [
    ("api", "budget=1.5"),
    ("api", "schedule=[True, True]"),
    ("api", "a gemma3 head's policy on a llama model"),
    ("api", "random: {'seed': 'x'}"),
    ("api", "snapkv: {'window': 2.5}"),
    ("api", "learned: {'adapter': None}"),
    ("api", "attach(use='nope')"),
    ("adapter files", "truncated safetensors (half)"),
    ("adapter files", "NaN weights"),
    ("adapter files", "format_version=99"),
    ("adapter files", "hidden_size=1000000000"),
    ("adapter files", "gemma3 head into SparseKVCache on llama"),
    ("train config", "YAML syntax error"),
    ("train config", "lr: .nan"),
    ("train config", "bogus_key=1"),
    ("train config", "inference.blend=5"),
    ("eval cli", "--tasks passkey,needle"),
    ("eval cli", "--budget abc"),
    ("eval cli", "--samples abc"),
    ("eval cli", "--eviction bogus=1"),
    ("api", "record_window=0"),  # was silent before SparseKVCache checked it
    ("api", "record_window=-1"),
    ("eval cli", "ingest: missing file"),  # was a raw FileNotFoundError traceback from the CLI
    ("api", "model=None"),  # was an AttributeError from families.py
    ("api", "context_ids beyond the vocabulary"),  # was an IndexError from torch's embedding
    ("api", "context_ids negative"),
    ("api", "context_ids as a string"),  # was "too many dimensions 'str'"
    ("api", "compress_text(tokenizer=None)"),  # was "'NoneType' object is not callable"
    ("eval cli", "--source without --ingest"),  # was ignored
    ("eval cli", "--policy ''"),  # ran the full cache alone
    ("eval cli", "--budget 0.3,,0.5"),  # the empty item was skipped
    ("api", "learned: {'adapter': '/nonexistent/adapter'}"),  # was an OSError with Hub text
    ("train config", "duplicate key lr, both valid (YAML keeps the last)"),  # trained with the last
    ("eval cli", "model-info --model /nonexistent"),  # was an OSError from huggingface_hub
]

@pytest.mark.parametrize("surface, name", CLEAR)
def test_sweep_cases_that_must_be_clear(sweep, surface, name):
    out = sweep.classify(_case(sweep, surface, name))
    assert out.outcome == "clear", out


def test_eval_rows_cases(sweep):
    for name in ("a fresh run into a folder with rows", "--resume onto another model's rows",
                 "a folder locked by another run"):
        out = sweep.classify(_case(sweep, "eval cli", name))
        assert out.outcome == "clear", out


def test_classifier(sweep):
    def boom(exc):
        def fn():
            raise exc
        return fn

    def mk(fn, names, cli=False, warn_ok=False):
        return sweep.Case("api", "g", "n", fn, names, cli, warn_ok)

    assert sweep.classify(mk(boom(ValueError("window=0 bad")), ("window",))).outcome == "clear"
    assert sweep.classify(mk(boom(ValueError("bad value")), ("window",))).outcome == "unclear"
    assert sweep.classify(mk(boom(KeyError("window")), ("window",))).outcome == "unclear"
    assert sweep.classify(mk(lambda: 1, ("window",))).outcome == "silent"
    assert sweep.classify(mk(lambda: 0, ("window",), cli=True)).outcome == "silent"

    def cli_err():
        print("sparsekv: error: --window is bad", file=sys.stderr)
        return 2

    assert sweep.classify(mk(cli_err, ("--window",), cli=True)).outcome == "clear"
    assert sweep.classify(mk(cli_err, ("--budget",), cli=True)).outcome == "unclear"


def test_the_sweep_is_broad(sweep):
    from collections import Counter

    per = Counter(c.surface for c in sweep.CASES)
    assert sum(per.values()) >= 170
    assert set(per) == set(sweep.SURFACES) and min(per.values()) >= 30, per


def test_record_window_is_checked_when_the_cache_is_built():
    from sparsekv import EvictionConfig, SparseKVCache
    from sparsekv.models.tiny import tiny_model

    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="record_window"):
            SparseKVCache(tiny_model("llama"), EvictionConfig(budget=1.0), "full",
                          record=("window",), record_window=bad)


def test_a_missing_file_is_a_cli_exit_2_naming_it(tmp_path, capsys):
    from sparsekv.cli import main

    assert main(["eval", "--config", str(tmp_path / "absent.yaml")]) == 2
    missing = tmp_path / "rows.jsonl"
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "prompts.jsonl").write_text("")
    code = main(["eval", "--out", str(tmp_path / "out"), "--ingest", str(missing)])
    assert code == 2 and "rows.jsonl" in capsys.readouterr().err


def test_compress_names_bad_token_ids_and_a_missing_tokenizer():
    import torch

    from sparsekv import EvictionConfig, SparseKVCache, compress, compress_text
    from sparsekv.models.tiny import tiny_model

    model, cfg = tiny_model("llama"), EvictionConfig(budget=0.5)
    vocab = model.get_input_embeddings().num_embeddings
    with pytest.raises(ValueError, match="context_ids holds token id .* beyond the vocabulary"):
        compress(model, torch.tensor([[1, 2, vocab]]), cfg)
    with pytest.raises(ValueError, match="context_ids holds a negative token id"):
        compress(model, [1, -2, 3], cfg)
    with pytest.raises(TypeError, match="context_ids must be token ids, got a string"):
        compress(model, "some text", cfg)
    with pytest.raises(TypeError, match="tokenizer=None"):
        compress_text(model, None, "some text", cfg)
    for bad in (None, "tiny:llama"):
        with pytest.raises(TypeError, match="model must be a Hugging Face causal LM"):
            SparseKVCache(bad, cfg, "snapkv")
