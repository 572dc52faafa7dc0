"""Adapters: exact round trip, shape checks, atomic saves, the Hub (intercepted), attach()."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from sparsekv.scoring.adapter import ADAPTER_FILES, AdapterConfig, ScorerAdapter
from sparsekv.teacher.statistics import TargetConfig


def _trained_like(adapter: ScorerAdapter, seed: int = 0) -> ScorerAdapter:
    """Give the head distinctive non-default weights."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.head.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return adapter


def _files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def test_for_model_records_shape_and_defaults():
    gemma = ScorerAdapter.for_model(tiny_model("gemma3"))
    c = gemma.config
    assert (c.model_type, c.num_layers, c.num_kv_heads, c.head_dim, c.hidden_size) == (
        "gemma3_text",
        4,
        2,
        16,
        64,
    )
    assert c.layers == [3]  # the full-attention layer only
    assert c.target == TargetConfig().to_dict() and c.sparsekv_version
    llama = ScorerAdapter.for_model(
        tiny_model("llama"), kind="linear", target=TargetConfig(cross_layer="per_layer")
    )
    assert llama.config.layers == [0, 1, 2, 3] and llama.config.kind == "linear"
    assert llama.config.target["cross_layer"] == "per_layer"


def test_round_trip_reproduces_scores_exactly(tmp_path):
    adapter = _trained_like(
        ScorerAdapter.for_model(tiny_model("llama"), layers=[1, 3], base_model_id="org/tiny")
    )
    adapter.config.training_config = {"lr": 1e-3, "max_steps": 10}
    adapter.config.eval_table = "| policy | acc |\n| --- | --- |\n| learned | 0.9 |"
    folder = adapter.save_pretrained(tmp_path / "adapter")
    assert _files(folder) == set(ADAPTER_FILES)  # weights, JSON config, card; nothing pickled
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp leftovers
    loaded = ScorerAdapter.from_pretrained(str(folder))
    assert loaded.config == adapter.config
    h = torch.randn(2, 9, 64)
    for layer in (1, 3):
        assert torch.equal(loaded.score_layer(layer, h), adapter.score_layer(layer, h))
    card = (folder / "README.md").read_text()
    assert (
        "base_model: org/tiny" in card and "| learned | 0.9 |" in card and '"max_steps": 10' in card
    )
    assert "| policy defaults | blend 0 (mix), head_layer own, kernel_size 1, recency 0 |" in card
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["layers"] == [1, 3] and cfg["hidden_size"] == 64 and cfg["target"]["stat"] == "mass"


