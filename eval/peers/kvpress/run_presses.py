"""The kvpress peer run: NVIDIA kvpress's presses on the prompts of a sparsekv evaluation, through
kvpress's own pipeline, written as result rows in the harness's format (the command line).

This script runs in its own environment (kvpress pins transformers < 5.3; `run.sh` beside it
creates that environment) and does not import the `sparsekv` package. Its parts, each in a file
of its own beside it:
- `kvp_plan.py`: the presses, the grid of runs, how a sample's prompt is fed to the pipeline;
- `kvp_rows.py`: the harness's row fields and metric functions, read from the sparsekv source
  tree (`sparsekv/evaluation/rows/store.py`, `metrics.py`) so both sides cannot drift; one row per run;
- `kvp_pipeline.py`: the kvpress side (the pipeline, measured; multi-token inputs fed causally
  when only the full-attention layers are compressed; kvpress's warnings kept in the rows);
- `kvp_gate.py`: the gate a peer's rows pass before they enter a table (its no-press run
  reproduces sparsekv's full cache on the same prompts).

Input: `prompts.jsonl` as written by `sparsekv eval` (every run, or `--dump-prompts`): per sample
its token ids (`context_ids` with BOS, `question_ids`, `target_ids`), texts, answer, kind and the
protocols it runs under. The prompt ids are fed to the pipeline as they are: kvpress's text
preprocessing (a newline after the question, or a chat template) is skipped so that both sides
see exactly the same tokens.

How one run goes, with the pipeline's `forward` (prefill of the context under the press, which
compresses the cache after each layer's prefill; then the question through the compressed cache
and greedy decoding; the answer is removed from the cache afterwards):
- "answer" samples, agnostic protocol: context = the sample's context, question = its question.
- "answer" samples, aware protocol: context = context + question minus its last token, which is
  fed as the question (kvpress's own way of putting the question in the compressed part).
- "generate" samples (no question): context minus its last token, which is fed as the question.
- "continuation" samples: context, then the held-out continuation (all but its last token)
  teacher-forced as the question; the log-probabilities of every position are rebuilt from the
  final hidden states (the pipeline keeps only the last position's logits).

Presses run two ways on models that mix sliding-window and full-attention layers (Gemma 3):
"all" = every layer compressed, sliding windows included, with the pipeline's default cache (as
users get them); "full" = only the full-attention layers, through `PerLayerCompressionPress`
(ratio 0 elsewhere) and a cache built from the model's config, so the sliding-window layers stay
as transformers keeps them, like the harness's caches. compression_ratio = 1 - budget (a
fraction) or 1 - budget / prompt tokens (a token count). A run that raises is a row with
`error` set and score 0 (a miss). KL(no press || press) is taken against the pipeline's own
no-press run in this environment.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvp_plan import (
    LAYER_MODES,
    PRESSES,
    PROTOCOLS,
    REFERENCE_LABEL,
    Plan,
    PressSpec,
    RawRun,
    compression_ratio,
    parse_budgets,
    parse_list,
    read_prompts,
    skip_reason,
    split_prompt,
)
from kvp_rows import (
    fill_row,
    harness_row_fields,
    load_harness_metrics,
    new_row,
    resume_keys,
    row_key,
    run_plan,
    spec_text,
)

__all__ = [
    "LAYER_MODES",
    "PRESSES",
    "PROTOCOLS",
    "REFERENCE_LABEL",
    "Plan",
    "PressSpec",
    "RawRun",
    "build_parser",
    "compression_ratio",
    "fill_row",
    "harness_row_fields",
    "load_harness_metrics",
    "main",
    "make_plan",
    "new_row",
    "parse_budgets",
    "parse_list",
    "read_prompts",
    "resume_keys",
    "row_key",
    "run_plan",
    "skip_reason",
    "spec_text",
    "split_prompt",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run_presses.py",
        description="Run kvpress's presses on a sparsekv prompts.jsonl through kvpress's pipeline and "
        "write result rows in the harness's format (see README.md beside this file).",
    )
    p.add_argument(
        "--prompts",
        required=True,
        help="prompts.jsonl written by `sparsekv eval` (or --dump-prompts)",
    )
    p.add_argument(
        "--out", required=True, help="rows file to write (JSON lines), e.g. results/x/kvpress.jsonl"
    )
    p.add_argument(
        "--config",
        help="the evaluation's config.yaml: budgets, model, dtype, attention when not given",
    )
    p.add_argument(
        "--model", help="local Hugging Face model folder (run.sh passes the default model's)"
    )
    p.add_argument(
        "--budget",
        "--budgets",
        dest="budgets",
        help="comma-separated budgets, by the harness's rule: fractions in (0, 1] (compression_ratio = 1 - budget), "
        "token counts >= 2 or Ntok (1tok, 512tok); 2.0 and a bare 1 are refused",
    )
    p.add_argument(
        "--presses", default=",".join(PRESSES), help=f"comma-separated, from: {', '.join(PRESSES)}"
    )
    p.add_argument(
        "--layers",
        default=",".join(LAYER_MODES),
        help="'all' (every layer compressed, as users get them) and/or 'full' (only the "
        "full-attention layers, via PerLayerCompressionPress); 'full' needs sliding layers",
    )
    p.add_argument(
        "--protocol",
        "--protocols",
        dest="protocols",
        default="agnostic",
        help="agnostic (question after compression; the pipeline's protocol) and/or aware",
    )
    p.add_argument("--tasks", help="only these tasks (comma-separated)")
    p.add_argument("--samples", type=int, help="only the first N samples of each task and length")
    p.add_argument("--dtype", help="float32 (default), bfloat16 or float16")
    p.add_argument("--attn", dest="attn_implementation", help="sdpa (default) or eager")
    p.add_argument("--threads", type=int, help="torch threads")
    p.add_argument(
        "--reference-only",
        action="store_true",
        help="run only the no-press reference (what the gate compares with sparsekv's full cache)",
    )
    p.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the no-press run (then no KL and no agreement)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the rows already in --out and make only the rest",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print the plan (runs per method) and exit"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _read_config(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path!r} must hold a mapping of fields")
    return data


def make_plan(args: argparse.Namespace, cfg: dict[str, Any]) -> Plan:
    samples = read_prompts(args.prompts)
    if args.tasks:
        wanted = [t.strip() for t in args.tasks.split(",") if t.strip()]
        unknown = sorted(set(wanted) - {s["task"] for s in samples})
        if unknown:
            raise ValueError(
                f"--tasks {unknown} not in {args.prompts}; it holds: "
                f"{', '.join(sorted({s['task'] for s in samples}))}"
            )
        samples = [s for s in samples if s["task"] in wanted]
    if args.samples is not None:
        if args.samples < 1:
            raise ValueError(f"--samples {args.samples} must be >= 1")
        samples = [s for s in samples if s["metadata"].get("index", 0) < args.samples]
    budgets = (
        [1.0]
        if args.reference_only
        else parse_budgets(args.budgets if args.budgets is not None else cfg.get("budgets") or "")
    )
    presses = parse_list(args.presses, PRESSES, "--presses")
    layers = parse_list(args.layers, LAYER_MODES, "--layers")
    protocols = parse_list(args.protocols, PROTOCOLS, "--protocol")
    specs = [] if args.reference_only else [PressSpec(p, m) for m in layers for p in presses]
    if args.reference_only and args.no_reference:
        raise ValueError("--reference-only and --no-reference exclude each other")
    return Plan(samples, specs, budgets, protocols, reference=not args.no_reference)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = _read_config(args.config)
    plan = make_plan(args, cfg)
    runs = plan.runs()
    per: dict[str, int] = {}
    for _, _, spec, _ in runs:
        per[REFERENCE_LABEL if spec is None else spec.label] = (
            per.get(REFERENCE_LABEL if spec is None else spec.label, 0) + 1
        )
    print(
        f"[kvpress peer] {len(plan.samples)} samples, {len(runs)} runs: "
        + ", ".join(f"{k} {v}" for k, v in per.items()),
        file=sys.stderr,
    )
    for reason, n in plan.skipped().items():
        print(f"[kvpress peer] {n} runs {reason}", file=sys.stderr)
    if args.dry_run:
        return 0
    model = args.model or cfg.get("model")
    if not model or model == "default" or str(model).startswith("tiny:"):
        raise ValueError(
            "give --model: a local Hugging Face model folder (run.sh passes the default model's); "
            f"config model {model!r} cannot be loaded here"
        )
    if not (Path(model) / "config.json").is_file():
        raise ValueError(f"--model {model!r} is not a model folder with a config.json")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    fields = harness_row_fields()
    t0 = time.perf_counter()
    from kvp_pipeline import KVPressRunner

    runner = KVPressRunner(
        model,
        args.dtype or cfg.get("dtype") or "float32",
        args.attn_implementation or cfg.get("attn_implementation") or "sdpa",
    )
    print(
        f"[kvpress peer] model loaded in {time.perf_counter() - t0:.1f}s; kvpress {runner.versions['kvpress']}, "
        f"transformers {runner.versions['transformers']}, torch {runner.versions['torch']}",
        file=sys.stderr,
    )
    if not runner.has_sliding_layers and any(s.layers == "full" for s in plan.specs):
        print(
            "[kvpress peer] the model has no sliding-window layers: 'full' equals 'all', running 'all' only",
            file=sys.stderr,
        )
        plan.specs = [s for s in plan.specs if s.layers == "all"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done: set[tuple] = set()
    if args.resume:
        done = resume_keys(out)
    times: dict[str, list[float]] = {}
    with open(out, "a" if args.resume else "w") as f:

        def write(row: dict[str, Any]) -> None:
            f.write(json.dumps(row) + "\n")
            f.flush()
            if not row.get("error"):
                times.setdefault(row["policy"], []).append(
                    (row["prefill_s"] or 0) + (row["decode_s"] or 0)
                )

        rows = run_plan(
            plan,
            runner,
            write,
            fields,
            runner.metrics,
            runner.layer_types,
            done,
            progress=not args.no_progress,
        )
    errors = sum(1 for r in rows if r.get("error"))
    print(
        f"[kvpress peer] wrote {len(rows)} rows ({errors} errors) to {out} in {time.perf_counter() - t0:.0f}s",
        file=sys.stderr,
    )
    for label, ts in times.items():
        print(
            f"[kvpress peer]   {label:<24} {len(ts):>4} runs, {sum(ts) / len(ts):6.2f} s per run (prefill+decode)",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:
        print(f"run_presses.py: error: {e}", file=sys.stderr)
        sys.exit(2)
