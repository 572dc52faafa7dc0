"""Reliability, the second sweep's findings (issue 36; `python eval/sweep_bad_inputs.py --round
2`): each case the sweep found silent or unclear, as a test that failed before its fix. A cache
refuses inputs that cannot belong to its sequence (a mask or positions of another length, an
all-zero mask, float ids, a second prompt through a used cache) while transformers' prompt-reuse
recipe still works; configs refuse budgets that evict nothing or keep nothing; the serving and
adapter APIs name the argument they cannot use."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_model

from sparsekv import EvictionConfig, SparseKVCache, policies
from sparsekv.cli import main as cli_main
from sparsekv.configfile import read_yaml_mapping
from sparsekv.scoring.adapter import ScorerAdapter
from sparsekv.serving.compressed import CompressedContext, compress, compress_text

CFG = {"budget": 0.5, "sink_tokens": 2, "recent_window": 4, "rerank_every": 4, "evict_slack": 2}
GEN = {"max_new_tokens": 2, "do_sample": False}


def _ids(n: int, start: int = 3) -> torch.Tensor:
    return torch.arange(start, start + n)[None] % 120 + 3


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama").eval()


def _cache(model, **kw):
    return SparseKVCache(model, EvictionConfig(**{**CFG, **kw}), "snapkv")


# ---- configs ----------------------------------------------------------------------------------
def test_a_fraction_too_small_to_keep_a_token_is_refused():
    with pytest.raises(ValueError, match=r"budget=1e-09 .*token count"):
        EvictionConfig(budget=1e-9)
    assert EvictionConfig(budget=1e-4).budget == 1e-4


def test_static_buffers_that_could_never_evict_are_refused():
    with pytest.raises(ValueError, match=r"max_length=8 is not above sink_tokens \+ recent_window"):
        EvictionConfig(budget=16, layout="static", max_length=8)
    with pytest.raises(ValueError, match=r"budget=200 tokens is more than max_length=100"):
        EvictionConfig(budget=200, layout="static", max_length=100)
    # keeping everything in buffers shorter than the window is fine: nothing is meant to go
    assert EvictionConfig(budget=1.0, layout="static", max_length=24).max_length == 24


def test_a_key_written_twice_in_a_config_file_is_refused(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("lr: 0.1\nseed: 1\nlr: 0.002\n")
    with pytest.raises(ValueError, match=r"duplicate key 'lr' \(first at line 1"):
        read_yaml_mapping(p)
    p.write_text("lr: 0.1\nloss: {budget: 0.2}\ntarget: {budget: 0.2}\n")  # same key, two maps
    assert read_yaml_mapping(p)["lr"] == 0.1


# ---- the cache's inputs -----------------------------------------------------------------------
def test_a_mask_shorter_than_the_ids_is_named(model):
    with _cache(model) as cache, pytest.raises(ValueError, match="attention_mask|position_ids"):
        model.generate(input_ids=_ids(20), attention_mask=torch.ones(1, 12, dtype=torch.long),
                       cache=cache, **GEN)
    with _cache(model) as cache, pytest.raises(ValueError, match="attention_mask covers 12"):
        model(input_ids=_ids(20), attention_mask=torch.ones(1, 12, dtype=torch.long), cache=cache)


def test_an_all_zero_mask_is_refused(model):
    with _cache(model) as cache, pytest.raises(ValueError, match=r"all zeros for sequence\(s\) \[1\]"):
        ids = torch.cat([_ids(10), _ids(10, 40)])
        mask = torch.ones_like(ids)
        mask[1] = 0
        model(input_ids=ids, attention_mask=mask, cache=cache)


def test_float_token_ids_are_refused_before_the_embedding(model):
    with _cache(model) as cache, pytest.raises(ValueError, match="input_ids must hold integer"):
        model.generate(input_ids=_ids(10).float(), cache=cache, **GEN)


def test_a_used_cache_refuses_another_prompt_and_continues_its_own(model):
    with _cache(model) as cache:
        first = model.generate(input_ids=_ids(20), cache=cache, **GEN)
        with pytest.raises(ValueError, match="a cache holds one sequence"):
            model.generate(input_ids=_ids(20, 50), cache=cache, **GEN)
    # transformers' prompt reuse: the output so far plus new tokens continues the sequence
    with _cache(model) as cache:
        first = model.generate(input_ids=_ids(20), cache=cache, **GEN)
        more = torch.cat([first, _ids(5, 70)], 1)
        out = model.generate(input_ids=more, cache=cache, **GEN)
        assert out.shape[1] == more.shape[1] + 2
    # and a prefix prefilled once, copied per continuation, equals a fresh run
    with _cache(model, budget=1.0) as cache:
        prefix = _ids(16)
        model(input_ids=prefix, cache=cache)
        full = torch.cat([prefix, _ids(6, 90)], 1)
        reused = model.generate(input_ids=full, cache=copy.deepcopy(cache), **GEN)
    fresh = model.generate(input_ids=full, **GEN)
    assert torch.equal(reused, fresh)


def test_crop_takes_an_int_of_at_most_the_tokens_seen(model):
    with _cache(model, budget=1.0) as cache:
        model(input_ids=_ids(10), cache=cache)
        with pytest.raises(ValueError, match="tokens_to_remove must be an int"):
            cache.crop("3")
        with pytest.raises(ValueError, match="more tokens than the cache has seen"):
            cache.crop(-11)
        cache.crop(-3)
        assert cache.tokens_seen() == 7


# ---- policies and adapters ----------------------------------------------------------------------
def test_kvzip_overlap_must_be_below_its_chunk():
    with pytest.raises(ValueError, match="overlap=8 must be less than chunk=8"):
        policies.get("kvzip", encode=lambda s: [5] * len(s), chunk=8, overlap=8)
    assert policies.get("kvzip", encode=lambda s: [5], chunk=8, overlap=7).overlap == 7


def test_a_missing_adapter_folder_is_not_sent_to_the_hub(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        policies.get("learned", adapter=str(tmp_path / "no-adapter-here"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ScorerAdapter.from_pretrained("./not/here")


def test_attach_and_load_name_a_model_that_is_not_one(model, tmp_path):
    adapter = ScorerAdapter.for_model(model)
    with pytest.raises(TypeError, match="model must be a Hugging Face causal LM"):
        with adapter.attach(None):
            pass
    ctx = compress(model, _ids(12), EvictionConfig(**CFG), "snapkv")
    path = ctx.save(tmp_path / "ctx")
    for bad in (None, "tiny:llama"):
        with pytest.raises(TypeError, match="model must be a Hugging Face causal LM"):
            CompressedContext.load(path, bad)


# ---- compressed contexts ------------------------------------------------------------------------
def test_context_ids_without_an_order_are_refused(model):
    with pytest.raises(TypeError, match="a set or dict has no order"):
        compress(model, {5, 6, 7}, EvictionConfig(**CFG), "snapkv")


def test_generate_length_arguments_are_checked_first(model):
    ctx = compress(model, _ids(12), EvictionConfig(**CFG), "snapkv")
    with pytest.raises(ValueError, match="max_new_tokens='4' must be an int >= 1"):
        ctx.generate([5, 6], max_new_tokens="4")
    with pytest.raises(ValueError, match="min_new_tokens=-1"):
        ctx.generate([5, 6], max_new_tokens=2, min_new_tokens=-1)
    assert ctx.generate([5, 6], max_new_tokens=2, do_sample=False).shape == (1, 4)


def test_add_special_tokens_must_be_a_bool(model):
    def tok(text, add_special_tokens=True):
        return {"input_ids": [1] * add_special_tokens + [3 + ord(c) % 100 for c in text]}

    with pytest.raises(TypeError, match="add_special_tokens='no' must be True or False"):
        compress_text(model, tok, "some text", EvictionConfig(**CFG), add_special_tokens="no")


# ---- the command line ---------------------------------------------------------------------------
def test_model_info_names_a_missing_folder_in_one_line(capsys):
    assert cli_main(["model-info", "--model", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sparsekv: error: --model='/nonexistent/model': no such folder")
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert cli_main(["model-info", "--model", "tiny:qwen3", "--json"]) == 0


# ---- saving over an adapter: a kill between files -------------------------------------------
_KILLED_SAVE = r"""
import os, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from conftest import tiny_model
from sparsekv.scoring.adapter import ScorerAdapter
import sparsekv.scoring.folder as folder