def test_save_over_existing_folder_is_atomic(tmp_path, monkeypatch):
    first = _trained_like(ScorerAdapter.for_model(tiny_model("llama")), seed=1)
    second = _trained_like(ScorerAdapter.for_model(tiny_model("llama")), seed=2)
    folder = first.save_pretrained(tmp_path / "a")
    before = {n: (folder / n).read_bytes() for n in ADAPTER_FILES}

    import safetensors.torch

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save", boom)
    with pytest.raises(OSError, match="disk full"):
        second.save_pretrained(folder)
    assert {n: (folder / n).read_bytes() for n in ADAPTER_FILES} == before  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    monkeypatch.undo()

    second.save_pretrained(folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    h = torch.randn(1, 4, 64)
    assert torch.equal(
        ScorerAdapter.from_pretrained(folder).score_layer(0, h), second.score_layer(0, h)
    )


@pytest.mark.parametrize(
    "family,overrides,words",
    [
        ("gemma3", {}, "model type"),
        ("llama", {"num_hidden_layers": 3}, "layers"),
        ("llama", {"num_key_value_heads": 1}, "KV heads"),
        ("llama", {"head_dim": 8}, "head dim"),
        ("llama", {"hidden_size": 32}, "hidden size"),
    ],
)
def test_wrong_shape_model_is_a_clear_error(tmp_path, family, overrides, words):
    folder = ScorerAdapter.for_model(
        tiny_model("llama"), base_model_id="org/tiny-llama"
    ).save_pretrained(tmp_path / "a")
    adapter = ScorerAdapter.from_pretrained(folder)
    other = tiny_model(family, **overrides)
    with pytest.raises(ValueError, match=f"mismatch in {words}.*org/tiny-llama"):
        adapter.check_compatible(other)
    with pytest.raises(ValueError, match=f"mismatch in {words}"), adapter.attach(other):
        pass
    assert "generate" not in vars(other)


def test_same_shape_other_weights_is_compatible():
    ScorerAdapter.for_model(tiny_model("qwen3", seed=0)).check_compatible(
        tiny_model("qwen3", seed=1)
    )


def test_push_to_hub_uploads_the_adapter_folder(monkeypatch):
    import huggingface_hub

    calls = {}

    def create_repo(self, repo_id, **kwargs):
        calls["create"] = (repo_id, kwargs)
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        folder = Path(folder_path)
        calls["upload"] = {
            "repo_id": repo_id,
            "files": _files(folder),
            "config": json.loads((folder / "config.json").read_text()),
            "card": (folder / "README.md").read_text(),
            "weights": (folder / "model.safetensors").read_bytes(),
            "kwargs": kwargs,
        }
        return "commit-info"

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    adapter = _trained_like(
        ScorerAdapter.for_model(tiny_model("gemma3"), base_model_id="google/gemma-3-270m")
    )
    adapter.config.training_config = {"seed": 0}
    assert adapter.push_to_hub("user/tiny-sparsekv", private=True, token="hf_x") == "commit-info"

    repo_id, kw = calls["create"]
    assert repo_id == "user/tiny-sparsekv" and kw["exist_ok"] is True and kw["private"] is True
    up = calls["upload"]
    assert up["repo_id"] == "user/tiny-sparsekv" and up["files"] == set(ADAPTER_FILES)
    assert up["config"]["base_model_id"] == "google/gemma-3-270m" and up["config"]["layers"] == [3]
    assert "base_model: google/gemma-3-270m" in up["card"] and '"seed": 0' in up["card"]
    from safetensors.torch import load

    state = load(up["weights"])
    assert torch.equal(state["heads.3.1.weight"], adapter.head.heads["3"][1].weight)


def test_from_pretrained_uses_the_hub_for_repo_ids(monkeypatch, tmp_path):
    import huggingface_hub

    folder = _trained_like(ScorerAdapter.for_model(tiny_model("llama"))).save_pretrained(
        tmp_path / "snap"
    )
    seen = {}

    def fake_snapshot_download(repo_id, **kwargs):
        seen.update(repo_id=repo_id, **kwargs)
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.chdir(tmp_path)  # "user/repo" must not resolve to a local folder
    adapter = ScorerAdapter.from_pretrained("user/repo", revision="v1")
    assert seen["repo_id"] == "user/repo" and seen["revision"] == "v1"
    assert adapter.config.layers == [0, 1, 2, 3]


def test_missing_adapter_is_a_clear_error_offline(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OSError, match="not a local adapter folder.*HF_HUB_OFFLINE=1"):
        ScorerAdapter.from_pretrained("nobody/no-such-adapter")
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        FileNotFoundError, match="missing model.safetensors, config.json"
    ):
        ScorerAdapter.from_pretrained(tmp_path / "empty")


def test_config_validation():
    base = dict(
        model_type="llama", num_layers=4, num_kv_heads=2, head_dim=16, hidden_size=64, layers=[0]
    )
    assert AdapterConfig.from_dict(AdapterConfig(**base).to_dict()) == AdapterConfig(**base)
    for kwargs, words in (
        ({"layers": [4]}, "layers"),
        ({"layers": []}, "layers"),
        ({"kind": "rnn"}, "kind"),
        ({"num_kv_heads": 0}, "num_kv_heads"),
        ({"target": {"stat": "median"}}, "stat"),
    ):
        with pytest.raises(ValueError, match=words):
            AdapterConfig(**{**base, **kwargs})
    with pytest.raises(ValueError, match="unknown AdapterConfig"):
        AdapterConfig.from_dict({**base, "bogus": True})


def test_score_layer_has_no_gradient():
    adapter = ScorerAdapter.for_model(tiny_model("llama"))
    out = adapter.score_layer(2, torch.randn(1, 3, 64))
    assert out.shape == (1, 2, 3) and not out.requires_grad
    with pytest.raises(ValueError, match="no module for layer 7"):
        adapter.score_layer(7, torch.randn(1, 3, 64))


