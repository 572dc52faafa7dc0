"""Adapter format 2: files, versions, uses, Hub arguments, the card, damaged files, the shipped
checkpoints, and the checks where a cache is built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from sparsekv.scoring.adapter import ScorerAdapter
from sparsekv.scoring.adapter_config import AdapterConfig

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = {  # fingerprints taken from the format-1 folders before the conversion
    # the head shipped before the tuning seed chose target.signal=both (renamed, same weights)
    "gemma3-270m-sparsekv-questions": (
        "e419b6e0b0c572000c9862ea44afd8b475760fe5cd48b3b2de89cc0fa5ba2c92"
    ),
    # the head shipped from then until issue 34 (configs/train/gemma3-270m-cpu.yaml, the quick
    # recipe; renamed, same weights): the seed-7 report grid's head
    "gemma3-270m-sparsekv-quick": (
        "56f3fce47a9170259422c1ac7fe77188530e98419ca34798833d355faab5addd"
    ),
    # the shipped head since issue 34: the store recipe over 2,500 store rows, head seed 2
    # (configs/train/gemma3-270m-store.yaml; the same weights as gemma3-270m-sparsekv-store2500-s2)
    "gemma3-270m-sparsekv": "e18027c3c6907a159ce340781c16d97b99bf8d3a171338cb85d8e80de1f58168",
    "gemma3-270m-sparsekv-perlayer": (
        "7de70436b1de53a47c5cadf0aa420caec9b835d52ebfafa2a8793de4f930d5d8"
    ),
    # the decode-time head (issue 18.4), trained in format 2: its own fingerprint at commit
    "gemma3-270m-sparsekv-decode": (
        "d02fba3037a4c1caa767ad0d4797e2edb705f5de1aa8d1632735bd0bfeca1064"
    ),
}


def _adapter(seed: int = 0, **kwargs) -> ScorerAdapter:
    adapter = ScorerAdapter.for_model(tiny_model("llama"), layers=[1, 3], **kwargs)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.head.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return adapter


def _v1_folder(adapter: ScorerAdapter, folder: Path) -> Path:
    """The same adapter written as format 1 (the layout before this version)."""
    from safetensors.torch import save_file

    folder.mkdir()
    d = adapter.config.to_dict()
    d.pop("sparsekv_type"), d.pop("uses"), d.pop("lora"), d.pop("eval_results")
    d.update(adapter.settings("aware"), format_version=1)
    (folder / "adapter_config.json").write_text(json.dumps(d))
    save_file(dict(adapter.head.state_dict()), str(folder / "adapter_model.safetensors"))
    return folder


def test_v2_files_and_config(tmp_path):
    adapter = _adapter(kernel_size=5, blend=0.5)
    folder = adapter.save_pretrained(tmp_path / "a")
    assert sorted(p.name for p in folder.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
    ]
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["sparsekv_type"] == "scorer_adapter" and cfg["format_version"] == 2
    assert cfg["uses"]["aware"] == {
        "blend": 0.5,
        "blend_mode": "mix",
        "recency": 0.0,
        "kernel_size": 5,
        "head_layer": "own",
    }
    assert cfg["uses"]["agnostic"]["blend"] == 0.0 and cfg["uses"]["agnostic"]["kernel_size"] == 9
    assert "blend" not in cfg and cfg["target"]["stat"] == "mass" and cfg["lora"] is None
    loaded = ScorerAdapter.from_pretrained(folder)
    assert loaded.config == adapter.config and loaded.fingerprint() == adapter.fingerprint()


def test_format_1_still_loads_with_the_same_scores(tmp_path):
    adapter = _adapter(kernel_size=3)
    old = ScorerAdapter.from_pretrained(_v1_folder(adapter, tmp_path / "v1"))
    h = torch.randn(1, 5, 64)
    assert torch.equal(old.score_layer(3, h), adapter.score_layer(3, h))
    assert old.fingerprint() == adapter.fingerprint()
    assert old.settings("agnostic")["kernel_size"] == 9  # the default agnostic use
    upgraded = ScorerAdapter.from_pretrained(old.save_pretrained(tmp_path / "v2"))
    assert upgraded.fingerprint() == adapter.fingerprint()


def test_newer_or_foreign_format_is_refused(tmp_path):
    folder = _adapter().save_pretrained(tmp_path / "a")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "format_version": 3}))
    with pytest.raises(ValueError, match=r"config.json.*reads adapter formats 1, 2"):
        ScorerAdapter.from_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "sparsekv_type": "other"}))
    with pytest.raises(ValueError, match="sparsekv_type='other'"):
        ScorerAdapter.from_pretrained(folder)


def test_target_fields_unknown_to_this_version_are_kept(tmp_path):
    folder = _adapter().save_pretrained(tmp_path / "a")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["target"]["future_field"] = "x"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match="future_field"):
        loaded = ScorerAdapter.from_pretrained(folder)
    assert (
        loaded.config.target["future_field"] == "x" and loaded.config.target_config.stat == "mass"
    )


def test_two_saves_write_identical_bytes(tmp_path):
    from safetensors.torch import load_file

    adapter = _adapter()
    blobs = {
        adapter.save_pretrained(tmp_path / f"s{i}").joinpath("model.safetensors").read_bytes()
        for i in range(6)
    }
    assert len(blobs) == 1
    data = blobs.pop()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    assert list(header) == sorted(header) and list(header["__metadata__"]) == sorted(
        header["__metadata__"]
    )
    loaded = load_file(str(tmp_path / "s0" / "model.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in adapter.head.state_dict().items())


def test_uses_apply_the_recorded_settings_and_a_bad_use_names_the_allowed():
    from sparsekv import policies

    model = tiny_model("llama")
    adapter = _adapter(kernel_size=5, blend=0.5)
    with adapter.attach(model, use="agnostic", budget=0.5) as att:
        assert (att.policy.blend, att.policy.kernel_size) == (0.0, 9)
    with adapter.attach(model, budget=0.5) as att:  # default: aware
        assert (att.policy.blend, att.policy.kernel_size) == (0.5, 5)
    with adapter.attach(model, use="agnostic", kernel_size=3) as att:  # an override wins
        assert (att.policy.blend, att.policy.kernel_size) == (0.0, 3)
    assert adapter.policy(use="agnostic").kernel_size == 9
    with pytest.raises(ValueError, match="use='decode'.*allowed values: aware, agnostic"):
        adapter.policy(use="decode")
    with pytest.raises(ValueError, match="use='agnostc'"), adapter.attach(model, use="agnostc"):
        pass
    assert "generate" not in vars(model)
    with pytest.raises(ValueError, match="unknown use 'sideways'"):
        AdapterConfig(**{**vars(adapter.config), "uses": {"sideways": {}}})
    assert policies.get("learned", adapter=adapter, use="agnostic").blend == 0.0
    decoding = ScorerAdapter.for_model(
        model, uses={"agnostic": {"blend": 0.0}, "decode": {"recency": 1.0}}
    )
    assert (
        decoding.settings("decode")["recency"] == 1.0
        and decoding.settings("agnostic")["kernel_size"] == 1
    )
    assert decoding.policy(use="decode").recency == 1.0
    # a use holds the keys it sets; the others follow "aware", also when aware changes later
    decoding.config.head_layer = "first"
    assert decoding.settings("agnostic")["head_layer"] == "first"
    decoding.config.uses["agnostic"] = {"blend": 2.0}  # edited in place: checked when used
    with pytest.raises(ValueError, match=r"uses\['agnostic'\]: blend=2.0"):
        decoding.policy(use="agnostic")


def test_hub_arguments_reach_snapshot_download(monkeypatch, tmp_path):
    import huggingface_hub

    snap = tmp_path / "snap"
    snap.mkdir()
    adapter = _adapter()
    adapter.save_pretrained(snap / "heads" / "v2")
    seen = {}

    def fake_snapshot_download(repo_id, **kwargs):
        seen.update(repo_id=repo_id, **kwargs)
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.chdir(tmp_path)
    loaded = ScorerAdapter.from_pretrained(
        "user/repo",
        revision="v1",
        cache_dir=tmp_path / "hub",
        local_files_only=True,
        subfolder="heads/v2",
        token="hf_x",
        force_download=True,
    )
    assert loaded.fingerprint() == adapter.fingerprint()
    assert seen["repo_id"] == "user/repo" and seen["revision"] == "v1" and seen["token"] == "hf_x"
    assert seen["local_files_only"] is True and seen["force_download"] is True
    assert seen["cache_dir"] == tmp_path / "hub"
    assert (
        "heads/v2/config.json" in seen["allow_patterns"]
        and "heads/v2/lora/*" in seen["allow_patterns"]
    )
    local = ScorerAdapter.from_pretrained(snap, subfolder="heads/v2")  # a local folder too
    assert local.fingerprint() == adapter.fingerprint()


def test_model_card_metadata():
    from huggingface_hub import ModelCard

    adapter = ScorerAdapter.for_model(tiny_model("gemma3"), base_model_id="google/gemma-3-270m")
    adapter.config.eval_results = [
        {
            "task_type": "text-generation",
            "dataset_type": "sparsekv/x",
            "dataset_name": "x",
            "metric_type": "retrieval_share",
            "metric_value": 1.07,
            "metric_config": "agnostic, budget 0.3",
        }
    ]
    card = ModelCard(adapter.model_card())
    d = card.data.to_dict()
    assert d["license"] == "gemma" and d["base_model"] == "google/gemma-3-270m"
    assert d["base_model_relation"] == "adapter" and d["library_name"] == "sparsekv"
    assert "kv-cache" in d["tags"]
    assert card.data.eval_results[0].metric_value == 1.07
    assert "Q4_K_M GGUF" in card.text and "dequantized" in card.text
    other = ModelCard(
        ScorerAdapter.for_model(tiny_model("llama"), base_model_id="/local/llama").model_card()
    )
    assert other.data.to_dict().get("license") is None and "base_model" not in other.data.to_dict()
    with pytest.raises(ValueError, match="eval_results entry"):
        AdapterConfig(**{**vars(adapter.config), "eval_results": [{"metric_value": 1}]})


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_checkpoints_are_format_2_with_unchanged_fingerprints(name):
    folder = ROOT / "checkpoints" / name
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["format_version"] == 2 and not (folder / "adapter_config.json").exists()
    adapter = ScorerAdapter.from_pretrained(folder)
    assert adapter.fingerprint() == SHIPPED[name]
    assert adapter.settings("agnostic") == {
        **adapter.settings("aware"),
        "blend": 0.0,
        "kernel_size": 9,
    }
    assert (
        adapter.settings("aware")["kernel_size"] == 5 and adapter.settings("aware")["blend"] == 0.5
    )


# ---- damaged files -------------------------------------------------------------------------------
def test_truncated_weights_name_the_file(tmp_path):
    folder = _adapter().save_pretrained(tmp_path / "a")
    w = folder / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file"):
        ScorerAdapter.from_pretrained(folder)
    w.write_bytes(b"\x00" * 5)
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file"):
        ScorerAdapter.from_pretrained(folder)


def test_garbled_weights_name_the_file(tmp_path):
    folder = _adapter().save_pretrained(tmp_path / "a")
    w = folder / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-40:-20] = bytes(20)  # inside the tensors: the header still parses
    w.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model.safetensors is damaged"):
        ScorerAdapter.from_pretrained(folder)
    data[8:30] = b"#" * 22  # inside the header
    w.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable"):
        ScorerAdapter.from_pretrained(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json is not readable JSON"):
        ScorerAdapter.from_pretrained(folder)


def test_non_finite_weights_are_rejected_naming_the_tensor(tmp_path):
    for bad in (float("nan"), float("inf")):
        adapter = _adapter()
        with torch.no_grad():
            adapter.head.heads["3"][1].weight[0, 5] = bad
        folder = adapter.save_pretrained(tmp_path / f"a{bad}")
        with pytest.raises(
            ValueError, match=r"model.safetensors: tensor heads.3.1.weight holds non-finite"
        ):
            ScorerAdapter.from_pretrained(folder)


def test_huge_config_is_checked_against_the_header_before_allocating(tmp_path, monkeypatch):
    import sparsekv.scoring.scorer as adapter_module

    folder = _adapter().save_pretrained(tmp_path / "a")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "hidden_size": 2**20, "hidden": 2**16}))
    built = []
    real = adapter_module.head_for  # where from_pretrained allocates the head
    monkeypatch.setattr(
        adapter_module, "head_for", lambda *a, **k: built.append(a) or real(*a, **k)
    )
    with pytest.raises(
        ValueError,
        match=r"model.safetensors does not match its config.*heads.1.1.weight is \[64, 64\]",
    ):
        ScorerAdapter.from_pretrained(folder)
    assert built == []  # no head was allocated
    (folder / "config.json").write_text(json.dumps({**cfg, "hidden_size": 2**62, "hidden": 2**62}))
    with pytest.raises(
        ValueError, match=r"model.safetensors: the config's dimensions are too large"
    ):
        ScorerAdapter.from_pretrained(folder)


# ---- checks where the cache is built ----------------------------------------------------------
def test_a_head_for_another_shape_fails_where_the_cache_is_built(tmp_path):
    from sparsekv import policies
    from sparsekv.cache import SparseKVCache
    from sparsekv.config import EvictionConfig

    adapter = ScorerAdapter.for_model(tiny_model("llama"), base_model_id="org/tiny-llama")
    folder = adapter.save_pretrained(tmp_path / "a")
    other = tiny_model("llama", hidden_size=32)
    cfg = EvictionConfig(budget=0.5)
    with pytest.raises(ValueError, match="mismatch in hidden size.*org/tiny-llama"):
        SparseKVCache(other, cfg, adapter.policy())
    with pytest.raises(ValueError, match="mismatch in hidden size"):
        SparseKVCache(other, cfg, policies.get(f"learned:{folder}"))
    with pytest.raises(ValueError, match="mismatch in model type"):
        SparseKVCache(tiny_model("gemma3"), cfg, f"learned:{folder}")
    SparseKVCache(tiny_model("llama", seed=3), cfg, adapter.policy()).close()  # same shape: fine


def _statements(tree, anywhere: bool):
    """Top-level statements, or every node, skipping `if TYPE_CHECKING:` blocks."""
    import ast

    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        yield node
        if anywhere:
            todo.extend(ast.iter_child_nodes(node))


@pytest.mark.parametrize("anywhere", [False, True], ids=["module-level", "function-level-too"])
def test_module_graph_has_no_import_cycle(anywhere):
    """The import statements of the adapter / cache / policies modules form no cycle: neither
    at module level nor counting the imports inside functions (the learned policy loads
    "learned:DIR" as a `sparsekv.scoring.scorer.TrainedScorer`, which imports neither the cache
    nor the policies; tests/test_layout.py checks the whole project)."""
    import ast

    pkg = ROOT / "sparsekv"
    graph: dict[str, set[str]] = {}
    for path in pkg.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        deps = set()
        tree = ast.parse(path.read_text())
        for node in _statements(tree, anywhere):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("sparsekv")
            ):
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("sparsekv"))
        graph[name] = deps
    graph = {k: {d for d in v if d in graph and d != k} for k, v in graph.items()}
    mine = {
        "sparsekv.scoring.adapter",
        "sparsekv.scoring.scorer",
        "sparsekv.scoring.files",
        "sparsekv.scoring.adapter_config",
        "sparsekv.scoring.lora",
        "sparsekv.scoring.card",
        "sparsekv.cache",
        "sparsekv.policies",
        "sparsekv.policies.learned",
        "sparsekv.policies.base",
    }

    def cycle_from(start):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for d in graph.get(node, ()):
                if d == start:
                    return path + [d]
                if d not in seen:
                    seen.add(d)
                    stack.append((d, path + [d]))
        return None

    cycles = {m: c for m in mine if m in graph and (c := cycle_from(m))}
    assert not cycles, cycles


def test_eval_cli_refuses_a_head_for_another_model(tmp_path, capsys):
    from sparsekv.cli import main

    folder = ScorerAdapter.for_model(tiny_model("gemma3"), hidden=8).save_pretrained(tmp_path / "a")
    argv = [
        "eval",
        "--model",
        "tiny:llama",
        "--policy",
        f"learned:{folder}",
        "--budget",
        "0.3",
        "--tasks",
        "passkey",
        "--lengths",
        "128",
        "--samples",
        "1",
        "--protocol",
        "agnostic",
        "--threads",
        "1",
        "--no-progress",
        "--out",
        str(tmp_path / "out"),
    ]
    code = main(argv)
    err = capsys.readouterr().err
    rows = tmp_path / "out" / "results.jsonl"
    text = rows.read_text() if rows.exists() else ""
    assert code != 0 or "mismatch in model type" in text, (code, err, text)
    assert "mismatch in model type" in err + text


def test_decode_checkpoint_records_its_target_and_decode_use():
    """The decode-time head (configs/train/gemma3-270m-decode.yaml): trained on the attention
    tokens receive from queries 64+ positions later, with its decode use chosen on seed 1."""
    folder = ROOT / "checkpoints" / "gemma3-270m-sparsekv-decode"
    adapter = ScorerAdapter.from_pretrained(folder)
    target = adapter.config.target
    assert (target["min_distance"], target["stat"], target["normalize"]) == (64, "mass", "length")
    aware = adapter.settings("aware")
    assert adapter.settings("decode") == {**aware, "blend": 0.5, "blend_mode": "mix"}
    assert "use `decode`" in (folder / "README.md").read_text()
