"""An adapter may hold k heads whose logits are averaged (AdapterConfig.ensemble): built from k
adapters trained apart, saved and loaded like one head (shapes checked against k), a single head
unchanged on disk, and adapters that do not share their shape refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from sparsekv.models.loading import load_model
from sparsekv.scoring.adapter import ScorerAdapter


@pytest.fixture(scope="module")
def model():
    return load_model("tiny:llama", seed=0).model


def fresh(model, seed: int, **kw) -> ScorerAdapter:
    torch.manual_seed(seed)
    return ScorerAdapter.for_model(model, hidden=16, base_model_id="tiny:llama", **kw)


def test_an_ensemble_scores_the_mean_of_its_heads_and_round_trips(model, tmp_path):
    members = [fresh(model, s) for s in (1, 2, 3)]
    ens = ScorerAdapter.ensemble(members)
    assert ens.config.ensemble == 3 and ens.head.members == 3
    assert ens.head.num_parameters() == 3 * members[0].head.num_parameters()
    h = torch.randn(2, 7, model.config.hidden_size)
    for layer in ens.config.layers:
        want = torch.stack([m.score_layer(layer, h) for m in members]).mean(0)
        torch.testing.assert_close(ens.score_layer(layer, h), want)
    ens.save_pretrained(tmp_path / "ens")
    assert json.loads((tmp_path / "ens" / "config.json").read_text())["ensemble"] == 3
    back = ScorerAdapter.from_pretrained(str(tmp_path / "ens"))
    assert back.config.ensemble == 3 and back.fingerprint() == ens.fingerprint()
    torch.testing.assert_close(back.score_layer(0, h), ens.score_layer(0, h))
    back.check_compatible(model)
    assert ens.fingerprint() != ScorerAdapter.ensemble(members[:2]).fingerprint()


def test_a_single_head_writes_no_ensemble_field(model, tmp_path):
    one = fresh(model, 1)
    one.save_pretrained(tmp_path / "one")
    assert "ensemble" not in json.loads((tmp_path / "one" / "config.json").read_text())
    assert ScorerAdapter.from_pretrained(str(tmp_path / "one")).config.ensemble == 1


def test_weights_of_another_ensemble_size_are_refused(model, tmp_path):
    ScorerAdapter.ensemble([fresh(model, 1), fresh(model, 2)]).save_pretrained(tmp_path / "e")
    cfg = json.loads((tmp_path / "e" / "config.json").read_text())
    cfg["ensemble"] = 3
    (tmp_path / "e" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model.safetensors"):
        ScorerAdapter.from_pretrained(str(tmp_path / "e"))


def test_adapters_of_other_shapes_are_refused_by_name(model):
    with pytest.raises(ValueError, match=r"adapter 1 has layers=\[0, 1\] but adapter 0 has \[0, 1, 2, 3\]"):
        ScorerAdapter.ensemble([fresh(model, 1), fresh(model, 2, layers=[0, 1])])
    with pytest.raises(ValueError, match="at least 2 adapters"):
        ScorerAdapter.ensemble([fresh(model, 1)])
    ens = ScorerAdapter.ensemble([fresh(model, 1), fresh(model, 2)])
    with pytest.raises(ValueError, match="is an ensemble itself"):
        ScorerAdapter.ensemble([ens, fresh(model, 3)])


def test_an_ensemble_drives_generate_like_one_head(model):
    ens = ScorerAdapter.ensemble([fresh(model, 1), fresh(model, 2)])
    ids = torch.randint(3, model.config.vocab_size, (1, 48))
    with ens.attach(model, budget=0.5, sink_tokens=2, recent_window=4) as att:
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 51) and att.last_cache is not None
