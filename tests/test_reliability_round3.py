"""Reliability, the third sweep's findings (`python eval/sweep_bad_inputs.py --round 3`): each
case the sweep found silent or unclear, as a test that failed before its fix. Ensembles, paths,
`generate` options, question lists, the pipeline, the default model's and the tiny models'
arguments name what they cannot use; teacher stores, saved contexts and training data refuse
what was edited or cannot apply; training settings, the store build and the eval diagnostics
refuse settings that would write elsewhere, crash later or report nothing."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from sparsekv import EvictionConfig, policies
from sparsekv.cli import main as cli_main
from sparsekv.scoring.adapter import ScorerAdapter
from sparsekv.serving.compressed import CompressedContext, compress, compress_text

CFG = EvictionConfig(budget=0.5, sink_tokens=2, recent_window=4, rerank_every=4, evict_slack=2)
IDS = torch.arange(3, 43)[None]


class CharTokenizer:
    bos_token_id = 1
    name_or_path = "char-tokenizer"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [3 + ord(c) % 125 for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i + 29) for i in ids)

    def __len__(self):
        return 128


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama").eval()


@pytest.fixture(scope="module")
def adapter(model):
    return ScorerAdapter.for_model(model, hidden=8)


@pytest.fixture(scope="module")
def ctx(model):
    return compress(model, IDS, CFG)


# ---- adapters ---------------------------------------------------------------------------------
def test_ensemble_names_what_it_was_given(model, adapter):
    with pytest.raises(TypeError, match="list"):
        ScorerAdapter.ensemble(adapter)
    with pytest.raises(TypeError, match="adapter 0 is a str.*from_pretrained"):
        ScorerAdapter.ensemble(["dir-a", "dir-b"])
    with pytest.raises(TypeError, match="adapter 1 is a NoneType"):
        ScorerAdapter.ensemble([adapter, None])
    with pytest.raises(ValueError, match="adapters 0 and 1 are the same adapter twice"):
        ScorerAdapter.ensemble([adapter, adapter])
    other = ScorerAdapter.for_model(model, hidden=8)
    assert ScorerAdapter.ensemble([adapter, other]).config.ensemble == 2


def test_for_model_target_and_attach_keywords_are_named(model, adapter):
    with pytest.raises(TypeError, match="target='kl' must be a TargetConfig"):
        ScorerAdapter.for_model(model, hidden=8, target="kl")
    with pytest.raises(ValueError, match=r"attach\(\*\*kwargs\): unknown.*'bogus'.*allowed:.*sink_tokens"):
        adapter.attach(model, bogus=3).__enter__()


def test_paths_that_are_not_paths_are_named(adapter, ctx, tmp_path):
    with pytest.raises(TypeError, match="save_directory=None must be a path"):
        adapter.save_pretrained(None)
    with pytest.raises(TypeError, match="path_or_repo_id=.* must be a path"):
        ScorerAdapter.from_pretrained(os.fsencode(str(tmp_path)))
    with pytest.raises(TypeError, match="path=None must be a path"):
        ctx.save(None)
    folder = adapter.save_pretrained(tmp_path / "a")
    assert policies.get("learned", adapter=folder).name == "learned"  # a pathlib path loads


# ---- compressed contexts ----------------------------------------------------------------------
def test_compress_and_generate_name_their_arguments(model, ctx):
    with pytest.raises(TypeError, match="model=None must be a Hugging Face causal LM"):
        compress(None, IDS, CFG)
    q = [5, 6, 7]
    with pytest.raises(ValueError, match=r"num_beams=2.0 must be the int 1"):
        ctx.generate(q, max_new_tokens=2, num_beams=2.0)
    with pytest.raises(ValueError, match="num_return_sequences='2' must be the int 1"):
        ctx.generate(q, max_new_tokens=2, num_return_sequences="2")
    with pytest.raises(ValueError, match="generation_config=.* must be a transformers GenerationConfig"):
        ctx.generate(q, max_new_tokens=2, generation_config="greedy")
    with pytest.raises(ValueError, match="use_cache=False"):
        ctx.generate(q, max_new_tokens=2, use_cache=False)
    assert ctx.generate(q, max_new_tokens=2, num_beams=1).shape == (1, 5)


def test_ask_many_takes_an_ordered_list(model):
    text = compress_text(model, CharTokenizer(), "The pass key is 41729. " * 3, CFG, "snapkv")
    with pytest.raises(ValueError, match="questions=None must be a list"):
        text.ask_many(None, max_new_tokens=2)
    with pytest.raises(ValueError, match="a set has no order"):
        text.ask_many({"Who?", "Where?"}, max_new_tokens=2)
    assert len(text.ask_many(("Who?", "Where?"), max_new_tokens=2)) == 2


def test_load_names_a_bad_tokenizer_a_file_path_and_edited_records(model, ctx, tmp_path):
    folder = ctx.save(tmp_path / "c")
    with pytest.raises(ValueError, match="tokenizer='char-tokenizer' must be a Hugging Face tokenizer"):
        CompressedContext.load(folder, model, tokenizer="char-tokenizer")
    with pytest.raises(ValueError, match="is a file; give the saved context's folder"):
        CompressedContext.load(folder / "context.json", model)
    for key, value, match in (("kept", [1, 1, 1, 1], "kept=.* does not match"),
                              ("dtype", "float8", "dtype='float8'.*float32")):
        edited = tmp_path / f"c-{key}"
        shutil.copytree(folder, edited)
        meta = json.loads((edited / "context.json").read_text())
        meta[key] = value
        (edited / "context.json").write_text(json.dumps(meta))
        with pytest.raises(ValueError, match=match):
            CompressedContext.load(edited, model)


# ---- the pipeline -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pipe(model):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, pipeline

    import sparsekv.serving.pipeline as sk

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "the": 4, "key": 5, "is": 6, "?": 7}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", unk_token="<unk>")
    return pipeline(sk.TASK, model=model, tokenizer=tok)


def test_the_pipeline_names_what_it_cannot_use(pipe):
    c, q = "the key is the key " * 8, " the key ?"
    with pytest.raises(ValueError, match=r"eviction: unknown EvictionConfig field\(s\) \['bogus'\]; allowed"):
        pipe(c, question=q, eviction={"bogus": 1}, max_new_tokens=2)
    with pytest.raises(ValueError, match="context=\\[\\] is an empty list"):
        pipe([], question=q, max_new_tokens=2)
    with pytest.raises(ValueError, match="batch_size=2"):
        pipe([c, c], question=q, batch_size=2, max_new_tokens=2)
    with pytest.raises(ValueError, match="questions=\\[\\] is empty"):
        pipe(c, questions=[], max_new_tokens=2)
    with pytest.raises(ValueError, match="a set has none"):
        pipe(c, questions={q, q + " is"}, max_new_tokens=2)
    assert len(pipe([c, c], question=q, max_new_tokens=2)) == 2  # a list without batch_size


# ---- the default model's and the tiny models' arguments ----------------------------------------
def test_load_default_model_checks_device_and_cache_before_loading(tmp_path, monkeypatch):
    from sparsekv.models import default

    def no_load(*a, **k):
        raise AssertionError("loaded before the arguments were checked")

    monkeypatch.setattr(default, "_convert", no_load)
    import transformers
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    with pytest.raises(ValueError, match="device='gpu'.*allowed values: cpu, cuda"):
        default.load_default_model(device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda': no CUDA GPU"):
            default.load_default_model(device="cuda")
    f = tmp_path / "file"
    f.write_text("x")
    monkeypatch.setenv("SPARSEKV_CACHE", str(f))
    with pytest.raises(ValueError, match="SPARSEKV_CACHE=.* is a file"):
        default.load_default_model()


def test_tiny_model_refuses_unknown_overrides_and_non_int_seeds():
    with pytest.raises(ValueError, match=r"\['num_layers'\] are not attributes"):
        tiny_model("llama", num_layers=2)
    for seed in ("x", 1.5):
        with pytest.raises(ValueError, match="seed=.* must be an int"):
            tiny_model("llama", seed=seed)
    assert tiny_model("llama", num_hidden_layers=2).config.num_hidden_layers == 2


# ---- teacher stores -----------------------------------------------------------------------------
def _yaml(tmp: Path, extra: str = "") -> Path:
    docs = tmp / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": "The quick brown fox jumps over the lazy dog. "
                                        * 6 + f"Doc {i}."}) + "\n" for i in range(12)))
    p = tmp / "c.yaml"
    p.write_text("model: tiny:llama\nnum_threads: 1\nhead_hidden: 8\nteacher_block_size: 64\n"
                 f"dataset: {docs}\nseq_len: 64\nbatch_size: 1\nmax_steps: 1\nwarmup_steps: 0\n"
                 "log_with: none\nprogress_bar: false\nsave_every: 0\n" + extra)
    return p


def _store(argv):
    from sparsekv.teacher.store import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv)
    return rc, err.getvalue()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("store")
    out = tmp / "st"
    rc, err = _store(["build", "--config", str(_yaml(tmp)), "--out", str(out), "--sequences",
                      "3", "--length", "64", "--shard-size", "1", "--threads", "1",
                      "--no-progress", "--signals", "questions"])
    assert rc == 0, err
    return out


def _copy(store, tmp_path, edit):
    d = tmp_path / "copy"
    shutil.copytree(store, d)
    edit(d)
    return d


@pytest.mark.parametrize("edit, match", [
    (lambda d: (d / "store.json").write_text('{"format": 1,'), "store.json: not valid JSON"),
    (lambda d: (d / "store.json").write_text("[1]"), "store.json: holds a JSON list"),
    (lambda d: (d / "store.json").write_text(json.dumps(
        {k: v for k, v in json.loads((d / "store.json").read_text()).items() if k != "length"})),
     r"missing key\(s\) \['length'\]"),
])
def test_a_damaged_store_json_is_named(store, tmp_path, edit, match):
    rc, err = _store(["info", str(_copy(store, tmp_path, edit))])
    assert rc == 2 and re_search(match, err)


def re_search(pattern: str, text: str) -> bool:
    import re
    return re.search(pattern, text) is not None


@pytest.mark.parametrize("edit, match", [
    (lambda d: (d / "shard-00000.safetensors").write_bytes(b"x" * 10), "damaged shard.*shard-00000"),
    (lambda d: (d / "shard-00001.safetensors").unlink(), "shard-00001.safetensors missing below"),
    (lambda d: [p.unlink() for p in d.glob("shard-*")], "holds no complete shard"),
])
def test_verify_fails_on_damaged_missing_or_no_shards(store, tmp_path, edit, match):
    rc, err = _store(["verify", str(_copy(store, tmp_path, edit))])
    assert rc == 2 and re_search(match, err), err
    assert _store(["verify", str(store)])[0] == 0


def test_store_build_flags_are_one_line_errors(tmp_path):
    conf = str(_yaml(tmp_path))
    base = ["build", "--config", conf, "--sequences", "2", "--length", "64", "--shard-size",
            "1", "--threads", "1", "--no-progress", "--signals", "questions"]

    def build(*extra, out=None):
        return _store([*base, "--out", str(out or tmp_path / "o"), *extra])

    for extra, match in ((["--length", "1"], "--length=1 must be >= 2"),
                         (["--threads", "0"], "--threads=0 must be >= 1"),
                         (["--shard-size", "0"], "--shard-size=0 must be >= 1"),
                         (["--signals", "quest"], "signals=.*questions"),
                         (["bogus=1"], "unknown config key 'bogus'"),
                         (["--probe", "count=2"], "--probe.*add probe to --signals")):
        rc, err = build(*extra)
        assert rc == 2 and re_search(match, err), (extra, err)
    f = tmp_path / "f.txt"
    f.write_text("x")
    assert re_search("is a file", build(out=f)[1])
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    rc, err = build(out=other)
    assert rc == 2 and "holds other files (config.json)" in err


# ---- training data and settings -------------------------------------------------------------------
def test_training_data_of_other_kinds_and_local_split_are_refused(tmp_path):
    from train.data import load_texts

    for name in ("docs.csv", "docs.jsonl.gz", "docs.txt"):
        (tmp_path / name).write_text("text\nhello\n")
        with pytest.raises(ValueError, match=r"a file of a kind not read here; allowed local files: \.jsonl"):
            load_texts(str(tmp_path / name))
    docs = tmp_path / "d.jsonl"
    docs.write_text('{"text": "hello"}\n')
    with pytest.raises(ValueError, match="dataset_split='validation' applies to a Hub dataset"):
        load_texts(str(docs), split="validation")
    with pytest.raises(ValueError, match="dataset_config='en' applies"):
        load_texts(str(docs), config="en")
    assert load_texts(str(docs)) == ["hello"]


def test_train_settings_that_would_escape_crash_or_train_defaults(tmp_path):
    from train.config import load_config

    empty = tmp_path / "empty.yaml"
    empty.write_text("# to do\n")
    with pytest.raises(ValueError, match="holds no settings"):
        load_config(empty)
    conf = _yaml(tmp_path)
    for override, match in (("run_name=../../outside", "run_name='../../outside' must be a name"),
                            ("run_name=/abs/run", "run_name='/abs/run' must be a name"),
                            ("seq_len=1", "seq_len=1 must be >= 2"),
                            (f"teacher_cache={conf}", "teacher_cache=.* is a file")):
        with pytest.raises(ValueError, match=match):
            load_config(conf, [override])
    assert load_config(conf, ["run_name=a/b", "seq_len=2"]).run_name == "a/b"


def test_an_adapter_folder_given_as_the_model_is_named(adapter, tmp_path):
    from sparsekv.models.loading import validate_model_spec

    folder = adapter.save_pretrained(tmp_path / "a")
    with pytest.raises(ValueError, match="is a sparsekv adapter folder.*not a model"):
        validate_model_spec(str(folder), hub=True, name="--model")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert cli_main(["model-info", "--model", str(folder)]) == 2
    assert "adapter folder" in err.getvalue()


# ---- the eval command line and its diagnostics --------------------------------------------------
def test_policy_and_eviction_keys_given_twice_and_list_values():
    from sparsekv.evaluation.cli import _parse_eviction
    from sparsekv.evaluation.config import parse_policy

    with pytest.raises(ValueError, match="option @window is given twice"):
        parse_policy("snapkv@window=8@window=16")
    with pytest.raises(ValueError, match="--eviction sink_tokens is given twice"):
        _parse_eviction("sink_tokens=2,sink_tokens=4")
    assert _parse_eviction("schedule=[0.5,0.4],sink_tokens=2") == {"schedule": [0.5, 0.4],
                                                                   "sink_tokens": 2}


def test_list_refuses_grid_flags_beside_it(capsys):
    assert cli_main(["eval", "--list", "--model", "tiny:gpt2"]) == 2
    assert "--list lists the tasks" in capsys.readouterr().err
    assert cli_main(["eval", "--list"]) == 0


GRID = ["eval", "--model", "tiny:llama", "--policy", "snapkv", "--budget", "0.3", "--tasks",
        "passkey", "--lengths", "128", "--samples", "1", "--protocol", "agnostic", "--threads",
        "1", "--no-progress"]


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    out = tmp_path_factory.mktemp("grid") / "g"
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        assert cli_main([*GRID, "--out", str(out)]) == 0
    return out


def test_seed_spread_refuses_a_budget_or_protocol_the_grid_lacks(grid):
    from eval.seed_spread import main

    with pytest.raises(SystemExit, match="--budget 0.7: no agnostic rows.*budgets: 0.3"):
        main(["--out", str(grid), "--budget", "0.7"])
    with pytest.raises(SystemExit, match="--protocol aware: .*they have: agnostic"):
        main(["--out", str(grid), "--protocol", "aware"])
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["--out", str(grid)]) == 0


def test_kept_spans_refuses_before_it_runs(grid, capsys, tmp_path):
    from eval.kept_spans import main

    copy = tmp_path / "g"
    shutil.copytree(grid, copy)
    (copy / "prompts.jsonl").unlink(missing_ok=True)
    args = ["--out", str(copy), "--task", "passkey", "--label", "snapkv"]
    with pytest.raises(SystemExit, match="--budget 0.7: 'snapkv' did not run at it"):
        main([*args, "--budget", "0.7"])
    for flag in ("--samples", "--threads"):
        with pytest.raises(SystemExit):
            main([*args, flag, "0"])
        assert "must be an int >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no prompts.jsonl there"):
        main(args)
