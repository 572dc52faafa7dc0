"""Reliability (issue 36): saving never loses data, a killed save leaves a loadable file, one
budget rule for the API and the CLI, integrity checks of saved contexts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from sparsekv.scoring.adapter import ADAPTER_FILES, ScorerAdapter


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
    assert torch.equal(ScorerAdapter.from_pretrained(folder).score_layer(0, h), adapter.score_layer(0, h))
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
    assert torch.equal(ScorerAdapter.from_pretrained(folder).score_layer(0, h), second.score_layer(0, h))


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


def test_a_foreign_file_inside_lora_is_refused(tmp_path):
    folder = ScorerAdapter.for_model(tiny_model("llama")).save_pretrained(tmp_path / "a")
    (folder / "lora").mkdir()
    (folder / "lora" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="lora/notes.txt"):
        ScorerAdapter.for_model(tiny_model("llama")).save_pretrained(folder)
    assert (folder / "lora" / "notes.txt").read_text() == "mine"
