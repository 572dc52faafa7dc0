"""Training: the real entry point end to end on a tiny model, exact resume, gradients only in the
head, a 2-process CPU run, clear config errors, the Hub export, and the pieces (data order,
data builder, tensors-only checkpoint files)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import math  # noqa: E402

from train import checkpoint as ckpt  # noqa: E402
from train.config import load_config  # noqa: E402
from train.data import BlockDataset, load_texts, tokenize_blocks  # noqa: E402
from train.models import ByteTokenizer, load_model  # noqa: E402

TINY = "configs/train/tiny-cpu.yaml"
# tiny:llama: 4 full-attention layers, hidden 64, 2 KV heads; MLP head of width 16 per layer:
# 64*16 + 16 + 16*2 + 2 = 1074 parameters per layer.
TINY_HEAD_PARAMETERS = 4 * 1074
STEP_FILES = {
    "adapter",
    "optimizer.safetensors",
    "scheduler.json",
    "rng_state_0.safetensors",
    "trainer_state.json",
}
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONPATH": str(ROOT),
    "CUDA_VISIBLE_DEVICES": "",
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small built corpus shared by the runs (the builder itself is tested below)."""
    from data.build import BuildConfig, build_file

    path = tmp_path_factory.mktemp("data") / "tiny.jsonl"
    return build_file(path, BuildConfig(max_prose_chars=60_000, synthetic=16, context_chars=400))


def common(out: Path, corpus: Path) -> list[str]:
    # schedule_steps fixes the LR schedule so a 4-step run is the prefix of a 6-step run.
    return [
        f"output_dir={out}",
        f"dataset={corpus}",
        "progress_bar=false",
        "log_with=none",
        "schedule_steps=6",
        "save_every=2",
    ]


def run_cli(args: list[str], timeout: float = 240, launcher: list[str] | None = None):
    cmd = (launcher or [sys.executable]) + ["train.py", "--config", TINY, *args]
    return subprocess.run(
        cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout, check=False
    )


