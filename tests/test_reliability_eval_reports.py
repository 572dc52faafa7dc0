"""Issue 36, the evaluation reports' part: token budgets are labelled as token counts in the
reports (summary.md, the README plots, the decode report), the kvpress peer reads budgets by the
library's one rule, and the shipped adapter's card carries the report grid's headline as
model-index metadata (written from the grid's rows, round-tripping, fingerprint unchanged).
Synthetic rows and tiny adapters: no model runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml


def _write_rows(folder: Path, rows: list[dict]) -> None:
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


# ---- item 5: token budgets labelled as such ---------------------------------------------------------
def _synthetic(folder: Path) -> None:
    folder.mkdir()
    base = {
        "source": "sparsekv",
        "task": "passkey",
        "length": 128,
        "protocol": "agnostic",
        "kv_bytes_compressed": 1000,
    }
    rows = []
    for i in range(2):
        sid = f"passkey-128-{i}"
        rows.append(
            {**base, "sample_id": sid, "policy": "full", "budget": 1.0, "score": 1.0, "kl": 0.0}
        )
        rows.append(
            {**base, "sample_id": sid, "policy": "snapkv", "budget": 0.3, "score": 1.0, "kl": 0.1}
        )
        rows.append(
            {**base, "sample_id": sid, "policy": "snapkv", "budget": 64, "score": 0.0, "kl": 0.2}
        )
    _write_rows(folder, rows)


def test_token_budgets_are_labelled_as_tokens_in_the_reports(tmp_path):
    import matplotlib.pyplot as plt

    from sparsekv.evaluation.config import budget_label, is_token_budget
    from sparsekv.evaluation.reports import plots
    from sparsekv.evaluation.reports.tables import write_reports

    assert [budget_label(b) for b in (0.3, 1.0, 64, 1, "256", "1tok", "0.3")] == [
        "0.3",
        "1.0",
        "64 tokens",
        "1 token",
        "256 tokens",
        "1 token",
        "0.3",
    ]
    assert not is_token_budget(True) and is_token_budget(2) and not is_token_budget(1.0)
    _synthetic(tmp_path / "g")
    got = write_reports(tmp_path / "g", ["snapkv"])
    md = (tmp_path / "g" / "summary.md").read_text()
    assert "| snapkv @ 64 tokens |" in md and "| snapkv @ 0.3 |" in md
    assert "retrieval share @ 0.3 / 64 tokens" in md and "@ 64 |" not in md
    from sparsekv.evaluation.reports.summary import glance_stats, views

    computed = {k: glance_stats(*v) for k, v in views(got["summary"]).items()}
    pts = plots.readme_series(computed, ["snapkv"])[("agnostic", 128)]
    fig = plots.readme_figure(pts, "agnostic", 128)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.3", "64 tokens"]
    assert "tokens" in ax.get_xlabel() and "share of the context" in ax.get_xlabel()
    plt.close(fig)


def test_the_decode_report_names_fraction_budgets_without_tokens():
    from sparsekv.evaluation.reports import decode

    rows = [
        {
            "task": "decode_prose",
            "sample_id": "decode_prose-512-0",
            "policy": p,
            "budget": b,
            "rerank_every": 16,
            "kl_mean": k,
            "error": None,
        }
        for p, b, k in (("full", 1.0, 0.0), ("snapkv-r16", 0.3, 0.1), ("snapkv-r16", 256, 0.2))
    ]
    text = decode.markdown(decode.summarize(rows))
    assert (
        "## decode_prose, budget 0.3\n" in text and "## decode_prose, budget 256 tokens\n" in text
    )


# ---- the kvpress plan reads budgets by the library's rule ------------------------------------------
def test_the_kvpress_plan_reads_budgets_by_the_librarys_rule():
    import importlib

    from sparsekv.evaluation.config import parse_budget

    peer = importlib.import_module("eval.peers.kvpress.run_presses")
    for text in (
        "0.3",
        "1.0",
        "2",
        "512",
        "2.0",
        "1",
        "1tok",
        "512tok",
        "0",
        "-1",
        "abc",
        "1.5",
        "0tok",
        "4096.0",
        "nan",
    ):
        try:
            mine = parse_budget(text)
        except ValueError:
            mine = None
        try:
            (theirs,) = peer.parse_budgets(text)
        except ValueError as e:
            theirs = None
            assert "budget" in str(e) and "allowed" in str(e), e
        assert (mine is None) == (theirs is None), (text, mine, theirs)
        if mine is not None:
            assert type(theirs) is (float if isinstance(mine, float) else int) and theirs == mine, (
                text
            )
    assert peer.parse_budgets([0.3, 512, "1tok"]) == [0.3, 512, 1]  # config.yaml's budgets list
    with pytest.raises(
        ValueError, match=r"2\.0: a float budget is a fraction in \(0, 1\] \(for 2 tokens"
    ):
        peer.parse_budgets([2.0])
    with pytest.raises(ValueError, match="budget 1 is ambiguous"):
        peer.parse_budgets("0.3,1")


# ---- item 8: the report grid's headline in the adapter's card ------------------------------------
def _card_grid(folder: Path, adapter_hash: str) -> None:
    folder.mkdir()
    base = {
        "source": "sparsekv",
        "length": 128,
        "protocol": "agnostic",
        "kv_bytes_compressed": 1000,
    }
    rows = []
    for i in range(3):
        for task, full, mine, kl in (
            ("passkey", 1.0, float(i > 0), 0.2),
            ("ppl", None, None, 0.05),
        ):
            sid = f"{task}-128-{i}"
            rows.append(
                {
                    **base,
                    "task": task,
                    "sample_id": sid,
                    "policy": "full",
                    "budget": 1.0,
                    "score": full,
                    "kl": 0.0,
                    "adapter_hash": None,
                }
            )
            for budget in (0.1, 0.3):
                rows.append(
                    {
                        **base,
                        "task": task,
                        "sample_id": sid,
                        "policy": "learned",
                        "budget": budget,
                        "score": mine,
                        "kl": kl * (1 + i),
                        "adapter_hash": adapter_hash,
                    }
                )
    _write_rows(folder, rows)
    (folder / "config.yaml").write_text(
        yaml.safe_dump({"model": "tiny:llama", "seed": 7, "samples": 3})
    )


def test_the_card_carries_the_grids_headline_as_model_index_and_round_trips(tmp_path, capsys):
    from huggingface_hub import EvalResult, ModelCard

    from sparsekv import ScorerAdapter
    from sparsekv.evaluation.reports import card
    from sparsekv.models.tiny import tiny_model
    from sparsekv.scoring.adapter_config import AdapterConfig
    from sparsekv.scoring.card import headline_eval_results

    adapter = ScorerAdapter.for_model(tiny_model("llama"), hidden=8)
    folder = adapter.save_pretrained(tmp_path / "adapter")
    weights = (folder / "model.safetensors").read_bytes()
    fingerprint = adapter.fingerprint()
    assert "model-index" not in (folder / "README.md").read_text()
    _card_grid(tmp_path / "grid", fingerprint)
    assert card.main(["--grid", str(tmp_path / "grid"), "--adapter", str(folder)]) == 0
    assert "share 67%" in capsys.readouterr().out

    head = card.headline(tmp_path / "grid")
    assert head["seed"] == 7 and head["samples"] == 3 and head["budget"] == 0.3
    assert head["share"] == pytest.approx(2 / 3) and head["kl"] == pytest.approx((0.4 + 0.1) / 2)
    expected = [EvalResult(**r) for r in headline_eval_results(head)]
    assert {(r.dataset_config, r.metric_type) for r in expected} == {
        ("passkey", "share_of_full_cache"),
        ("passkey", "kl_from_full_cache"),
        ("ppl", "kl_from_full_cache"),
        ("all", "share_of_full_cache"),
        ("all", "kl_from_full_cache"),
    }
    text = (folder / "README.md").read_text()
    assert "model-index:" in text and "## Evaluation" in text and "Regenerate: `python -m" in text
    assert ModelCard(text).data.eval_results == expected  # the card's metadata reads back
    saved = AdapterConfig.from_dict(json.loads((folder / "config.json").read_text()))
    assert [EvalResult(**r) for r in saved.eval_results] == expected
    again = ScorerAdapter.from_pretrained(folder)
    assert (
        again.fingerprint() == fingerprint
        and (folder / "model.safetensors").read_bytes() == weights
    )
    assert again.model_card() == text  # a later save writes the same card
    # rows of another adapter never fill this one's card
    _card_grid(tmp_path / "other", "0" * 64)
    assert card.main(["--grid", str(tmp_path / "other"), "--adapter", str(folder)]) == 2
    assert "ran adapter 000000000000, not" in capsys.readouterr().err
    assert (
        card.main(["--grid", str(tmp_path / "grid"), "--adapter", str(folder), "--budget", "0.5"])
        == 2
    )
    assert "ran budgets 0.1, 0.3, not 0.5" in capsys.readouterr().err


def _card_shares(adapter: str, grid: str, adapter_hash: str) -> tuple[dict, dict[str, float]]:
    """Checks that a committed adapter's card holds its report grid's headline (the grid ran that
    adapter, whose fingerprint is `adapter_hash`); returns the headline and the card's shares."""
    from huggingface_hub import EvalResult, ModelCard

    from sparsekv import ScorerAdapter
    from sparsekv.evaluation.reports import card
    from sparsekv.scoring.card import headline_eval_results

    root = Path(__file__).resolve().parents[1]
    folder = root / "checkpoints" / adapter
    head = card.headline(root / "docs" / "results" / grid)
    assert head["adapter_hash"] == adapter_hash
    assert ScorerAdapter.from_pretrained(folder).fingerprint() == head["adapter_hash"]
    data = ModelCard((folder / "README.md").read_text()).data
    assert data.eval_results == [EvalResult(**r) for r in headline_eval_results(head)]
    shares = {
        r.dataset_config: r.metric_value
        for r in data.eval_results
        if r.metric_type == "share_of_full_cache"
    }
    return head, shares


def test_the_quick_heads_card_holds_the_seed7_report_grids_headline():
    _, shares = _card_shares(  # the seed-7 grid's head
        "gemma3-270m-sparsekv-quick",
        "generalize-4k",
        "56f3fce47a9170259422c1ac7fe77188530e98419ca34798833d355faab5addd",
    )
    assert shares["passkey"] == 1.5 and round(shares["all"], 2) == 0.97


def test_the_shipped_heads_card_holds_the_seed13_report_grids_headline():
    head, shares = _card_shares(  # the store-trained head
        "gemma3-270m-sparsekv",
        "generalize-4k-s13",
        "e18027c3c6907a159ce340781c16d97b99bf8d3a171338cb85d8e80de1f58168",
    )
    assert head["seed"] == 13 and head["samples"] == 30
    assert round(shares["qa"], 2) == 0.39 and round(shares["all"], 2) == 0.91
