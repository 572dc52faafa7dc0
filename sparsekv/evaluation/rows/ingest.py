"""Rows produced elsewhere (a peer such as kvpress, run on the folder's `prompts.jsonl`) into an
evaluation folder's `results.jsonl`: `ingest`.

Every row is checked field by field against the folder's prompts before any is added, and a bad
row is an error naming the file, the line, the field and the values allowed (the first bad row,
with how many others are bad). Ingested rows can never take the place of the harness's own: a
row claiming `source: sparsekv` (or `--source sparsekv`) is refused, and a row replaces only the
row of its own slot (same source, sample, protocol, policy, budget), so rows of one peer ingested
again replace that peer's earlier rows. What a row must hold:

- `sample_id` (a sample of prompts.jsonl), `task` (that sample's task), `length` (that sample's
  length, an int), `protocol` (one the task runs under), `policy` (a non-empty label), `budget`
  (a fraction in (0, 1] or a token count, an int >= 1);
- optional: `source` (a peer's name, not sparsekv; `--source` overrides it), `score` (in [0, 1];
  when absent, an answer task's `output` is scored here against the prompt's answer, an `error`
  counts as a miss), `output` and `error` (text), `output_ids` (ints), the numbers of
  `ROW_FIELDS` (`kl`, `kl_mean`, bytes and timings: numbers >= 0), `seed` and `prompt_hash`
  (when given, those of the sample in prompts.jsonl). Other fields are kept as they are.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sparsekv.evaluation import metrics as M
from sparsekv.evaluation.rows.folder import read_prompts
from sparsekv.evaluation.rows.identity import prompt_hash
from sparsekv.evaluation.rows.store import (
    RESULTS,
    ROW_FIELDS,
    BadRow,
    _number,
    check_numbers,
    merge_parts,
    read_own,
    supersede,
    unique,
    write_rows_atomic,
)
from sparsekv.evaluation.tasks import TASKS, Sample

REQUIRED_PEER_FIELDS = ("sample_id", "task", "length", "protocol", "policy", "budget")
OWN_SOURCE = "sparsekv"
def check_row(r: Any, s: Sample | None, prompts_path: Path) -> None:
    """Raise `BadRow` naming the first field of peer row `r` that the row format (module
    docstring) refuses; `s` is the sample of prompts.jsonl with the row's sample_id (None: there
    is none)."""
    if not isinstance(r, dict):
        raise BadRow(f"a JSON {type(r).__name__}, not an object; allowed: one row object per line")
    missing = [k for k in REQUIRED_PEER_FIELDS if k not in r]
    if missing:
        raise BadRow(f"missing field(s) {missing}; required: {', '.join(REQUIRED_PEER_FIELDS)}")
    src = r.get("source")
    if src == OWN_SOURCE:
        raise BadRow(
            f"source={src!r} is the harness itself, whose rows ingested rows never "
            "replace; allowed: a peer's name (e.g. kvpress), or leave it out and give --source"
        )
    if src is not None and (not isinstance(src, str) or not src.strip()):
        raise BadRow(
            f"source={src!r} is not a name; allowed: a peer's name (e.g. kvpress), or "
            "leave it out and give --source"
        )
    sid = r["sample_id"]
    if s is None:
        raise BadRow(
            f"sample_id={sid!r} is not a sample of {prompts_path}; allowed: its sample ids"
        )
    if r["task"] != s.task:
        raise BadRow(
            f"task={r['task']!r} contradicts sample_id {sid!r} (a {s.task} sample in "
            f"{prompts_path}); allowed: {s.task!r}"
        )
    length = s.metadata.get("target_length")
    if isinstance(r["length"], bool) or r["length"] != length or not isinstance(r["length"], int):
        raise BadRow(
            f"length={r['length']!r} is not the length of sample {sid!r}; allowed: {length!r}"
        )
    allowed = TASKS[s.task].protocols if s.task in TASKS else ("agnostic", "aware")
    if r["protocol"] not in allowed:
        raise BadRow(
            f"protocol={r['protocol']!r}; allowed values for {s.task}: {', '.join(allowed)}"
        )
    if not isinstance(r["policy"], str) or not r["policy"].strip():
        raise BadRow(f"policy={r['policy']!r} is not a label; allowed: a non-empty string")
    check_numbers(r)
    for k in ("output", "error", "policy_spec"):
        if r.get(k) is not None and not isinstance(r[k], str):
            raise BadRow(f"{k}={r[k]!r} is not text; allowed: a string or null")
    ids = r.get("output_ids")
    if ids is not None and (
        not isinstance(ids, list) or not all(_number(x) and x == int(x) for x in ids)
    ):
        raise BadRow(
            f"output_ids={ids!r:.60} is not a list of token ids; allowed: a list of ints or null"
        )
    seed = s.metadata.get("seed")
    if r.get("seed") is not None and r["seed"] != seed:
        raise BadRow(
            f"seed={r['seed']!r} is not the seed of the prompts in {prompts_path}; "
            f"allowed: {seed!r}"
        )
    if r.get("prompt_hash") is not None and r["prompt_hash"] != prompt_hash(s):
        raise BadRow(
            f"prompt_hash={r['prompt_hash']!r} is not the hash of sample {sid!r} in "
            f"{prompts_path} (the rows ran other prompts); allowed: {prompt_hash(s)!r}"
        )


def read_peer_rows(path: Path) -> list[tuple[int, Any]]:
    """(line number, parsed JSON) of every non-blank line of `path`; raises ValueError naming the
    file and line of one that is not JSON (a peer's file is read whole: no torn-line drop)."""
    if path.is_dir():
        raise ValueError(
            f"--ingest {path} is a folder; give the JSON-lines file of a peer's rows "
            "(one row object per line)"
        )
    if not path.is_file():
        raise ValueError(f"--ingest {path}: no such file")
    out = []
    for i, line in enumerate(path.read_bytes().split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            out.append((i, json.loads(line.decode("utf-8"))))
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            raise ValueError(
                f"--ingest {path}, line {i}: not a JSON row ({e}); fix or remove that line"
            ) from None
    if not out:
        raise ValueError(f"--ingest {path} holds no rows")
    return out


def ingest(out: str | Path, rows_path: str | Path, source: str | None = None) -> int:
    """Add result rows produced elsewhere (e.g. the kvpress peer run on `prompts.jsonl`) to
    `out`/results.jsonl; returns the number of rows added (each slot once). The caller holds the
    folder's lock. Every row is checked first (module docstring); nothing is added unless all
    are valid. A row's `output` is scored here when it carries no `score`."""
    out, rows_path = Path(out), Path(rows_path)
    if source is not None and (
        not isinstance(source, str) or not source.strip() or source == OWN_SOURCE
    ):
        raise ValueError(
            f"--source={source!r}: the name of the rows' producer, not the harness itself; "
            "allowed: a peer's name such as kvpress"
        )
    prompts_path = out / "prompts.jsonl"
    prompts = {s.sample_id: s for s in read_prompts(prompts_path)}
    cleaned, bad = [], []
    for i, r in read_peer_rows(rows_path):
        try:
            check_row(
                r, prompts.get(r.get("sample_id")) if isinstance(r, dict) else None, prompts_path
            )
        except BadRow as e:
            bad.append(f"--ingest {rows_path}, line {i}: {e}")
            continue
        s = prompts[r["sample_id"]]
        row = {k: None for k in ROW_FIELDS}
        row.update(r)
        row["source"] = source or r.get("source") or "peer"
        row["answer"] = s.answer
        row["seed"], row["prompt_hash"] = s.metadata.get("seed"), prompt_hash(s)
        if row.get("error") and row.get("score") is None:
            row["score"] = 0.0  # a crash counts as a miss
        elif row.get("score") is None and s.kind == "answer" and row.get("output") is not None:
            row["score"] = M.score_answer(row["output"], s.answer)
        if row.get("n_tokens") is None:
            row["n_tokens"] = s.metadata.get("n_tokens")
        if row.get("depth") is None:
            row["depth"] = s.metadata.get("depth")
        cleaned.append(row)
    if bad:
        more = (
            f" (and {len(bad) - 1} more bad rows; nothing was added)"
            if len(bad) > 1
            else " (nothing was added)"
        )
        raise ValueError(bad[0] + more)
    cleaned = unique(cleaned, rows_path)
    merge_parts(out)
    results = out / RESULTS
    old = read_own(results) if results.exists() else []
    write_rows_atomic(results, supersede(old, cleaned))
    return len(cleaned)
