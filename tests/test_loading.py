"""One model loader (`sparsekv.models.loading`) behind training's and evaluation's: the same model for
the same spec, each caller's tokenizer, dtype / attention / seed applied, clear errors."""

from __future__ import annotations

import pytest
import torch

from sparsekv.evaluation.running.models import load_model as eval_load
from sparsekv.evaluation.tasks.codec import AsciiCodec, HFCodec
from sparsekv.models.loading import load_model
from sparsekv.models.tiny import tiny_model
from train.models import ByteTokenizer
from train.models import load_model as train_load


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_tiny_models_are_one_model_for_both_callers_with_their_own_tokenizers():
    state = torch.random.get_rng_state()
    model_e, codec = eval_load("tiny:gemma3", seed=3)
    model_t, tok, base_id = train_load("tiny:gemma3", seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG stream is untouched
    assert _same_weights(model_e, model_t) and _same_weights(model_e, tiny_model("gemma3", seed=3))
    assert not _same_weights(model_e, eval_load("tiny:gemma3", seed=4)[0])
    assert (
        isinstance(codec, AsciiCodec)
        and isinstance(tok, ByteTokenizer)
        and base_id == "tiny:gemma3"
    )
    for m in (model_e, model_t):
        assert not m.training and not any(p.requires_grad for p in m.parameters())


def test_dtype_and_attention_implementation_are_applied():
    model, _ = eval_load("tiny:llama", dtype="bfloat16", attn_implementation="eager")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == "eager"
    model, _, _ = train_load("tiny:qwen3", dtype="float16")
    assert {p.dtype for p in model.parameters()} == {torch.float16}


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {
        "<pad>": 0,
        "<s>": 1,
        "</s>": 2,
        "<unk>": 3,
        **{w: i + 4 for i, w in enumerate(["the", "cat", "sat", "on", "mat"])},
    }
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def test_a_local_folder_loads_the_same_for_both_callers(tmp_path):
    folder = tmp_path / "m"
    tiny_model("mistral", seed=1).save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    model_e, codec = eval_load(str(folder))
    model_t, tok, base_id = train_load(str(folder))
    assert _same_weights(model_e, model_t) and _same_weights(model_e, tiny_model("mistral", seed=1))
    assert isinstance(codec, HFCodec) and codec.name == str(folder) and base_id == str(folder)
    assert codec.encode("the cat") == tok("the cat", add_special_tokens=False).input_ids == [4, 5]
    assert codec.bos_ids == [1] and 2 in codec.eos_ids
    assert load_model(str(folder), dtype="bfloat16").model.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "spec, kwargs, message",
    [
        ("", {}, "model='' must be 'default' (gemma-3-270m), 'tiny:<family>'"),
        (
            "tiny:gpt2",
            {},
            "tiny model family 'gpt2'; allowed: llama, qwen2, qwen3, mistral, gemma3",
        ),
        ("/no/such/folder", {}, "is not 'default' (gemma-3-270m), 'tiny:<family>' (llama"),
        ("/no/such/folder", {"hub": True}, "model='/no/such/folder': no such folder"),
        ("nobody-here/no-such-model", {"hub": True}, "could not be loaded"),
        (
            "tiny:llama",
            {"dtype": "float13"},
            "dtype='float13' is not supported; allowed values: float32",
        ),
        (
            "tiny:llama",
            {"attn_implementation": "flash"},
            "attn_implementation='flash'; allowed values: sdpa, eager",
        ),
    ],
)
def test_bad_specs_give_clear_errors(spec, kwargs, message, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError) as e:
        load_model(spec, **kwargs)
    assert message in str(e.value), str(e.value)


def test_a_path_without_a_config_is_named_even_where_hub_ids_are_allowed(tmp_path):
    with pytest.raises(ValueError, match="is a path without a config.json"):
        train_load(str(tmp_path))
