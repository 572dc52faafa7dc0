"""The rows of eval/bench_serving.py: what each row records as its setup (`SETUP_KEYS`,
`setup`), the finished rows of a `--json` file that `--resume` keeps (`load_rows`, which stops
on a row of another setup), which implementation read the INT8 slots (`int8_kernel`), and the
table printed at the end (`print_table`, `comparable`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import transformers

from sparsekv.cache import int8_attention

SETUP_KEYS = (
    "shape", "dtype", "memory_gib", "compile", "new_tokens", "warmup_steps", "probes", "chunk",
    "static_chunk",
)


def setup(args, mode: str) -> dict:
    """What a row's numbers depend on besides its length and mode: rows of one table share it."""
    cuda = args.device.startswith("cuda")
    return {
        **{k: getattr(args, k) for k in SETUP_KEYS},
        "policy": args.policy if mode.startswith("0.3") else None,
        "attention": "packed" if mode.startswith("0.3") else args.attention,
        # transformers' switch: grouped-query sdpa even with a mask (no KV head expansion)
        "sdpa_force_gqa": os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA", "0") == "1",
        "device": torch.cuda.get_device_name(torch.device(args.device)) if cuda else args.device,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def load_rows(path: Path, args) -> dict[tuple[int, str], dict]:
    """The finished rows of `path` by (length, mode), for `--resume`: failures are left out (run
    again); a row measured under another setup stops the run, naming what differs."""
    if not path.exists():
        return {}
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SystemExit(f"--resume: {path} is not a JSON list of rows ({e})") from None
    if not isinstance(rows, list):
        raise SystemExit(f"--resume: {path} is not a JSON list of rows")
    kept = {}
    for r in rows:
        if not isinstance(r, dict) or "length" not in r or "mode" not in r:
            raise SystemExit(f"--resume: {path} holds a row without length and mode: {r!r:.120}")
        if "error" in r:
            continue
        want = setup(args, r["mode"])
        have = r.get("setup")
        if have is None:
            raise SystemExit(
                f"--resume: the row {r['length']} {r['mode']} of {path} records no setup (written "
                "before rows did): measure into another --json"
            )
        differ = {k: (have.get(k), v) for k, v in want.items() if have.get(k) != v}
        if differ:
            said = ", ".join(f"{k}: {a!r} in the file, {b!r} now" for k, (a, b) in differ.items())
            raise SystemExit(
                f"--resume: the row {r['length']} {r['mode']} of {path} was measured under another "
                f"setup ({said}); use the same flags and machine, or another --json"
            )
        kept[(r["length"], r["mode"])] = r
    return kept


def int8_kernel(device: str) -> str:
    """The implementation `decode_attention(kernel="auto")` takes on `device` for this model."""
    return "triton" if device.startswith("cuda") and int8_attention.triton_available() else "torch"


def print_table(rows: list[dict], args) -> None:
    print(
        f"\n{args.shape}, {args.dtype}, cap {args.memory_gib:g} GiB, "
        f"{args.new_tokens} timed steps, "
        f"compile={args.compile}, budget modes scored by {args.policy}, full-cache decode "
        f"attention {args.attention}"
    )
    print(
        "| length | mode | KV MiB / seq | largest batch run | fails at | ms / step | tok/s "
        "| vs best full |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        full = [
            x["tok_s"]
            for x in rows
            if x["length"] == r["length"] and x["mode"] in ("dynamic", "static") and comparable(x)
        ]
        ratio = f"{r['tok_s'] / max(full):.2f}x" if full and max(full) > 0 else "-"
        per_seq = r.get("kv_bytes_per_seq", 0) / 2**20
        if "error" in r:
            speed = f"- | - (failed: {r['error'][:80]}) | -"
        elif comparable(r):
            speed = f"{r.get('ms_per_step', 0):.1f} | {r['tok_s']:.1f} | {ratio}"
        else:  # only the eager batch-1 run fitted: no batch found, no speed to compare
            speed = f"- | - (no batch > 1 ran in {r.get('probes', 0)} probes) | -"
        print(
            f"| {r['length']} | {r['mode']} | {per_seq:.1f} | {r['batch']} | "
            f"{r.get('fails_at') or '-'} | {speed} |"
        )


def comparable(row: dict) -> bool:
    """A row whose speed is the searched batch's: not the eager batch-1 memory probe left
    standing because every larger probe ran out of memory."""
    return "error" not in row and (row["batch"] > 1 or not row.get("fails_at"))

