"""Result rows of a kvpress peer run, in the harness's format: the fields and metric functions
read from the sparsekv source tree (so both sides cannot drift apart), one row per run, and the
loop that runs a `Plan` and writes its rows. Imports neither kvpress nor sparsekv.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvp_plan import (
    EVAL_SRC,
    PRESSES,
    REFERENCE_LABEL,
    SOURCE,
    Plan,
    PressRunner,
    PressSpec,
    RawRun,
    compression_ratio,
    split_prompt,
)


def load_harness_metrics(src: Path = EVAL_SRC):
    """`sparsekv/evaluation/metrics.py` as a standalone module (it imports only torch and the
    standard library), so that scores and KL here are the harness's own functions."""
    path = src / "metrics.py"
    spec = importlib.util.spec_from_file_location("sparsekv_eval_metrics", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the harness's metrics from {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def harness_row_fields(src: Path = EVAL_SRC) -> tuple[str, ...]:
    """`ROW_FIELDS` of the harness's row store (`sparsekv/evaluation/rows/store.py`), read from its
    source (not imported: the harness needs a newer transformers than kvpress accepts)."""
    for name in ("rows/store.py", "rows.py", "runner.py"):
        if not (src / name).is_file():
            continue
        tree = ast.parse((src / name).read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                getattr(t, "id", None) == "ROW_FIELDS" for t in node.targets
            ):
                return tuple(ast.literal_eval(node.value))
    raise ValueError(f"no ROW_FIELDS in {src / 'rows' / 'store.py'}")


def new_row(
    fields: tuple[str, ...],
    sample: dict[str, Any],
    protocol: str,
    label: str,
    spec_text: str,
    budget,
) -> dict[str, Any]:
    row: dict[str, Any] = {k: None for k in fields}
    meta = sample.get("metadata", {})
    row.update(
        source=SOURCE,
        sample_id=sample["sample_id"],
        task=sample["task"],
        length=meta.get("target_length"),
        n_tokens=meta.get("n_tokens"),
        protocol=protocol,
        policy=label,
        policy_spec=spec_text,
        budget=budget,
        answer=sample["answer"],
        depth=meta.get("depth"),
    )
    return row


def fill_row(
    row: dict[str, Any], sample: dict[str, Any], raw: RawRun, ref: RawRun | None, metrics
) -> dict[str, Any]:
    """Metrics of one run, as the harness's `Runner._fill` computes them (first compressed step 0)."""
    import torch

    lp = raw.step_logprobs
    row.update(
        kv_bytes_compressed=int(raw.kv_bytes_compressed),
        kv_bytes_end=int(raw.kv_bytes_end),
        peak_rss_mb=round(raw.peak_rss_mb, 1),
        prefill_s=round(raw.prefill_s, 4),
        decode_s=round(raw.decode_s, 4),
    )
    row.update(raw.extra)
    if sample["kind"] == "continuation":
        tgt = torch.tensor(sample["target_ids"][1:])
        nll = -lp.gather(-1, tgt[:, None])[:, 0]
        row["nll"] = float(nll.mean())
        row["ppl"] = math.exp(row["nll"])
        row["top1"] = float((lp.argmax(-1) == tgt).float().mean())
        row["score"] = row["top1"]
        row["output"], row["output_ids"] = "", []
        if ref is not None:
            row["kl_mean"] = row["kl"] = float(metrics.kl_divergence(ref.step_logprobs, lp).mean())
        return row
    out = list(raw.output_ids)
    n = len(out)
    row["output_ids"], row["output"], row["new_tokens"] = out, raw.output, n
    row["decode_tok_s"] = round((n - 1) / raw.decode_s, 2) if n > 1 and raw.decode_s > 0 else None
    row["repetition"] = metrics.repetition_rate(out)
    if sample["kind"] == "answer":
        row["score"] = metrics.score_answer(raw.output, sample["answer"])
    if ref is not None:
        agree, prefix = metrics.token_agreement(ref.output_ids, out)
        row["agreement"], row["prefix_match"] = agree, prefix
        if sample["kind"] == "generate":
            row["score"] = agree
        valid = [t for t in range(min(len(ref.step_logprobs), len(lp))) if t <= prefix]
        if valid:
            kls = metrics.kl_divergence(ref.step_logprobs[valid], lp[valid])
            row["kl_mean"], row["kl"] = float(kls.mean()), float(kls[0])
    return row


def error_row(row: dict[str, Any], err: BaseException) -> dict[str, Any]:
    row["error"] = f"{type(err).__name__}: {err}"
    row["score"] = 0.0  # a crash counts as a miss
    return row


def clean(row: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (None if isinstance(v, float) and (math.isnan(v) or math.isinf(v)) else v)
        for k, v in row.items()
    }


def row_key(row: dict[str, Any]) -> tuple:
    return (row["policy"], str(row["budget"]), row["protocol"], row["sample_id"])


def spec_text(spec: PressSpec, ratio: float, layer_types: list[str] | None) -> str:
    cls, kwargs, eager = PRESSES[spec.press]
    args = ", ".join([f"compression_ratio={ratio:.4g}"] + [f"{k}={v!r}" for k, v in kwargs.items()])
    inner = f"{cls}({args})"
    if spec.layers == "full" and layer_types:
        full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        inner = f"PerLayerCompressionPress({inner}, layers {','.join(map(str, full))}; others 0)"
    return inner + (" [eager attention]" if eager else "")


def run_plan(
    plan: Plan,
    runner: PressRunner,
    write: Callable[[dict[str, Any]], None],
    fields: tuple[str, ...],
    metrics,
    layer_types: list[str] | None = None,
    done: set[tuple] | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Run every (sample, protocol, spec, budget) of `plan`; `write` gets each row as it is made.

    The reference (no press) runs first for each sample and protocol, since every other row's KL
    and agreement are taken against it; rows whose key is in `done` are not run again (resume).
    """
    from tqdm.auto import tqdm

    done = done or set()
    runs = plan.runs()

    def key_of(s: dict[str, Any], p: str, spec: PressSpec | None, budget) -> tuple:
        return (REFERENCE_LABEL if spec is None else spec.label, str(budget), p, s["sample_id"])

    todo = [r for r in runs if key_of(*r) not in done]
    # the reference is re-run (not re-written) when its sample still has rows to make
    need_ref = {(s["sample_id"], p) for s, p, spec, _ in todo if spec is not None}
    bar = tqdm(
        total=sum(s["metadata"].get("n_tokens", 1) for s, *_ in todo),
        unit="tok",
        unit_scale=True,
        desc=f"kvpress {len(todo)} runs",
        disable=not progress,
        dynamic_ncols=True,
    )
    rows: list[dict[str, Any]] = []
    ref: RawRun | None = None
    ref_key = None
    for s, p, spec, budget in runs:
        label = REFERENCE_LABEL if spec is None else spec.label
        key = key_of(s, p, spec, budget)
        if key in done and not (spec is None and (s["sample_id"], p) in need_ref):
            continue
        bar.set_postfix_str(f"{s['sample_id']} {p} {label}@{budget}", refresh=False)
        ctx, _, _ = split_prompt(s, p)
        if spec is None:
            text = "kv-press-text-generation pipeline without a press (cache from the model config)"
        else:
            text = spec_text(spec, compression_ratio(budget, len(ctx)), layer_types)
        row = new_row(fields, s, p, label, text, budget)
        try:
            raw = runner.run(s, p, spec, budget)
            if spec is None:
                ref, ref_key = raw, (s["sample_id"], p)
            cur_ref = ref if ref_key == (s["sample_id"], p) else None
            row = fill_row(row, s, raw, cur_ref, metrics)
            if spec is None:
                row["kl"] = row["kl_mean"] = 0.0
        except Exception as e:  # noqa: BLE001 - a crashing press is a measured miss, not a stop
            if spec is None:
                ref, ref_key = None, None
            row = error_row(row, e)
            print(
                f"\n[kvpress peer] {label} @ {budget} on {s['sample_id']} ({p}) failed: {row['error']}",
                file=sys.stderr,
            )
        if key not in done:
            write(clean(row))
            rows.append(row)
        bar.update(s["metadata"].get("n_tokens", 1))
    bar.close()
    return rows


def resume_keys(path: Path) -> set[tuple]:
    """Keys of the rows already in `path` (a rows file being resumed). A torn last line (the
    writer was killed mid-row) is cut off, so the rows appended next start on a line of their
    own; any other line that is not JSON is an error naming the file and line."""
    import json

    if not path.exists():
        return set()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        print(f"[kvpress peer] {path}: dropping a torn last line", file=sys.stderr)
        with open(path, "r+b") as f:
            f.truncate(end)
        data = data[:end]
    keys = set()
    for i, line in enumerate(data.decode().splitlines(), 1):
        if line.strip():
            try:
                keys.add(row_key(json.loads(line)))
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{i} is not a JSON row; fix or remove it") from None
    return keys
