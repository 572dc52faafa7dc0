"""The row store of an evaluation folder: reading, writing and merging `results.jsonl` and the
part files a run appends to, and what a resume keeps (rows from peers come in through
`rows.ingest`; what else identifies a row is `rows.identity`).

Rows are never dropped. Each row fills one slot, `(source, sample_id, protocol, policy label,
budget)`; a new row replaces an old one only in the same slot (a rerun under `--overwrite`, or a
peer's rows ingested again), every other row stays. A run appends its rows to
`results.part-<k>.jsonl` as they finish; they are folded into results.jsonl (atomically: a temporary
file and a rename) when the run ends, when it is stopped, and before the next run starts. A torn
last line (a process killed mid-write) is dropped with a warning; damage elsewhere is an error
naming the file and line. A row repeated in one slot (a file appended twice) is read once: the
last one, in the place of the first, with a note on stderr (`unique`).

Row format (also what peers such as kvpress write; see `ingest`): `sample_id`, `task`,
`length`, `protocol`, `policy` (label), `budget` (1.0 for the reference), `source`
("sparsekv" or the peer's name), `output` (generated text), `score`, `kl`, `kl_mean`,
`kv_bytes_compressed`, `kv_bytes_end`, `peak_rss_mb`, `prefill_s`, `decode_tok_s`,
`error` (None, or the error text of a run that crashed: it counts as a miss), `adapter_hash`
(learned policies: `ScorerAdapter.fingerprint()` of the adapter that ran), `seed`, `model`,
`prompt_hash` and `setup` (what else identifies the row: `rows.identity`), plus the per-task
extras listed in `ROW_FIELDS`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sparsekv.evaluation.config import REFERENCE, EvalConfig, lora_spec_text
from sparsekv.io import read_jsonl, write_atomic

ROW_FIELDS = (
    "source",
    "sample_id",
    "task",
    "length",
    "n_tokens",
    "protocol",
    "policy",
    "policy_spec",
    "budget",
    "answer",
    "output",
    "output_ids",
    "score",
    "kl",
    "kl_mean",
    "nll",
    "ppl",
    "top1",
    "agreement",
    "prefix_match",
    "repetition",
    "kv_bytes_compressed",
    "kv_bytes_end",
    "peak_rss_mb",
    "prefill_s",
    "decode_s",
    "decode_tok_s",
    "new_tokens",
    "depth",
    "error",
    "kv_bytes_peak",
    "prefill_shared",
    "fork_s",
    "adapter_hash",
    "learned_settings",
    "seed",
    "model",
    "prompt_hash",
    "setup",
)
RESULTS = "results.jsonl"
PART_GLOB = "results.part-*.jsonl"


NON_NEGATIVE = (
    "kl",
    "kl_mean",
    "nll",
    "ppl",
    "kv_bytes_compressed",
    "kv_bytes_end",
    "kv_bytes_peak",
    "peak_rss_mb",
    "prefill_s",
    "decode_s",
    "decode_tok_s",
    "fork_s",
    "new_tokens",
    "prefix_match",
    "n_tokens",
)
UNIT = ("top1", "agreement", "repetition", "depth")
KL_SLACK = 1e-6  # a peer's KL computed in float32 may come out a hair below 0


class BadRow(ValueError):
    """One field of one row is not what the row format allows."""


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_number(
    row: dict[str, Any], k: str, low: float, high: float | None, allowed: str
) -> None:
    v = row.get(k)
    if v is None:
        return
    if not _number(v):
        raise BadRow(f"{k}={v!r} is not a number; allowed: {allowed} or null")
    if math.isnan(v) or math.isinf(v):  # written as null, as the harness writes them
        return
    if v < low or (high is not None and v > high):
        raise BadRow(f"{k}={v!r} is out of range; allowed: {allowed} or null")


def check_budget(v: Any) -> None:
    if not _number(v):
        raise BadRow(
            f"budget={v!r} is not a number; allowed: a fraction in (0, 1] (a float) or a "
            "token count (an int >= 1)"
        )
    if isinstance(v, float) and not 0.0 < v <= 1.0:
        raise BadRow(
            f"budget={v!r} is out of range; allowed: a fraction in (0, 1] (a float) or a "
            "token count (an int >= 1)"
        )
    if isinstance(v, int) and v < 1:
        raise BadRow(f"budget={v!r} is out of range; allowed: a token count is an int >= 1")


def check_numbers(r: dict[str, Any]) -> None:
    """The budget, the score (in [0, 1]), the non-negative numbers (`NON_NEGATIVE`: KL, bytes,
    timings) and the unit ones (`UNIT`) of row `r` are what a row may hold, else `BadRow`."""
    check_budget(r["budget"])
    _check_number(r, "score", 0.0, 1.0, "a number in [0, 1]")
    for k in NON_NEGATIVE:
        _check_number(r, k, -KL_SLACK if k.startswith("kl") else 0.0, None, "a number >= 0")
    for k in UNIT:
        _check_number(r, k, 0.0, 1.0, "a number in [0, 1]")


SLOT_FIELDS = ("sample_id", "protocol", "policy", "budget")
"""The fields of a row's slot."""
REQUIRED = (*SLOT_FIELDS, "score")
"""What every row read from a folder must hold."""