def run_inprocess(args: list[str]) -> dict:
    from train.loop import main

    threads = torch.get_num_threads()
    try:
        return main(["--config", TINY, *args])
    finally:
        torch.set_num_threads(threads)


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def adapter_files() -> set[str]:
    from sparsekv.scoring.adapter import ADAPTER_FILES

    return set(ADAPTER_FILES)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, corpus):
    """`python train.py --config tiny-cpu.yaml max_steps=4 save_every=2 ...` (the real entry point)."""
    out = tmp_path_factory.mktemp("runs") / "smoke"
    proc = run_cli(["max_steps=4", *common(out, corpus)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, corpus) -> Path:
    """The uninterrupted 6-step reference run (in-process)."""
    out = tmp_path_factory.mktemp("runs") / "full"
    run_inprocess(["max_steps=6", *common(out, corpus)])
    return out


# ---------------------------------------------------------------------- end to end


def test_smoke_run_writes_the_exact_checkpoints(smoke_run):
    out, proc = smoke_run
    assert sorted(p.name for p in out.iterdir()) == [
        "config.yaml",
        "final",
        "metrics.jsonl",
        "step-0002",
        "step-0004",
    ]
    for step in (2, 4):
        d = out / f"step-{step:04d}"
        assert {p.name for p in d.iterdir()} == STEP_FILES
        assert {p.name for p in (d / "adapter").iterdir()} == adapter_files()
        state = json.loads((d / "trainer_state.json").read_text())
        assert (state["step"], state["samples_seen"], state["world_size"]) == (step, 2 * step, 1)
        assert state["tokens_seen"] == 2 * step * 128
        assert state["trainable_parameters"] == TINY_HEAD_PARAMETERS
    assert {p.name for p in (out / "final").iterdir()} == adapter_files()
    assert sorted(losses(out)) == [1, 2, 3, 4]
    assert f"done: 4 steps; trainable parameters {TINY_HEAD_PARAMETERS} " in proc.stdout
    m = re.search(r"wall time [\d.]+ min \(([\d.]+) s, model loading included\), peak memory \(RSS\) ([\d.]+) GiB", proc.stdout)
    assert m and 0 < float(m.group(1)) < 1800 and 0.05 < float(m.group(2)) < 24, proc.stdout[-500:]


def test_smoke_run_saves_the_resolved_config_and_a_loadable_adapter(smoke_run):
    from sparsekv.scoring.adapter import ScorerAdapter

    out, _ = smoke_run
    saved = load_config(out / "config.yaml")
    assert (saved.max_steps, saved.output_dir, saved.model, saved.seq_len) == (
        4,
        str(out),
        "tiny:llama",
        128,
    )
    assert (out / "config.yaml").read_text().startswith("# Resolved config")
    adapter = ScorerAdapter.from_pretrained(out / "final")
    assert adapter.head.num_parameters() == TINY_HEAD_PARAMETERS
    assert adapter.config.layers == [0, 1, 2, 3] and adapter.config.base_model_id == "tiny:llama"
    assert adapter.config.training_config["config"]["max_steps"] == 4
    result = adapter.config.training_config["result"]
    assert result["last_metrics"]["step"] == 4
    # what it trained on: the blocks of 128 tokens and their real (unpadded) tokens
    assert result["training_blocks"] >= 1
    assert 0 < result["training_tokens"] <= 128 * result["training_blocks"]
    # final/ holds the weights of the last step
    last = ScorerAdapter.from_pretrained(out / "step-0004" / "adapter")
    for k, v in adapter.head.state_dict().items():
        assert torch.equal(v, last.head.state_dict()[k])


def test_resume_gives_the_losses_of_an_uninterrupted_run(smoke_run, full_run, tmp_path, corpus):
    import shutil

    out = tmp_path / "resumed"
    shutil.copytree(smoke_run[0], out)
    # the learned policy's defaults may change on resume: they do not touch training
    summary = run_inprocess(["max_steps=6", "inference.recency=1.5", "inference.kernel_size=5", *common(out, corpus)])
    assert summary["step"] == 6
    assert losses(out) == losses(full_run)  # per step, bit for bit
    from sparsekv.scoring.adapter import ScorerAdapter

    final = ScorerAdapter.from_pretrained(out / "final").config
    assert (final.recency, final.kernel_size) == (1.5, 5)
    assert sorted(losses(out)) == [1, 2, 3, 4, 5, 6]
    assert ckpt.latest(out).name == "step-0006"


def test_resume_never_refuses_a_folder_with_checkpoints(smoke_run, corpus):
    with pytest.raises(SystemExit, match="already holds checkpoints"):
        run_inprocess(["max_steps=6", "resume=never", *common(smoke_run[0], corpus)])


def test_metrics_go_to_tensorboard_when_installed(tmp_path, corpus):
    pytest.importorskip("tensorboard")
    out = tmp_path / "tb"
    args = [a for a in common(out, corpus) if not a.startswith("log_with")]
    run_inprocess(["max_steps=2", "log_with=tensorboard", *args])
    assert list((out / "tensorboard").rglob("events.out.tfevents.*"))


def test_a_run_killed_at_any_moment_resumes_exactly(full_run, tmp_path, corpus):
    out = tmp_path / "killed"
    cmd = [sys.executable, "train.py", "--config", TINY, "max_steps=6", *common(out, corpus)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 180
    while not (out / "step-0002").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (out / ".step-0008.tmp").mkdir(parents=True, exist_ok=True)  # a write cut short
    run_inprocess(["max_steps=6", *common(out, corpus)])
    assert losses(out) == losses(full_run)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


def test_only_the_head_gets_gradients(corpus):
    from sparsekv.scoring.adapter import ScorerAdapter
    from sparsekv.teacher.losses import LossConfig
    from sparsekv.teacher.statistics import TargetConfig
    from train.objective import LayerwiseHead, Objective

    model, tok, _ = load_model("tiny:llama", seed=0)
    model.train()  # even in train mode nothing of the base may collect gradients
    adapter = ScorerAdapter.for_model(model, hidden=16)
    ids, mask = tokenize_blocks(tok, load_texts(str(corpus), limit=20), seq_len=64)
    objective = Objective(TargetConfig(), LossConfig(), adapter.config.layers, block_size=16)
    head = LayerwiseHead(adapter.head, adapter.config.layers)
    loss, metrics = objective(model, head, ids[:2], mask[:2])
    loss.backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(not p.requires_grad for p in model.parameters())
    params = list(adapter.head.parameters())
    assert params and all(p.grad is not None for p in params)
    assert any(float(p.grad.abs().sum()) > 0 for p in params)
    assert {"loss", "kl", "bce", "recall"} <= set(metrics)


def test_two_process_cpu_run_trains_and_writes_one_checkpoint(tmp_path, corpus):
    out = tmp_path / "ddp"
    launcher = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "configs/accelerate/ddp_cpu.yaml",
    ]
    proc = run_cli(["max_steps=2", *common(out, corpus)], launcher=launcher)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name for _, p in ckpt.step_dirs(out)] == ["step-0002"]
    d = out / "step-0002"
    assert {p.name for p in d.iterdir()} == STEP_FILES | {"rng_state_1.safetensors"}
    state = json.loads((d / "trainer_state.json").read_text())
    assert (state["world_size"], state["step"], state["samples_seen"]) == (2, 2, 2 * 2 * 2)
    assert sorted(losses(out)) == [1, 2]
    assert proc.stdout.count("done: 2 steps") == 1  # printed by the main process only


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "override, words",
    [
        (
            "max_step=3",
            ["unknown config key 'max_step'", "did you mean 'max_steps'", "known keys:"],
        ),
        ("max_steps=abc", ["max_steps='abc' must be an int"]),
        ("max_steps=0", ["max_steps=0 must be an int >= 1"]),
        ("log_with=wandb", ["log_with='wandb'", "allowed values: auto, tensorboard, none"]),
        ("loss.kl_wieght=1", ["unknown config key 'loss.kl_wieght'", "loss.kl_weight"]),
        ("loss.budget=2", ["loss: budget=2 must be a fraction in (0, 1]"]),
        ("push_to_hub=nope", ["push_to_hub='nope' must be a repo id"]),
        ("maxsteps", ["must look like key=value"]),
        ("inference.kernel_size=4", ["inference.kernel_size=4 must be an odd int >= 1"]),
        ("inference.recency=-1", ["inference.recency=-1 must be a finite number >= 0"]),
        ("inference.blend_mode=union", ["inference.blend_mode='union' is not supported; allowed values: mix, max"]),
        ("inference.window=8", ["inference has unknown key(s) ['window']"]),
    ],
)
def test_bad_override_gives_a_clear_error(override, words, capsys):
    from train.loop import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--config", TINY, override])
    assert e.value.code == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err


