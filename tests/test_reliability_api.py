"""Reliability of the library's API (issue 36, items 6 and 7 and the unclear errors in the API):
a cache refuses another model's forward and a forward after it closed, a config cannot change
under a cache, bad token ids and generate arguments are refused before anything runs, a saved
context file is checked part by part, a text context loads back as one that asks, and the model
goes back to its own attention when its last cache closes."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from sparsekv import EvictionConfig, SparseKVCache, policies
from sparsekv.serving import compressed
from sparsekv.serving.compressed import CompressedContext, TextContext, compress, compress_text

CFG = {"budget": 0.3, "sink_tokens": 2, "recent_window": 8, "rerank_every": 4, "evict_slack": 2}
GEN = {"max_new_tokens": 4, "do_sample": False}


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


class CharTokenizer:
    """Characters folded into the tiny models' 128-id vocabulary (ids 0-2 special)."""

    bos_token_id = 1
    name_or_path = "char-tokenizer"

    def __init__(self, size: int = 128):
        self.size = size

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = [3 + ord(c) % 125 for c in text]
        return {"input_ids": ([self.bos_token_id] if add_special_tokens else []) + ids}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i - 3 + 32) for i in ids if not (skip_special_tokens and i < 3))

    def __len__(self) -> int:
        return self.size


# ---- item 6: a cache serves the model it was built for ------------------------------------------
def test_a_cache_passed_to_another_model_of_the_same_shape_is_refused():
    a, b = tiny_model("llama"), tiny_model("llama", seed=1)
    cache = SparseKVCache(a, EvictionConfig(**CFG), "snapkv")
    ids = _ids(40)
    with pytest.raises(ValueError, match="built for another model.*same shape.*one cache per model"):
        b.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, **GEN)
    assert cache.tokens_seen() == 0  # refused before anything was stored
    out = a.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, **GEN)
    assert out.shape == (1, 44) and max(cache.layer_lengths()) < 44  # its own model: it evicts
    cache.close()


@pytest.mark.parametrize("override", [{"head_dim": 8}, {"num_key_value_heads": 4}])
def test_a_cache_passed_to_a_model_of_another_shape_is_a_clear_error(override):
    a, other = tiny_model("llama"), tiny_model("llama", **override)
    with (
        SparseKVCache(a, EvictionConfig(**CFG), "snapkv") as cache,
        pytest.raises(ValueError, match="another model.*another shape.*KV heads of dim"),
    ):
        other(input_ids=_ids(20), cache=cache)


def test_a_config_cannot_change_under_a_cache():
    c = EvictionConfig(**CFG)
    for field, value in (("budget", -1), ("layout", "paged")):
        with pytest.raises(dataclasses.FrozenInstanceError, match=f"immutable.*{field}.*replace"):
            setattr(c, field, value)
    assert c.budget == 0.3 and c.layout == "dynamic"
    assert dataclasses.replace(c, budget=0.5).budget == 0.5  # the documented way to change one
    assert EvictionConfig.from_dict(c.to_dict()) == c
    model = tiny_model("llama")
    object.__setattr__(c, "layout", "paged")  # behind the immutability: checked where used
    with pytest.raises(ValueError, match="layout='paged' is not supported; allowed values"):
        SparseKVCache(model, c, "snapkv")
    listed = EvictionConfig(budget=0.3, schedule=[0.5, 0.5, 0.5, 0.5])
    listed.schedule[0] = 5.0
    with pytest.raises(ValueError, match="schedule=.*fractions in \\(0, 1\\]"):
        SparseKVCache(model, listed, "snapkv")


def test_compress_warns_when_the_context_is_longer_than_the_models_positions():
    model = tiny_model("llama", max_position_embeddings=64)
    with pytest.warns(UserWarning, match="80 tokens, more than the model's max_position_embeddings"):
        compress(model, _ids(80), EvictionConfig(**CFG))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compress(model, _ids(64), EvictionConfig(**CFG))


def test_compress_refuses_float_token_ids_instead_of_truncating_them():
    model = tiny_model("llama")
    config = EvictionConfig(**CFG)
    with pytest.raises(ValueError, match="context_ids must hold integer token ids as int64.*3.5"):
        compress(model, [5, 6, 3.5], config)
    with pytest.raises(ValueError, match="config must be an EvictionConfig"):
        compress(model, CharTokenizer(), [5, 6, 3.5])  # the tokenizer-first spelling: refused
    assert compress(model, [5, 6, 7], config).context_ids.tolist() == [[5, 6, 7]]


