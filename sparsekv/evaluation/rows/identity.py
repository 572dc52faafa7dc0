"""What identifies a result row beyond its slot: the seed and model of the grid that wrote it, a
hash of the prompt it ran (`prompt_hash`) and the rest of the grid's setup (dtype, attention,
device, eviction settings, task options, prefill mode), recorded on every row the harness writes
(`row_identity`), and the check that a grid may add rows to a folder (`check_identity`).

A sample id (`passkey-4096-0`) names a task, a length and an index, not the seed or the model
that built the prompt: without these fields a folder whose `config.yaml` was edited, replaced
or deleted could take seed-0 rows for seed-5 rows, or a qwen3 grid's rows for a llama grid's.
Rows written before rows recorded them read their values from the folder: `config.yaml` for the
seed, model and setup, `prompts.jsonl` for the prompt hash.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

from sparsekv.evaluation.config import EvalConfig
from sparsekv.evaluation.rows.folder import SETUP_FIELDS, read_prompts
from sparsekv.evaluation.tasks import Sample

IDENTITY_FIELDS = ("seed", "model", "prompt_hash", "setup")
"""The row fields `row_identity` fills (`rows.store.ROW_FIELDS` ends with them)."""
SETUP_KEYS = tuple(k for k in SETUP_FIELDS if k not in ("seed", "model"))
"""The grid fields a row records in its `setup` mapping."""


def prompt_hash(sample: Sample) -> str:
    """sha256 hex digest of what a run of `sample` was given and scored against: its context,
    question and continuation token ids, its answer and its `max_new_tokens`."""
    what = {
        "context_ids": list(sample.context_ids),
        "question_ids": list(sample.question_ids),
        "target_ids": list(sample.target_ids),
        "answer": sample.answer,
        "max_new_tokens": int(sample.max_new_tokens),
    }
    text = json.dumps(what, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(b"sparsekv-eval-prompt/1\n" + text.encode()).hexdigest()


def setup_of(cfg: EvalConfig | dict[str, Any]) -> dict[str, Any]:
    """The `setup` a row of grid `cfg` records (as config.yaml writes those fields)."""
    d = cfg if isinstance(cfg, dict) else cfg.to_dict()
    return {k: d.get(k) for k in SETUP_KEYS}


def row_identity(
    cfg: EvalConfig, sample: Sample, memo: dict[str, str] | None = None
) -> dict[str, Any]:
    """The identity fields of a row of `cfg` run on `sample`; `memo` (sample id -> prompt hash)
    keeps each sample's hash for its next rows."""
    memo = {} if memo is None else memo
    if sample.sample_id not in memo:
        memo[sample.sample_id] = prompt_hash(sample)
    return {
        "seed": cfg.seed,
        "model": cfg.model,
        "prompt_hash": memo[sample.sample_id],
        "setup": setup_of(cfg),
    }


def _own(row: dict[str, Any]) -> bool:
    return (row.get("source") or "sparsekv") == "sparsekv"


def recorded(row: dict[str, Any], config: dict[str, Any] | None) -> dict[str, Any]:
    """Field -> value of what `row` was run with (`seed`, `model` and the `SETUP_KEYS`): its
    own fields, else the folder's `config` (None where neither says)."""
    setup = row.get("setup") if isinstance(row.get("setup"), dict) else {}
    out = {}
    for k in ("model", "seed", *SETUP_KEYS):
        mine = row.get(k) if k in ("seed", "model") else setup.get(k, None)
        has = (row.get(k) is not None) if k in ("seed", "model") else k in setup
        out[k] = mine if has else (config or {}).get(k)
    return out


def check_identity(
    rows: list[dict[str, Any]],
    cfg: EvalConfig,
    out: str | Path,
    samples: list[Sample],
    config: dict[str, Any] | None,
) -> None:
    """Refuse (ValueError, one line naming the field, both values and how many rows) a grid `cfg`
    adding rows to folder `out` whose `rows` were run with another model, seed or setup, or on
    other prompts under the same sample ids. `config` is the folder's config.yaml (None if it
    has none); its `prompts.jsonl` stands in for the prompt hash of rows that do not record one.
    Rows of a peer are checked for their seed and prompts only (its model and setup are its own).
    Own rows that record nothing and a folder without config.yaml: refused (nothing says what
    they were run with)."""
    out = Path(out)
    new = {"model": cfg.model, "seed": cfg.seed, **setup_of(cfg)}
    differ: Counter = Counter()
    unknown = 0
    for r in rows:
        own = _own(r)
        rec = recorded(r, config)
        if own and rec["model"] is None and rec["seed"] is None:
            unknown += 1
            continue
        for k, v in rec.items():
            if (own or k == "seed") and v is not None and v != new[k]:
                src = (
                    "the rows"
                    if (r.get(k) is not None or k in (r.get("setup") or {}))
                    else "config.yaml"
                )
                differ[(k, json.dumps(v, sort_keys=True, default=str), src)] += 1
    if differ:
        (k, old, src), n = next(iter(differ.items()))
        more = f" (and {len(differ) - 1} more differences)" if len(differ) > 1 else ""
        raise ValueError(
            f"{out} holds {n} rows run with {k}={json.loads(old)!r} (recorded in {src}), this grid "
            f"has {k}={new[k]!r}{more}; rows of two settings never share a folder (neither "
            "--resume nor --overwrite mixes them): use another --out (or the same setting)"
        )
    if unknown:
        raise ValueError(
            f"{out} holds {unknown} rows that record neither their seed nor their model, and no "
            "config.yaml says what they were run with; restore the folder's config.yaml or use "
            "another --out"
        )
    check_prompts(rows, out, samples)


def check_prompts(rows: list[dict[str, Any]], out: Path, samples: list[Sample]) -> None:
    """Refuse rows whose sample id is among `samples` but whose prompt differs (their
    `prompt_hash`, else the hash of that sample in the folder's prompts.jsonl)."""
    new = {s.sample_id: prompt_hash(s) for s in samples}
    ids = {r["sample_id"] for r in rows if r.get("sample_id") in new}
    if not ids:
        return
    old: dict[str, str] = {}
    if any(not r.get("prompt_hash") for r in rows if r.get("sample_id") in ids):
        path = out / "prompts.jsonl"
        if path.is_file():
            old = {s.sample_id: prompt_hash(s) for s in read_prompts(path) if s.sample_id in ids}
    bad = [
        r
        for r in rows
        if r.get("sample_id") in ids
        and (r.get("prompt_hash") or old.get(r["sample_id"])) not in (None, new[r["sample_id"]])
    ]
    if bad:
        by = "its prompt_hash" if bad[0].get("prompt_hash") else "the folder's prompts.jsonl"
        raise ValueError(
            f"{out} holds {len(bad)} rows (e.g. {bad[0]['sample_id']}, by {by}) run on other "
            "prompts than this grid builds under the same sample ids (another seed, tokenizer, "
            "task option or generator); rows of two prompt sets never share a folder: use "
            "another --out"
        )