def test_entry_point_reports_a_bad_override_and_exits_2():
    proc = run_cli(["max_step=3"], timeout=120)
    assert proc.returncode == 2
    assert "unknown config key 'max_step'" in proc.stderr and "Traceback" not in proc.stderr


def test_train_py_without_config_prints_its_usage_and_exits_2():
    proc = subprocess.run(
        [sys.executable, "train.py"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: python train.py --config")
    assert "--config is required" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "yaml_text, words",
    [
        ("model: tiny:llama\nlr: [0.1\n", ["bad.yaml", "not valid YAML", "line 3"]),
        ("model: tiny:llama\nlr: .nan\n", ["lr=nan must be a finite number"]),
        ("model: tiny:llama\nlr: .inf\n", ["lr=inf must be a finite number"]),
        ("model: tiny:llama\nlr: -0.1\n", ["lr=-0.1 must be > 0"]),
        ("model: tiny:llama\nmin_lr_ratio: .nan\n", ["min_lr_ratio=nan must be a finite number"]),
        ("model: tiny:llama\nweight_decay: -1\n", ["weight_decay=-1.0 must be >= 0"]),
    ],
)
def test_bad_training_yaml_gives_a_clear_error(yaml_text, words, tmp_path, capsys):
    from train.loop import parse_args

    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_an_override_that_is_not_yaml_names_itself(capsys):
    from train.loop import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--config", TINY, "layers=[0, 1"])
    assert "override 'layers=[0, 1': value '[0, 1' is not valid YAML" in capsys.readouterr().err


def test_a_torn_last_metrics_line_does_not_stop_resume(smoke_run, full_run, tmp_path, corpus):
    import shutil

    out = tmp_path / "torn"
    shutil.copytree(smoke_run[0], out)
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "loss": 0.12')  # killed while writing step 5's row
    run_inprocess(["max_steps=6", *common(out, corpus)])
    assert losses(out) == losses(full_run)


def test_a_damaged_metrics_line_before_the_last_is_a_clear_error(smoke_run, tmp_path, corpus, capsys):
    import shutil

    out = tmp_path / "damaged"
    shutil.copytree(smoke_run[0], out)
    rows = (out / "metrics.jsonl").read_text().splitlines()
    rows[1] = rows[1][:20]
    (out / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.raises(SystemExit) as e:
        run_inprocess(["max_steps=6", *common(out, corpus)])
    assert e.value.code == 2
    assert "metrics.jsonl:2 is not a JSON object" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["tiny:qwen3", "tiny:gemma3"])
def test_resuming_onto_another_model_is_a_clear_error(model, smoke_run, tmp_path, corpus, capsys):
    """tiny:qwen3 has the head's shapes (it used to resume with a warning), tiny:gemma3 not (it
    used to crash in load_state_dict); both stop before anything is written or loaded."""
    import shutil

    out = tmp_path / "other-model"
    shutil.copytree(smoke_run[0], out)
    before = (out / "config.yaml").read_text()
    with pytest.raises(SystemExit) as e:
        run_inprocess(["max_steps=6", f"model={model}", *common(out, corpus)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"was trained with model='tiny:llama' but this run has model='{model}'" in err
    assert (out / "config.yaml").read_text() == before


def test_resuming_onto_another_layer_set_is_a_clear_error(smoke_run, tmp_path, corpus, capsys):
    import shutil

    out = tmp_path / "other-layers"
    shutil.copytree(smoke_run[0], out)
    with pytest.raises(SystemExit):
        run_inprocess(["max_steps=6", "layers=[0, 1]", *common(out, corpus)])
    assert "has heads on layers [0, 1, 2, 3] but this run puts them on [0, 1]" in capsys.readouterr().err


def test_cpu_true_under_a_deepspeed_launch_is_an_error(monkeypatch):
    from train.distributed import make_accelerator
    from train.run import RunError

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(RunError, match="cpu=true with an accelerate config that names DeepSpeed"):
        make_accelerator(load_config(TINY, ["cpu=true"]))


def test_deepspeed_with_several_cpu_processes_is_an_error(monkeypatch):
    from train.distributed import make_accelerator
    from train.run import RunError

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RunError, match="DeepSpeed on the CPU runs one process"):
        make_accelerator(load_config(TINY))


def test_shipped_cpu_configs_let_accelerate_decide_the_device():
    for path in sorted((ROOT / "configs" / "train").glob("*-cpu.yaml")):
        assert load_config(path).cpu is False, path.name


def test_overrides_and_push_flag_apply():
    from train.loop import parse_args

    cfg = parse_args(
        [
            "--config",
            TINY,
            "max_steps=3",
            "seed=5",
            "resume=never",
            "keep_last=none",
            "layers=[1, 3]",
            "loss.budget=0.5",
            "--push_to_hub",
            "me/tiny",
        ]
    )
    assert (cfg.max_steps, cfg.seed, cfg.resume, cfg.keep_last, cfg.layers) == (
        3,
        5,
        "never",
        None,
        [1, 3],
    )
    assert cfg.loss_config().budget == 0.5 and cfg.push_to_hub == "me/tiny"


# ---------------------------------------------------------------------- Hub export


def test_push_to_hub_exports_the_final_adapter_with_config_and_metrics(
    tmp_path, corpus, monkeypatch
):
    from huggingface_hub import HfApi

    calls = {}

    def create_repo(self, repo_id, **kw):
        calls["create"] = (repo_id, kw.get("private"))

    def upload_folder(self, *, repo_id, folder_path, **kw):
        calls["upload"] = {p.name: p.read_bytes() for p in Path(folder_path).iterdir()}
        calls["repo"] = repo_id

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    out = tmp_path / "push"
    run_inprocess(
        ["max_steps=2", *common(out, corpus), "hub_private=true", "--push_to_hub", "me/tiny-head"]
    )
    assert calls["create"] == ("me/tiny-head", True) and calls["repo"] == "me/tiny-head"
    assert set(calls["upload"]) == adapter_files()
    card = calls["upload"]["README.md"].decode()
    assert "## Training config" in card and '"max_steps": 2' in card and '"last_metrics"' in card
    from safetensors.torch import load, load_file

    from sparsekv.scoring.adapter import WEIGHTS_NAME

    pushed = load(calls["upload"][WEIGHTS_NAME])
    final = load_file(out / "final" / WEIGHTS_NAME)
    assert pushed.keys() == final.keys() and all(torch.equal(pushed[k], final[k]) for k in final)


# ---------------------------------------------------------------------- pieces


def test_data_order_is_seeded_and_split_across_processes():
    ids = torch.arange(10 * 4).view(10, 4)
    ds = BlockDataset(ids, torch.ones_like(ids), seed=3)
    first = [ds.index(p) for p in range(10)]
    assert sorted(first) == list(range(10))  # one epoch visits every block once
    assert first == [BlockDataset(ids, torch.ones_like(ids), seed=3).index(p) for p in range(10)]
    assert first != [BlockDataset(ids, torch.ones_like(ids), seed=4).index(p) for p in range(10)]
    assert sorted(ds.index(p) for p in range(10, 20)) == list(range(10))  # next epoch
    r0, _ = ds.batch(6, batch_size=2, rank=0, world=2)
    r1, _ = ds.batch(6, batch_size=2, rank=1, world=2)
    assert [int(r[0]) // 4 for r in torch.cat([r0, r1])] == [ds.index(p) for p in range(6, 10)]


def test_tokenize_blocks_pack_and_pad():
    tok = ByteTokenizer(128)
    ids, mask = tokenize_blocks(tok, ["abcdef", "gh"], seq_len=4, packing="pack")
    # stream: a b c d e f EOS g h EOS -> blocks of 3 after BOS
    assert ids.shape == (3, 4) and bool(mask.all())
    assert (ids[:, 0] == tok.bos_token_id).all() and ids[2, 1] == tok.eos_token_id
    ids, mask = tokenize_blocks(tok, ["abcdefg", "gh"], seq_len=4, packing="pad")
    # "abcdefg" continues over 3 blocks (its 1-token tail is kept: >= seq_len // 4), "gh" is padded
    assert ids.shape == (4, 4) and mask.tolist() == [[1, 1, 1, 1]] * 2 + [
        [1, 1, 0, 0],
        [1, 1, 1, 0],
    ]
    assert ids[3, 3] == tok.pad_token_id and (ids[:, 0] == tok.bos_token_id).all()
    ids, _ = tokenize_blocks(tok, ["x" * 32], seq_len=16, packing="pad")
    assert ids.shape == (2, 16)  # 15 + 15 tokens; the 2-token tail (BOS + 2 < 16 // 4) is dropped
    with pytest.raises(ValueError, match="seq_len=64"):
        tokenize_blocks(tok, ["ab"], seq_len=64)


def test_tokenize_blocks_fill_keeps_texts_whole_and_blocks_full():
    tok = ByteTokenizer(128)
    # blocks of BOS + 7: "abc"+EOS and "de"+EOS share one; "fghij"+EOS does not fit what is left
    ids, mask = tokenize_blocks(tok, ["abc", "de", "fghij", "x" * 17], seq_len=8, packing="fill")
    rows = [[int(t) for t, m in zip(r, k) if m] for r, k in zip(ids, mask)]
    eos, bos = tok.eos_token_id, tok.bos_token_id
    enc = {c: tok([c])["input_ids"][0][0] for c in "abcdefghijx"}
    assert rows[0] == [bos, *[enc[c] for c in "abc"], eos, enc["d"], enc["e"], eos]
    assert rows[1] == [bos, *[enc[c] for c in "fghij"], eos]
    # 17 x's + EOS = 18 tokens: two blocks of 7, and the 4-token tail (>= 8 // 4) starts a block
    assert rows[2] == [bos] + [enc["x"]] * 7 and rows[3] == rows[2]
    assert rows[4] == [bos] + [enc["x"]] * 3 + [eos] and len(rows) == 5
    assert ids.shape == (5, 8) and ids[4, 7] == tok.pad_token_id
    with pytest.raises(ValueError, match="allowed values: pack, pad, fill"):
        tokenize_blocks(tok, ["ab"], seq_len=4, packing="zip")


def test_load_texts_reads_jsonl_and_parquet_and_builds_a_missing_file(tmp_path, corpus):
    import datasets

    texts = load_texts(str(corpus), limit=5)
    assert len(texts) == 5 and all(isinstance(t, str) and t for t in texts)
    pq = tmp_path / "t.parquet"
    datasets.Dataset.from_dict({"body": ["one text", "two"]}).to_parquet(str(pq))
    assert load_texts(str(pq), text_field="body") == ["one text", "two"]
    with pytest.raises(ValueError, match="text_field='text'"):
        load_texts(str(pq))
    built = []
    missing = tmp_path / "new.jsonl"
    with pytest.raises(FileNotFoundError):
        load_texts(str(missing))
    missing.parent.mkdir(exist_ok=True)

    def build(p):
        built.append(p)
        p.write_text(json.dumps({"text": "made"}) + "\n")

    assert load_texts(str(missing), build=build) == ["made"] and built == [missing]


def test_data_builder_is_deterministic_and_hides_needles_in_prose(tmp_path):
    from data.build import BuildConfig, build, main

    cfg = BuildConfig(seed=1, max_prose_chars=30_000, synthetic=12, context_chars=600)
    a, b = build(cfg), build(cfg)
    assert a == b and a != build(
        BuildConfig(seed=2, max_prose_chars=30_000, synthetic=12, context_chars=600)
    )
    prose = [r for r in a if not r["source"].startswith("synthetic")]
    synth = [r for r in a if r["source"].startswith("synthetic")]
    assert {r["source"] for r in prose} <= {"pydoc", "docstrings", "license"} and prose
    from data.build import KINDS

    # 12 samples need not cover all eight kinds; each one made is a known kind
    assert len(synth) == 12 and {r["source"] for r in synth} <= {f"synthetic:{k}" for k in KINDS}
    for r in synth:
        assert r["text"].rstrip().endswith(r["answer"]) and "Question:" in r["text"]
    for pk in (r for r in synth if r["source"] == "synthetic:passkey"):
        key = re.search(r"\d{5}", pk["answer"]).group()
        assert pk["text"].count(key) >= 2  # the needle and the answer
    out = tmp_path / "c.jsonl"
    assert (
        main(
            [
                "--out",
                str(out),
                "--seed",
                "1",
                "--max_prose_chars",
                "30000",
                "--synthetic",
                "12",
                "--context_chars",
                "600",
            ]
        )
        == 0
    )
    assert [json.loads(line) for line in out.read_text().splitlines()] == a
    with pytest.raises(ValueError, match="kinds"):
        BuildConfig(kinds=["haystack"])


def test_state_dicts_round_trip_without_pickle(tmp_path):
    head = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(head.parameters(), lr=0.1)
    head(torch.randn(3, 4)).sum().backward()
    opt.step()
    ckpt.save_state_dict(opt.state_dict(), tmp_path / "opt.safetensors")
    back = ckpt.load_state_dict(tmp_path / "opt.safetensors")
    assert back["param_groups"] == opt.state_dict()["param_groups"]
    for i, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            assert torch.equal(back["state"][i][k], v)
    with pytest.raises(TypeError, match="without pickling"):
        ckpt.save_state_dict({"f": object()}, tmp_path / "x.safetensors")


def test_rng_state_round_trip_replays_the_same_numbers(tmp_path):
    ckpt.save_state_dict(ckpt.rng_state(), tmp_path / "rng.safetensors")
    first = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    ckpt.set_rng_state(ckpt.load_state_dict(tmp_path / "rng.safetensors"))
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == first


def test_latest_skips_incomplete_folders_and_prune_keeps_the_newest(tmp_path):
    for step in (2, 4, 6):
        d = tmp_path / ckpt.step_dir_name(step)
        d.mkdir()
        (d / ckpt.TRAINER_STATE).write_text("{}")
    (tmp_path / "step-0008").mkdir()  # no trainer_state.json: not complete
    (tmp_path / ".step-0010.tmp").mkdir()
    assert ckpt.latest(tmp_path).name == "step-0006"
    assert [p.name for p in ckpt.prune(tmp_path, 2)] == ["step-0002"]
    assert [p.name for _, p in ckpt.step_dirs(tmp_path)] == ["step-0004", "step-0006"]


def _former_schedule(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """The hand-written schedule every shipped head was trained with (before transformers' one
    replaced it): its learning rates must be the same at every step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@pytest.mark.parametrize(
    "warmup, total, min_ratio",
    [(2, 6, 0.1), (10, 60, 0.1), (20, 600, 0.1), (100, 1000, 0.05), (0, 8, 0.0), (10, 3, 0.1),
     (5, 5, 0.2), (1, 2, 0.5)],
)
def test_lr_schedule_is_transformers_at_the_shipped_steps(warmup, total, min_ratio):
    from train.run import lr_schedule

    def run(steps, state=None):
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.AdamW([p], lr=0.002)
        sched = lr_schedule(opt, warmup, total, min_ratio)
        if state is not None:
            opt.load_state_dict(state[0])
            sched.load_state_dict(state[1])
        seen = []
        for _ in range(steps):
            seen.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return seen, (opt.state_dict(), sched.state_dict())

    n = total + 5
    lrs, _ = run(n)
    want = [0.002 * _former_schedule(s, warmup, total, min_ratio) for s in range(n)]
    assert lrs == pytest.approx(want, rel=1e-12, abs=1e-15)
    head, state = run(n // 2)  # a resumed run continues the same schedule
    tail, _ = run(n - n // 2, state)
    assert head + tail == pytest.approx(want, rel=1e-12, abs=1e-15)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_single_process_resumes_exactly(stage, full_run, tmp_path, corpus):
    """The DeepSpeed code path (engine state in step-N/deepspeed/, ZeRO-3 gathering for adapter/)
    on one CPU process: same losses as the plain run, exact resume."""
    pytest.importorskip("deepspeed")
    out = tmp_path / f"zero{stage}"
    launcher = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        f"configs/accelerate/deepspeed_zero{stage}.yaml",
        "--num_processes",
        "1",
        "--mixed_precision",
        "no",
    ]
    for steps in (4, 6):
        proc = run_cli([f"max_steps={steps}", "cpu=false", *common(out, corpus)], launcher=launcher)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "deepspeed" in {p.name for p in (out / "step-0006").iterdir()}
    assert losses(out) == pytest.approx(losses(full_run), rel=1e-6)


@pytest.mark.slow
def test_deepspeed_cpu_config_trains_under_the_deepspeed_engine(full_run, tmp_path, corpus):
    """The shipped CPU DeepSpeed config with the shipped tiny CPU training config, as the README
    launches it: the head is trained by a DeepSpeedEngine under ZeRO-2 (recorded in
    trainer_state.json and the final adapter), with the plain run's losses. A 20-step launch
    takes ~20 s here."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "zero2-cpu"
    launcher = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "configs/accelerate/deepspeed_zero2_cpu.yaml",
    ]
    proc = run_cli(["max_steps=4", *common(out, corpus)], launcher=launcher, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = {"distributed_type": "DEEPSPEED", "zero_stage": 2, "engine": "DeepSpeedEngine",
                "num_processes": 1, "device": "cpu"}
    state = json.loads((out / "step-0004" / "trainer_state.json").read_text())
    assert state["distributed"] == expected
    assert "deepspeed" in {p.name for p in (out / "step-0004").iterdir()}
    assert "distributed_type=DEEPSPEED" in proc.stdout
    from sparsekv.scoring.adapter import ScorerAdapter

    card = ScorerAdapter.from_pretrained(out / "final").config.training_config
    assert card["result"]["distributed"] == expected
    assert losses(out) == pytest.approx({k: v for k, v in losses(full_run).items() if k <= 4}, rel=1e-6)
    # cpu=true would silently drop DeepSpeed: refused
    proc = run_cli(["max_steps=4", "cpu=true", *common(tmp_path / "x", corpus)], launcher=launcher)
    assert proc.returncode != 0 and "train.py: error: cpu=true with an accelerate config" in proc.stderr


def test_training_needles_never_use_the_evaluation_wording():
    """The evaluation's needle and question sentences must not appear in the training corpus,
    or passkey accuracy would partly measure memorisation of one sentence."""
    from data.build import KINDS, BuildConfig, build

    synth = [r for r in build(BuildConfig(seed=3, max_prose_chars=20_000, synthetic=60,
                                          context_chars=300, kinds=list(KINDS)))
             if r["source"].startswith("synthetic")]
    assert {r["source"] for r in synth} == {f"synthetic:{k}" for k in KINDS}  # seed 3 covers all
    for phrase in ("pass key", "Remember it.", "special magic number", "VAR "):
        assert not any(phrase in r["text"] for r in synth), phrase


# ---------------------------------------------------------------------- teacher cache, signals


def test_teacher_cache_serves_later_epochs_and_follows_the_target_config(tmp_path, corpus):
    """4 samples, 2 per step: epoch 1 (steps 1-2) computes and writes, epoch 2 (steps 3-4) reads;
    the losses equal those of a run without the cache; another target reads another folder."""
    cache = tmp_path / "cache"
    base = [
        f"dataset={corpus}",
        "progress_bar=false",
        "log_with=none",
        "save_every=0",
        "max_samples=4",
        "batch_size=2",
        "max_steps=4",
        "target.signal=reconstruction",
    ]
    uses = "inference.uses={agnostic: {kernel_size: 3}}"  # recorded in the adapter, per use
    run_inprocess([*base, f"output_dir={tmp_path / 'a'}", f"teacher_cache={cache}", uses])
    rows = [json.loads(r) for r in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["teacher_cached"] for r in rows] == [0.0, 0.0, 1.0, 1.0]
    from sparsekv.scoring.adapter import ScorerAdapter

    recorded = ScorerAdapter.from_pretrained(str(tmp_path / "a" / "final")).config
    assert recorded.settings("agnostic")["kernel_size"] == 3 and recorded.kernel_size == 1
    folders = list(cache.iterdir())
    assert len(folders) == 1 and len(list(folders[0].glob("*.safetensors"))) == 4
    assert not list(folders[0].glob(".tmp-*"))
    run_inprocess([*base, f"output_dir={tmp_path / 'b'}"])
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    run_inprocess(
        [*base, f"output_dir={tmp_path / 'c'}", f"teacher_cache={cache}", "target.stat=max"]
    )
    rows = [json.loads(r) for r in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["teacher_cached"] == 0.0 and len(list(cache.iterdir())) == 2


def test_cached_rows_are_the_computed_tensors(tmp_path, corpus):
    from sparsekv.teacher.statistics import TargetConfig
    from train.targets import TargetCache, TeacherTargets, model_identity

    model, tok, base_id = load_model("tiny:gemma3", seed=0)
    ids, mask = tokenize_blocks(tok, load_texts(str(corpus), limit=20), 48, "pad")
    ids, mask = ids[:3], mask[:3]
    target = TargetConfig(signal="both", stat="max")
    prompt = [5, 6, 7]

    def make(seed_model=model):
        cache = TargetCache(
            tmp_path,
            target=target.to_dict(),
            layers=[3],
            repeat_prompt_ids=prompt,
            model=model_identity(seed_model, base_id),
        )
        return TeacherTargets(target, [3], 16, prompt, cache)

    first = make()
    t1, h1 = first(model, ids[:2], mask[:2])  # rows 0, 1 computed
    t2, h2 = first(model, ids, mask)  # rows 0, 1 read, row 2 computed
    assert (first.cache.misses, first.cache.hits) == (3, 2)
    torch.testing.assert_close(t2[3][:2], t1[3], rtol=0, atol=0)
    torch.testing.assert_close(h2[3][:2], h1[3], rtol=0, atol=0)
    fresh_t, fresh_h = first.compute(model, ids, mask)
    torch.testing.assert_close(t2[3], fresh_t[3], rtol=0, atol=0)
    torch.testing.assert_close(h2[3], fresh_h[3], rtol=0, atol=0)
    other, _, _ = load_model("tiny:gemma3", seed=1)  # same id, other weights: another key
    assert make(other).cache.folder != first.cache.folder


def test_target_cache_keys_on_min_distance(tmp_path):
    from sparsekv.teacher.statistics import TargetConfig
    from train.targets import TargetCache

    def folder(target: dict):
        model = {"base_id": "x", "weights": "0"}
        return TargetCache(tmp_path, target=target, layers=[3], repeat_prompt_ids=None, model=model).folder

    plain = TargetConfig(stat="max").to_dict()
    decode = TargetConfig(stat="max", min_distance=64).to_dict()
    assert folder(decode) != folder(plain)  # a decode-time target never reads prompt-time rows
    assert folder(decode) != folder({**decode, "min_distance": 32})
    # the default keeps the key targets had before the option existed
    legacy = {k: v for k, v in plain.items() if k != "min_distance"}
    assert folder(plain) == folder(legacy)


def test_kvzap_objective_trains_the_kvzap_head_with_mse(corpus):
    from sparsekv.scoring.adapter import ScorerAdapter
    from sparsekv.teacher.losses import LossConfig
    from sparsekv.teacher.statistics import TargetConfig
    from train.objective import LayerwiseHead, Objective

    model, tok, _ = load_model("tiny:llama", seed=0)
    adapter = ScorerAdapter.for_model(model, kind="kvzap", hidden=32)
    ids, mask = tokenize_blocks(tok, load_texts(str(corpus), limit=20), seq_len=64)
    target = TargetConfig(signal="reconstruction", kind="kvzip_plus")
    objective = Objective(target, LossConfig(kind="mse"), adapter.config.layers, 16, [5, 6, 7])
    head = LayerwiseHead(adapter.head, adapter.config.layers)
    loss, metrics = objective(model, head, ids[:2], mask[:2])
    loss.backward()
    assert all(p.grad is not None for p in adapter.head.parameters())
    assert {"loss", "mse", "recall"} <= set(metrics) and "kl" not in metrics
    assert loss.item() > 0


def test_max_samples_draws_a_seeded_subset():
    from train.data import select_samples

    ids = torch.arange(40).view(10, 4)
    mask = torch.ones_like(ids)
    a, _ = select_samples(ids, mask, 4, seed=0)
    b, _ = select_samples(ids, mask, 4, seed=0)
    c, _ = select_samples(ids, mask, 4, seed=1)
    assert torch.equal(a, b) and not torch.equal(a, c) and a.shape == (4, 4)
    assert (a[1:, 0] > a[:-1, 0]).all()  # original order kept
    assert select_samples(ids, mask, None)[0] is ids
