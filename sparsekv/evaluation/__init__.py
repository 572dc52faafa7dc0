"""The evaluation harness: tasks from real prose, two protocols, per-task tables and plots.

`sparsekv eval ...` on the command line (`sparsekv.evaluation.cli`), or from Python:

    from sparsekv.evaluation import EvalConfig, run_eval
    run_eval(EvalConfig(out="results/x", model="default", policies=["snapkv", "h2o"],
                        budgets=[0.1, 0.3], tasks=["passkey", "ppl"], lengths=[4096], samples=10))

Packages: `tasks` (the task families and their registry: `needles`, `words`, `language`,
`decode`, over evaluation-only prose from `text`, tokenized through `codec`), `running` (`plan`:
the grid's samples and runs; `execute`: one sample's runs; `outcome`: a run's metrics; `runner`:
a grid into its folder; `models`: which model; `decode`, `decode_grid`: decode-heavy runs),
`rows` (`store`: results.jsonl, resume; `ingest`: peers' rows, validated; `identity`: the seed,
model, prompt hash and setup every row records; `folder`: lock, prompts.jsonl, config.yaml),
`reports` (`summary`: the numbers; `tables`: summary.csv and summary.md; `plots`; `decode`;
`card`: a grid's headline into an adapter's model card).
Beside them: `config` (the grid, `EvalConfig`), `metrics` (per-sample metrics), `cli`.
"""

from sparsekv.evaluation.config import EvalConfig, PolicySpec, parse_policy
from sparsekv.evaluation.running.runner import ingest_rows, run_eval
from sparsekv.evaluation.tasks import TASKS, Sample, make_sample

__all__ = ["TASKS", "EvalConfig", "PolicySpec", "Sample", "ingest_rows", "make_sample", "parse_policy", "run_eval"]