def test_policy_is_the_learned_policy():
    adapter = ScorerAdapter.for_model(tiny_model("llama"))
    p = adapter.policy(blend=0.25)
    assert p.name == "learned" and p.adapter is adapter and p.blend == 0.25


def test_attach_runs_generate_with_the_learned_cache():
    from sparsekv.cache import SparseKVCache

    model = tiny_model("gemma3")
    adapter = ScorerAdapter.for_model(model)
    calls = []
    real = adapter.score_layer

    def prefer_early(layer_idx, hidden_states):
        calls.append((layer_idx, tuple(hidden_states.shape)))
        real(layer_idx, hidden_states)
        n = hidden_states.shape[1]
        return -torch.arange(n, dtype=torch.float32).expand(
            hidden_states.shape[0], 2, n
        )  # earlier = better

    adapter.score_layer = prefer_early
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(0))
    full = model.generate(input_ids=ids, max_new_tokens=1, do_sample=False)
    with adapter.attach(
        model, budget=0.3, schedule="uniform", sink_tokens=2, recent_window=8
    ) as att:
        out = model.generate(input_ids=ids, max_new_tokens=1, do_sample=False)
        cache = att.last_cache
        assert isinstance(cache, SparseKVCache)
        kept = cache.layers[3].positions[0, 0].tolist()
        # the capacity (30% of 100) holds the recent window and then the earliest (best-scored)
        capacity = cache.budgets()[3]
        assert capacity == 30
        assert kept == list(range(capacity - 8)) + list(range(92, 100))
        assert calls[0] == (3, (1, 100, 64))
        # a caller's own cache is left alone
        own = SparseKVCache(model, att.config, "streaming")
        model.generate(input_ids=ids, max_new_tokens=1, do_sample=False, cache=own)
        assert att.last_cache is cache
        own.close()
    assert out.shape == full.shape
    assert "generate" not in vars(model) and model.config._attn_implementation == "sdpa"


def test_attach_passes_policy_settings_to_the_policy_and_the_rest_to_the_config():
    model = tiny_model("llama")
    adapter = ScorerAdapter.for_model(model)
    with adapter.attach(model, budget=0.5, blend=0.0, kernel_size=9, sink_tokens=2) as att:
        assert (att.policy.blend, att.policy.kernel_size) == (0.0, 9)
        assert att.policy.blend_mode == adapter.config.blend_mode  # unset: the recorded default
        assert att.config.sink_tokens == 2 and att.config.budget == 0.5
    with adapter.attach(model) as att:
        assert (att.policy.blend, att.policy.kernel_size) == (adapter.config.blend, adapter.config.kernel_size)
    with pytest.raises(ValueError, match="kernel_size"), adapter.attach(model, kernel_size=4):
        pass
    assert "generate" not in vars(model)


def test_attach_restores_generate_after_an_error():
    model = tiny_model("llama")
    adapter = ScorerAdapter.for_model(model)
    with pytest.raises(RuntimeError, match="inside"), adapter.attach(model, budget=0.5):
        assert "generate" in vars(model)
        raise RuntimeError("inside")
    assert "generate" not in vars(model)
    out = model.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)
    assert out.shape == (1, 5)


def test_no_pickle_anywhere(tmp_path):
    folder = ScorerAdapter.for_model(tiny_model("mistral")).save_pretrained(tmp_path / "m")
    for name in os.listdir(folder):
        data = (folder / name).read_bytes()
        assert not data.startswith(b"\x80") and b"PK\x03\x04" not in data[:4]  # pickle / torch zip


