"""The evaluation harness: tasks from real prose, two protocols, per-task tables and plots.

`sparsekv eval ...` on the command line (`sparsekv.evaluation.cli`), or from Python:

    from sparsekv.evaluation import EvalConfig, run_eval
    run_eval(EvalConfig(out="results/x", model="default", policies=["snapkv", "h2o"],
                        budgets=[0.1, 0.3], tasks=["passkey", "ppl"], lengths=[4096], samples=10))

Modules: `text` (real prose), `tasks` (generators), `config` (the grid), `plan` (the grid's
samples and runs), `execute` (one sample's runs), `outcome` (a run's metrics), `rows` (the row
store: results.jsonl, resume, ingest), `folder` (lock, prompts.jsonl, config.yaml), `runner` (a
grid into its folder, workers), `metrics`, `summary` (the numbers), `report` (summary.csv,
summary.md), `plots` (figures), `models` (which model), `codec` (tokens).
"""

from sparsekv.evaluation import decode_tasks as decode_tasks  # registers the decode_* tasks
from sparsekv.evaluation.config import EvalConfig, PolicySpec, parse_policy
from sparsekv.evaluation.runner import ingest_rows, run_eval
from sparsekv.evaluation.tasks import TASKS, Sample, make_sample

__all__ = ["TASKS", "EvalConfig", "PolicySpec", "Sample", "ingest_rows", "make_sample", "parse_policy", "run_eval"]