def check_rows(rows: list[dict[str, Any]], path: str | Path) -> list[dict[str, Any]]:
    """`rows` of `path` (a folder's results.jsonl or part file) after checking each holds its
    slot's fields and a `score` (a number in [0, 1], or null for a run that failed), and that
    its numbers are numbers: ValueError naming the file, the row and the field (a row edited by
    hand, a file from another tool) instead of a KeyError or a report that shows a blank."""
    for i, r in enumerate(rows, 1):
        try:
            missing = [k for k in REQUIRED if k not in r]
            if missing:
                raise BadRow(f"missing field(s) {missing}; every row holds {', '.join(REQUIRED)}")
            for k in ("sample_id", "protocol", "policy"):
                if not isinstance(r[k], str) or not r[k].strip():
                    raise BadRow(f"{k}={r[k]!r} is not a name; allowed: a non-empty string")
            check_numbers(r)
        except BadRow as e:
            raise ValueError(
                f"{path}: row {i} ({r.get('sample_id', '?')}, {r.get('policy', '?')}): {e}; fix "
                "or remove that row"
            ) from None
    return rows


def read_own(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a folder's results file, checked (`check_rows`), each slot once (`unique`)."""
    return unique(check_rows(read_rows(path), path), path)


def slot(row: dict[str, Any]) -> tuple[str, str, str, str, str]:
    """The slot a row fills: (source, sample_id, protocol, policy label, budget as text)."""
    return (
        row.get("source") or "sparsekv",
        row["sample_id"],
        row["protocol"],
        row["policy"],
        str(row["budget"]),
    )


def part_path(out: Path, k: int) -> Path:
    return Path(out) / f"results.part-{k}.jsonl"


def part_files(out: Path) -> list[Path]:
    return sorted(Path(out).glob(PART_GLOB))


# ---- reading and writing ------------------------------------------------------------------
def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file (`sparsekv.io.read_jsonl`: a torn last line is dropped with
    a warning; a bad line before it raises ValueError naming it)."""
    return read_jsonl(path)


def _json_default(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.tolist()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def _clean(row: dict) -> dict:
    return {
        k: (None if isinstance(v, float) and (math.isnan(v) or math.isinf(v)) else v)
        for k, v in row.items()
    }


def dump_row(f, row: dict[str, Any]) -> None:
    """Append one row (NaN and inf as null) to an open text file and flush it."""
    f.write(json.dumps(_clean(row), default=_json_default) + "\n")
    f.flush()


def write_rows_atomic(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace `path` by `rows` atomically (`sparsekv.io.write_atomic`)."""
    write_atomic(path, "".join(json.dumps(_clean(r), default=_json_default) + "\n" for r in rows))


def supersede(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`old` with each row of `new` put in its slot: replacing the old row of the same slot in
    place, or appended. Rows of other slots are never touched."""
    out = list(old)
    where = {slot(r): i for i, r in enumerate(out)}
    for r in new:
        k = slot(r)
        if k in where:
            out[where[k]] = r
        else:
            where[k] = len(out)
            out.append(r)
    return out


def unique(rows: list[dict[str, Any]], where: str | Path | None = None) -> list[dict[str, Any]]:
    """`rows` with each slot once: a row repeated in its slot (the same row appended twice, or a
    later row of the same slot) is kept once, the last one in the place of the first (as
    `supersede` puts it), with a note on stderr naming `where`. Rows are never counted twice."""
    out = supersede([], rows)
    if len(out) < len(rows):
        import sys

        print(
            f"[sparsekv eval] {where or 'rows'}: {len(rows) - len(out)} duplicate rows repeat the "
            "slot (source, sample, protocol, policy, budget) of an earlier row; each slot is "
            "read once (the last row)",
            file=sys.stderr,
        )
    return out


def folder_rows(out: Path) -> list[dict[str, Any]]:
    """Every row of `out`, each slot once (`unique`): results.jsonl, then what the part files of
    a stopped run hold."""
    results = Path(out) / RESULTS
    rows = read_own(results) if results.exists() else []
    for p in part_files(out):
        rows = supersede(rows, check_rows(read_rows(p), p))
    return rows


def count_rows(out: str | Path) -> int:
    """How many rows `out` holds (results.jsonl and part files; 0 for a new or missing folder)."""
    out = Path(out)
    results = out / RESULTS
    if (not results.exists() or results.stat().st_size == 0) and not part_files(out):
        return 0
    return len(folder_rows(out))


def merge_parts(out: str | Path) -> int:
    """Fold the part files in `out` into results.jsonl (each part row in its slot) and remove
    them. Returns the number of part rows folded in (0 when there were no part files)."""
    out = Path(out)
    parts = part_files(out)
    if not parts:
        return 0
    results = out / RESULTS
    rows = read_own(results) if results.exists() else []
    new = [r for p in parts for r in check_rows(read_rows(p), p)]
    write_rows_atomic(results, supersede(rows, new))
    for p in parts:
        p.unlink()
    return len(new)


# ---- what a resume keeps -------------------------------------------------------------------
@dataclass
class Finished:
    """What the rows of a folder already hold for a grid.

    `done[(sample_id, protocol)]` are the method keys (label, budget) whose rows a resume keeps;
    `conflicts` are the messages of rows in a slot of the grid that another method filled (its
    label meant another spec, or another adapter: their slots are not done); `legacy` counts
    learned rows written before rows recorded `adapter_hash`, per label (kept as done)."""

    done: dict[tuple[str, str], set[tuple[str, str]]] = field(default_factory=dict)
    conflicts: list[str] = field(default_factory=list)
    legacy: dict[str, int] = field(default_factory=dict)


def finished(
    rows: list[dict[str, Any]],
    cfg: EvalConfig,
    hashes: dict[str, str | None],
    out: Path,
    settings: dict[str, dict[str, Any]] | None = None,
) -> Finished:
    """Sort the folder's own rows (source sparsekv) against the grid `cfg`, whose learned
    methods run the adapters of fingerprint `hashes[spec.spec]` with the resolved settings
    `settings[spec.spec]`. A row counts as done unless its label belongs to a grid method under
    the same protocol that it does not match: another spec text, or (when both are known)
    another adapter fingerprint or other settings (an adapter whose recorded use changed)."""
    settings = settings or {}
    specs = {(pr, p.label): p for p in cfg.policy_specs for pr in cfg.protocols if p.runs_under(pr)}
    res = Finished()
    clash: dict[tuple, list] = {}
    for r in rows:
        if (r.get("source") or "sparsekv") != "sparsekv":
            continue
        label, pr = r["policy"], r["protocol"]
        spec = specs.get((pr, label))
        if spec is not None and label != REFERENCE:
            old_spec, old_hash, new_hash = (
                r.get("policy_spec"),
                r.get("adapter_hash"),
                hashes.get(spec.spec),
            )
            # a method that ran its adapter's LoRA records `...@lora=true` (`lora_spec_text`)
            if old_spec is not None and old_spec not in (spec.spec, lora_spec_text(spec.spec)):
                clash.setdefault(("spec", label, pr, old_spec, spec.spec), []).append(r)
                continue
            if old_hash and new_hash and old_hash != new_hash:
                clash.setdefault(("adapter", label, pr, old_hash, new_hash), []).append(r)
                continue
            old_set, new_set = r.get("learned_settings"), settings.get(spec.spec)
            if old_set and new_set and old_set != new_set:
                clash.setdefault(
                    ("settings", label, pr, _settings_text(old_set, new_set), ""), []
                ).append(r)
                continue
            if new_hash and not old_hash:
                res.legacy[label] = res.legacy.get(label, 0) + 1
        res.done.setdefault((r["sample_id"], pr), set()).add((label, str(r["budget"])))
    for (kind, label, pr, old, new), rs in clash.items():
        if kind == "spec":
            res.conflicts.append(
                f"resume: label {label!r} meant {old!r} under {pr} in {out} ({len(rs)} rows), "
                f"here {new!r}; give the new method another @label=NAME to keep both, or add "
                "--overwrite to replace those rows"
            )
        elif kind == "settings":
            res.conflicts.append(
                f"resume: {len(rs)} rows of {label!r} under {pr} in {out} ran with other settings "
                f"than {specs[(pr, label)].spec!r} resolves to now ({old}; its adapter's recorded "
                "use changed?); rows of two settings are never merged under one label: pin the "
                "settings in the spec, give this one another @label=NAME to keep both, add "
                "--overwrite to replace those rows, or use another --out"
            )
        else:
            res.conflicts.append(
                f"resume: {len(rs)} rows of {label!r} under {pr} in {out} ran adapter {old[:12]}, "
                f"but the adapter of {specs[(pr, label)].spec!r} is now {new[:12]} (its weights or "
                "scoring settings changed); rows of two adapters are never merged under one label: "
                "give this one another @label=NAME to keep both, add --overwrite to replace those "
                "rows, or use another --out"
            )
    return res


def _settings_text(old: dict[str, Any], new: dict[str, Any]) -> str:
    """`key: old -> new` for each setting that differs."""
    keys = sorted(set(old) | set(new))
    return ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k))
