"""Benchmark: serving a compressed context in vLLM (`sparsekv.serving.vllm`) against vLLM on the full
context and against sparsekv inside transformers; JSON rows, one per line.

Two steps, in two environments (vLLM pins transformers < 5.20, sparsekv >= 5.20):

    # 1. sparsekv's environment: compress the contexts, time sparsekv's own answers
    .venv/bin/python eval/bench_vllm.py prepare DIR --dtype float32
    # 2. vLLM's environment: serve them, time vLLM, count resident documents
    .venv-vllm/bin/python eval/bench_vllm.py serve DIR --dtype float32 --out ROWS.jsonl

`prepare` writes DIR/<dtype>/answers (one context of `--length` tokens, `--questions` pass-key
questions, budget `--budget`, and sparsekv's own greedy answers and their time, question after
question: `CompressedContext.generate`) and DIR/<dtype>/resident-<L> (`--docs` documents of L
tokens for each `--doc-lengths`, compressed, no answers).

`serve` starts one engine (a fixed KV-cache size of `--kv-space` GiB: `kv_cache_memory_bytes`, what
`VLLM_CPU_KVCACHE_SPACE` sets in whole GiB; prefix caching on; the `SparseKVConnector`) and writes
rows:

- `answers`: answers per second for the questions against the one context, asked as one batch
  after a first question has made the context resident (prefix cache warm), for `vllm_compressed`
  (the served context: K placeholder slots) and `vllm_full` (the full prompt); `sparsekv_transformers`
  is copied from `prepare` (one question at a time, as `ask_many` does there). The first question's
  time (cold: vLLM prefills the full context, or loads the compressed one) is in `cold_first_s`.
  `agree_with_sparsekv`: how many of vLLM's compressed answers equal sparsekv's own.
- `resident`: documents asked one after the other (one question each), then asked again newest
  first: `resident_measured` = how many of the newest were still in the prefix cache (their
  context blocks hit: at least all full blocks of the K or N slots; capped by `docs_asked`),
  against the pool's blocks / the blocks per document: `resident_predicted_held` with the blocks
  a document's request holds when it ends (summed over vLLM's KV-cache groups, from the
  connector's records), `resident_predicted_hit` with the blocks a later question needs to hit
  (the context's full blocks in the full-attention group, the window's last
  ceil((window - 1) / block) in each sliding one), and `resident_predicted_first_step` = 1 + what
  fits beside the blocks a request takes at its first step (`blocks_first_step_per_doc`, from the
  connector's `alloc` records: a prompt prefilled in one chunk takes blocks for the whole chunk in
  every group, sliding ones included, and evicts that much of the prefix cache at once).
  `--max-batched-tokens` sets the engine's prefill chunk (`max_num_batched_tokens`; vLLM's CPU
  default is 4096), which bounds that first step.

Timings on a shared machine are noisy; rows name the machine (`machine`) and the settings. Sized
for a GPU: the same two commands with vLLM 0.32.0's CUDA build in the second environment and larger
sizes, e.g. `--length 32768 --doc-lengths 32768 131072 --docs 64 --kv-space 20 --dtype bfloat16`
(the connector writes through the attention backend's own cache write, so it is not CPU-specific;
not run on a GPU yet).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()}: {cpu}, {os.cpu_count()} cores"


# ------------------------------------------------------------------------------ prepare
def prepare(args) -> int:
    from sparsekv.serving.vllm import prepare as prep

    base = Path(args.dir) / args.dtype
    common = ["--dtype", args.dtype, "--budgets", str(args.budget), "--schedule", "uniform",
              "--max-new-tokens", str(args.max_new_tokens)]
    if "answers" in args.only and not (base / "answers" / "manifest.json").is_file():
        prep.main([str(base / "answers"), "--count", "1", "--length", str(args.length),
                   "--questions", str(args.questions), "--seed", "1", *common])
    for length in args.doc_lengths if "resident" in args.only else []:
        out = base / f"resident-{length}"
        if (out / "manifest.json").is_file():
            continue
        prep.main([str(out), "--count", str(args.docs), "--length", str(length),
                   "--seed", str(100 + length), "--no-reference", *common])
    return 0


# ------------------------------------------------------------------------------ serve
def _rows_out(path: Path, row: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def _stats(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def serve(args) -> int:
    # the fixed KV-cache size: kv_cache_memory_bytes is what VLLM_CPU_KVCACHE_SPACE sets, in bytes
    # (the variable takes whole GiB only); leave the variable unset so it does not override it
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    # vLLM's CPU worker drops to one thread below OMP_NUM_THREADS' default; sparsekv's own answers
    # (prepare) run with torch's default, all cores: give vLLM the same
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from vllm import LLM, SamplingParams

    from sparsekv.serving.vllm import ask_many, engine_kwargs, load_context

    base = Path(args.dir) / args.dtype
    ans = None
    if "answers" in args.only:
        ans = json.loads((base / "answers" / "manifest.json").read_text())
    first_manifest = ans or json.loads(
        (base / f"resident-{args.doc_lengths[0]}" / "manifest.json").read_text())
    out = Path(args.out)
    stats = out.with_suffix(".served.jsonl")
    stats.unlink(missing_ok=True)
    max_len = max([args.length, *args.doc_lengths]) + 256
    t0 = time.perf_counter()
    chunk = {"max_num_batched_tokens": args.max_batched_tokens} if args.max_batched_tokens else {}
    llm = LLM(model=first_manifest["model"], dtype=args.dtype, max_model_len=max_len, seed=0,
              kv_cache_memory_bytes=int(args.kv_space * 2**30), enforce_eager=args.eager,
              **chunk, **engine_kwargs(stats_path=stats))
    start_s = time.perf_counter() - t0
    pool = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    setup = {"machine": machine(), "dtype": args.dtype, "kv_space_gib": args.kv_space,
             "vllm": __import__("vllm").__version__, "pool_blocks": pool,
             "engine_start_s": round(start_s, 1), "budget": args.budget, "schedule": "uniform",
             "adapter": first_manifest["adapter"], "max_new_tokens": args.max_new_tokens,
             "max_num_batched_tokens":
                 llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
             "torch_threads": __import__("torch").get_num_threads(), "eager": args.eager}
    greedy = SamplingParams(temperature=0, max_tokens=args.max_new_tokens)

    # ---- answers per second, one context, many questions
    if ans is not None:
        p = ans["prompts"][0]
        rec = p["contexts"][f"{args.budget:g}"]
        qs = [q["ids"] for q in p["questions"]]
        # compressed: a first question makes the context resident, then all in one batch
        t = time.perf_counter()
        ask_many(llm, rec["path"], qs[:1], greedy)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        got = ask_many(llm, rec["path"], qs, greedy)
        warm = time.perf_counter() - t
        served = [list(o.outputs[0].token_ids) for o in got]
        own = rec.get("sparsekv_answers") or []
        ctx = load_context(rec["path"])
        _rows_out(out, {"bench": "answers", "mode": "vllm_compressed", **setup,
                        "length": ctx.num_tokens, "slots": ctx.num_slots, "questions": len(qs),
                        "cold_first_s": round(cold, 3), "seconds": round(warm, 3),
                        "answers_per_s": round(len(qs) / warm, 3),
                        "agree_with_sparsekv": sum(a == b for a, b in zip(served, own)),
                        "answers": served})
        # full: the same, on the full prompt
        full = [{"prompt_token_ids": p["context_ids"] + q} for q in qs]
        t = time.perf_counter()
        llm.generate(full[:1], greedy)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        got = llm.generate(full, greedy)
        warm = time.perf_counter() - t
        _rows_out(out, {"bench": "answers", "mode": "vllm_full", **setup,
                        "length": len(p["context_ids"]), "slots": len(p["context_ids"]),
                        "questions": len(qs), "cold_first_s": round(cold, 3),
                        "seconds": round(warm, 3), "answers_per_s": round(len(qs) / warm, 3),
                        "answers": [list(o.outputs[0].token_ids) for o in got]})
        s = rec.get("sparsekv_answer_s")
        if s:
            _rows_out(out, {"bench": "answers", "mode": "sparsekv_transformers", **setup,
                            "pool_blocks": None, "engine_start_s": None,
                            "length": len(p["context_ids"]), "slots": max(rec["kept"]),
                            "questions": len(qs), "cold_first_s": None,
                            "compress_s": round(rec["compress_s"], 3), "seconds": round(s, 3),
                            "answers_per_s": round(len(qs) / s, 3),
                            "note": "measured by `prepare` in sparsekv's environment, one "
                                    "question after the other (ctx.generate), max_new_tokens "
                                    "greedy (stops at EOS)"})

    # ---- resident documents in one fixed KV-cache size
    if "resident" in args.only:
        one = SamplingParams(temperature=0, max_tokens=1)
        for length in args.doc_lengths:
            m = json.loads((base / f"resident-{length}" / "manifest.json").read_text())
            docs = m["prompts"][: args.docs]
            for mode in ("vllm_compressed", "vllm_full"):
                llm.reset_prefix_cache()
                before = len(_stats(stats))

                def ask(d, mode=mode):
                    q = d["questions"][0]["ids"]
                    if mode == "vllm_full":
                        return llm.generate([{"prompt_token_ids": d["context_ids"] + q}], one)
                    return ask_many(llm, d["contexts"][f"{args.budget:g}"]["path"], [q], one)

                t = time.perf_counter()
                for d in docs:
                    ask(d)
                first = _stats(stats)[before:]
                held = [sum(r["held"]) for r in first if r["event"] == "finish"]
                # the blocks a document's request takes at its first step (its prompt's first
                # chunk, in every group): what its prefill evicts from the pool at once
                peak = [sum(r["held"]) for r in first if r["event"] == "alloc"]
                mark = len(_stats(stats))
                resident = 0
                for d in reversed(docs):
                    ask(d)
                    look = [r for r in _stats(stats)[mark:] if r["event"] == "lookup"][-1]
                    if mode == "vllm_full":
                        need = (len(d["context_ids"]) // 128) * 128
                    else:
                        need = (load_context(d["contexts"][f"{args.budget:g}"]["path"]).num_slots
                                // 128) * 128
                    if look["local_hit"] < need:
                        break
                    resident += 1
                    mark = len(_stats(stats))
                per_doc = sum(held) / max(1, len(held))
                per_doc_peak = max(peak, default=0)
                # the blocks a later question needs to hit: the context's full blocks in a
                # full-attention group, the window's last cdiv(window - 1, block) in a sliding one
                groups = next(r["groups"] for r in first if r["event"] == "finish")
                ctx0 = load_context(docs[0]["contexts"][f"{args.budget:g}"]["path"])
                slots = len(docs[0]["context_ids"]) if mode == "vllm_full" else ctx0.num_slots
                hit = sum(slots // 128 if g == "FullAttentionSpec"
                          else math.ceil((ctx0.sliding_window - 1) / 128) for g in groups)
                _rows_out(out, {"bench": "resident", "mode": mode, **setup, "length": length,
                                "docs_asked": len(docs), "resident_measured": resident,
                                "blocks_held_per_doc": round(per_doc, 1),
                                "blocks_hit_per_doc": hit,
                                "resident_predicted_held": math.floor(pool / per_doc),
                                "resident_predicted_hit": math.floor(pool / hit),
                                "blocks_first_step_per_doc": per_doc_peak,
                                # the newest document plus those whose hit blocks fit beside
                                # the newest one's first step
                                "resident_predicted_first_step":
                                    1 + math.floor(max(0, pool - per_doc_peak) / hit),
                                "seconds": round(time.perf_counter() - t, 1)})
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("prepare", "serve"):
        s = sub.add_parser(name)
        s.add_argument("dir")
        s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
        s.add_argument("--length", type=int, default=4096)
        s.add_argument("--questions", type=int, default=16)
        s.add_argument("--budget", type=float, default=0.3)
        s.add_argument("--max-new-tokens", type=int, default=8)
        s.add_argument("--docs", type=int, default=12)
        s.add_argument("--doc-lengths", type=int, nargs="*", default=[4096])
    sub.choices["serve"].add_argument("--out", required=True)
    sub.choices["serve"].add_argument("--kv-space", type=float, default=0.25,
                                      help="the KV-cache size, GiB (kv_cache_memory_bytes)")
    sub.choices["serve"].add_argument("--max-batched-tokens", type=int, default=None,
                                      help="the engine's max_num_batched_tokens (a prompt's "
                                           "prefill chunk); default: vLLM's")
    sub.choices["serve"].add_argument("--eager", action="store_true",
                                      help="enforce_eager (no torch.compile warm-up)")
    for name in ("prepare", "serve"):
        sub.choices[name].add_argument("--only", nargs="+", default=["answers", "resident"],
                                       choices=["answers", "resident"])
    args = ap.parse_args(argv)
    return prepare(args) if args.cmd == "prepare" else serve(args)


if __name__ == "__main__":
    sys.exit(main())
