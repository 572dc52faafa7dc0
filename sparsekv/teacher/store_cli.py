"""The teacher store's command line: `python -m sparsekv.teacher.store build|info|verify`.

`sparsekv.teacher.store.main` calls `main` here; the store itself (building, reading, the file
format) lives in `sparsekv.teacher.store` and the modules it imports.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from sparsekv.teacher.store_build import build_store, text_blocks
from sparsekv.teacher.store_format import (
    HIDDEN_DTYPES,
    PROBE_DEFAULTS,
    SIGNALS,
    StoreError,
    StoreSpec,
    model_identity,
    target_settings,
)
from sparsekv.teacher.store_read import TeacherStore, store_dataset_path


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _probe_options(text: str | None) -> dict[str, int]:
    """`--probe count=8,answer=16` -> `{"count": 8, "answer": 16}` (a clear error otherwise)."""
    out: dict[str, int] = {}
    for part in [p for p in (text or "").split(",") if p.strip()]:
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in PROBE_DEFAULTS:
            raise StoreError(
                f"--probe {part!r}: expected key=value with key one of {', '.join(PROBE_DEFAULTS)}"
            )
        try:
            out[key] = int(value)
        except ValueError:
            raise StoreError(f"--probe {key}={value!r} must be an integer") from None
    return out


def _worker(text: str) -> tuple[int, int]:
    """`--worker 1/2` -> `(1, 2)`: argparse's type, with the allowed values in the error."""
    i, sep, w = text.partition("/")
    try:
        pair = (int(i), int(w))
    except ValueError:
        pair = None
    if not sep or pair is None or not (pair[1] >= 1 and 0 <= pair[0] < pair[1]):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected I/W with W >= 1 and 0 <= I < W (e.g. 0/2 and 1/2)"
        )
    return pair


def _cmd_build(args) -> int:
    from sparsekv.policies.reconstruction import REPEAT_PROMPT
    from sparsekv.teacher.probes import PROBE_PROMPTS
    from sparsekv.teacher.statistics import default_layers
    from train.config import load_config
    from train.models import load_model

    t_start = time.perf_counter()
    cfg = load_config(args.config, args.overrides)
    threads = args.threads if args.threads is not None else cfg.num_threads
    if threads is not None:
        torch.set_num_threads(threads)
    if store_dataset_path(cfg.dataset) is not None:
        raise StoreError("--config names a store as its dataset: a store is built from text")
    model, tok, base_id = load_model(cfg.model, cfg.dtype, cfg.attn_implementation, cfg.seed)
    from sparsekv.models.families import model_shape

    shape = model_shape(model)
    layers = list(cfg.layers or default_layers(model))
    signals = args.signals.split(",")
    prompt = probe_ids = None
    if any(s in ("reconstruction", "kvzip_plus") for s in signals):
        prompt = list(tok([REPEAT_PROMPT], add_special_tokens=False)["input_ids"][0])
    if "probe" in signals:
        probe_ids = [
            list(p) for p in tok(list(PROBE_PROMPTS), add_special_tokens=False)["input_ids"]
        ]
    settings = target_settings(
        cfg.target_config(),
        shape.layer_types,
        layers,
        prompt,
        signals,
        probe_prompt_ids=probe_ids,
        probe=_probe_options(args.probe),
    )
    ids, mask, text = text_blocks(cfg, tok, args.length)
    text["sequences"] = int(args.sequences)
    spec = StoreSpec(
        model=model_identity(model, base_id),
        text=text,
        target=settings,
        layers=layers,
        hidden=args.hidden,
        length=args.length,
        shard_size=args.shard_size,
    )
    print(
        f"teacher store {args.out}: {args.sequences} of {text['blocks']} sequences of "
        f"{args.length} tokens from {cfg.dataset}; model {base_id}; hidden states of layers "
        f"{layers} ({args.hidden}); signals {', '.join(settings['signals'])}; "
        f"{args.shard_size} sequences per shard",
        flush=True,
    )
    out = build_store(
        args.out,
        model,
        spec,
        ids,
        mask,
        block_size=cfg.teacher_block_size,
        resume=args.resume,
        progress=not args.no_progress,
        worker=args.worker[0],
        workers=args.worker[1],
    )
    rate = out["new"] / out["seconds"] * 3600 if out["new"] and out["seconds"] > 0 else 0.0
    total_s = time.perf_counter() - t_start
    print(
        f"done: {out['sequences']} sequences in {args.out} ({out['new']} built now in "
        f"{out['seconds'] / 60:.1f} min, {rate:.0f} sequences/hour; {total_s / 60:.1f} min with "
        f"loading); size {_human(out['bytes'])} ({out['bytes'] / max(1, out['sequences']) / 2**20:.1f} "
        "MiB per sequence)",
        flush=True,
    )
    return 0


