"""A grid of decode-heavy runs (issue 18): every decode sample of an `EvalConfig` under the
full cache (the reference) and every policy x budget, one row per run appended to
`<out>/results.jsonl` as it finishes, so a stopped grid resumes where it stopped.

    python -m sparsekv.evaluation.running.decode_grid --config configs/eval/decode-rerank.yaml
    python -m sparsekv.evaluation.running.decode_grid --config ... --samples 2 --threads 1   # grows it

Rows already in `results.jsonl` (same sample, label and budget) are kept and not rerun; the
reference of a sample is recomputed whenever one of its methods still has to run (its hidden
states are needed for the KL). The folder's `config.yaml` holds the resolved grid of the last
run (with its environment); a grid whose model, dtype, seed, eviction or task options differ
from the folder's is refused. At the end `decode_report.write_decode_report` writes the tables
and plots. The runs themselves are `sparsekv.evaluation.running.decode.run_decode`.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
import yaml

from sparsekv.evaluation.config import REFERENCE, EvalConfig
from sparsekv.evaluation.running.decode_runs import (
    RunnerMethods,
    _check_setup,
    append_row,
    decode_samples,
    read_rows,
    run_sample,
)
from sparsekv.evaluation.running.execute import Runner
from sparsekv.io import write_atomic

__all__ = ["main", "read_rows", "run_decode_grid"]


def run_decode_grid(cfg: EvalConfig, model=None, codec=None, progress: bool = True, report: bool = True,
                    only: set[str] | None = None) -> Path:
    """Run (or resume) the decode grid of `cfg` into `cfg.out`; returns the folder. `only`: run
    just the methods with these labels (several processes can share one grid this way)."""
    import transformers

    from sparsekv._version import __version__
    from sparsekv.evaluation.running.models import load_model

    if cfg.out is None:
        raise ValueError("out is not set: give --out DIR (or out: in the config)")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    _check_setup(out, cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    if model is None:
        model, codec = load_model(cfg.model, cfg.dtype, cfg.attn_implementation, seed=cfg.seed, device=cfg.device)
    runner = Runner(model, codec, cfg)
    runner.plan()  # builds every policy once: a bad spec fails before any work
    builder = RunnerMethods(runner)
    env = {"sparsekv": __version__, "torch": str(torch.__version__), "transformers": transformers.__version__,
           "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
           "torch_threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    resolved = {**cfg.to_dict(), "policy_specs": [p.to_dict() for p in cfg.policy_specs], "environment": env}
    write_atomic(out / "config.yaml", yaml.safe_dump(resolved, sort_keys=False))
    results = out / "results.jsonl"
    done: dict[str, set[tuple[str, str]]] = {}
    for r in read_rows(results):
        if not r.get("error"):
            done.setdefault(r["sample_id"], set()).add((r["policy"], str(r["budget"])))
    want = {(REFERENCE, "1.0")} | {(p.label, str(b)) for p in cfg.policy_specs for b in cfg.budgets_of(p, "agnostic")
                                   if only is None or p.label in only}
    for sample in decode_samples(cfg, codec):
        have = done.get(sample.sample_id, set())
        if want <= have:
            continue
        t0 = time.perf_counter()
        for row in run_sample(model, codec, cfg, sample, builder, have, only):
            append_row(results, row)
            if progress:
                print(f"[decode grid] {sample.sample_id} {row['policy']}@{row['budget']}: "
                      f"kl {row.get('kl_mean')} ppl {row.get('ppl')} recall {row.get('recall')} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    if report:
        from sparsekv.evaluation.reports.decode import write_decode_report

        write_decode_report(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML grid (configs/eval/decode-*.yaml)")
    p.add_argument("--out", help="output folder (default: the config's)")
    p.add_argument("--samples", type=int)
    p.add_argument("--threads", type=int)
    p.add_argument("--only", help="comma-separated labels: run just these methods (the reference always)")
    p.add_argument("--budgets", help="comma-separated budgets instead of the config's (e.g. one budget first)")
    p.add_argument("--report-only", action="store_true", help="rewrite the tables and plots of --out")
    args = p.parse_args(argv)
    cfg = EvalConfig.from_yaml(args.config, out=args.out, samples=args.samples, threads=args.threads,
                               budgets=args.budgets)
    if args.report_only:
        from sparsekv.evaluation.reports.decode import write_decode_report

        write_decode_report(Path(cfg.out))
        return 0
    only = {x.strip() for x in args.only.split(",") if x.strip()} if args.only else None
    if only:
        unknown = sorted(only - {p.label for p in cfg.policy_specs})
        if unknown:
            raise ValueError(f"--only {unknown}: not labels of this grid; labels: "
                             f"{', '.join(p.label for p in cfg.policy_specs)}")
    run_decode_grid(cfg, only=only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