new = ScorerAdapter.for_model(tiny_model("llama"), hidden=16)
real_replace, real_unlink, n = os.replace, Path.unlink, [0]
def replace(a, b):
    n[0] += 1
    if {when!r} == "between" and n[0] == 2:
        os._exit(9)  # killed between the first file's replacement and the second's
    return real_replace(a, b)
def unlink(self, missing_ok=False):
    if {when!r} == "committed" and ".old-" in self.name:
        os._exit(9)  # killed after every file was replaced, while the marks go
    return real_unlink(self, missing_ok=missing_ok)
folder.os.replace = replace
Path.unlink = unlink
new.save_pretrained({out!r})
"""


@pytest.mark.parametrize("when, hidden", [("between", 8), ("committed", 16)])
def test_a_save_killed_between_files_leaves_the_old_adapter_or_the_new(tmp_path, when, hidden):
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "adapter"
    ScorerAdapter.for_model(tiny_model("llama"), hidden=8).save_pretrained(out)
    code = _KILLED_SAVE.format(tests=str(Path(__file__).parent), when=when, out=str(out))
    assert subprocess.run([sys.executable, "-c", code], timeout=300).returncode == 9
    assert any(".old-" in p.name or ".new-" in p.name for p in out.iterdir())  # the journal
    assert ScorerAdapter.from_pretrained(out).config.hidden == hidden  # recovered, loads
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    ScorerAdapter.for_model(tiny_model("llama"), hidden=32).save_pretrained(out)
    assert ScorerAdapter.from_pretrained(out).config.hidden == 32


# ---- rows read back from an evaluation folder ------------------------------------------------
def _row(**kw):
    return {"sample_id": "passkey-256-0", "task": "passkey", "protocol": "agnostic",
            "policy": "snapkv", "budget": 0.3, "score": 1.0, "kl": 0.1, **kw}


@pytest.mark.parametrize("edit, words", [
    (dict(score="n/a"), r"row 2 \(passkey-256-0, snapkv\): score='n/a' is not a number"),
    (dict(policy=None), r"policy=None is not a name"),
    (dict(kl=-3.0), r"kl=-3.0 is out of range"),
])
def test_rows_read_back_name_the_row_and_field(tmp_path, edit, words):
    import json

    from sparsekv.evaluation.rows.store import read_own

    p = tmp_path / "results.jsonl"
    p.write_text(json.dumps(_row(sample_id="a")) + "\n" + json.dumps(_row(**edit)) + "\n")
    with pytest.raises(ValueError, match=words):
        read_own(p)


@pytest.mark.parametrize("field", ["score", "policy"])
def test_a_row_missing_a_field_is_named(tmp_path, field):
    import json

    from sparsekv.evaluation.rows.store import read_own

    row = _row()
    del row[field]
    p = tmp_path / "results.jsonl"
    p.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=rf"row 1 .*missing field\(s\) \['{field}'\]"):
        read_own(p)


def test_rows_written_twice_are_read_once_with_a_note(tmp_path, capsys):
    import json

    from sparsekv.evaluation.rows.store import read_own

    p = tmp_path / "results.jsonl"
    rows = [_row(sample_id=f"s{i}") for i in range(3)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows + rows))
    assert len(read_own(p)) == 3
    assert "3 duplicate rows" in capsys.readouterr().err


# ---- training config overrides ------------------------------------------------------------------
def _train_config(*overrides):
    from train.config import load_config

    return load_config(None, ["model=tiny:llama", *overrides])


def test_an_override_may_reach_a_use_two_levels_down():
    c = _train_config("inference.uses.agnostic.blend=0.5", "inference.uses.decode.kernel_size=3")
    assert c.inference_uses()["agnostic"]["blend"] == 0.5
    assert c.inference_uses()["decode"]["kernel_size"] == 3
    with pytest.raises(ValueError, match="unknown use 'agnostik'"):
        _train_config("inference.uses.agnostik.blend=0.5")


def test_schedule_and_warmup_that_cannot_work_are_named():
    with pytest.raises(ValueError, match="schedule_steps=2 must be above warmup_steps=5"):
        _train_config("schedule_steps=2", "warmup_steps=5")
    with pytest.warns(UserWarning, match="warmup_steps=50 is more than max_steps=2"):
        _train_config("max_steps=2", "warmup_steps=50")


def test_an_override_without_a_value_is_refused():
    with pytest.raises(ValueError, match=r"override 'output_dir=' has no value"):
        _train_config("output_dir=")
    assert _train_config("output_dir=null").output_dir is None


# ---- the eval command line ------------------------------------------------------------------
def test_report_only_refuses_grid_flags_and_finds_the_config_folder(tmp_path, capsys):
    assert cli_main(["eval", "--report-only", "--budget", "0.5", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--report-only reads the rows already in --out and runs nothing: --budget" in err
    assert cli_main(["eval", "--ingest", "rows.jsonl", "--seed", "3", "--out", str(tmp_path)]) == 2
    assert "--ingest reads the rows" in capsys.readouterr().err
    cfg = tmp_path / "grid.yaml"
    cfg.write_text(f"out: {tmp_path / 'none-yet'}\n")
    assert cli_main(["eval", "--report-only", "--config", str(cfg)]) == 2  # its out:, empty
    assert "none-yet" in capsys.readouterr().err


def test_task_options_of_a_task_not_run_are_named():
    from sparsekv.evaluation.config import EvalConfig

    with pytest.warns(UserWarning, match=r"task_options\['multikey'\] is for a task this grid"):
        EvalConfig(tasks=["passkey"], task_options={"multikey": {"num_keys": 2}})


def test_recovering_an_adapter_folder_leaves_other_files_alone(tmp_path):
    """`recover` (run by every save and load) touches only an adapter's own journal names: a
    file of someone else's that happens to look like one stays, as saving over the folder
    with overwrite=True promises."""
    out = tmp_path / "adapter"
    ScorerAdapter.for_model(tiny_model("llama"), hidden=8).save_pretrained(out)
    theirs = [out / ".notes.txt.old-4194303-abcd", out / ".run.log.tmp-4194303-abcd",
              out / "notes.txt"]  # (a pid no process has)
    for p in theirs:
        p.write_text("mine")
    ScorerAdapter.for_model(tiny_model("llama"), hidden=16).save_pretrained(out, overwrite=True)
    assert ScorerAdapter.from_pretrained(out).config.hidden == 16
    assert all(p.read_text() == "mine" for p in theirs)


def test_a_save_whose_rollback_fails_in_this_process_is_recovered_by_the_next_load(
    tmp_path, monkeypatch
):
    """os.replace failing from its second call on (a dying disk): the save and its own rollback
    stop half-way, and the same process's next load still finds the old adapter."""
    import errno
    import os

    out = tmp_path / "adapter"
    ScorerAdapter.for_model(tiny_model("llama"), hidden=8).save_pretrained(out)
    real, calls = os.replace, [0]

    def replace(a, b):
        calls[0] += 1
        if calls[0] >= 2:
            raise OSError(errno.EIO, "Input/output error")
        return real(a, b)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="Input/output error"):
        ScorerAdapter.for_model(tiny_model("llama"), hidden=16).save_pretrained(out)
    monkeypatch.setattr(os, "replace", real)
    assert ScorerAdapter.from_pretrained(out).config.hidden == 8
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