@pytest.mark.parametrize("how", ["forward", "generate"])
def test_prefill_chunk_applies_to_inputs_embeds(how):
    """A chunked prefill from `inputs_embeds` keeps what the same prefill from `input_ids` keeps
    (it used to run unchunked without a word)."""
    model = tiny_model("llama")
    cfg = EvictionConfig(budget=0.3, sink_tokens=2, recent_window=4, evict_slack=0, prefill_chunk=8)
    ids = _ids(40)
    kept, peaks = {}, {}
    for kind in ("input_ids", "inputs_embeds"):
        x = ids if kind == "input_ids" else model.get_input_embeddings()(ids)
        with SparseKVCache(model, cfg, "snapkv") as cache, torch.no_grad():
            if how == "forward":
                model(**{kind: x}, cache=cache)
            else:
                model.generate(**{kind: x}, attention_mask=torch.ones_like(ids), cache=cache, **GEN)
            kept[kind] = [cache.layers[i].positions.clone() for i in cache.budgeted_layers]
            peaks[kind] = cache.peak_kv_bytes()
    assert peaks["inputs_embeds"] == peaks["input_ids"]
    assert all(torch.equal(a, b) for a, b in zip(kept["input_ids"], kept["inputs_embeds"]))


# ---- unclear errors, now one clear error each ------------------------------------------------------
def test_bad_inputs_of_the_cache_and_policies_name_the_parameter():
    import numpy as np

    with pytest.raises(ValueError, match="schedule=array.*list of fractions.*tolist"):
        EvictionConfig(budget=0.3, schedule=np.array([0.5, 0.5]))
    with pytest.raises(ValueError, match="seed=.* must be an int in \\[0, "):
        policies.get("random", seed=2**70)
    model = tiny_model("llama")
    with SparseKVCache(model, EvictionConfig(**CFG), "snapkv") as cache:
        empty = torch.empty(1, 0, dtype=torch.long)
        with pytest.raises(ValueError, match="input_ids is empty.*at least one token"):
            model(input_ids=empty, cache=cache)
        with pytest.raises(ValueError, match="input_ids is empty"):
            model.generate(input_ids=empty, cache=cache, **GEN)


def test_a_closed_cache_is_refused_also_by_the_learned_policy():
    from sparsekv.scoring.adapter import ScorerAdapter

    model = tiny_model("llama")
    policy = ScorerAdapter.for_model(model).policy()
    cache = SparseKVCache(model, EvictionConfig(**CFG), policy)
    model(input_ids=_ids(30), cache=cache)
    cache.close()
    with pytest.raises(ValueError, match="this SparseKVCache is closed.*build a new SparseKVCache"):
        model(input_ids=_ids(1, 3), cache=cache)
    with SparseKVCache(model, EvictionConfig(**CFG), policy) as again:  # the policy is reusable
        model(input_ids=_ids(30), cache=again)


def test_bad_inputs_of_a_compressed_context_name_the_parameter():
    model = tiny_model("llama")
    config = EvictionConfig(**CFG)
    with pytest.raises(ValueError, match="int64 \\(torch.long\\) or int32, got int16"):
        compress(model, torch.tensor([[5, 6, 7]], dtype=torch.int16), config)
    ctx = compress(model, _ids(30), config)
    with pytest.raises(ValueError, match="question_ids holds token id 500, beyond the vocabulary"):
        ctx.generate([500], **GEN)
    calls = []
    hook = model.register_forward_pre_hook(lambda *a: calls.append(1))
    for kwargs, name in (({"num_beams": 2}, "num_beams"), ({"num_return_sequences": 2, "do_sample": True}, "num_return_sequences")):
        with pytest.raises(ValueError, match=f"{name}=2: .*allowed value: {name}=1"):
            ctx.generate([5, 6], max_new_tokens=2, **kwargs)
    model.generation_config.num_beams = 3
    with pytest.raises(ValueError, match="num_beams=3 \\(from the generation config\\)"):
        ctx.generate([5, 6], max_new_tokens=2)
    model.generation_config.num_beams = 1
    hook.remove()
    assert not calls  # refused before the question's prefill ran


def test_a_dtype_change_between_compress_and_generate_is_named():
    model = tiny_model("llama")
    ctx = compress(model, _ids(30), EvictionConfig(**CFG))
    model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="holds float32 keys and values but the model now runs in bfloat16"):
        ctx.generate([5, 6], **GEN)
    model.to(torch.float32)
    assert ctx.generate([5, 6], **GEN).shape == (1, 6)


