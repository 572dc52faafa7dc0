"""What a Hugging Face user arrives with: the conventions of transformers' own caches and
objects hold for sparsekv's (copying a cache to reuse a prompt, objects that print briefly)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import FAMILIES, tiny_model

from sparsekv import EvictionConfig, SparseKVCache


def _ids(n=48, seed=0):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_deepcopy_of_a_prefilled_cache_continues_like_the_original(family, quantize):
    """transformers' prompt-reuse recipe: prefill once, `copy.deepcopy(cache)` per continuation.
    Each copy continues exactly as the original would, and shares no tensor with it."""
    model = tiny_model(family)
    cfg = EvictionConfig(budget=0.5, recent_window=4, sink_tokens=2, evict_slack=0, quantize=quantize)
    prompt = _ids()
    with torch.no_grad():
        cache = SparseKVCache(model, cfg, "snapkv")
        model(input_ids=prompt, cache=cache)
        copied = copy.deepcopy(cache)
        assert copied is not cache and copied.model is model
        assert copied.layer_lengths() == cache.layer_lengths()
        assert copied.tokens_seen() == cache.tokens_seen()
        for a, b in zip(cache.layers, copied.layers):
            if getattr(a, "keys", None) is not None and a.keys.numel():
                assert torch.equal(a.keys, b.keys)
                assert a.keys.data_ptr() != b.keys.data_ptr()
        cont = _ids(6, seed=1)
        want = model(input_ids=cont, cache=cache).logits
        got = model(input_ids=cont, cache=copied).logits
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        again = copy.deepcopy(copied)  # a copy of a copy that has decoded is a copy too
        assert again.layer_lengths() == copied.layer_lengths()
    cache.close(), copied.close(), again.close()


def test_deepcopy_of_a_recording_cache_names_fork():
    model = tiny_model("llama")
    cache = SparseKVCache(model, EvictionConfig(budget=1.0), "full", record=("window",))
    with torch.no_grad():
        model(input_ids=_ids(), cache=cache)
    with pytest.raises(ValueError, match="fork"):
        copy.deepcopy(cache)
    cache.close()


def test_attach_yields_an_object_that_prints_briefly():
    from sparsekv import ScorerAdapter

    model = tiny_model("llama")
    adapter = ScorerAdapter.for_model(model)
    with adapter.attach(model, budget=0.3) as att:
        text = repr(att)
    assert "Attachment(" in text and "budget=0.3" in text and "LearnedPolicy(" in text
    assert "LlamaForCausalLM" in text and "Linear(" not in text and len(text) < 600


def test_eval_takes_the_hub_model_ids_that_train_and_adapters_take():
    from sparsekv.evaluation.config import EvalConfig
    from sparsekv.evaluation.running.models import load_model, validate_model_spec

    validate_model_spec("some-org/some-model")  # a Hub id, as train.py's `model:` takes
    cfg = EvalConfig(model="some-org/some-model", tasks=["passkey"], lengths=[256], samples=1,
                     policies=["streaming"], budgets=[0.5])
    assert cfg.model == "some-org/some-model"
    with pytest.raises(ValueError, match="some-org/no-such-model"):  # offline: named, no traceback
        load_model("some-org/no-such-model")
    with pytest.raises(ValueError, match="model"):
        validate_model_spec("")


@pytest.mark.integration
def test_one_call_pipeline_answers_like_compress_text(default_model):
    """`pipeline("sparsekv-text-generation")` is compress_text + ask(_many) in one call."""
    from transformers import pipeline

    import sparsekv
    from sparsekv.serving import pipeline as sk_pipeline  # registers the task

    model, tok = default_model
    pipe = pipeline(sk_pipeline.TASK, model=model, tokenizer=tok)
    context = "The pass key is 41729. Remember it. " + "The grass is green. The sky is blue. " * 30
    q = "\nQuestion: What is the pass key?\nAnswer: The pass key is"
    want = sparsekv.compress_text(model, tok, context, sparsekv.EvictionConfig(budget=0.5), "snapkv")
    got = pipe(context, question=q, policy="snapkv", budget=0.5, max_new_tokens=6)
    assert got == {"answer": want.ask(q, max_new_tokens=6)}
    many = pipe(context, questions=[q, q], policy="streaming", budget=0.5, max_new_tokens=4)
    assert len(many["answers"]) == 2 and many["answers"][0] == many["answers"][1]
    with pytest.raises(ValueError, match="num_beams"):
        pipe(context, question=q, num_beams=2)
    with pytest.raises(ValueError, match="question"):
        pipe(context)
