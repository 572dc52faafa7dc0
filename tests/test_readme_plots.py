"""README plots (issue 19.6): a few chosen methods, named as in the tables, the retrieval share
and the mean KL, each with the report's own 95% bootstrap interval as error bars, n in the
title."""

from __future__ import annotations

import json

import pytest

from sparsekv.cli import main
from sparsekv.evaluation.reports.plots import readme_figure, readme_series
from sparsekv.evaluation.reports.summary import glance_stats, summarize, views


def _rows() -> list[dict]:
    def row(task, sid, policy, budget, score, kl, source="sparsekv"):
        return {
            "source": source,
            "task": task,
            "length": 512,
            "protocol": "agnostic",
            "sample_id": sid,
            "policy": policy,
            "policy_spec": policy,
            "budget": budget,
            "score": score,
            "kl": kl,
            "kv_bytes_compressed": 100,
        }

    rows = []
    for i in range(6):
        for t in ("passkey", "multikey"):
            sid = f"{t}-{i}"
            rows += [row(t, sid, "full", 1.0, 1.0, 0.0)]
            rows += [
                row(t, sid, "a", 0.1, float(i % 2), 0.3 + 0.2 * (i % 2)),
                row(t, sid, "a", 0.3, float(i % 3 > 0), 0.2),
            ]
            rows += [row(t, sid, "b", 0.1, 0.0, 0.9), row(t, sid, "b", 0.3, float(i == 0), 0.5)]
            rows += [row(t, sid, "snapkv", 0.3, 1.0, 0.1, source="kvpress")]
    return rows


def _computed():
    return {key: glance_stats(*view) for key, view in views(summarize(_rows())).items()}


def test_points_are_the_reports_own_shares_and_intervals():
    computed = _computed()
    pts = readme_series(computed, ["b", "a", "snapkv (kvpress)"])[("agnostic", 512)]
    assert [(p["name"], p["budget"]) for p in pts] == [
        ("b", 0.1),
        ("b", 0.3),
        ("a", 0.1),
        ("a", 0.3),
        ("snapkv (kvpress)", 0.3),
    ]
    stats = {(st["policy"], st["budget"]): st for st in computed[("agnostic", 512)][0]}
    for p in pts:
        st = stats[(p["name"].split(" (")[0], p["budget"])]
        assert (p["share"], p["lo"], p["hi"], p["kl"], p["kl_lo"], p["kl_hi"], p["n"]) == (
            st["share"],
            st["lo"],
            st["hi"],
            st["kl"],
            st["kl_lo"],
            st["kl_hi"],
            6,
        )
    a03 = next(p for p in pts if p["name"] == "a" and p["budget"] == 0.3)
    assert a03["share"] == pytest.approx(4 / 6) and a03["lo"] < a03["share"] < a03["hi"]
    # KL 0.3 or 0.5 per prompt, 3 of each per task: mean 0.4, and resamples move it both ways
    a01 = next(p for p in pts if p["name"] == "a" and p["budget"] == 0.1)
    assert a01["kl"] == pytest.approx(0.4) and 0.3 <= a01["kl_lo"] < 0.4 < a01["kl_hi"] <= 0.5
    # the same KL on every prompt: no spread to show
    assert a03["kl_lo"] == pytest.approx(0.2) and a03["kl_hi"] == pytest.approx(0.2)


def test_the_figure_draws_those_points_with_interval_bars_and_n_in_the_title():
    pts = readme_series(_computed(), ["a", "b"])[("agnostic", 512)]
    fig = readme_figure(pts, "agnostic", 512)
    ax_share, ax_kl = fig.axes
    assert "n = 6 samples per task" in fig._suptitle.get_text()
    bars = {c.get_label(): c for c in ax_share.containers}
    assert set(bars) == {"a", "b"}
    line, _, (segments,) = bars["a"].lines
    mine = [p for p in pts if p["name"] == "a"]
    assert list(line.get_ydata()) == pytest.approx([100 * p["share"] for p in mine])
    spans = [(float(seg[0][1]), float(seg[1][1])) for seg in segments.get_segments()]
    assert spans == [pytest.approx((100 * p["lo"], 100 * p["hi"])) for p in mine]
    kl_bars = {c.get_label(): c for c in ax_kl.containers}
    assert set(kl_bars) == {"a", "b"}
    kl_line, _, (kl_segments,) = kl_bars["a"].lines
    assert list(kl_line.get_ydata()) == pytest.approx([0.4, 0.2])
    kl_spans = [(float(seg[0][1]), float(seg[1][1])) for seg in kl_segments.get_segments()]
    assert kl_spans == [pytest.approx((p["kl_lo"], p["kl_hi"])) for p in mine]
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["full cache", "a", "b"]


def test_unknown_or_too_many_series_are_clear_errors():
    with pytest.raises(
        ValueError,
        match=r"\['c'\] are not methods of this folder; available: 'a', 'b', 'snapkv \(kvpress\)'",
    ):
        readme_series(_computed(), ["a", "c"])
    with pytest.raises(ValueError, match="1 to 6 series"):
        readme_series(_computed(), [f"m{i}" for i in range(7)])


def test_report_only_draws_them_on_request(tmp_path, capsys):
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    assert main(["eval", "--out", str(tmp_path), "--report-only"]) == 0
    assert (
        not list(tmp_path.glob("readme_*.png"))
        and (tmp_path / "quality_agnostic_512.png").is_file()
    )
    assert (
        main(
            [
                "eval",
                "--out",
                str(tmp_path),
                "--report-only",
                "--readme-plots",
                "a",
                "snapkv (kvpress)",
            ]
        )
        == 0
    )
    assert (tmp_path / "readme_agnostic_512.png").stat().st_size > 10_000
    assert (
        main(["eval", "--out", str(tmp_path), "--report-only", "--readme-plots", *"abcdefg"]) == 2
    )
    assert "--readme-plots takes 1 to 6 method names, got 7" in capsys.readouterr().err
