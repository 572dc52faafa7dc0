"""Compress once, ask many (`sparsekv.compress`): every answer from one compressed context equals
a separate compress-then-ask run, the compressed context never changes, and a saved context
answers the same after loading (and refuses another model)."""

from __future__ import annotations

import json

import pytest
import torch

from sparsekv import EvictionConfig, SparseKVCache
from sparsekv.serving.compressed import CompressedContext, compress, compress_text

CFG = dict(budget=0.3, sink_tokens=2, recent_window=8, rerank_every=4, evict_slack=2)
GEN = dict(max_new_tokens=10, do_sample=False)


def _ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (1, n), generator=g)


@pytest.fixture
def questions() -> list[torch.Tensor]:
    return [_ids(n, 10 + n) for n in (5, 9, 3)]


def _adapter(model):
    from sparsekv.scoring.adapter import ScorerAdapter

    torch.manual_seed(0)
    return ScorerAdapter.for_model(model, hidden=8)


def _policy(name: str, model):
    if name == "kvzip":  # scored after the prefill by a repeat pass (a Policy instance)
        from sparsekv import policies

        return policies.get("kvzip", encode=lambda s: [3 + ord(c) % 125 for c in s])
    return _adapter(model) if name == "adapter" else name


@torch.no_grad()
def separate_run(model, context, question, config, policy) -> torch.Tensor:
    """The reference: a fresh cache, the context prefilled through it, then `generate` on
    context + question; returns question + answer ids."""
    from sparsekv.serving.compressed import _resolve_policy

    built, _ = _resolve_policy(policy)
    with SparseKVCache(model, config, built) as cache:
        model(input_ids=context, cache=cache, use_cache=True)
        ids = torch.cat([context, question], dim=1)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, **GEN)
    return out[:, context.shape[1] :]


def _clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("policy", ["snapkv", "h2o", "adapter", "kvzip"])
def test_answers_equal_separate_compress_then_ask_runs(make_tiny_model, family, policy, questions):
    model = make_tiny_model(family)
    context = _ids(100, 1)
    config = EvictionConfig(**CFG)
    pol = _policy(policy, model)
    ctx = compress(model, context, config, pol)
    before = _clone(ctx.state())
    assert ctx.kept()[model.config.num_hidden_layers - 1] < ctx.num_tokens  # it did compress
    for q in questions:
        got = ctx.generate(q, **GEN)
        assert got[:, : q.shape[1]].tolist() == q.tolist()
        assert torch.equal(got, separate_run(model, context, q, config, pol))
        _assert_same_state(ctx.state(), before)  # the compressed context is unchanged


def test_int8_context_round_trips_through_save_and_load(make_tiny_model, tmp_path, questions):
    model = make_tiny_model("qwen3")
    context = _ids(80, 2)
    config = EvictionConfig(**CFG, quantize="int8")
    ctx = compress(model, context, config, "snapkv")
    assert any(k.endswith("key_scale") for k in ctx.state())
    answers = [ctx.generate(q, **GEN) for q in questions]
    ctx.save(tmp_path / "c")
    loaded = CompressedContext.load(tmp_path / "c", model)
    _assert_same_state(loaded.state(), ctx.state())
    assert loaded.config == config
    for q, a in zip(questions, answers):
        assert torch.equal(loaded.generate(q, **GEN), a)
        assert torch.equal(a, separate_run(model, context, q, config, "snapkv"))


def test_saved_context_records_what_it_holds_and_overwrites_atomically(make_tiny_model, tmp_path):
    model = make_tiny_model("gemma3")
    ctx = compress(model, _ids(60, 3), EvictionConfig(**CFG), "tova")
    path = ctx.save(tmp_path / "c")
    meta = json.loads((path / "context.json").read_text())
    assert meta["num_tokens"] == 60 and meta["kept"] == ctx.kept()
    assert meta["policy"]["spec"] == "tova" and meta["config"]["budget"] == 0.3
    assert meta["model_shape"]["model_type"] == "gemma3_text"
    ctx.save(path)  # replacing a saved context leaves one complete folder, no leftovers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("mine")
    with pytest.raises(ValueError, match="not a saved compressed context"):
        ctx.save(tmp_path / "other")


def test_loaded_adapter_context_answers_the_same_and_checks_the_adapter(
    make_tiny_model, tmp_path, questions
):
    model = make_tiny_model("llama")
    adapter = _adapter(model)
    ctx = compress(model, _ids(90, 4), EvictionConfig(**CFG), adapter)
    ctx.save(tmp_path / "c")
    with pytest.raises(ValueError, match="policy="):  # an in-memory adapter must be passed again
        CompressedContext.load(tmp_path / "c", model)
    loaded = CompressedContext.load(tmp_path / "c", model, policy=adapter)
    for q in questions:
        assert torch.equal(loaded.generate(q, **GEN), ctx.generate(q, **GEN))
    other = _adapter(model)
    with torch.no_grad():
        next(other.head.parameters()).add_(1.0)
    with pytest.raises(ValueError, match="fingerprint"):
        CompressedContext.load(tmp_path / "c", model, policy=other)