def _cmd_info(args) -> int:
    store = TeacherStore(args.path)
    spec = store.spec
    print(
        json.dumps(
            {
                "path": str(store.path),
                "fingerprint": store.fingerprint,
                "sequences_complete": len(store),
                "sequences_planned": spec.text.get("sequences"),
                "shards_complete": len(store.complete),
                "bytes": store.size_bytes(),
                "size": _human(store.size_bytes()),
                "model": {k: v for k, v in spec.model.items() if k != "shape"},
                "length": spec.length,
                "layers": spec.layers,
                "hidden": spec.hidden,
                "target": {k: v for k, v in spec.target.items() if k != "repeat_prompt_ids"},
                "text": {k: v for k, v in spec.text.items() if k != "build"},
            },
            indent=1,
        )
    )
    return 0


def _cmd_verify(args) -> int:
    store = TeacherStore(args.path)
    n = store.verify()
    print(f"{store.path}: {n} rows in {len(store.complete)} shards match their checksums")
    return 0


def _parser(description: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sparsekv.teacher.store", description=description)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build or continue a store from a training config")
    b.add_argument("--config", required=True, help="training YAML (configs/train/<name>.yaml)")
    b.add_argument("--out", required=True, help="the store folder (kept out of git)")
    b.add_argument("--sequences", type=int, required=True, help="sequences to store")
    b.add_argument("--length", type=int, default=2048, help="tokens per sequence (default 2048)")
    b.add_argument(
        "--resume",
        action="store_true",
        help="continue the store in --out (refused when its settings differ)",
    )
    b.add_argument(
        "--hidden",
        choices=HIDDEN_DTYPES,
        default="bfloat16",
        help="dtype of the stored hidden states (default bfloat16; int8 = half)",
    )
    b.add_argument(
        "--signals",
        default=",".join(SIGNALS),
        help=f"statistics to store, comma-separated (default {','.join(SIGNALS)})",
    )
    b.add_argument(
        "--probe",
        default=None,
        metavar="key=value,...",
        help="probe signal settings: count (probes per sequence, default 8), cue and "
        "answer (tokens, default 8 and 16), seed, sink",
    )
    b.add_argument("--shard-size", type=int, default=8, help="sequences per shard (default 8)")
    b.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: the config's num_threads)",
    )
    b.add_argument(
        "--worker",
        type=_worker,
        default=(0, 1),
        metavar="I/W",
        help="build only shards s with s %% W == I (run W of these side by side, each with "
        "--threads 1 and --resume; default 0/1: every shard)",
    )
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="training config overrides (e.g. model=tiny:llama)",
    )
    i = sub.add_parser("info", help="print a store's settings and size")
    i.add_argument("path")
    v = sub.add_parser("verify", help="check every stored row against its checksum")
    v.add_argument("path")
    return p


def main(argv: list[str] | None = None, description: str | None = None) -> int:
    """`python -m sparsekv.teacher.store`'s commands; `description`: its help's first line."""
    args = _parser(description).parse_args(argv)
    try:
        if args.command == "build":
            _check_build_args(args)
            return _cmd_build(args)
        if args.command == "info":
            return _cmd_info(args)
        return _cmd_verify(args)
    except (ValueError, FileNotFoundError) as e:  # StoreError, a bad config or override: one line
        print(f"sparsekv.teacher.store: error: {e}", file=sys.stderr)
        return 2


def _check_build_args(args) -> None:
    """The build's own flags, checked before the config or the model is read."""
    from pathlib import Path

    for flag, value, least in (("--sequences", args.sequences, 1), ("--length", args.length, 2),
                               ("--shard-size", args.shard_size, 1)):
        if value < least:
            why = " (BOS and at least one token)" if flag == "--length" else ""
            raise StoreError(f"{flag}={value} must be >= {least}{why}")
    if args.threads is not None and args.threads < 1:
        raise StoreError(f"--threads={args.threads} must be >= 1 (or left out for the config's)")
    signals = [x.strip() for x in args.signals.split(",")]
    if args.probe and "probe" not in signals:
        raise StoreError(f"--probe {args.probe!r} sets the probe signal, which --signals "
                         f"{args.signals!r} does not build; add probe to --signals or drop --probe")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise StoreError(f"--out {str(out)!r} is a file; the store is a folder: name a new one")
    if out.is_dir() and not (out / "store.json").exists():
        mine = ("shard-", ".shard-", "store.json", ".store.json")
        other = sorted(p.name for p in out.iterdir() if not p.name.startswith(mine))
        if other:
            raise StoreError(f"--out {str(out)!r} holds other files ({', '.join(other[:5])}): a "
                             "store is built into an empty or new folder; name another one")
