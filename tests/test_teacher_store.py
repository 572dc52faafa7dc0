"""The teacher store (sparsekv.teacher.store) on tiny random models: built by its command line,
resumed after a kill, refused when damaged or built for another model or other settings, and a
head trained from it sees the same losses as a head trained from the model on the same sequences.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sparsekv.teacher import store as ts
from train.config import load_config

TINY = "configs/train/tiny-cpu.yaml"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from data.build import BuildConfig, build_file

    path = tmp_path_factory.mktemp("data") / "tiny-store.jsonl"
    return build_file(path, BuildConfig(max_prose_chars=5_000, synthetic=4, context_chars=300))


def n_blocks(corpus: Path, length: int = 128, packing: str = "pack") -> int:
    from train.data import load_texts, tokenize_blocks
    from train.models import ByteTokenizer

    ids, _ = tokenize_blocks(ByteTokenizer(256), load_texts(str(corpus)), length, packing)
    return ids.shape[0]


def same_shard(a: Path, b: Path) -> bool:
    """Equal tensors and metadata (safetensors writes its metadata keys in no fixed order)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(a), "pt") as fa, safe_open(str(b), "pt") as fb:
        if fa.metadata() != fb.metadata():
            return False
    ta, tb = load_file(str(a)), load_file(str(b))
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def build(out: Path, corpus: Path, sequences: int, *extra: str, overrides=()) -> int:
    threads = torch.get_num_threads()
    try:
        return ts.main([
            "build", "--config", TINY, "--out", str(out), "--sequences", str(sequences),
            "--length", "128", "--shard-size", "4", "--no-progress", *extra,
            f"dataset={corpus}", *overrides,
        ])
    finally:
        torch.set_num_threads(threads)


def train_losses(out: Path, dataset: str, *overrides: str) -> list[float]:
    from train.loop import main

    threads = torch.get_num_threads()
    try:
        main(["--config", TINY, f"output_dir={out}", f"dataset={dataset}", "max_steps=3",
              "progress_bar=false", "log_with=none", "save_every=0", *overrides])
    finally:
        torch.set_num_threads(threads)
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows]


@pytest.fixture(scope="module")
def built(tmp_path_factory, corpus) -> Path:
    out = tmp_path_factory.mktemp("stores") / "s"
    assert build(out, corpus, 10) == 0
    return out


