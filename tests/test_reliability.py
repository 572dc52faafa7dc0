"""Reliability (issue 36): saving never loses data, a killed save leaves a loadable file, one
budget rule for the API and the CLI, integrity checks of saved contexts."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from sparsekv import EvictionConfig
from sparsekv.scoring.adapter import ADAPTER_FILES, ScorerAdapter
from sparsekv.serving import compressed
from sparsekv.serving.compressed import CompressedContext, compress

CFG = dict(budget=0.3, sink_tokens=2, recent_window=8, rerank_every=4, evict_slack=2)


def _trained_like(adapter: ScorerAdapter, seed: int = 0) -> ScorerAdapter:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.head.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return adapter


def _tree(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def _rewrite(path: Path, write) -> None:
    """Write a file anew (a new inode: tensors still mapped from the old one stay readable)."""
    tmp = path.with_name(path.name + ".new")
    write(tmp)
    os.replace(tmp, path)


# ---- 1. ScorerAdapter.save_pretrained never removes what it did not write ------------------------
def _run_folder(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "step-10").mkdir(parents=True)
    (run / "step-10" / "optimizer.safetensors").write_bytes(b"optimizer")
    (run / "metrics.jsonl").write_text('{"step": 10, "loss": 1.0}\n')
    (run / "config.yaml").write_text("lr: 0.001\n")
    return run


def test_save_into_a_training_run_folder_is_refused_and_removes_nothing(tmp_path):
    run = _run_folder(tmp_path)
    before = _tree(run)
    adapter = ScorerAdapter.for_model(tiny_model("llama"))
    with pytest.raises(ValueError) as e:
        adapter.save_pretrained(run)
    msg = str(e.value)
    assert str(run) in msg and "config.yaml" in msg and "metrics.jsonl" in msg and "step-10/" in msg
    assert "overwrite=True" in msg
    assert _tree(run) == before  # nothing written, nothing removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_overwrite_writes_the_adapter_beside_the_other_files(tmp_path):
    run = _run_folder(tmp_path)
    before = _tree(run)
    adapter = _trained_like(ScorerAdapter.for_model(tiny_model("llama")))
    folder = adapter.save_pretrained(run, overwrite=True)
    after = _tree(folder)
    assert {k: after[k] for k in before} == before  # the run's files are all there, unchanged
    assert set(after) - set(before) == set(ADAPTER_FILES)
    h = torch.randn(1, 4, 64)
    assert torch.equal(
        ScorerAdapter.from_pretrained(folder).score_layer(0, h), adapter.score_layer(0, h)
    )
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]  # no temporaries
    with pytest.raises(ValueError, match="overwrite='yes' must be True or False"):
        adapter.save_pretrained(run, overwrite="yes")


def test_saving_over_an_adapter_replaces_each_file_atomically(tmp_path, monkeypatch):
    first = _trained_like(ScorerAdapter.for_model(tiny_model("llama")), seed=1)
    second = _trained_like(ScorerAdapter.for_model(tiny_model("llama")), seed=2)
    folder = first.save_pretrained(tmp_path / "a")
    inode = folder.stat().st_ino
    before = _tree(folder)
    replaced, synced = [], []
    real_replace, real_fsync = os.replace, os.fsync

    def replace(src, dst):
        assert Path(src).parent == Path(dst).parent  # a temporary file in the same folder
        assert Path(src).name.startswith(f".{Path(dst).name}.tmp-")
        replaced.append(Path(dst).name)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    monkeypatch.setattr(os, "rename", lambda *a: pytest.fail("the folder is not renamed"))
    second.save_pretrained(folder)
    monkeypatch.undo()
    assert sorted(replaced) == sorted(ADAPTER_FILES) and replaced[-1] == "config.json"
    assert len(synced) >= len(ADAPTER_FILES)
    assert folder.stat().st_ino == inode  # written in place, not swapped
    assert set(_tree(folder)) == set(before)
    h = torch.randn(1, 4, 64)
    assert torch.equal(
        ScorerAdapter.from_pretrained(folder).score_layer(0, h), second.score_layer(0, h)
    )


def test_a_save_killed_between_files_leaves_loadable_files_and_is_cleaned(tmp_path, monkeypatch):
    first = _trained_like(ScorerAdapter.for_model(tiny_model("llama")), seed=1)
    folder = first.save_pretrained(tmp_path / "a")
    real_replace = os.replace
    calls = []

    def killed(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt  # a kill between two replaces
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        _trained_like(ScorerAdapter.for_model(tiny_model("llama")), seed=2).save_pretrained(folder)
    monkeypatch.undo()
    ScorerAdapter.from_pretrained(folder)  # every file is whole (the old or the new one)
    # what a SIGKILL would leave: a temporary file of a process that is gone
    (folder / ".model.safetensors.tmp-999999999-abc").write_bytes(b"half")
    third = _trained_like(ScorerAdapter.for_model(tiny_model("llama")), seed=3)
    third.save_pretrained(folder)  # a killed save's leftover is an adapter's, not foreign
    assert sorted(p.name for p in folder.iterdir()) == sorted(ADAPTER_FILES)


def test_a_first_save_killed_leaves_no_folder_and_its_temporary_is_cleaned(tmp_path, monkeypatch):
    adapter = ScorerAdapter.for_model(tiny_model("llama"))

    def killed(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "rename", killed)
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: None)  # a kill runs no clean-up
    with pytest.raises(KeyboardInterrupt):
        adapter.save_pretrained(tmp_path / "a")
    monkeypatch.undo()
    (left,) = [p for p in tmp_path.iterdir()]
    assert not (tmp_path / "a").exists() and left.name.startswith(f".a.tmp-{os.getpid()}-")
    os.rename(left, tmp_path / ".a.tmp-999999999-xyz")  # as a process that is gone left it
    adapter.save_pretrained(tmp_path / "a")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_a_foreign_file_inside_lora_is_refused(tmp_path):
    folder = ScorerAdapter.for_model(tiny_model("llama")).save_pretrained(tmp_path / "a")
    (folder / "lora").mkdir()
    (folder / "lora" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="lora/notes.txt"):
        ScorerAdapter.for_model(tiny_model("llama")).save_pretrained(folder)
    assert (folder / "lora" / "notes.txt").read_text() == "mine"


# ---- 2. CompressedContext.save is atomic at every point -----------------------------------------
def _ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (1, n), generator=g)


class Killed(BaseException):
    """A kill: raised at step k, and by every later file operation (no clean-up runs)."""


def _kill_at(monkeypatch, k: int, exchange: bool) -> list[str]:
    """Make the k-th file operation of a save (mkdir, safetensors write, fsync, rename,
    exchange, rmtree) and every one after it raise `Killed`; returns the log of steps."""
    import safetensors.torch

    log: list[str] = []

    def step(name, real):
        def run(*args, **kwargs):
            log.append(name)
            if len(log) >= k:
                raise Killed(f"killed at step {k} ({name})")
            return real(*args, **kwargs)

        return run

    real_exchange = compressed._exchange
    monkeypatch.setattr(os, "mkdir", step("mkdir", os.mkdir))
    monkeypatch.setattr(
        safetensors.torch, "save_file", step("save_file", safetensors.torch.save_file)
    )
    monkeypatch.setattr(os, "fsync", step("fsync", os.fsync))
    monkeypatch.setattr(os, "rename", step("rename", os.rename))
    monkeypatch.setattr(os, "replace", step("replace", os.replace))
    monkeypatch.setattr(shutil, "rmtree", step("rmtree", shutil.rmtree))
    monkeypatch.setattr(
        compressed, "_exchange", step("exchange", real_exchange if exchange else lambda a, b: False)
    )
    return log


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
@pytest.mark.parametrize("first", [False, True], ids=["over-old", "first-save"])
def test_a_save_killed_at_any_step_leaves_the_old_or_the_new_context(
    tmp_path, monkeypatch, exchange, first
):
    model = tiny_model("llama")
    old = compress(model, _ids(30, 1), EvictionConfig(**CFG), "snapkv")
    new = compress(model, _ids(40, 2), EvictionConfig(**CFG), "snapkv")
    if exchange and not compressed._exchange(tmp_path, tmp_path):  # swapping a folder with itself
        pytest.skip("no renameat2(RENAME_EXCHANGE) here")
    k, steps = 0, None
    while True:
        k += 1
        path = tmp_path / f"k{k}" / "c"
        path.parent.mkdir()
        if not first:
            old.save(path)
        log = _kill_at(monkeypatch, k, exchange)
        try:
            new.save(path)
            done = True
        except Killed:
            done = False
        monkeypatch.undo()
        compressed._IN_PROGRESS.clear()  # the killed process is gone
        steps = log
        try:
            loaded = CompressedContext.load(path, model)
        except FileNotFoundError:
            assert first and not done  # nothing was saved yet: no file, nothing lost
            loaded = None
        if loaded is not None:
            n = loaded.num_tokens
            assert n in ((40,) if first or done else (30, 40)), f"step {k}: {n} tokens"
            want = new if n == 40 else old
            assert torch.equal(loaded.context_ids, want.context_ids)
        # the load recovered and cleaned what the kill left
        assert sorted(p.name for p in path.parent.iterdir()) == (["c"] if loaded else []), k
        new.save(path)  # and the next save works
        assert sorted(p.name for p in path.parent.iterdir()) == ["c"]
        assert CompressedContext.load(path, model).num_tokens == 40
        if done:
            break
    assert k > 4 and steps.count("rename") == (1 if first else 0 if exchange else 2), steps


def test_the_next_save_moves_back_an_old_folder_a_kill_left_aside(tmp_path):
    """What the previous version left after a kill between its two renames: nothing at the
    path, the old context in `.c.old-PID`, a temporary folder `.c.tmp-PID`."""
    model = tiny_model("llama")
    old = compress(model, _ids(30, 1), EvictionConfig(**CFG), "snapkv")
    path = old.save(tmp_path / "c")
    os.rename(path, tmp_path / ".c.old-999999999")
    (tmp_path / ".c.tmp-999999999").mkdir()
    (tmp_path / ".c.tmp-999999999" / "context.json").write_text("{")
    assert CompressedContext.load(path, model).num_tokens == 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    os.rename(path, tmp_path / ".c.old-999999999")
    compress(model, _ids(40, 2), EvictionConfig(**CFG), "snapkv").save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    assert CompressedContext.load(path, model).num_tokens == 40


# ---- 5. budgets: one rule for the API and the CLI, no int/float trap ----------------------------
def test_int_1_is_refused_as_ambiguous_and_1tok_keeps_one_token(tmp_path):
    from sparsekv import SparseKVCache
    from sparsekv.config import Tokens

    with pytest.raises(ValueError) as e:
        EvictionConfig(budget=1)
    assert "ambiguous" in str(e.value) and "budget=1.0" in str(e.value) and '"1tok"' in str(e.value)
    for b in (True, False):
        with pytest.raises(ValueError, match="must be a float in"):
            EvictionConfig(budget=b)
    for b in ("0.3", "1", "tok", "0tok", "-2tok"):
        with pytest.raises(ValueError, match="budget="):
            EvictionConfig(budget=b)
    one = EvictionConfig(budget="1tok", sink_tokens=0, recent_window=0)
    assert one.budget == 1 and isinstance(one.budget, Tokens)
    assert EvictionConfig(budget=Tokens(1), sink_tokens=0, recent_window=0) == one
    assert EvictionConfig(budget="512 tokens").budget == 512
    assert EvictionConfig.from_dict(json.loads(json.dumps(one.to_dict()))) == one  # written as 1
    model = tiny_model("llama")
    ids = _ids(24, 3)
    for budget, kept in (("1tok", 1), (1.0, 24), (2, 2)):
        cfg = EvictionConfig(budget=budget, sink_tokens=0, recent_window=0)
        with SparseKVCache(model, cfg, "snapkv") as cache:
            model(input_ids=ids, cache=cache, use_cache=True)
            assert set(cache.layer_lengths()) == {kept}, budget
    ctx = compress(model, ids, EvictionConfig(budget="1tok", sink_tokens=0, recent_window=0))
    loaded = CompressedContext.load(ctx.save(tmp_path / "one"), model)  # context.json says 1
    assert loaded.kept() == [1] * 4 and loaded.config == ctx.config


def test_a_token_budget_below_sinks_and_window_warns():
    import warnings

    with pytest.warns(UserWarning, match=r"sink_tokens \+ recent_window = 4 \+ 64 = 68") as w:
        EvictionConfig(budget=16)
    assert "raised to 68" in str(w[0].message) and w[0].filename == __file__
    with pytest.warns(UserWarning, match="the pyramid's last layer 50 tokens"):
        EvictionConfig(budget=100, schedule="pyramid")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EvictionConfig(budget=100)
        EvictionConfig(budget=16, sink_tokens=4, recent_window=8)
        EvictionConfig(budget=0.01)  # a fraction: its token count depends on the context


@pytest.mark.parametrize(
    "text, want",
    [("0.3", 0.3), ("1.0", 1.0), ("512", 512), ("1tok", 1), ("64tok", 64)],
)
def test_cli_budgets_follow_the_api_rule(text, want):
    from sparsekv.config import Tokens
    from sparsekv.evaluation.config import EvalConfig, parse_budget

    got = parse_budget(text)
    assert got == want and type(got) is type(
        EvictionConfig(budget=got, sink_tokens=0, recent_window=0).budget
    )
    assert isinstance(got, Tokens) == text.endswith("tok")
    assert EvalConfig(budgets=text).budgets == [want]


@pytest.mark.parametrize(
    "text, api, message",
    [
        ("2.0", 2.0, "a float budget is a fraction in (0, 1]"),
        ("1", 1, "is ambiguous"),
        ("0", 0, "an int budget is a token count >= 1"),
    ],
)
def test_cli_refuses_what_the_api_refuses(text, api, message, tmp_path, capsys):
    from sparsekv.cli import main
    from sparsekv.evaluation.config import parse_budget

    with pytest.raises(ValueError, match=re.escape(message)):
        EvictionConfig(budget=api)
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_budget(text)
    assert (
        main(["eval", "--model", "tiny:llama", "--out", str(tmp_path / "x"), "--budget", text]) == 2
    )
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_an_explicit_token_budget_survives_config_yaml(tmp_path):
    import yaml

    from sparsekv.config import Tokens
    from sparsekv.evaluation.config import EvalConfig
    from sparsekv.evaluation.rows.folder import read_config, write_config

    cfg = EvalConfig(budgets="0.3,1tok,128", policies="snapkv@budgets=1tok+0.5", out=str(tmp_path))
    write_config(tmp_path, cfg)
    back = read_config(tmp_path)
    again = EvalConfig.from_dict({k: v for k, v in back.items() if k != "policy_specs"})
    assert again.budgets == [0.3, 1, 128] and isinstance(again.budgets[1], Tokens)
    assert again.policy_specs[0].budgets == (1, 0.5) and isinstance(
        again.policy_specs[0].budgets[0], Tokens
    )
    assert yaml.safe_load(yaml.safe_dump(cfg.to_dict()))["budgets"] == [0.3, "1tok", 128]


# ---- 3. integrity of saved contexts; adapter subfolders stay inside the root ---------------------
def _saved(tmp_path, name: str, seed: int, n: int = 30):
    model = tiny_model("llama")
    ctx = compress(model, _ids(n, seed), EvictionConfig(**CFG), "snapkv")
    return model, ctx, ctx.save(tmp_path / name)


def test_a_saved_context_records_the_digest_of_its_tensors(tmp_path):
    model, ctx, path = _saved(tmp_path, "c", 1)
    meta = json.loads((path / "context.json").read_text())
    assert len(meta["tensors_sha256"]) == 64
    loaded = CompressedContext.load(path, model)
    assert torch.equal(loaded.context_ids, ctx.context_ids)
    loaded.save(tmp_path / "again")  # a loaded context saves the same digest
    assert (
        json.loads((tmp_path / "again" / "context.json").read_text())["tensors_sha256"]
        == meta["tensors_sha256"]
    )


def test_flipped_bytes_in_a_saved_context_are_refused(tmp_path):
    model, _, path = _saved(tmp_path, "c", 1)
    f = path / "context.safetensors"
    raw = bytearray(f.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    start = json.loads(raw[8 : 8 + n])["layers.0.values"]["data_offsets"][0]
    raw[8 + n + start + 1] ^= 0x10  # one bit of one value
    f.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="tensors' digest differs from the tensors_sha256"):
        CompressedContext.load(path, model)


def test_another_contexts_tensors_beside_this_json_are_refused(tmp_path):
    model, _, path = _saved(tmp_path, "a", 1)
    _, _, other = _saved(tmp_path, "b", 2)  # the same shapes: only the digest tells them apart
    shutil.copy(other / "context.safetensors", path / "context.safetensors")
    with pytest.raises(ValueError, match="does not match .*context.json"):
        CompressedContext.load(path, model)


def test_nan_keys_are_refused_even_with_a_matching_digest(tmp_path):
    from safetensors.torch import load_file, save_file

    model, _, path = _saved(tmp_path, "c", 1)
    tensors = {k: v.clone() for k, v in load_file(str(path / "context.safetensors")).items()}
    tensors["layers.2.keys"][0, 0, 0, 0] = float("nan")
    _rewrite(path / "context.safetensors", lambda p: save_file(tensors, str(p)))
    meta = json.loads((path / "context.json").read_text())
    meta["tensors_sha256"] = compressed._digest(tensors)  # a forged digest
    (path / "context.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="layers.2.keys holds non-finite values"):
        CompressedContext.load(path, model)
    del meta["tensors_sha256"]  # a context written before the digest existed
    (path / "context.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="layers.2.keys holds non-finite values"):
        CompressedContext.load(path, model)


@pytest.mark.parametrize(
    "sub", ["x/../../other", "heads/../..", "..", "/etc", "x\\..\\..\\y", "C:\\other"]
)
def test_a_subfolder_that_leaves_the_adapter_root_is_refused(tmp_path, sub):
    root = tmp_path / "root"
    (root / "x").mkdir(parents=True)
    ScorerAdapter.for_model(tiny_model("llama")).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="must be a relative path inside the folder or repo"):
        ScorerAdapter.from_pretrained(root, subfolder=sub)


def test_a_subfolder_inside_the_root_still_loads(tmp_path):
    adapter = ScorerAdapter.for_model(tiny_model("llama"))
    adapter.save_pretrained(tmp_path / "root" / "heads" / "v2")
    loaded = ScorerAdapter.from_pretrained(tmp_path / "root", subfolder="heads/./v2")
    assert loaded.fingerprint() == adapter.fingerprint()


def _learned_context(tmp_path):
    model = tiny_model("llama")
    torch.manual_seed(0)
    folder = _trained_like(ScorerAdapter.for_model(model, hidden=8)).save_pretrained(
        tmp_path / "ad"
    )
    ctx = compress(model, _ids(30, 1), EvictionConfig(**CFG), f"learned:{folder}")
    return model, folder, ctx.save(tmp_path / "c")


def test_a_context_naming_its_adapter_is_checked_against_the_recorded_fingerprint(tmp_path):
    model, folder, path = _learned_context(tmp_path)
    assert CompressedContext.load(path, model).num_tokens == 30  # rebuilt from the record
    other = _trained_like(ScorerAdapter.for_model(model, hidden=8), seed=5).save_pretrained(
        tmp_path / "other"
    )
    meta = json.loads((path / "context.json").read_text())
    meta["policy"]["source"] = str(other)  # context.json pointed at another adapter
    (path / "context.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="compressed with an adapter of fingerprint"):
        CompressedContext.load(path, model)
    meta["policy"]["adapter_fingerprint"] = None  # and its fingerprint stripped
    (path / "context.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="records no adapter_fingerprint"):
        CompressedContext.load(path, model)
    # passing the adapter vouches for it
    assert (
        CompressedContext.load(path, model, policy=ScorerAdapter.from_pretrained(folder)).num_tokens
        == 30
    )


def test_an_adapter_whose_header_digest_is_stripped_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _trained_like(ScorerAdapter.for_model(tiny_model("llama"))).save_pretrained(
        tmp_path / "a"
    )
    state = {k: v.clone() for k, v in load_file(str(folder / "model.safetensors")).items()}
    name = min(state)
    state[name] = state[name] + 1.0  # edited weights
    _rewrite(
        folder / "model.safetensors", lambda p: save_file(state, str(p), metadata={"format": "pt"})
    )
    with pytest.raises(ValueError, match="has no sparsekv_tensors_sha256 in its header"):
        ScorerAdapter.from_pretrained(folder)


def _lora_adapter_folder(tmp_path) -> Path:
    from peft import LoraConfig, get_peft_model

    from sparsekv.scoring.lora import quiet_peft

    torch.manual_seed(0)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    with quiet_peft():
        peft_model = get_peft_model(tiny_model("llama"), config)
    return ScorerAdapter.for_model(tiny_model("llama")).save_pretrained(
        tmp_path / "a", lora=peft_model
    )


def test_a_lora_missing_factors_or_edited_is_refused(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from sparsekv.scoring.files import safetensors_bytes

    folder = _lora_adapter_folder(tmp_path)
    ScorerAdapter.from_pretrained(folder)  # as saved: loads
    f = folder / "lora" / "adapter_model.safetensors"
    original = f.read_bytes()
    state = {k: v.clone() for k, v in load_file(str(f)).items()}
    with safe_open(str(f), framework="pt") as st:
        meta = st.metadata()
    no_b = {k: v for k, v in state.items() if ".lora_B." not in k}
    # a consistent digest of the remaining tensors
    _rewrite(f, lambda p: p.write_bytes(safetensors_bytes(no_b)))
    with pytest.raises(ValueError, match=r"lora_A\.weight has no .*lora_B\.weight"):
        ScorerAdapter.from_pretrained(folder)
    edited = {k: v + 1.0 for k, v in state.items()}
    _rewrite(f, lambda p: save_file(edited, str(p), metadata=meta))  # the old header's digest
    with pytest.raises(ValueError, match="is damaged: its tensors do not match the digest"):
        ScorerAdapter.from_pretrained(folder)
    _rewrite(f, lambda p: save_file(edited, str(p), metadata={"format": "pt"}))  # no digest
    with pytest.raises(ValueError, match="has no sparsekv_tensors_sha256"):
        ScorerAdapter.from_pretrained(folder)
    _rewrite(f, lambda p: p.write_bytes(original))
    ScorerAdapter.from_pretrained(folder)