def test_cache_none_inside_attach_is_the_attachments_cache():
    from sparsekv.scoring.adapter import ScorerAdapter

    model = tiny_model("llama")
    adapter = ScorerAdapter.for_model(model)
    ids = _ids(40)
    with adapter.attach(model, budget=0.3) as att:
        want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **GEN)
        first = att.last_cache
        got = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=None, **GEN)
        assert att.last_cache is not first  # a fresh SparseKVCache served the cache=None call
    assert torch.equal(got, want)


# ---- a saved context is checked part by part ------------------------------------------------------
def _saved(tmp_path: Path):
    model = tiny_model("llama")
    ctx = compress(model, _ids(30, 1), EvictionConfig(**CFG), "snapkv")
    return model, ctx.save(tmp_path / "c")


def _edit_tensors(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = {k: v.clone() for k, v in load_file(str(path / "context.safetensors")).items()}
    edit(tensors)
    tmp = path / "new.safetensors"
    save_file(tensors, str(tmp))
    os.replace(tmp, path / "context.safetensors")
    meta = json.loads((path / "context.json").read_text())
    meta["tensors_sha256"] = compressed._digest(tensors)  # consistent, so only the check speaks
    (path / "context.json").write_text(json.dumps(meta))


def _edit_meta(path: Path, edit) -> None:
    meta = json.loads((path / "context.json").read_text())
    (path / "context.json").write_text(json.dumps(edit(meta)))


def test_a_context_file_missing_a_tensor_is_refused_by_name(tmp_path):
    model, path = _saved(tmp_path)
    _edit_tensors(path, lambda t: t.pop("layers.1.values"))
    with pytest.raises(ValueError, match="no tensor layers.1.values, which context.json says"):
        CompressedContext.load(path, model)


def test_a_context_file_with_the_wrong_head_dim_is_refused_by_name(tmp_path):
    model, path = _saved(tmp_path)

    def halve(t):
        t["layers.0.keys"] = t["layers.0.keys"][..., :8].contiguous()
        t["layers.0.values"] = t["layers.0.values"][..., :8].contiguous()

    _edit_tensors(path, halve)
    with pytest.raises(ValueError, match="tensor layers.0.keys has shape .*8\\), expected .*16\\)"):
        CompressedContext.load(path, model)
    _edit_meta(path, lambda m: {**m, "model_shape": {**m["model_shape"], "head_dim": 8}})
    with pytest.raises(ValueError, match="another model.*differing in head_dim"):
        CompressedContext.load(path, model)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: [m], "holds a JSON list, not an object"),
        (lambda m: {k: v for k, v in m.items() if k != "layers"}, "no 'layers'"),
        (lambda m: {**m, "layers": {"0": 1}}, "layers=.* must be a JSON list"),
        (lambda m: {**m, "layers": [{**m["layers"][0], "seen": "many"}] + m["layers"][1:]},
         "layers\\[0\\]: seen='many' must be an int >= 0"),
        (lambda m: {**m, "config": {**m["config"], "budget": 7.5}}, "config: budget=7.5"),
        (lambda m: {**m, "policy": "snapkv"}, "policy='snapkv' must be a JSON object"),
    ],
    ids=["list", "no-layers", "layers-not-list", "bad-counter", "bad-config", "bad-policy"],
)
def test_a_damaged_context_json_is_one_clear_error(tmp_path, edit, message):
    model, path = _saved(tmp_path)
    _edit_meta(path, edit)
    with pytest.raises(ValueError, match=message):
        CompressedContext.load(path, model)


# ---- item 7: a text context loads back as one; the model's attention comes back -------------------
def test_a_saved_text_context_loads_back_as_one_that_asks(tmp_path):
    model, tok = tiny_model("mistral"), CharTokenizer()
    doc = compress_text(model, tok, "The pass key is 7491. " * 6, EvictionConfig(**CFG), "snapkv")
    questions = [" What is the pass key?", " Say it again:"]
    want = doc.ask_many(questions, max_new_tokens=5)
    path = doc.save(tmp_path / "doc.ctx")
    assert json.loads((path / "context.json").read_text())["tokenizer"] == {
        "name_or_path": "char-tokenizer", "size": 128}
    back = TextContext.load(path, model, tok)
    assert back.ask_many(questions, max_new_tokens=5) == want
    assert back.ask(questions[0], max_new_tokens=5) == want[0]
    ctx = CompressedContext.load(path, model, tokenizer=tok)
    assert ctx.ask_many(questions, max_new_tokens=5) == want
    bare = CompressedContext.load(path, model)
    with pytest.raises(ValueError, match="ask_many\\(\\) takes text, so it needs the model's tokenizer"):
        bare.ask_many(questions)
    assert bare.ask_many(questions, tokenizer=tok, max_new_tokens=5) == want
    with pytest.raises(ValueError, match="tokenizer of 128 tokens .*has 50"):
        TextContext.load(path, model, CharTokenizer(size=50))


