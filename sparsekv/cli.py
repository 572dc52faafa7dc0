"""The `sparsekv` command line: model-info, eval (see `sparsekv --help`)."""

from __future__ import annotations

import argparse
import json
import sys


def _model_info(args: argparse.Namespace) -> int:
    import torch

    from sparsekv.models.default import load_default_model, resolve_dtype
    from sparsekv.models.families import model_shape
    from sparsekv.models.loading import validate_model_spec

    dtype = resolve_dtype(args.dtype, "--dtype")
    validate_model_spec(args.model, hub=True, name="--model")
    if args.model == "default":
        model, _ = load_default_model(dtype=dtype)
    elif args.model.startswith("tiny:"):
        from sparsekv.models.tiny import tiny_model

        model = tiny_model(args.model.removeprefix("tiny:"))
    else:
        from transformers import AutoConfig

        try:
            model = AutoConfig.from_pretrained(args.model)
        except OSError as e:  # a Hub id that is not there or not reachable
            raise ValueError(f"--model {args.model!r} could not be read: {e}") from None
    shape = model_shape(model)
    per_tok = shape.kv_bytes_per_token(dtype)
    full = shape.full_layers
    grow = 2 * len(full) * shape.num_kv_heads * shape.head_dim * torch.empty((), dtype=dtype).element_size()
    info = {
        **shape.to_dict(),
        "dtype": str(dtype).removeprefix("torch."),
        "kv_bytes_per_token_all_layers": per_tok,
        "kv_bytes_per_token_full_layers": grow,
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"model type        : {shape.model_type}")
    print(f"layers            : {shape.num_layers} ({len(full)} full attention: {full})")
    kinds = "".join("F" if t == "full_attention" else "s" for t in shape.layer_types)
    print(f"layer types       : {kinds}   (F full, s sliding window {shape.sliding_window})")
    print(f"query / KV heads  : {shape.num_attention_heads} / {shape.num_kv_heads}")
    print(f"head dim          : {shape.head_dim}")
    print(f"hidden size       : {shape.hidden_size}")
    print(f"KV bytes per token: {per_tok} ({info['dtype']}, all layers); "
          f"{grow} in the full-attention layers, which grow with the context")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsekv", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    mi = sub.add_parser("model-info", help="print layer types, KV heads, head dim, KV bytes/token")
    mi.add_argument("--model", default="default", help="'default' (gemma-3-270m), tiny:<family>, a local HF folder or a Hub id")
    mi.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    mi.add_argument("--json", action="store_true", help="print JSON")
    mi.set_defaults(func=_model_info)
    try:
        from sparsekv.evaluation.cli import add_eval_parser
    except ImportError:
        pass
    else:
        add_eval_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:  # a bad flag or a missing file: exit 2, no traceback
        print(f"sparsekv: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C or kill: what was finished is saved (the command says where)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
