"""The kvpress peer run: NVIDIA kvpress's presses on the prompts of a sparsekv evaluation, through
kvpress's own pipeline, written as result rows in the harness's format.

This script runs in its own environment (kvpress pins transformers < 5.3; `run.sh` beside it
creates that environment) and does not import the `sparsekv` package. It reads from the sparsekv
source tree only what defines the comparison, so that both sides cannot drift apart:
- `sparsekv/evaluation/metrics.py`, loaded as a standalone module (pure functions over outputs and
  log-probabilities): answer matching, KL divergence, agreement, repetition, peak RSS;
- `ROW_FIELDS` of `sparsekv/evaluation/runner.py`, read from its source text.

Input: `prompts.jsonl` as written by `sparsekv eval` (every run, or `--dump-prompts`): per sample
its token ids (`context_ids` with BOS, `question_ids`, `target_ids`), texts, answer, kind and the
protocols it runs under. The prompt ids are fed to the pipeline as they are: kvpress's text
preprocessing (a newline after the question, or a chat template) is skipped so that both sides
see exactly the same tokens.

How one run goes, with the pipeline's `forward` (prefill of the context under the press, which
compresses the cache after each layer's prefill; then the question through the compressed cache
and greedy decoding; the answer is removed from the cache afterwards):
- "answer" samples, agnostic protocol: context = the sample's context, question = its question.
- "answer" samples, aware protocol: context = context + question minus its last token, which is
  fed as the question (kvpress's own way of putting the question in the compressed part).
- "generate" samples (no question): context minus its last token, which is fed as the question.
- "continuation" samples: context, then the held-out continuation (all but its last token)
  teacher-forced as the question; the log-probabilities of every position are rebuilt from the
  final hidden states of that forward (the pipeline keeps only the last position's logits).

Presses (`PRESSES`) run two ways on models that mix sliding-window and full-attention layers
(Gemma 3): "all" = every layer compressed, sliding windows included, with the pipeline's default
cache (as users get them); "full" = only the full-attention layers, through
`PerLayerCompressionPress` (ratio 0 elsewhere) and a cache built from the model's config, so the
sliding-window layers stay as transformers keeps them, like the harness's caches.
compression_ratio = 1 - budget (a fraction of the compressed prompt) or 1 - budget / prompt
tokens (a token count). A run that raises is a row with `error` set and score 0 (a miss).

Metrics, as in the harness (`sparsekv/evaluation/runner.py`): score by the harness's matching
function; KV bytes counted from the cache's tensors right after compression
(`kv_bytes_compressed`, before the question) and after decoding (`kv_bytes_end`); `prefill_s`
= context prefill and compression + the question's forward; `decode_tok_s` = (tokens - 1) /
decoding seconds; KL(no press || press) in nats against a run of the same pipeline without a
press (policy "no-press", a cache built from the config: the harness's full cache), at the first
step (always computed from the compressed cache here) and averaged over the steps that share the
reference's prefix.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

REPO = Path(__file__).resolve().parents[3]
EVAL_SRC = REPO / "sparsekv" / "evaluation"
SOURCE = "kvpress"
REFERENCE_LABEL = "no-press"

# name -> (kvpress class, keyword arguments, needs eager attention)
PRESSES: dict[str, tuple[str, dict[str, Any], bool]] = {
    "snapkv": ("SnapKVPress", {}, False),
    "expected_attention": ("ExpectedAttentionPress", {}, False),
    "tova": ("TOVAPress", {}, False),
    "knorm": ("KnormPress", {}, False),
    "streaming_llm": ("StreamingLLMPress", {}, False),
    "pyramidkv": ("PyramidKVPress", {}, False),
    "observed_attention": ("ObservedAttentionPress", {}, True),
}
LAYER_MODES = ("all", "full")
PROTOCOLS = ("agnostic", "aware")
CONTINUATION_LEAK = (
    "skipped: kvpress's pipeline builds the full-attention mask from the uncompressed length of "
    "the sliding layers when only the full layers are compressed, so a multi-token forward after "
    "compression sees later tokens of its own chunk there (teacher-forced targets would leak)"
)


# --------------------------------------------------------------------------- harness definitions


def load_harness_metrics(src: Path = EVAL_SRC):
    """`sparsekv/evaluation/metrics.py` as a standalone module (it imports only torch and the
    standard library), so that scores and KL here are the harness's own functions."""
    path = src / "metrics.py"
    spec = importlib.util.spec_from_file_location("sparsekv_eval_metrics", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the harness's metrics from {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def harness_row_fields(src: Path = EVAL_SRC) -> tuple[str, ...]:
    """`ROW_FIELDS` of `sparsekv/evaluation/runner.py`, read from its source (not imported: the
    harness needs a newer transformers than kvpress accepts)."""
    tree = ast.parse((src / "runner.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "ROW_FIELDS" for t in node.targets
        ):
            return tuple(ast.literal_eval(node.value))
    raise ValueError(f"no ROW_FIELDS in {src / 'runner.py'}")


# --------------------------------------------------------------------------- what runs


@dataclass(frozen=True)
class PressSpec:
    """One kvpress method: a press from `PRESSES` applied to `layers` ("all" or "full")."""

    press: str
    layers: str

    def __post_init__(self) -> None:
        if self.press not in PRESSES:
            raise ValueError(f"press={self.press!r}; allowed values: {', '.join(PRESSES)}")
        if self.layers not in LAYER_MODES:
            raise ValueError(f"layers={self.layers!r}; allowed values: {', '.join(LAYER_MODES)}")

    @property
    def label(self) -> str:
        return f"{self.press}-{self.layers}"

    @property
    def needs_eager(self) -> bool:
        return PRESSES[self.press][2]


def compression_ratio(budget: float, n_tokens: int) -> float:
    """kvpress's compression ratio for a harness budget: 1 - fraction, or 1 - tokens / n_tokens."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"budget={budget!r} must be a fraction in (0, 1] or a token count >= 1")
    if isinstance(budget, float) and 0 < budget <= 1:
        return max(0.0, 1.0 - budget)
    if isinstance(budget, int) and budget >= 1:
        return max(0.0, 1.0 - budget / max(1, n_tokens))
    raise ValueError(f"budget={budget!r} must be a fraction in (0, 1] or a token count >= 1")


def parse_budgets(text: str | Iterable) -> list[float | int]:
    items = [b.strip() for b in text.split(",")] if isinstance(text, str) else list(text)
    out: list[float | int] = []
    for b in items:
        if b == "" or b is None:
            continue
        s = str(b)
        try:
            v: float | int = int(s) if s.isdigit() else float(s)
        except ValueError:
            raise ValueError(
                f"budget {s!r} is not a number; use fractions in (0, 1] or token counts >= 1"
            ) from None
        if isinstance(v, float) and v.is_integer() and v > 1:
            v = int(v)
        compression_ratio(v, 1)  # validates
        out.append(v)
    if not out:
        raise ValueError("no budgets given: --budget 0.1,0.3 (or a config.yaml with budgets)")
    return out


def parse_list(text: str, allowed: Iterable[str], what: str) -> list[str]:
    allowed = list(allowed)
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise ValueError(f"{what}={text!r}; allowed values: {', '.join(allowed)}")
    return items


def read_prompts(path: str | Path) -> list[dict[str, Any]]:
    """Samples of `prompts.jsonl` (plain dicts, the harness's `Sample` fields + `protocols`)."""
    out = []
    need = ("task", "sample_id", "kind", "context_ids", "question_ids", "answer", "metadata")
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            d = json.loads(line)
            missing = [k for k in need if k not in d]
            if missing:
                raise ValueError(
                    f"{path}:{i}: missing field(s) {missing}; is this a sparsekv prompts.jsonl?"
                )
            d.setdefault("target_ids", [])
            d.setdefault("protocols", ["agnostic"])
            out.append(d)
    return out


def split_prompt(sample: dict[str, Any], protocol: str) -> tuple[list[int], list[int], int]:
    """(ids compressed by the press, ids fed after it as the question, max new tokens)."""
    ctx, q = list(sample["context_ids"]), list(sample["question_ids"])
    kind = sample["kind"]
    if kind == "continuation":
        return ctx, list(sample["target_ids"][:-1]), 1
    max_new = int(sample.get("max_new_tokens") or 1)
    if q and protocol == "agnostic":
        return ctx, q, max_new
    full = ctx + q  # aware, or no question: the last prompt token is the pipeline's question
    return full[:-1], full[-1:], max_new


def skip_reason(sample: dict[str, Any], protocol: str, spec: PressSpec | None) -> str | None:
    """Why a run is not made (None: it is made)."""
    if protocol not in sample.get("protocols", ["agnostic"]):
        return f"protocol {protocol} does not apply to task {sample['task']}"
    if spec is not None and spec.layers == "full" and sample["kind"] == "continuation":
        return CONTINUATION_LEAK
    return None


@dataclass
class RawRun:
    """What one pipeline run produced, before metrics. `step_logprobs` is `(steps, vocab)`: one
    row per generated token (answer/generate) or per teacher-forced position predicting
    `target_ids[1:]` (continuation)."""

    output_ids: list[int]
    output: str
    step_logprobs: Any
    kv_bytes_compressed: int
    kv_bytes_end: int
    prefill_s: float
    decode_s: float
    peak_rss_mb: float
    extra: dict[str, Any] = field(default_factory=dict)


class PressRunner(Protocol):
    def run(
        self, sample: dict[str, Any], protocol: str, spec: PressSpec | None, budget
    ) -> RawRun: ...


# --------------------------------------------------------------------------- rows


def new_row(
    fields: tuple[str, ...],
    sample: dict[str, Any],
    protocol: str,
    label: str,
    spec_text: str,
    budget,
) -> dict[str, Any]:
    row: dict[str, Any] = {k: None for k in fields}
    meta = sample.get("metadata", {})
    row.update(
        source=SOURCE,
        sample_id=sample["sample_id"],
        task=sample["task"],
        length=meta.get("target_length"),
        n_tokens=meta.get("n_tokens"),
        protocol=protocol,
        policy=label,
        policy_spec=spec_text,
        budget=budget,
        answer=sample["answer"],
        depth=meta.get("depth"),
    )
    return row


def fill_row(
    row: dict[str, Any], sample: dict[str, Any], raw: RawRun, ref: RawRun | None, metrics
) -> dict[str, Any]:
    """Metrics of one run, as the harness's `Runner._fill` computes them (first compressed step 0)."""
    import torch

    lp = raw.step_logprobs
    row.update(
        kv_bytes_compressed=int(raw.kv_bytes_compressed),
        kv_bytes_end=int(raw.kv_bytes_end),
        peak_rss_mb=round(raw.peak_rss_mb, 1),
        prefill_s=round(raw.prefill_s, 4),
        decode_s=round(raw.decode_s, 4),
    )
    row.update(raw.extra)
    if sample["kind"] == "continuation":
        tgt = torch.tensor(sample["target_ids"][1:])
        nll = -lp.gather(-1, tgt[:, None])[:, 0]
        row["nll"] = float(nll.mean())
        row["ppl"] = math.exp(row["nll"])
        row["top1"] = float((lp.argmax(-1) == tgt).float().mean())
        row["score"] = row["top1"]
        row["output"], row["output_ids"] = "", []
        if ref is not None:
            row["kl_mean"] = row["kl"] = float(metrics.kl_divergence(ref.step_logprobs, lp).mean())
        return row
    out = list(raw.output_ids)
    n = len(out)
    row["output_ids"], row["output"], row["new_tokens"] = out, raw.output, n
    row["decode_tok_s"] = round((n - 1) / raw.decode_s, 2) if n > 1 and raw.decode_s > 0 else None
    row["repetition"] = metrics.repetition_rate(out)
    if sample["kind"] == "answer":
        row["score"] = metrics.score_answer(raw.output, sample["answer"])
    if ref is not None:
        agree, prefix = metrics.token_agreement(ref.output_ids, out)
        row["agreement"], row["prefix_match"] = agree, prefix
        if sample["kind"] == "generate":
            row["score"] = agree
        valid = [t for t in range(min(len(ref.step_logprobs), len(lp))) if t <= prefix]
        if valid:
            kls = metrics.kl_divergence(ref.step_logprobs[valid], lp[valid])
            row["kl_mean"], row["kl"] = float(kls.mean()), float(kls[0])
    return row


def error_row(row: dict[str, Any], err: BaseException) -> dict[str, Any]:
    row["error"] = f"{type(err).__name__}: {err}"
    row["score"] = 0.0  # a crash counts as a miss
    return row


def clean(row: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (None if isinstance(v, float) and (math.isnan(v) or math.isinf(v)) else v)
        for k, v in row.items()
    }


def row_key(row: dict[str, Any]) -> tuple:
    return (row["policy"], str(row["budget"]), row["protocol"], row["sample_id"])


def spec_text(spec: PressSpec, ratio: float, layer_types: list[str] | None) -> str:
    cls, kwargs, eager = PRESSES[spec.press]
    args = ", ".join([f"compression_ratio={ratio:.4g}"] + [f"{k}={v!r}" for k, v in kwargs.items()])
    inner = f"{cls}({args})"
    if spec.layers == "full" and layer_types:
        full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        inner = f"PerLayerCompressionPress({inner}, layers {','.join(map(str, full))}; others 0)"
    return inner + (" [eager attention]" if eager else "")


# --------------------------------------------------------------------------- the grid


@dataclass
class Plan:
    samples: list[dict[str, Any]]
    specs: list[PressSpec]
    budgets: list[float | int]
    protocols: list[str]
    reference: bool = True

    def runs(self) -> list[tuple[dict[str, Any], str, PressSpec | None, Any]]:
        """(sample, protocol, spec or None for the reference, budget), in execution order."""
        out = []
        for s in self.samples:
            for p in self.protocols:
                if skip_reason(s, p, None):
                    continue
                if self.reference:
                    out.append((s, p, None, 1.0))
                for spec in self.specs:
                    if skip_reason(s, p, spec):
                        continue
                    out.extend((s, p, spec, b) for b in self.budgets)
        return out

    def skipped(self) -> dict[str, int]:
        """Reason -> number of runs left out (protocols that do not apply are not counted)."""
        out: dict[str, int] = {}
        for s in self.samples:
            for p in self.protocols:
                if skip_reason(s, p, None):
                    continue
                for spec in self.specs:
                    r = skip_reason(s, p, spec)
                    if r:
                        out[r] = out.get(r, 0) + len(self.budgets)
        return out


def run_plan(
    plan: Plan,
    runner: PressRunner,
    write: Callable[[dict[str, Any]], None],
    fields: tuple[str, ...],
    metrics,
    layer_types: list[str] | None = None,
    done: set[tuple] | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Run every (sample, protocol, spec, budget) of `plan`; `write` gets each row as it is made.

    The reference (no press) runs first for each sample and protocol, since every other row's KL
    and agreement are taken against it; rows whose key is in `done` are not run again (resume).
    """
    from tqdm.auto import tqdm

    done = done or set()
    runs = plan.runs()

    def key_of(s: dict[str, Any], p: str, spec: PressSpec | None, budget) -> tuple:
        return (REFERENCE_LABEL if spec is None else spec.label, str(budget), p, s["sample_id"])

    todo = [r for r in runs if key_of(*r) not in done]
    # the reference is re-run (not re-written) when its sample still has rows to make
    need_ref = {(s["sample_id"], p) for s, p, spec, _ in todo if spec is not None}
    bar = tqdm(
        total=sum(s["metadata"].get("n_tokens", 1) for s, *_ in todo),
        unit="tok",
        unit_scale=True,
        desc=f"kvpress {len(todo)} runs",
        disable=not progress,
        dynamic_ncols=True,
    )
    rows: list[dict[str, Any]] = []
    ref: RawRun | None = None
    ref_key = None
    for s, p, spec, budget in runs:
        label = REFERENCE_LABEL if spec is None else spec.label
        key = key_of(s, p, spec, budget)
        if key in done and not (spec is None and (s["sample_id"], p) in need_ref):
            continue
        bar.set_postfix_str(f"{s['sample_id']} {p} {label}@{budget}", refresh=False)
        ctx, _, _ = split_prompt(s, p)
        if spec is None:
            text = "kv-press-text-generation pipeline without a press (cache from the model config)"
        else:
            text = spec_text(spec, compression_ratio(budget, len(ctx)), layer_types)
        row = new_row(fields, s, p, label, text, budget)
        try:
            raw = runner.run(s, p, spec, budget)
            if spec is None:
                ref, ref_key = raw, (s["sample_id"], p)
            cur_ref = ref if ref_key == (s["sample_id"], p) else None
            row = fill_row(row, s, raw, cur_ref, metrics)
            if spec is None:
                row["kl"] = row["kl_mean"] = 0.0
        except Exception as e:  # noqa: BLE001 - a crashing press is a measured miss, not a stop
            if spec is None:
                ref, ref_key = None, None
            row = error_row(row, e)
            print(
                f"\n[kvpress peer] {label} @ {budget} on {s['sample_id']} ({p}) failed: {row['error']}",
                file=sys.stderr,
            )
        if key not in done:
            write(clean(row))
            rows.append(row)
        bar.update(s["metadata"].get("n_tokens", 1))
    bar.close()
    return rows


# --------------------------------------------------------------------------- kvpress side


class KVPressRunner:
    """Runs one press at a time through kvpress's `kv-press-text-generation` pipeline."""

    def __init__(self, model_path: str, dtype: str = "float32", attn_implementation: str = "sdpa"):
        import logging

        import kvpress
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        logging.getLogger("kvpress").setLevel(
            logging.ERROR
        )  # "not tested" / "experimental" per call
        self.torch = torch
        self.kvpress = kvpress
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={dtype!r}; allowed values: float32, bfloat16, float16")
        self.attn = attn_implementation
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=getattr(torch, dtype), attn_implementation=attn_implementation
        ).eval()
        self.model.requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pipe = pipeline(
            "kv-press-text-generation",
            model=self.model,
            tokenizer=self.tokenizer,
            device=self.model.device,
        )
        cfg = self.model.config.get_text_config()
        self.layer_types: list[str] | None = list(getattr(cfg, "layer_types", None) or []) or None
        self.metrics = load_harness_metrics()
        self.versions = {
            "kvpress": _version("kvpress"),
            "transformers": transformers.__version__,
            "torch": str(torch.__version__),
        }

    @property
    def has_sliding_layers(self) -> bool:
        return bool(self.layer_types) and any(t != "full_attention" for t in self.layer_types)

    def _press(self, spec: PressSpec, ratio: float):
        cls, kwargs, _ = PRESSES[spec.press]
        press = getattr(self.kvpress, cls)(compression_ratio=ratio, **kwargs)
        if spec.layers == "full":
            ratios = [ratio if t == "full_attention" else 0.0 for t in self.layer_types]
            press = self.kvpress.PerLayerCompressionPress(press=press, compression_ratios=ratios)
        return press

    def _cache(self, spec: PressSpec | None):
        from transformers import DynamicCache

        if spec is not None and spec.layers == "all":
            return DynamicCache()  # what the pipeline makes when given none
        # The reference and the full-layers mode: sliding layers kept as transformers keeps them
        # (the pipeline's default cache crashes with PerLayerCompressionPress on Gemma 3).
        return DynamicCache(config=self.model.config)

    def _logits(self, hidden):
        logits = self.model.lm_head(hidden)
        cap = getattr(self.model.config.get_text_config(), "final_logit_softcapping", None)
        if cap:
            logits = self.torch.tanh(logits / cap) * cap
        return logits

    def run(self, sample: dict[str, Any], protocol: str, spec: PressSpec | None, budget) -> RawRun:
        torch = self.torch
        ctx, q, max_new = split_prompt(sample, protocol)
        ratio = 0.0 if spec is None else compression_ratio(budget, len(ctx))
        press = None if spec is None else self._press(spec, ratio)
        cache = self._cache(spec)
        cont = sample["kind"] == "continuation"
        rec: dict[str, Any] = {"steps": [], "inner_calls": 0}

        def kv_now() -> int:
            return int(self.metrics.kv_bytes(cache))

        def pre_top(module, args, kwargs):
            if not rec["steps"]:
                rec["t_ctx"] = time.perf_counter()
                rec["kv_compressed"] = kv_now()
                rec["lengths"] = [
                    int(layer.keys.shape[-2])
                    if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4
                    else 0
                    for layer in cache.layers
                ]

        def post_top(module, args, kwargs, output):
            rec["steps"].append(output.logits[0, -1].float())
            rec["t_last"] = time.perf_counter()
            if len(rec["steps"]) == 1:
                rec["t_q"] = rec["t_last"]
            rec["kv_end"] = kv_now()

        def post_inner(module, args, kwargs, output):
            rec["inner_calls"] += 1
            if (
                cont and rec["inner_calls"] == 2
            ):  # the question's (= teacher-forced targets') forward
                rec["hidden"] = output.last_hidden_state[0]

        need_eager = spec is not None and spec.needs_eager and self.attn != "eager"
        hooks = [
            self.model.register_forward_pre_hook(pre_top, with_kwargs=True),
            self.model.register_forward_hook(post_top, with_kwargs=True),
            self.model.model.register_forward_hook(post_inner, with_kwargs=True),
        ]
        try:
            if need_eager:
                self.model.set_attn_implementation("eager")
            inputs = {"context_ids": torch.tensor([ctx]), "questions_ids": [torch.tensor([q])]}
            with self.metrics.PeakRSS() as rss:
                t0 = time.perf_counter()
                answers = self.pipe.forward(
                    inputs, max_new_tokens=max_new, press=press, cache=cache
                )
        finally:
            for h in hooks:
                h.remove()
            if need_eager:
                self.model.set_attn_implementation(self.attn)
        out = self.pipe.postprocess(answers, single_question=True)["answer"]
        steps = torch.stack(rec["steps"])  # (new tokens, vocab)
        extra = {
            "press": None if spec is None else PRESSES[spec.press][0],
            "layers": None if spec is None else spec.layers,
            "compression_ratio": round(ratio, 6),
            "kv_layer_lengths": rec.get("lengths"),
            "context_prefill_s": round(rec["t_ctx"] - t0, 4),
            "peer_env": ", ".join(f"{k} {v}" for k, v in self.versions.items()),
        }
        if cont:
            with torch.no_grad():
                logits = self._logits(rec["hidden"]).float()  # (K-1, vocab) predicting target[1:]
            if not torch.allclose(logits[-1], steps[0], atol=1e-3, rtol=1e-3):
                raise RuntimeError("rebuilt continuation logits differ from the pipeline's own")
            lp, ids, text = torch.log_softmax(logits, -1), [], ""
        else:
            lp = torch.log_softmax(steps, -1)
            ids = [int(i) for i in steps.argmax(-1)]
            text = str(out)
        return RawRun(
            output_ids=ids,
            output=text,
            step_logprobs=lp,
            kv_bytes_compressed=rec["kv_compressed"],
            kv_bytes_end=rec["kv_end"],
            prefill_s=rec["t_q"] - t0,
            decode_s=rec["t_last"] - rec["t_q"],
            peak_rss_mb=rss.peak / 2**20,
            extra=extra,
        )


def _version(pkg: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(pkg)
    except Exception:  # noqa: BLE001
        return None


# --------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run_presses.py",
        description="Run kvpress's presses on a sparsekv prompts.jsonl through kvpress's pipeline and "
        "write result rows in the harness's format (see README.md beside this file).",
    )
    p.add_argument(
        "--prompts",
        required=True,
        help="prompts.jsonl written by `sparsekv eval` (or --dump-prompts)",
    )
    p.add_argument(
        "--out", required=True, help="rows file to write (JSON lines), e.g. results/x/kvpress.jsonl"
    )
    p.add_argument(
        "--config",
        help="the evaluation's config.yaml: budgets, model, dtype, attention when not given",
    )
    p.add_argument(
        "--model", help="local Hugging Face model folder (run.sh passes the default model's)"
    )
    p.add_argument(
        "--budget",
        "--budgets",
        dest="budgets",
        help="comma-separated budgets: fractions in (0, 1] (compression_ratio = 1 - budget) or token counts",
    )
    p.add_argument(
        "--presses", default=",".join(PRESSES), help=f"comma-separated, from: {', '.join(PRESSES)}"
    )
    p.add_argument(
        "--layers",
        default=",".join(LAYER_MODES),
        help="'all' (every layer compressed, as users get them) and/or 'full' (only the "
        "full-attention layers, via PerLayerCompressionPress); 'full' needs sliding layers",
    )
    p.add_argument(
        "--protocol",
        "--protocols",
        dest="protocols",
        default="agnostic",
        help="agnostic (question after compression; the pipeline's protocol) and/or aware",
    )
    p.add_argument("--tasks", help="only these tasks (comma-separated)")
    p.add_argument("--samples", type=int, help="only the first N samples of each task and length")
    p.add_argument("--dtype", help="float32 (default), bfloat16 or float16")
    p.add_argument("--attn", dest="attn_implementation", help="sdpa (default) or eager")
    p.add_argument("--threads", type=int, help="torch threads")
    p.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the no-press run (then no KL and no agreement)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the rows already in --out and make only the rest",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print the plan (runs per method) and exit"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _read_config(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path!r} must hold a mapping of fields")
    return data


def make_plan(args: argparse.Namespace, cfg: dict[str, Any]) -> Plan:
    samples = read_prompts(args.prompts)
    if args.tasks:
        wanted = [t.strip() for t in args.tasks.split(",") if t.strip()]
        unknown = sorted(set(wanted) - {s["task"] for s in samples})
        if unknown:
            raise ValueError(
                f"--tasks {unknown} not in {args.prompts}; it holds: "
                f"{', '.join(sorted({s['task'] for s in samples}))}"
            )
        samples = [s for s in samples if s["task"] in wanted]
    if args.samples is not None:
        if args.samples < 1:
            raise ValueError(f"--samples {args.samples} must be >= 1")
        samples = [s for s in samples if s["metadata"].get("index", 0) < args.samples]
    budgets = parse_budgets(args.budgets if args.budgets is not None else cfg.get("budgets") or "")
    presses = parse_list(args.presses, PRESSES, "--presses")
    layers = parse_list(args.layers, LAYER_MODES, "--layers")
    protocols = parse_list(args.protocols, PROTOCOLS, "--protocol")
    specs = [PressSpec(p, m) for m in layers for p in presses]
    return Plan(samples, specs, budgets, protocols, reference=not args.no_reference)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = _read_config(args.config)
    plan = make_plan(args, cfg)
    runs = plan.runs()
    per: dict[str, int] = {}
    for _, _, spec, _ in runs:
        per[REFERENCE_LABEL if spec is None else spec.label] = (
            per.get(REFERENCE_LABEL if spec is None else spec.label, 0) + 1
        )
    print(
        f"[kvpress peer] {len(plan.samples)} samples, {len(runs)} runs: "
        + ", ".join(f"{k} {v}" for k, v in per.items()),
        file=sys.stderr,
    )
    for reason, n in plan.skipped().items():
        print(f"[kvpress peer] {n} runs {reason}", file=sys.stderr)
    if args.dry_run:
        return 0
    model = args.model or cfg.get("model")
    if not model or model == "default" or str(model).startswith("tiny:"):
        raise ValueError(
            "give --model: a local Hugging Face model folder (run.sh passes the default model's); "
            f"config model {model!r} cannot be loaded here"
        )
    if not (Path(model) / "config.json").is_file():
        raise ValueError(f"--model {model!r} is not a model folder with a config.json")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    fields = harness_row_fields()
    t0 = time.perf_counter()
    runner = KVPressRunner(
        model,
        args.dtype or cfg.get("dtype") or "float32",
        args.attn_implementation or cfg.get("attn_implementation") or "sdpa",
    )
    print(
        f"[kvpress peer] model loaded in {time.perf_counter() - t0:.1f}s; kvpress {runner.versions['kvpress']}, "
        f"transformers {runner.versions['transformers']}, torch {runner.versions['torch']}",
        file=sys.stderr,
    )
    if not runner.has_sliding_layers and any(s.layers == "full" for s in plan.specs):
        print(
            "[kvpress peer] the model has no sliding-window layers: 'full' equals 'all', running 'all' only",
            file=sys.stderr,
        )
        plan.specs = [s for s in plan.specs if s.layers == "all"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done: set[tuple] = set()
    if args.resume and out.exists():
        with open(out) as f:
            done = {row_key(json.loads(line)) for line in f if line.strip()}
    times: dict[str, list[float]] = {}
    with open(out, "a" if args.resume else "w") as f:

        def write(row: dict[str, Any]) -> None:
            f.write(json.dumps(row) + "\n")
            f.flush()
            if not row.get("error"):
                times.setdefault(row["policy"], []).append(
                    (row["prefill_s"] or 0) + (row["decode_s"] or 0)
                )

        rows = run_plan(
            plan,
            runner,
            write,
            fields,
            runner.metrics,
            runner.layer_types,
            done,
            progress=not args.no_progress,
        )
    errors = sum(1 for r in rows if r.get("error"))
    print(
        f"[kvpress peer] wrote {len(rows)} rows ({errors} errors) to {out} in {time.perf_counter() - t0:.0f}s",
        file=sys.stderr,
    )
    for label, ts in times.items():
        print(
            f"[kvpress peer]   {label:<24} {len(ts):>4} runs, {sum(ts) / len(ts):6.2f} s per run (prefill+decode)",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:
        print(f"run_presses.py: error: {e}", file=sys.stderr)
        sys.exit(2)
