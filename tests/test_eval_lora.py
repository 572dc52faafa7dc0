"""The evaluation harness runs a learned adapter's LoRA: applied for the method's whole run
(which forks from a prefill recorded with the LoRA applied, never from the plain model's),
removed after it (the plain model bitwise unchanged), and `lora: false` runs the same adapter
without it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sparsekv.evaluation.config import EvalConfig, parse_policy


def _adapter(folder: Path, model, nonzero: bool) -> Path:
    """A tiny adapter folder with a LoRA on q/v: B non-zero (changes the outputs) or zero (the
    default peft initialization: the LoRA adds exactly nothing)."""
    from peft import LoraConfig, get_peft_model

    from sparsekv.models.tiny import tiny_model
    from sparsekv.scoring.adapter import ScorerAdapter
    from sparsekv.scoring.lora import quiet_peft

    torch.manual_seed(0)
    config = LoraConfig(
        r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=not nonzero
    )
    with quiet_peft():
        peft_model = get_peft_model(tiny_model("llama"), config)
    if nonzero:  # large enough that greedy tokens move on a random tiny model
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if "lora_" in n:
                    p.normal_(0.0, 0.5)
    torch.manual_seed(0)
    return ScorerAdapter.for_model(model, hidden=8).save_pretrained(folder, lora=peft_model)


def _grid(out: Path, adapter: Path, shared: bool = True) -> EvalConfig:
    return EvalConfig(
        shared_prefill=shared,
        out=str(out),
        model="tiny:llama",
        tasks=["passkey", "ppl"],
        lengths=[256],
        samples=1,
        seed=3,
        budgets=[0.3],
        protocols=["agnostic", "aware"],
        threads=1,
        policies=[
            "snapkv",
            {"policy": f"learned:{adapter}", "label": "learned + LoRA"},
            {"policy": f"learned:{adapter}", "lora": False, "label": "learned"},
        ],
    )


def _run(tmp_path: Path, nonzero: bool, shared: bool = True, adapter: Path | None = None):
    from sparsekv.evaluation.running.models import load_model
    from sparsekv.evaluation.running.runner import run_eval

    model, codec = load_model("tiny:llama", seed=3)
    before = {n: t.detach().clone() for n, t in model.state_dict().items()}
    names = [n for n, _ in model.named_modules()]
    if adapter is None:
        adapter = _adapter(tmp_path / "adapter", model, nonzero)
    cfg = _grid(tmp_path / "run", adapter, shared)
    out = run_eval(cfg, model=model, codec=codec, progress=False, report=False)
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines() if x.strip()]
    after = model.state_dict()
    assert [n for n, _ in model.named_modules()] == names  # no LoRA module left behind
    assert after.keys() == before.keys()
    for n, t in before.items():
        assert torch.equal(after[n], t), n
    return rows, cfg, model, codec


def _by(rows, label):
    return {(r["sample_id"], r["protocol"]): r for r in rows if r["policy"] == label}


@pytest.fixture(scope="module")
def nonzero(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("lora1"), nonzero=True)


def test_lora_option_parses_and_is_learned_only():
    assert parse_policy("learned:x").lora is True
    spec = parse_policy("learned:x@lora=false@blend=0.5")
    assert spec.lora is False and spec.policy_kwargs == {"blend": 0.5}
    assert parse_policy({"policy": "learned:x", "lora": False}).lora is False
    with pytest.raises(ValueError, match="only a learned adapter"):
        parse_policy("snapkv@lora=false")
    with pytest.raises(ValueError, match="true or false"):
        parse_policy("learned:x@lora=maybe")


def test_a_nonzero_lora_changes_the_rows_and_the_model_comes_back_bitwise(nonzero):
    rows, *_ = nonzero
    assert all(r["error"] is None for r in rows)
    lora, plain = _by(rows, "learned + LoRA"), _by(rows, "learned")
    assert lora.keys() == plain.keys() and len(lora) == 3  # passkey x 2 protocols + ppl
    for key, r in lora.items():
        p = plain[key]
        assert r["policy_spec"].endswith("@lora=true") and "@lora=False" in p["policy_spec"]
        assert r["adapter_hash"] == p["adapter_hash"]  # one adapter; its hash covers the LoRA
        assert r["prefill_shared"] and p["prefill_shared"]  # each forked from its own prefill
        assert r["kl"] != pytest.approx(p["kl"], rel=1e-3, abs=1e-6), key
    # the reference and the other methods ran on the plain model (forked from its prefill)
    assert all(r["prefill_shared"] for r in rows if r["policy"] in ("full", "snapkv"))


def test_the_lora_fork_gives_the_rows_of_a_live_lora_prefill(nonzero, tmp_path):
    """The LoRA method's fork of the prefill recorded with its LoRA applied keeps what a live
    prefill with the LoRA keeps, and answers the same (the plain rows as well)."""
    rows, cfg, *_ = nonzero
    adapter = Path(cfg.policy_specs[1].name.split(":", 1)[1])  # the same adapter folder
    live, *_ = _run(tmp_path, nonzero=True, shared=False, adapter=adapter)
    assert {r["prefill_shared"] for r in live} == {False}
    shared = {(r["sample_id"], r["protocol"], r["policy"]): r for r in rows}
    assert len(live) == len(shared)
    for b in live:
        a = shared[(b["sample_id"], b["protocol"], b["policy"])]
        assert a["output_ids"] == b["output_ids"], a["policy"]
        assert a["kv_bytes_compressed"] == b["kv_bytes_compressed"], a["policy"]
        # NaN (written as null) where the first answer token already differs from the full cache's
        ka, kb = (float("nan") if x is None else x for x in (a["kl"], b["kl"]))
        assert ka == pytest.approx(kb, rel=1e-3, abs=1e-7, nan_ok=True), a["policy"]
        if a["task"] == "ppl":
            assert a["nll"] == pytest.approx(b["nll"], rel=1e-5), a["policy"]


def test_the_lora_method_forks_its_own_prefill_and_resume_keeps_its_rows(nonzero):
    from sparsekv.evaluation.running.execute import Runner
    from sparsekv.evaluation.running.runner import run_eval

    rows, cfg, model, codec = nonzero
    forks = Runner(model, codec, cfg).plan().forkable
    by_label = {s.label: forks[s.spec] for s in cfg.policy_specs}
    assert by_label == {"snapkv": True, "learned + LoRA": True, "learned": True}
    run_eval(cfg, model=model, codec=codec, progress=False, report=False, resume=True)
    again = [json.loads(x) for x in (Path(cfg.out) / "results.jsonl").read_text().splitlines()]
    assert len(again) == len(rows)  # nothing rerun: the `@lora=true` spec text matches


def test_a_zero_lora_gives_the_rows_of_the_adapter_without_it(tmp_path):
    rows, *_ = _run(tmp_path, nonzero=False)
    assert all(r["error"] is None for r in rows)
    lora, plain = _by(rows, "learned + LoRA"), _by(rows, "learned")
    assert lora.keys() == plain.keys() and len(lora) == 3
    for key, r in lora.items():
        p = plain[key]
        assert r["prefill_shared"]
        assert r["output_ids"] == p["output_ids"], key
        assert r["kv_bytes_compressed"] == p["kv_bytes_compressed"], key
        assert r["kl"] == pytest.approx(p["kl"], rel=1e-3, abs=1e-7), key
        if r["task"] == "ppl":
            assert r["nll"] == pytest.approx(p["nll"], rel=1e-5), key
