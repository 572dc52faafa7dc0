"""Every shipped config validates: configs/train/*.yaml as TrainConfig, configs/accelerate/*.yaml
with accelerate's own config loader; each opens with a comment showing how to launch it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sparsekv.configfile import field_docs  # noqa: E402
from train.config import TrainConfig, load_config  # noqa: E402

TRAIN = sorted((ROOT / "configs" / "train").glob("*.yaml"))
ACCEL = sorted((ROOT / "configs" / "accelerate").glob("*.yaml"))


def test_the_required_configs_ship():
    assert {p.name for p in TRAIN} >= {
        "tiny-cpu.yaml",
        "gemma3-270m-cpu.yaml",
        "gemma3-270m-kvzap.yaml",
        "llama3.1-8b-gpu.yaml",
    }
    assert {p.name for p in ACCEL} >= {
        "single_process.yaml",
        "ddp_cpu.yaml",
        "ddp_gpu.yaml",
        "deepspeed_zero2.yaml",
        "deepspeed_zero3.yaml",
    }


@pytest.mark.parametrize("path", TRAIN + ACCEL, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_config_opens_with_a_launch_comment(path):
    head = path.read_text().splitlines()[0:6]
    assert head[0].startswith("#"), f"{path.name} must open with a comment"
    assert any("accelerate launch" in line or "python train.py" in line for line in head), head


@pytest.mark.parametrize("path", TRAIN, ids=lambda p: p.name)
def test_train_config_validates(path):
    raw = yaml.safe_load(path.read_text())
    known = set(field_docs(TrainConfig))
    assert set(raw) <= known, f"unknown keys {set(raw) - known}"
    cfg = load_config(path)
    assert cfg.run_name == path.stem
    # The nested configs are built (and so validated) by the loop; build them here too.
    cfg.target_config(), cfg.loss_config(), cfg.build_config()
    assert cfg.run_dir == Path(raw.get("output_dir") or f"checkpoints/{path.stem}")


@pytest.mark.parametrize("path", TRAIN, ids=lambda p: p.name)
def test_train_config_overrides_apply(path):
    cfg = load_config(
        path,
        ["max_steps=3", "output_dir=/tmp/x", "seed=7", "resume=never", "push_to_hub=user/repo"],
    )
    assert (cfg.max_steps, cfg.output_dir, cfg.seed, cfg.resume, cfg.push_to_hub) == (
        3,
        "/tmp/x",
        7,
        "never",
        "user/repo",
    )


@pytest.mark.parametrize("path", ACCEL, ids=lambda p: p.name)
def test_accelerate_config_validates(path):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType, PrecisionType

    cfg = load_config_from_file(str(path))  # raises on unknown keys
    assert cfg.distributed_type in set(DistributedType)
    assert cfg.mixed_precision in {p.value for p in PrecisionType}
    assert cfg.num_processes >= 1
    if cfg.distributed_type == DistributedType.DEEPSPEED:
        ds = cfg.deepspeed_config
        assert ds["zero_stage"] in (2, 3)
        assert f"zero{ds['zero_stage']}" in path.stem
        # grad accumulation is owned by the train config (train.loop refuses a mismatch)
        assert "gradient_accumulation_steps" not in ds
    if path.stem == "ddp_cpu":
        assert cfg.use_cpu and cfg.num_processes == 2


def test_every_train_config_field_is_documented():
    from dataclasses import fields

    docs = field_docs(TrainConfig)
    missing = [f.name for f in fields(TrainConfig) if not docs.get(f.name)]
    assert not missing


def test_default_pipeline_evaluates_the_adapter_it_trains_on_the_generalize_grid():
    """eval/run_default.py runs generalize-4k.yaml with the shipped head swapped for the new one,
    every other method and setting as the headline grid has them."""
    from eval import run_default as mod
    from sparsekv.evaluation.config import EvalConfig

    d = mod.eval_config("checkpoints/new/final", 3, "results/p", length=2048, budgets=[0.3])
    cfg = EvalConfig.from_dict(d)
    shipped = EvalConfig.from_yaml(ROOT / "configs" / "eval" / "generalize-4k.yaml")
    assert cfg.samples == 3 and cfg.out == "results/p" and cfg.lengths == [2048] and cfg.budgets == [0.3]
    assert cfg.seed == shipped.seed and cfg.tasks == shipped.tasks and cfg.protocols == shipped.protocols
    assert [p.label for p in shipped.policy_specs] == [p.label for p in cfg.policy_specs]
    new = {p.name for p in cfg.policy_specs} - {p.name for p in shipped.policy_specs}
    assert new == {"learned:checkpoints/new/final"}
    assert [p.runs_under("agnostic") for p in cfg.policy_specs] == [
        p.runs_under("agnostic") for p in shipped.policy_specs]
    # the estimate printed first follows the size of the job
    quick = mod.estimate_minutes(True, 2, 1024, 1)
    assert mod.estimate_minutes(False, 2, 1024, 1) < quick < mod.estimate_minutes(True, 30, 4096, 3)
    # measured on 2 idle cores: 35 min 40 s at 2,048 tokens (2026-12-03), 23 min 52 s at 1,024
    # (2026-12-04); the estimate stays within 10% of both
    assert abs(mod.estimate_minutes(True, 2, 2048, 1) - 35.7) <= 3.6
    assert abs(quick - 23.9) <= 2.4
    assert quick <= 25  # the default job (1,024 tokens) within the 25 minutes
    d = mod.parser().parse_args([])  # the command's defaults are that quick job
    assert (d.samples, d.length, d.budgets, d.skip_train) == (2, 1024, "0.3", False)


def test_learned_4k_sets_up_learned_and_every_ablation_under_both_protocols():
    """Agnostic: the head's prior alone (the window holds no question); aware: the adapter's
    recorded blend; every ablation present under both, changing one thing each."""
    from sparsekv.evaluation.config import EvalConfig

    cfg = EvalConfig.from_yaml(ROOT / "configs" / "eval" / "learned-4k.yaml")
    under = {pr: {p.label: p for p in cfg.policy_specs if p.runs_under(pr)} for pr in ("agnostic", "aware")}
    agnostic_only = {"learned, window blend", "learned, kernel 9", "learned, per-layer target, kernel 9"}
    assert set(under["agnostic"]) - agnostic_only == set(under["aware"]) - {"learned, prior only", "learned, union blend"}
    assert set(under["aware"]).isdisjoint(agnostic_only)
    for label in ("learned, kernel 9", "learned, per-layer target, kernel 9"):  # round 4 of docs/learned-scorer.md
        assert under["agnostic"][label].policy_kwargs == {"blend": 0.0, "kernel_size": 9}
    assert under["agnostic"]["learned"].policy_kwargs == {"blend": 0.0}
    assert under["aware"]["learned"].policy_kwargs == {}
    assert under["aware"]["learned, prior only"].policy_kwargs == {"blend": 0.0}
    assert under["agnostic"]["learned, window blend"].policy_kwargs == {}
    assert under["aware"]["learned, union blend"].policy_kwargs == {"blend_mode": "max"}
    for label, spec in under["agnostic"].items():
        if label.startswith("learned, ") and label != "learned, window blend":
            assert spec.policy_kwargs.get("blend") == 0.0, label


def test_kvzap_config_is_kvzaps_recipe():
    """The KVzap peer: KVzip+ target, MSE, KVzap's MLP (hidden 512, no norm), 15 epochs over a
    cached teacher, and none of our ranking tricks in its recorded policy settings."""
    cfg = load_config(ROOT / "configs" / "train" / "gemma3-270m-kvzap.yaml")
    target, loss = cfg.target_config(), cfg.loss_config()
    assert (target.signal, target.kind, loss.kind) == ("reconstruction", "kvzip_plus", "mse")
    assert (cfg.head, cfg.head_hidden, cfg.lr) == ("kvzap", 512, 0.005)
    assert cfg.teacher_cache and cfg.max_steps == 15 * cfg.max_samples // cfg.batch_size
    assert cfg.inference_kwargs() == {
        "head_layer": "own",
        "blend": 0.0,
        "blend_mode": "mix",
        "kernel_size": 1,
        "recency": 0.0,
    }
    # none of our tricks in the agnostic use either: no span filling, no word closing (0)
    assert cfg.inference_uses()["agnostic"] == {
        **cfg.inference_kwargs(), "span_fill": 0, "span_peaks": 0.0, "span_words": 0
    }
    assert cfg.dataset == "data/train-kvzap.jsonl"


@pytest.mark.parametrize(
    "uses,words",
    [
        ({"offline": {}}, "unknown use 'offline'"),
        ({"agnostic": {"kernel": 3}}, "unknown setting(s) ['kernel']"),
        ({"agnostic": {"kernel_size": 4}}, "inference.uses['agnostic']: kernel_size=4"),
        ({"agnostic": 3}, "inference.uses['agnostic']=3 must be a dict over"),
        ({"aware": {}}, 'inference.uses must not hold "aware"'),
    ],
)
def test_inference_uses_errors_name_the_use(uses, words):
    with pytest.raises(ValueError) as e:
        load_config(None, [f"inference.uses={uses}"])
    assert words in str(e.value)


def test_generalize_configs_split_tuning_and_report_seeds():
    """Issue 15: the tuning grid runs on seed 1, the report grid on a seed no choice saw (not 0,
    1 or 5) with every task family, >= 30 samples, both protocols, the six heuristics, the learned
    head set up per use, and the peers; each opens with how to run it."""
    from sparsekv.evaluation.config import EvalConfig

    families = {"passkey", "multikey", "multivalue", "vartrack", "qa", "wordkey", "uuidkey",
                "multiquery", "commonwords", "freqwords", "ppl"}
    heuristics = {"streaming", "h2o", "snapkv", "pyramidkv", "tova", "knorm"}
    tune = EvalConfig.from_yaml(ROOT / "configs" / "eval" / "generalize-tune.yaml")
    report = EvalConfig.from_yaml(ROOT / "configs" / "eval" / "generalize-4k.yaml")
    assert tune.seed == 1 and report.seed not in (0, 1, 5)
    assert set(report.tasks) == families and report.samples >= 30 and report.lengths == [4096]
    assert 2 <= len(set(tune.tasks)) < len(families) and set(tune.tasks) <= families
    for cfg in (tune, report):
        assert cfg.budgets == [0.1, 0.2, 0.3] and set(cfg.protocols) == {"agnostic", "aware"}
        names = {p.name for p in cfg.policy_specs}
        assert heuristics <= names
        learned = {pr: [p for p in cfg.policy_specs if p.label == "learned" and p.runs_under(pr)]
                   for pr in cfg.protocols}
        for pr, specs in learned.items():
            assert len(specs) == 1 and specs[0].policy_kwargs == {"use": pr}, pr
        path = ROOT / "configs" / "eval" / f"generalize-{'tune' if cfg is tune else '4k'}.yaml"
        head = path.read_text().splitlines()[:10]
        assert head[0].startswith("#") and any("sparsekv eval --config" in line for line in head)
    assert {"kvzip", "expected_attention", "learned:checkpoints/gemma3-270m-kvzap"} <= {
        p.name for p in report.policy_specs}
