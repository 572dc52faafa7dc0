"""Where a needle's tokens survive: per budgeted layer, the share of the tokens of each prompt's
needle (the qa sentence, the UUID, the pass key: whatever the answer is read from) that a method
keeps after compressing the context, beside that method's score on the prompt.

    python eval/kept_spans.py --out docs/results/agnostic-span-tune-s1 --task qa --label learned --budget 0.3
    python eval/kept_spans.py --out docs/results/agnostic-span-tune-s1 --task uuidkey \
        --label "learned, fill 16 above q0.9" --budget 0.3 --samples 10

It reads the grid folder's `config.yaml` (the method's spec, the eviction settings), its
`prompts.jsonl` (the same prompt ids the rows ran) and `results.jsonl` (the scores), compresses
each prompt's context as the agnostic protocol does (the question is not in it), and prints one
line per prompt and a summary split by whether the method answered as well as the full cache.
Nothing is written. It is a diagnostic for the tuning seed's folders: reading it on a report
seed's rows is reading the report seed.

The needle is the text the answer is copied from: for qa the planted sentence up to the end of
its answer words (the cue and the answer), otherwise the first occurrence of the answer text in
the context (a value, a UUID; families whose answer is not one span, such as multivalue, take
the first value). Its tokens are the context tokens whose characters overlap it (the
tokenizer's offsets).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch


def needle_text(prompt: dict[str, Any]) -> str | None:
    meta = prompt.get("metadata") or {}
    answer = prompt.get("answer")
    if meta.get("sentence"):  # qa: the sentence up to the end of the answer words (cue + answer)
        s = meta["sentence"]
        end = s.find(answer) if isinstance(answer, str) else -1
        return s if end < 0 else s[: end + len(answer)]
    if isinstance(answer, list):
        answer = answer[0] if answer else None
    return str(answer) if answer else None


def needle_positions(tokenizer, prompt: dict[str, Any], bos: int) -> list[int]:
    """Context token positions (BOS = 0) whose characters overlap the needle; [] when the needle
    is not in the context or the tokenizer's offsets do not reproduce the prompt's ids."""
    text, needle = prompt["context"], needle_text(prompt)
    if needle is None:
        return []
    start = text.find(needle)
    if start < 0:
        return []
    end = start + len(needle)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if [*([] if bos < 0 else [bos]), *enc.input_ids] != prompt["context_ids"]:
        return []
    shift = 0 if bos < 0 else 1
    return [i + shift for i, (a, b) in enumerate(enc.offset_mapping) if a < end and b > start]


def _positive(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be an int >= 1")
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="a grid folder (config.yaml, prompts.jsonl)")
    ap.add_argument("--task", required=True, help="the task whose prompts to read, e.g. qa")
    ap.add_argument("--label", required=True, help="the method's label in the grid")
    ap.add_argument("--budget", type=float, default=0.3)
    ap.add_argument("--samples", type=_positive, default=None,
                    help="the first N prompts (default all)")
    ap.add_argument("--threads", type=_positive, default=None)
    args = ap.parse_args(argv)

    from sparsekv import SparseKVCache
    from sparsekv.evaluation.config import EvalConfig
    from sparsekv.evaluation.rows.folder import read_config
    from sparsekv.evaluation.rows.store import read_rows
    from sparsekv.evaluation.running.execute import Runner
    from sparsekv.evaluation.running.models import load_model

    folder = Path(args.out)
    raw = read_config(folder)
    if raw is None:
        raise SystemExit(f"--out {folder}: no config.yaml there")
    # the folder's config is the grid as run: its fields, plus what the run resolved and recorded
    raw = {k: v for k, v in raw.items() if k not in ("environment", "policy_specs")}
    cfg = EvalConfig.from_dict(raw)
    specs = {p.label: p for p in cfg.policy_specs}
    if args.label not in specs:
        raise SystemExit(
            f"--label {args.label!r}: not in {folder}/config.yaml; there: {sorted(specs)}"
        )
    spec = specs[args.label]
    budgets = sorted(set(spec.budgets or cfg.budgets))
    if args.budget not in budgets:
        raise SystemExit(f"--budget {args.budget:g}: {args.label!r} did not run at it in {folder}; "
                         f"its budgets: {', '.join(f'{b:g}' for b in budgets)}")
    if args.threads:
        torch.set_num_threads(args.threads)

    if not (folder / "prompts.jsonl").is_file():
        raise SystemExit(f"--out {folder}: no prompts.jsonl there; write it with sparsekv eval "
                         "... --dump-prompts --out (the grid's flags)")
    from sparsekv.io import read_jsonl

    prompts = read_jsonl(folder / "prompts.jsonl", "prompt")
    prompts = [p for p in prompts if p["task"] == args.task]
    if not prompts:
        raise SystemExit(f"--task {args.task!r}: no prompts of it in {folder}/prompts.jsonl")
    prompts = prompts[: args.samples]
    scores: dict[tuple[str, str], float] = {}
    for r in read_rows(folder / "results.jsonl"):
        ours = r["policy"] == "full" or (r["policy"] == args.label and r["budget"] == args.budget)
        if ours and r["task"] == args.task and r["protocol"] == "agnostic" and not r.get("error"):
            scores[(r["policy"], r["sample_id"])] = r["score"]

    model, codec = load_model(cfg.model, cfg.dtype, cfg.attn_implementation)
    if getattr(codec, "tokenizer", None) is None:
        raise SystemExit(f"--out {folder}: the grid's model {cfg.model!r} has no tokenizer with "
                         "character offsets (a tiny model's codec): the needle cannot be located")
    runner = Runner(model, codec, cfg)
    bos = codec.bos_ids[0] if codec.bos_ids else -1
    kept_by_outcome: dict[str, list[list[float]]] = {"as full": [], "below full": []}
    print(f"{args.task}, {args.label} @ {args.budget}, {folder} (agnostic: the context alone)")
    for p in prompts:
        pos = needle_positions(codec.tokenizer, p, bos)
        if not pos:
            print(f"{p['sample_id']}: needle not located, skipped")
            continue
        cache = SparseKVCache(
            model, runner.eviction_config(spec, args.budget), runner.build_policy(spec)
        )
        with torch.no_grad():
            runner._forward(p["context_ids"], cache, 1)
        want = torch.tensor(pos)
        shares = []
        for i in cache.budgeted_layers:
            kept = cache.layers[i].positions[0]  # (kv_heads, stored) absolute positions
            hit = torch.isin(kept, want).sum(-1).float() / len(pos)  # per KV head
            shares.append(hit.mean().item())
        full, mine = scores.get(("full", p["sample_id"])), scores.get((args.label, p["sample_id"]))
        if full is not None and mine is not None:
            kept_by_outcome["as full" if mine >= full else "below full"].append(shares)
        cells = " ".join(f"L{i} {s:.0%}" for i, s in zip(cache.budgeted_layers, shares))
        print(
            f"{p['sample_id']}: {len(pos)} needle tokens kept {cells}; score full {full} / method {mine}"
        )
        sys.stdout.flush()
    for outcome, rows in kept_by_outcome.items():
        if rows:
            mean = [sum(c) / len(rows) for c in zip(*rows)]
            cells = " ".join(f"{m:.0%}" for m in mean)
            print(f"mean share kept per budgeted layer, prompts {outcome} ({len(rows)}): {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