def test_the_result_of_compress_has_ask_many():
    model, tok = tiny_model("llama"), CharTokenizer()
    text = "The pass key is 7491. " * 6
    ctx = compress(model, tok(text)["input_ids"], EvictionConfig(**CFG))
    doc = compress_text(model, tok, text, EvictionConfig(**CFG))
    questions = [" What is the pass key?", " Again:"]
    assert ctx.ask_many(questions, tokenizer=tok, max_new_tokens=4) == doc.ask_many(
        questions, max_new_tokens=4
    )


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_model_goes_back_to_its_attention_when_its_last_cache_closes(attn):
    model = tiny_model("llama", attn_implementation=attn)

    def impl() -> str:
        return model.config._attn_implementation

    one = SparseKVCache(model, EvictionConfig(**CFG), "snapkv")
    two = SparseKVCache(model, EvictionConfig(**CFG), "h2o")
    assert impl() == f"sparsekv_{attn}"
    one.close()
    assert impl() == f"sparsekv_{attn}"  # `two` is still open
    two.close()
    assert impl() == attn
    three = SparseKVCache(model, EvictionConfig(**CFG), "snapkv")
    model(input_ids=_ids(20), cache=three)
    del three
    gc.collect()  # a cache collected without close() counts as closed
    assert impl() == attn
    compress(model, _ids(20), EvictionConfig(**CFG)).generate([5], **GEN)
    assert impl() == attn


def test_a_model_switched_by_its_user_stays_switched():
    import sparsekv.cache.attention as attn

    model = tiny_model("llama")
    model.set_attn_implementation(attn.register("sdpa"))  # as eval/bench_serving.py does
    SparseKVCache(model, EvictionConfig(**CFG), "snapkv").close()
    assert model.config._attn_implementation == "sparsekv_sdpa"


# ---- item 4: the vLLM side's prepare reads budgets by the library's rule ---------------------------
def test_vllm_prepare_budgets_follow_the_library_rule(capsys):
    from sparsekv.config import Tokens
    from sparsekv.serving.vllm import prepare

    assert prepare._budget("0.3") == 0.3 and isinstance(prepare._budget("512"), int)
    assert isinstance(prepare._budget("1tok"), Tokens) and prepare._budget("1.0") == 1.0
    assert [prepare.budget_label(b) for b in (1.0, 0.3, 512, Tokens(1))] == [
        "1", "0.3", "512tok", "1tok"]
    for bad, message in (("2.0", "a float budget is a fraction in \\(0, 1\\]"),
                         ("1", "ambiguous"), ("lots", "not a number")):
        with pytest.raises(SystemExit) as e:
            prepare.main(["out", "--budgets", "0.3", bad])
        assert e.value.code == 2
        assert "argument --budgets" in (err := capsys.readouterr().err)
        assert re.search(message, err), err


# ---- house: the serving modules stay short; the save's patch points are where tests patch ---------
def test_the_serving_modules_stay_short_and_the_save_is_patched_in_compressed(tmp_path, monkeypatch):
    folder = Path(compressed.__file__).parent
    long = {p.name: n for p in folder.glob("*.py") if (n := len(p.read_text().splitlines())) > 420}
    assert not long, long
    model = tiny_model("llama")
    ctx = compress(model, _ids(20), EvictionConfig(**CFG))
    ctx.save(tmp_path / "c")
    renames = []
    real = os.rename
    monkeypatch.setattr(compressed, "_exchange", lambda a, b: False)
    monkeypatch.setattr(os, "rename", lambda a, b: (renames.append(1), real(a, b)))
    ctx.save(tmp_path / "c")
    assert len(renames) == 2  # the patched exchange was used: two renames
    assert compressed._IN_PROGRESS == set()