def test_build_writes_shards_with_fingerprint_and_checksums(built, capsys):
    store = ts.TeacherStore(built)
    assert len(store) == 10 and store.complete == [0, 1, 2]  # 4 + 4 + 2 rows
    assert store.spec.model["base_id"] == "tiny:llama" and store.spec.layers == [0, 1, 2, 3]
    assert store.spec.target["signals"] == list(ts.SIGNALS)
    row = store.read_row(0, 1)
    assert row["hidden.0"].dtype == torch.bfloat16 and row["hidden.0"].shape == (128, 64)
    assert row["questions.3"].shape == (2, 128) and row["kvzip_plus.0"].shape == (2, 128)
    from safetensors import safe_open

    with safe_open(str(built / "shard-00000.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["fingerprint"] == store.fingerprint and len(json.loads(meta["rows_sha256"])) == 4
    assert ts.main(["verify", str(built)]) == 0
    assert "10 rows in 3 shards match" in capsys.readouterr().out


def test_a_store_folder_is_not_overwritten_without_resume(built, corpus, capsys):
    assert build(built, corpus, 10) == 2
    assert "already holds a teacher store; pass --resume" in capsys.readouterr().err


def test_a_killed_build_resumes_and_rebuilds_only_the_partial_shards(tmp_path, corpus, built):
    """A kill while shard 1 is computed leaves shard 0; a torn shard 2 and a leftover temporary
    (what a SIGKILL inside atomic_path leaves) are ignored; --resume computes exactly the missing
    rows and the result equals an uninterrupted build."""
    from sparsekv.models.loading import load_model

    cfg = load_config(TINY, [f"dataset={corpus}"])
    model = load_model("tiny:llama", seed=0).model
    from train.models import ByteTokenizer

    ids, mask, text = ts.text_blocks(cfg, ByteTokenizer(model.config.vocab_size), 128)
    spec = ts.TeacherStore(built).spec
    calls = []

    def dying(*args, **kwargs):
        if len(calls) == 5:  # the second row of shard 1
            raise KeyboardInterrupt
        calls.append(1)
        return ts.compute_row(*args, **kwargs)

    out = tmp_path / "s"
    with pytest.raises(KeyboardInterrupt):
        ts.build_store(out, model, spec, ids, mask, block_size=64, progress=False, compute=dying)
    assert sorted(p.name for p in out.glob("shard-*")) == ["shard-00000.safetensors"]
    (out / "shard-00002.safetensors").write_bytes((built / "shard-00002.safetensors").read_bytes()[:300])
    (out / ".shard-00001.safetensors.abc.tmp").write_bytes(b"partial")
    store = ts.TeacherStore(out, warn=lambda m: None)
    assert store.complete == [0]  # the torn shard is skipped
    counted = []

    def counting(*args, **kwargs):
        counted.append(1)
        return ts.compute_row(*args, **kwargs)

    summary = ts.build_store(out, model, spec, ids, mask, block_size=64, resume=True,
                             progress=False, compute=counting)
    assert len(counted) == summary["new"] == 6  # shards 1 and 2, not shard 0
    assert not list(out.glob(".shard-*.tmp"))
    for s in range(3):  # identical to the uninterrupted build
        assert same_shard(out / ts.shard_name(s), built / ts.shard_name(s))


def test_a_store_grows_with_resume(tmp_path, corpus, built):
    out = tmp_path / "g"
    assert build(out, corpus, 6) == 0
    assert build(out, corpus, 10, "--resume") == 0
    store = ts.TeacherStore(out)
    assert len(store) == 10
    for s in range(3):
        assert same_shard(out / ts.shard_name(s), built / ts.shard_name(s))


def test_two_workers_build_the_store_one_process_builds(tmp_path, corpus, built, capsys):
    """--worker 0/2 and 1/2 split the shards (0, 2 and 1); together they equal a one-process
    build; a worker leaves the other's temporary file alone; a bad --worker is refused."""
    out = tmp_path / "w"
    assert build(out, corpus, 10, "--resume", "--worker", "1/2") == 0
    assert sorted(p.name for p in out.glob("shard-*")) == ["shard-00001.safetensors"]
    other = out / ".shard-00001.safetensors.x.tmp"
    other.write_bytes(b"being written by worker 1")
    assert build(out, corpus, 10, "--resume", "--worker", "0/2") == 0
    assert other.exists()  # shard 1 is worker 1's: not removed by worker 0
    assert len(ts.TeacherStore(out)) == 10
    for s in range(3):
        assert same_shard(out / ts.shard_name(s), built / ts.shard_name(s))
    for bad in ("2/2", "1", "a/b", "0/0"):
        with pytest.raises(SystemExit):
            build(tmp_path / "bad", corpus, 10, "--worker", bad)
        assert "--worker" in capsys.readouterr().err


def test_resume_with_other_settings_is_refused_by_name(built, corpus, capsys):
    assert build(built, corpus, 10, "--resume", overrides=["target.stat=max"]) == 2
    err = capsys.readouterr().err
    assert "differs in target.stat: the store has 'mass', this build 'max'" in err
    assert build(built, corpus, 10, "--resume", "--hidden", "int8") == 2
    assert "hidden: the store has 'bfloat16', this build 'int8'" in capsys.readouterr().err


def test_a_damaged_row_is_refused(tmp_path, built, corpus):
    out = tmp_path / "bad"
    out.mkdir()
    for p in built.iterdir():
        (out / p.name).write_bytes(p.read_bytes())
    shard = out / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # a byte of the last tensor's data
    shard.write_bytes(bytes(data))
    store = ts.TeacherStore(out)
    store.read_row(0, 0)  # other shards still read
    with pytest.raises(ts.StoreError, match=r"shard-00001.safetensors: row 3 does not match its checksum"):
        store.read_row(1, 3)
    with pytest.raises(ts.StoreError, match="does not match its checksum"):
        ts.TeacherStore(out).verify()


def test_training_from_a_store_of_another_model_is_refused_by_name(tmp_path, built, capsys):
    # seed=1 builds a tiny:llama of the same shape with other weights
    with pytest.raises(SystemExit) as e:
        train_losses(tmp_path / "r", f"store:{built}", "seq_len=128", "seed=1")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "model.fingerprint: the store has" in err and "this run (model='tiny:llama')" in err
    with pytest.raises(SystemExit):
        train_losses(tmp_path / "r2", f"store:{built}", "seq_len=128", "target.normalize=none")
    assert "differs in target.normalize: the store has 'length'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_losses(tmp_path / "r3", f"store:{built}", "seq_len=256")
    assert "holds sequences of 128 tokens but seq_len=256" in capsys.readouterr().err


def test_check_names_missing_layers_and_signals(built):
    store = ts.TeacherStore(built)
    with pytest.raises(ts.StoreError, match=r"layers: needs \[7\]"):
        store.check({"layers": [0, 7]})
    with pytest.raises(ts.StoreError, match=r"target.kvzip_plus_layers: needs \[5\]"):
        store.check({"target": {"kvzip_plus_layers": [5]}})


@pytest.mark.parametrize(
    "target, packing",
    [
        ([], "pack"),  # signal=questions, the tiny config's defaults
        (["target.signal=both", "target.stat=max", "target.source_layers=all_budgeted"], "pad"),
        (["target.signal=reconstruction", "target.kind=kvzip_plus"], "pack"),
        (["target.signal=reconstruction"], "pad"),  # mass, length-normalized
    ],
)
def test_training_from_the_store_gives_the_losses_of_training_from_the_model(
    tmp_path, corpus, target, packing
):
    n = n_blocks(corpus, 128, packing)
    out = tmp_path / "store"
    assert build(out, corpus, n, "--hidden", "model", overrides=[*target, f"packing={packing}"]) == 0
    common = [*target, f"packing={packing}", "seq_len=128"]
    from_model = train_losses(tmp_path / "m", str(corpus), *common)
    from_store = train_losses(tmp_path / "s", f"store:{out}", *common)
    assert len(from_model) == 3
    assert from_store == pytest.approx(from_model, rel=1e-4, abs=1e-5)


def test_bf16_and_int8_hidden_states_train_close_to_the_model(tmp_path, corpus):
    n = n_blocks(corpus)
    from_model = train_losses(tmp_path / "m", str(corpus))
    for kind in ("bfloat16", "int8"):
        out = tmp_path / kind
        assert build(out, corpus, n, "--hidden", kind) == 0
        got = train_losses(tmp_path / f"s-{kind}", f"store:{out}")
        assert got == pytest.approx(from_model, rel=2e-2), kind
        assert got != from_model  # the stored hidden states really are rounded


def test_int8_encoding_round_trips_within_a_step():
    h = torch.randn(3, 5, 16) * 4
    enc = ts.encode_hidden("hidden.2", h, "int8")
    assert enc["hidden.2"].dtype == torch.int8 and enc["hidden_scale.2"].shape == (3, 5)
    back = ts.decode_hidden(enc, 2)
    step = h.abs().amax(-1, keepdim=True) / 127
    assert ((back - h).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("stat", ["mass", "max"])
@pytest.mark.parametrize("normalize", ["none", "length", "uniform"])
def test_the_shared_softmax_equals_the_two_statistics(stat, normalize):
    from sparsekv.teacher.reconstruction import kvzip_plus_received
    from sparsekv.teacher.statistics import attention_received

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 8, generator=g) for h, n in ((4, 5), (2, 13), (2, 13)))
    hidden, o = torch.randn(1, 5, 16, generator=g), torch.randn(16, 32, generator=g)
    common = {"scaling": 0.35, "softcap": 20.0, "num_kv_groups": 2, "block_size": 2}
    r, z = ts.repeat_received(q, k, v, hidden, o, stat=stat, normalize=normalize, **common)
    want_r = attention_received(q, k, stat=stat, normalize=normalize, exclude_self=False, **common)
    want_z = kvzip_plus_received(q, k, v, hidden, o, **common)
    torch.testing.assert_close(r, want_r)
    torch.testing.assert_close(z, want_z)
    assert ts.repeat_received(q, k, None, None, None, kvzip_plus=False, **common)[1] is None
