"""An adapter's LoRA subfolder: a standard PEFT folder, loaded with the adapter, applied by
`attach` and removed exactly on exit."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from sparsekv.scoring.adapter import ScorerAdapter


def _trained_lora():
    """A PeftModel whose LoRA changes the outputs (B initialized non-zero)."""
    from peft import LoraConfig, get_peft_model

    from sparsekv.scoring.lora import quiet_peft

    torch.manual_seed(0)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    with quiet_peft():
        return get_peft_model(tiny_model("llama"), config)


def _ids():
    return torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    peft_model = _trained_lora()
    with torch.no_grad():
        want = peft_model(input_ids=_ids()).logits
    adapter = ScorerAdapter.for_model(tiny_model("llama"))
    plain = adapter.fingerprint()
    folder = adapter.save_pretrained(tmp_path_factory.mktemp("a") / "adapter", lora=peft_model)
    return folder, want, plain


def test_the_lora_subfolder_is_a_peft_folder_peft_loads_on_its_own(saved):
    from peft import PeftModel

    folder, want, _ = saved
    assert sorted(p.name for p in (folder / "lora").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    from sparsekv.scoring.lora import quiet_peft

    with quiet_peft():
        peft = PeftModel.from_pretrained(tiny_model("llama"), str(folder / "lora"))
    with torch.no_grad():
        assert torch.allclose(peft(input_ids=_ids()).logits, want, atol=1e-6)


def test_load_records_and_fingerprints_the_lora(saved, tmp_path):
    folder, _, plain = saved
    adapter = ScorerAdapter.from_pretrained(folder)
    assert adapter.lora is not None and adapter.config.lora == "lora"
    assert adapter.fingerprint() != plain
    again = adapter.save_pretrained(tmp_path / "again")
    for name in ("model.safetensors", "lora/adapter_model.safetensors"):
        assert (again / name).read_bytes() == (folder / name).read_bytes()
    assert ScorerAdapter.from_pretrained(again).fingerprint() == adapter.fingerprint()
    assert "lora" in (folder / "README.md").read_text()


def test_attach_applies_the_lora_and_restores_the_model_bitwise(saved):
    folder, want, _ = saved
    adapter = ScorerAdapter.from_pretrained(folder)
    model = tiny_model("llama")
    names = [n for n, _ in model.named_parameters()]
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    model.train()
    with torch.no_grad():
        before = model(input_ids=_ids()).logits
    with adapter.attach(model, budget=1.0):
        with torch.no_grad():
            inside = model(input_ids=_ids()).logits
        out = model.generate(input_ids=_ids()[:1], max_new_tokens=3, do_sample=False)
        assert out.shape == (1, 27)
    with torch.no_grad():
        after = model(input_ids=_ids()).logits
    assert torch.allclose(inside, want, atol=1e-6) and not torch.allclose(inside, before, atol=1e-3)
    assert torch.equal(after, before)
    assert [n for n, _ in model.named_parameters()] == names and "generate" not in vars(model)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == grads and model.training
    assert not any("lora" in n for n, _ in model.named_modules())
    with adapter.attach(model, budget=1.0, lora=False), torch.no_grad():
        assert torch.equal(model(input_ids=_ids()).logits, before)


def test_lora_is_removed_after_an_error_too(saved):
    adapter = ScorerAdapter.from_pretrained(saved[0])
    model = tiny_model("llama")
    with torch.no_grad():
        before = model(input_ids=_ids()).logits
    with pytest.raises(RuntimeError, match="inside"), adapter.attach(model):
        raise RuntimeError("inside")
    with torch.no_grad():
        assert torch.equal(model(input_ids=_ids()).logits, before)


def test_a_damaged_lora_names_the_file(saved, tmp_path):
    import shutil

    folder = shutil.copytree(saved[0], tmp_path / "copy")
    w = folder / "lora" / "adapter_model.safetensors"
    w.write_bytes(w.read_bytes()[:50])
    with pytest.raises(
        ValueError, match=r"lora/adapter_model.safetensors is not a readable safetensors"
    ):
        ScorerAdapter.from_pretrained(folder)
    shutil.rmtree(folder / "lora")
    with pytest.raises(FileNotFoundError, match="names a LoRA subfolder 'lora'"):
        ScorerAdapter.from_pretrained(folder)
