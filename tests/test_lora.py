"""LoRA co-adaptation (train/lora.py): only the LoRA gets gradients, the model comes back
unchanged, a few steps lower the KL between the full cache and the compressed one, the saved
`lora/` subfolder is a PEFT folder that `PeftModel.from_pretrained` loads on its own, and the
`lora:` config keys are validated and run end to end through train.py."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from train.lora import (  # noqa: E402
    LoraTrainConfig,
    continuation_kl,
    gate_policy,
    lora_parameters,
    train_lora,
    trainable_lora,
)

SMALL = {
    "r": 4,
    "budget": 0.1,
    "steps": 10,
    "lr": 3e-3,
    "warmup_steps": 0,
    "context_len": 96,
    "continuation_len": 16,
    "eviction": {"sink_tokens": 2, "recent_window": 4},
}


def _blocks(n: int, length: int = 112, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (n, length), generator=g)


def _adapter(model):
    from sparsekv.scoring.adapter import ScorerAdapter

    torch.manual_seed(0)
    return ScorerAdapter.for_model(model, hidden=8)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_after_backward_only_lora_parameters_have_grad(make_tiny_model, family):
    model = make_tiny_model(family)
    adapter, cfg = _adapter(model), LoraTrainConfig(**SMALL)
    with trainable_lora(model, cfg) as peft_model:
        loss, _ = continuation_kl(
            peft_model,
            gate_policy(adapter, cfg),
            cfg.eviction_config(),
            _blocks(1),
            cfg.context_len,
        )
        loss.backward()
        with_grad = {n for n, p in peft_model.named_parameters() if p.grad is not None}
        lora = {
            n for n, p in peft_model.named_parameters() if p in set(lora_parameters(peft_model))
        }
        assert with_grad == lora and lora
        assert all("lora_" in n for n in with_grad)
        # the full-attention layers only: tiny gemma3's layer 3 (0-2 slide), all four in llama
        layers = {int(n.split(".layers.")[1].split(".")[0]) for n in lora}
        assert layers == ({3} if family == "gemma3" else {0, 1, 2, 3})
        assert any(float(peft_model.get_parameter(n).grad.abs().sum()) > 0 for n in lora)
    assert all(p.grad is None for p in adapter.head.parameters())


def test_the_model_comes_back_unchanged(make_tiny_model):
    model = make_tiny_model("qwen3")
    ids = _blocks(1)
    before = model(input_ids=ids).logits
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    names = {n for n, _ in model.named_modules()}
    train_lora(
        model,
        _adapter(model),
        LoraTrainConfig(**{**SMALL, "steps": 2}),
        _blocks(2),
        _blocks(1, seed=2),
    )
    assert torch.equal(model(input_ids=ids).logits, before)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert {n for n, _ in model.named_modules()} == names and not hasattr(model, "peft_config")


def test_a_few_steps_lower_the_kl(make_tiny_model):
    model = make_tiny_model("llama")
    blocks = _blocks(2)
    _, metrics = train_lora(model, _adapter(model), LoraTrainConfig(**SMALL), blocks, blocks)
    assert metrics["heldout_kl_before"] > 0
    assert metrics["heldout_kl_after"] < 0.5 * metrics["heldout_kl_before"], metrics


def test_saved_lora_subfolder_loads_with_peft_on_its_own(make_tiny_model, tmp_path):
    from peft import PeftModel, get_peft_model_state_dict

    model = make_tiny_model("llama")
    adapter = _adapter(model)
    weights, _ = train_lora(
        model, adapter, LoraTrainConfig(**{**SMALL, "steps": 3}), _blocks(2), _blocks(1)
    )
    adapter.save_pretrained(tmp_path / "a", lora=weights)
    assert {p.name for p in (tmp_path / "a" / "lora").iterdir()} >= {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    with warnings.catch_warnings():  # peft calls transformers' deprecated is_gradient_checkpointing
        warnings.simplefilter("ignore", FutureWarning)
        loaded = PeftModel.from_pretrained(make_tiny_model("llama"), str(tmp_path / "a" / "lora"))
    state = get_peft_model_state_dict(loaded)
    assert state.keys() == weights.state.keys()
    assert all(torch.equal(state[k], weights.state[k]) for k in state)
    ids = _blocks(1)
    assert not torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    # the held-out report reads the folder back: KL on evaluation prose, gate alone vs + LoRA
    from train.lora import main

    args = [
        "--model",
        "tiny:llama",
        "--budgets",
        "0.2",
        "--blocks",
        "2",
        "--context-len",
        "160",
        "--continuation-len",
        "8",
    ]
    (row,) = main([str(tmp_path / "a"), *args])
    assert row["blocks"] == 2 and row["kl_gate"] > 0 and row["kl_gate_lora"] != row["kl_gate"]


@pytest.mark.parametrize(
    "override, words",
    [
        ("lora.r=0", "lora: r=0 must be an int >= 1"),
        ("lora.lr=.nan", "lora: lr=nan must be a finite number > 0"),
        ("lora.budget=1.5", "lora: budget=1.5 must be a fraction in (0, 1]"),
        (
            "lora.target_modules=[gate_proj]",
            "must be a non-empty list of q_proj, k_proj, v_proj, o_proj",
        ),
        ("lora.use=decode", "use='decode' is not supported; allowed values: agnostic, aware"),
        ("lora.eviction={budget: 0.3}", "other than budget"),
        ("lora.eviction={schedule: cone}", "schedule='cone' is not supported"),
        ("lora.rank=4", "unknown config key 'lora.rank'"),
    ],
)
def test_lora_config_errors_name_the_key(override, words):
    from train.config import load_config

    with pytest.raises(ValueError) as e:
        load_config(ROOT / "configs" / "train" / "tiny-cpu.yaml", [override])
    assert words in str(e.value)


def test_train_py_trains_a_lora_after_the_head_and_for_a_saved_adapter(tmp_path):
    """`lora:` in the training config: final/ holds the head and lora/; `lora.adapter=DIR` then
    trains only a LoRA for that adapter into another run folder (here the same LoRA again)."""
    from data.build import BuildConfig, build_file
    from sparsekv.scoring.adapter import ScorerAdapter
    from train.loop import main

    corpus = build_file(
        tmp_path / "c.jsonl", BuildConfig(max_prose_chars=20_000, synthetic=4, context_chars=300)
    )
    lora = "lora={steps: 2, context_len: 96, continuation_len: 16, eval_sequences: 1, r: 2}"
    common = [f"dataset={corpus}", "progress_bar=false", "log_with=none", "save_every=0"]
    threads = torch.get_num_threads()
    try:
        summary = main(
            [
                "--config",
                str(ROOT / "configs/train/tiny-cpu.yaml"),
                "max_steps=2",
                f"output_dir={tmp_path / 'run'}",
                lora,
                *common,
            ]
        )
        final = tmp_path / "run" / "final"
        assert (final / "lora" / "adapter_model.safetensors").is_file()
        assert summary["lora"]["steps"] == 2 and summary["lora"]["heldout_sequences"] == 1
        rows = [
            json.loads(r)
            for r in (tmp_path / "run" / "lora_metrics.jsonl").read_text().splitlines()
        ]
        assert [r["lora_step"] for r in rows] == [1, 2]
        recorded = ScorerAdapter.from_pretrained(final)
        assert (
            recorded.lora is not None
            and recorded.config.training_config["result"]["lora"]["steps"] == 2
        )
        only = main(
            [
                "--config",
                str(ROOT / "configs/train/tiny-cpu.yaml"),
                f"output_dir={tmp_path / 'only'}",
                lora.replace("{", f"{{adapter: {final}, "),
                *common,
            ]
        )
    finally:
        torch.set_num_threads(threads)
    # same gate, data and seed: the LoRA trained for the saved adapter is the in-run one, exactly
    assert (tmp_path / "only" / "config.yaml").read_text().startswith("# Resolved config")
    again = ScorerAdapter.from_pretrained(only["final"])
    assert again.lora is not None and again.fingerprint() == recorded.fingerprint()
    assert only["lora"]["heldout_kl_after"] == summary["lora"]["heldout_kl_after"]