def test_loading_onto_another_model_is_a_clear_error(make_tiny_model, tmp_path):
    model = make_tiny_model("llama")
    compress(model, _ids(40, 5), EvictionConfig(**CFG), "snapkv").save(tmp_path / "c")
    with pytest.raises(ValueError, match="another model.*differing in"):
        CompressedContext.load(tmp_path / "c", make_tiny_model("qwen3"))
    with pytest.raises(ValueError, match="same shape"):
        CompressedContext.load(tmp_path / "c", make_tiny_model("llama", seed=1))
    with pytest.raises(ValueError, match="float32.*bfloat16"):
        CompressedContext.load(tmp_path / "c", make_tiny_model("llama").to(torch.bfloat16))
    with pytest.raises(ValueError, match="compressed with SnapKV"):
        CompressedContext.load(tmp_path / "c", model, policy="h2o")
    (tmp_path / "c" / "context.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="context.safetensors"):
        CompressedContext.load(tmp_path / "c", model)


def test_the_package_exports_the_functions_not_the_module():
    """`sparsekv.compress` is the function even after its module was imported (the module is
    sparsekv/serving/compressed.py: a module named `compress` would shadow the lazy export)."""
    import sparsekv
    import sparsekv.serving.compressed  # noqa: F401
    from sparsekv import compress as fn

    assert callable(sparsekv.compress) and fn is compress
    assert (
        sparsekv.CompressedContext is CompressedContext and sparsekv.compress_text is compress_text
    )


def test_bad_inputs_name_the_parameter(make_tiny_model):
    model = make_tiny_model("llama")
    config = EvictionConfig(**CFG)
    with pytest.raises(ValueError, match="context_ids.*one sequence"):
        compress(model, torch.ones(2, 10, dtype=torch.long), config)
    with pytest.raises(ValueError, match="context_ids is empty"):
        compress(model, [], config)
    with pytest.raises(ValueError, match="config must be an EvictionConfig"):
        compress(model, [5, 6, 7], {"budget": 0.3})
    with pytest.raises(ValueError, match="policy=.*known policies"):
        compress(model, [5, 6, 7], config, policy=3)
    ctx = compress(model, _ids(20, 6), config)
    with pytest.raises(ValueError, match="cache=...\\) is set by the compressed context"):
        ctx.generate([5], cache=None)
    with pytest.raises(ValueError, match="question_ids is empty"):
        ctx.generate([])


class CharTokenizer:
    """Characters folded into the tiny models' 128-id vocabulary (ids 0-2 special)."""

    bos_token_id = 1

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = [3 + ord(c) % 125 for c in text]
        return {"input_ids": ([self.bos_token_id] if add_special_tokens else []) + ids}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i - 3 + 32) for i in ids if not (skip_special_tokens and i < 3))


def test_text_contexts_answer_each_question_as_a_separate_run(make_tiny_model):
    model, tok = make_tiny_model("mistral"), CharTokenizer()
    text = "The pass key is 7491. " * 6
    config = EvictionConfig(**CFG)
    doc = compress_text(model, tok, text, config, "snapkv")
    questions = [" What is the pass key?", " Say it again:"]
    answers = doc.ask_many(questions, max_new_tokens=6)
    for q, a in zip(questions, answers):
        context = torch.tensor([tok(text)["input_ids"]])
        question = torch.tensor([tok(q, add_special_tokens=False)["input_ids"]])
        ref = separate_run(model, context, question, config, "snapkv")
        assert a == tok.decode(ref[0, question.shape[1] : question.shape[1] + 6].tolist(), True)
    with pytest.raises(ValueError, match="list of strings"):
        doc.ask_many("one question")


def _random_lora(model):
    """A LoRA with non-zero weights on k_proj/v_proj of every layer (built on its own model)."""
    import warnings

    from peft import LoraConfig, get_peft_model

    from sparsekv.scoring.lora import LoraWeights

    torch.manual_seed(3)
    cfg = LoraConfig(
        r=2, lora_alpha=8, target_modules=["k_proj", "v_proj"], init_lora_weights=False
    )
    with warnings.catch_warnings():  # peft calls transformers' deprecated is_gradient_checkpointing
        warnings.simplefilter("ignore", FutureWarning)
        return LoraWeights.from_peft(get_peft_model(model, cfg))


def test_an_adapters_lora_is_applied_to_the_prefill_and_every_question(
    make_tiny_model, questions, tmp_path
):
    from sparsekv.scoring.lora import apply_lora

    model = make_tiny_model("llama")
    adapter = _adapter(model)
    adapter.set_lora(_random_lora(make_tiny_model("llama")))
    config, context = EvictionConfig(**CFG), _ids(100, 7)
    before = model(input_ids=context).logits
    ctx = compress(model, context, config, adapter)
    plain = compress(model, context, config, adapter, lora=False)
    assert not torch.equal(ctx.state()["layers.0.keys"], plain.state()["layers.0.keys"])
    with apply_lora(model, adapter.lora):
        refs = [separate_run(model, context, q, config, adapter) for q in questions]
    for q, ref in zip(questions, refs):
        assert torch.equal(ctx.generate(q, **GEN), ref)
    assert torch.equal(model(input_ids=context).logits, before)  # the LoRA is gone again
    ctx.save(tmp_path / "c")
    loaded = CompressedContext.load(tmp_path / "c", model, policy=adapter)
    assert torch.equal(loaded.generate(questions[0], **GEN), refs[0])
    bare = _adapter(model)  # same gate, no LoRA: another fingerprint
    with pytest.raises(ValueError, match="fingerprint|LoRA"):
        CompressedContext.load(tmp_path / "c", model, policy=bare)
