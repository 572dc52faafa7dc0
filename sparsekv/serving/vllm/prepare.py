"""The compress side of serving a compressed context in vLLM: runs in sparsekv's own environment
(transformers >= 5.20), never in vLLM's.

    python -m sparsekv.serving.vllm.prepare OUT --count 20 --length 2048 --budgets 1.0 0.3

writes, under OUT, one saved `CompressedContext` per (prompt, budget) (`OUT/ctx-<i>-b<budget>/`,
`CompressedContext.save`'s folder; a budget as "0.3", or "512tok" for a token count: `--budgets`
follows the library's budget rule, `sparsekv.config.check_budget`) and `OUT/manifest.json`: per prompt the context ids, the
question ids, and per budget the folder, its kept entries per layer and sparsekv's own greedy
answer (`ctx.generate`, `--max-new-tokens` tokens) that the vLLM side is compared with.

Prompts: a pass key ("The secret number of the <name> archive is <5 digits>.") at a seeded depth
in prose from the docstrings of Python's standard library (text every machine has), cut to
`--length` tokens (BOS included); the question asks for it in the "Question: ...\\nAnswer: ..."
layout. `--questions Q` asks Q questions per prompt (one pass key each, at Q depths), which is what
the benchmark uses (16 questions against one context).
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import sysconfig
import time
from pathlib import Path

__all__ = ["budget_label", "build_prompts", "main", "prose"]

_NAMES = ("amber", "basalt", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo",
          "juniper", "kestrel", "lagoon", "mesa", "nimbus", "onyx", "prairie", "quartz", "raven",
          "sierra", "tundra", "umber", "vesper", "willow", "yarrow", "zephyr", "aspen", "birch",
          "coral", "dune", "elm", "flint", "grove")


def prose(max_chars: int = 4_000_000) -> list[str]:
    """Paragraphs of the docstrings of Python's standard library (sorted files: deterministic)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if not doc:
                    continue
                for para in doc.split("\n\n"):
                    para = " ".join(para.split())
                    if len(para) >= 80 and ">>>" not in para:
                        out.append(para)
                        total += len(para)
        if total >= max_chars:
            break
    return out


def build_prompts(tokenizer, count: int, length: int, questions: int = 1, seed: int = 0):
    """`count` prompts of exactly `length` context tokens (BOS first), each with `questions`
    pass keys and their questions: a list of {"context_ids", "questions": [{"ids", "key"}]}."""
    paras = prose()
    rng = random.Random(seed)
    prompts = []
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    for _ in range(count):
        start = rng.randrange(len(paras))
        names = rng.sample(_NAMES, questions)
        keys = [f"{rng.randrange(10**4, 10**5)}" for _ in names]
        needles = [f"The secret number of the {n} archive is {k}." for n, k in zip(names, keys)]
        # filler: consecutive paragraphs (one token list each, newline-separated) past the length
        chunks: list[list[int]] = []
        i, total = start, len(bos)
        while total < length + 64 * questions:
            chunks.append(tokenizer("\n" + paras[i % len(paras)], add_special_tokens=False)[
                "input_ids"])
            total += len(chunks[-1])
            i += 1
        # needles between paragraphs, at seeded depths of 10-85% of the length
        depths = sorted(rng.uniform(0.1, 0.85) for _ in needles)
        order = list(range(len(needles)))
        rng.shuffle(order)
        cum, at = [], 0
        for c in chunks:
            cum.append(at)
            at += len(c)
        for d, j in zip(reversed(depths), order):
            k = max(n for n, c in enumerate(cum) if c <= d * length)
            chunks.insert(k, tokenizer("\n" + needles[j], add_special_tokens=False)["input_ids"])
        ids = (bos + [t for c in chunks for t in c])[:length]
        asked = []
        for n, k in zip(names, keys):
            q = (f"\nQuestion: What is the secret number of the {n} archive?\n"
                 f"Answer: The secret number of the {n} archive is")
            asked.append({"ids": tokenizer(q, add_special_tokens=False)["input_ids"], "key": k,
                          "text": q})
        prompts.append({"context_ids": ids, "questions": asked})
    return prompts


def _budget(text: str) -> float | int:
    """`--budgets` read by the library's budget rule (`sparsekv.config.budget_from_text`)."""
    from sparsekv.config import budget_from_text

    try:
        return budget_from_text(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def budget_label(b: float) -> str:
    """A budget as the manifest keys and folder names spell it: a fraction as "0.3" (1.0 as
    "1"), a token count as "512tok"."""
    return f"{b:g}" if isinstance(b, float) else f"{int(b)}tok"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--questions", type=int, default=1)
    ap.add_argument("--budgets", type=_budget, nargs="+", default=[1.0, 0.3],
                    help="budgets by the library's rule (EvictionConfig.budget): fractions in "
                         "(0, 1] such as 0.3, token counts >= 2 such as 512, or 1tok; 2.0 and a "
                         "bare 1 are refused")
    ap.add_argument("--schedule", default="uniform")
    ap.add_argument("--adapter", default="checkpoints/gemma3-270m-sparsekv")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--no-reference", action="store_true",
                    help="skip sparsekv's own answers (ctx.generate)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch

    import sparsekv

    torch.set_grad_enabled(False)
    model, tokenizer = sparsekv.load_default_model(dtype=args.dtype)
    adapter = sparsekv.ScorerAdapter.from_pretrained(args.adapter)
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = build_prompts(tokenizer, args.count, args.length, args.questions, args.seed)
    manifest = {"model": str(sparsekv.default_model_path()), "dtype": args.dtype,
                "length": args.length, "schedule": args.schedule, "adapter": args.adapter,
                "max_new_tokens": args.max_new_tokens, "prompts": []}
    for i, p in enumerate(prompts):
        entry = {"context_ids": p["context_ids"], "questions": p["questions"], "contexts": {}}
        for b in args.budgets:
            cfg = sparsekv.EvictionConfig(budget=b, schedule=args.schedule)
            t0 = time.perf_counter()
            ctx = sparsekv.compress(model, p["context_ids"], cfg, adapter)
            compress_s = time.perf_counter() - t0
            folder = ctx.save(args.out / f"ctx-{i}-b{budget_label(b)}")
            rec = {"path": str(folder.resolve()), "kept": ctx.kept(), "compress_s": compress_s}
            if not args.no_reference:
                answers, t0 = [], time.perf_counter()
                for q in p["questions"]:
                    out = ctx.generate(q["ids"], max_new_tokens=args.max_new_tokens,
                                       do_sample=False)
                    answers.append(out[0, len(q["ids"]):].tolist())
                rec["sparsekv_answers"] = answers
                rec["sparsekv_answer_s"] = time.perf_counter() - t0
            entry["contexts"][budget_label(b)] = rec
            print(f"prompt {i} budget {budget_label(b)}: kept {max(ctx.kept())}/{len(p['context_ids'])}, "
                  f"{len(p['questions'])} questions", file=sys.stderr, flush=True)
        manifest["prompts"].append(entry)
        (args.out / "manifest.json").write_text(json.dumps(manifest) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