def test_recency_prior_is_read_from_the_adapter_and_ranks_by_importance_times_decay(tmp_path):
    from sparsekv.cache import SparseKVCache
    from sparsekv.config import EvictionConfig

    model = tiny_model("llama")
    adapter = ScorerAdapter.for_model(model)
    assert adapter.config.recency == 0.0 and adapter.policy().recency == 0.0
    adapter.config.recency = 2000.0  # 2 nats per position
    assert adapter.policy().recency == 2000.0 and adapter.policy(recency=0).recency == 0.0
    adapter.save_pretrained(tmp_path / "rec")
    assert ScorerAdapter.from_pretrained(tmp_path / "rec").config.recency == 2000.0
    needle = 10

    def flat_but_needle(layer_idx, hidden_states):
        b, n, _ = hidden_states.shape
        out = torch.zeros(b, 2, n)
        start = flat_but_needle.seen
        if start <= needle < start + n:
            out[..., needle - start] = 41.0  # worth 20.5 positions of age at 2 nats each
        flat_but_needle.seen += n
        return out

    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    kept = {}
    for rec in (0.0, 2000.0):
        flat_but_needle.seen = 0
        adapter.score_layer = flat_but_needle
        cache = SparseKVCache(model, EvictionConfig(budget=12, sink_tokens=0, recent_window=0,
                                                    rerank_every=0, evict_slack=0),
                              adapter.policy(recency=rec))
        with torch.no_grad():
            model(input_ids=ids, cache=cache)
        kept[rec] = sorted(cache.layers[0].positions[0, 0].tolist())
        cache.close()
    # without the prior: the needle plus ties; with it: the needle (41 > 2 * (39 - 10 - 11))
    # and the 11 most recent positions, the same set a ranking by logit + 2 * position gives
    assert needle in kept[0.0]
    assert kept[2000.0] == [needle, *range(29, 40)]
    with pytest.raises(ValueError, match="recency"):
        adapter.policy(recency=-1.0)
    with pytest.raises(ValueError, match="recency"):
        AdapterConfig(**{**adapter.config.__dict__, "recency": float("nan")})


def test_fingerprint_follows_weights_and_settings_not_files(tmp_path):
    adapter = _trained_like(ScorerAdapter.for_model(tiny_model("llama"), layers=[1, 3]))
    fp = adapter.fingerprint()
    assert len(fp) == 64 and int(fp, 16) >= 0
    adapter.config.eval_table = "| a | b |"  # metadata does not count
    adapter.config.training_config = {"lr": 1.0}
    assert adapter.fingerprint() == fp
    loaded = ScorerAdapter.from_pretrained(adapter.save_pretrained(tmp_path / "a"))
    assert loaded.fingerprint() == fp
    with torch.no_grad():
        next(loaded.head.parameters()).view(-1)[0] += 1e-6
    assert loaded.fingerprint() != fp
    other = ScorerAdapter.from_pretrained(tmp_path / "a")
    other.config.kernel_size = 9
    assert other.fingerprint() != fp
    other.config.kernel_size = 1
    other.config.span_fill = 16  # a later setting: it counts once it is set
    assert other.fingerprint() != fp
    other.config.span_fill = 0
    assert other.fingerprint() == fp
    other.config.span_words = 48
    assert other.fingerprint() != fp


@pytest.mark.parametrize(("name", "value", "bad"), [("span_fill", 24, -3), ("span_words", 48, 1.5)])
def test_later_settings_are_recorded_per_use_and_written_only_when_set(tmp_path, name, value, bad):
    adapter = _trained_like(ScorerAdapter.for_model(tiny_model("llama"), layers=[1, 3]))
    folder = adapter.save_pretrained(tmp_path / "plain")
    written = json.loads((folder / "config.json").read_text())["uses"]
    # off (0) it is not written, so sparsekv versions that predate it still read the folder
    assert all(name not in settings for settings in written.values())
    assert ScorerAdapter.from_pretrained(folder).settings("agnostic")[name] == 0
    adapter.config.uses["agnostic"] = {**adapter.config.uses["agnostic"], name: value}
    folder = adapter.save_pretrained(tmp_path / "set")
    written = json.loads((folder / "config.json").read_text())["uses"]
    assert written["agnostic"][name] == value and name not in written["aware"]
    loaded = ScorerAdapter.from_pretrained(folder)
    assert getattr(loaded.policy(use="agnostic"), name) == value
    assert getattr(loaded.policy(), name) == 0
    assert getattr(loaded.policy(use="agnostic", **{name: 0}), name) == 0  # an argument overrides
    adapter.config.uses["agnostic"][name] = bad
    with pytest.raises(ValueError, match=name):
        adapter.save_pretrained(tmp_path / "bad")
