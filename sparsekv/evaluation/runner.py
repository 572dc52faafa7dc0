"""Runs an evaluation grid: every sample under every protocol, the full cache first (the
reference), then every policy x budget; one result row per run, appended to `results.jsonl`.

Shared prefill (the default, `EvalConfig.shared_prefill`): the compressed part of each prompt is
prefilled once by a full `SparseKVCache` that records the attention statistics the grid's
policies read, and the reference and every policy x budget start from `fork` of it, which keeps
exactly what that policy's own prefill would have kept (eviction happens after each layer's
attention, so the prefill's outputs do not depend on the policy). The prefill forward then
runs once per prompt instead of once per method. `prefill_s` of such rows is the shared
forward (which computes the statistics of every policy) plus the method's own fork and question
forward. Methods with `prefill_chunk`, or an observation window other than the grid's most
common one, prefill live; `shared_prefill: false` prefills every run live, with transformers'
`DynamicCache` as the full-cache reference.

How one run goes (batch 1, greedy, no sampling):
- "answer" and "generate" samples: the prompt is prefilled with `logits_to_keep=1`; under the
  agnostic protocol the context alone first (the cache compresses it), then the question through
  the compressed cache; under the aware protocol context + question in one forward. Then
  greedy decoding token by token up to `max_new_tokens` or an end-of-sequence token.
- "continuation" samples: the context is prefilled (compressed), then the held-out continuation
  is teacher-forced through the cache and scored position by position.

KL divergence, KL(full || policy) in nats from the next-token distributions:
- `kl`: at the first decoding step whose logits came from the compressed cache, i.e. step 0
  under the agnostic protocol (the question's forward) and step 1 under the aware protocol or
  without a question (step 0 comes from the prefill itself, which attends to everything before
  the cache compresses); step 0 whenever the prompt is prefilled in chunks. It is computed only
  while the policy's output so far equals the full cache's (same inputs), else NaN.
- `kl_mean`: the mean over all such steps with a shared prefix (for continuation samples: over
  every teacher-forced position, which always share their inputs).

Row format (also what peers such as kvpress write; see `ingest_rows`): `sample_id`, `task`,
`length`, `protocol`, `policy` (label), `budget` (1.0 for the reference), `source`
("sparsekv" or the peer's name), `output` (generated text), `score`, `kl`, `kl_mean`,
`kv_bytes_compressed`, `kv_bytes_end`, `peak_rss_mb`, `prefill_s`, `decode_tok_s`,
`error` (None, or the error text of a run that crashed: it counts as a miss), plus the
per-task extras listed in `ROW_FIELDS`.
"""

from __future__ import annotations

import json
import math
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from sparsekv.evaluation import metrics as M
from sparsekv.evaluation.codec import Codec
from sparsekv.evaluation.config import REFERENCE, EvalConfig, PolicySpec
from sparsekv.evaluation.tasks import Sample, get_task, make_sample

ROW_FIELDS = (
    "source", "sample_id", "task", "length", "n_tokens", "protocol", "policy", "policy_spec",
    "budget", "answer", "output", "output_ids", "score", "kl", "kl_mean", "nll", "ppl", "top1",
    "agreement", "prefix_match", "repetition", "kv_bytes_compressed", "kv_bytes_end",
    "peak_rss_mb", "prefill_s", "decode_s", "decode_tok_s", "new_tokens", "depth", "error",
    "kv_bytes_peak", "prefill_shared", "fork_s",
)
REQUIRED_PEER_FIELDS = ("sample_id", "task", "length", "protocol", "policy", "budget")
NAN = float("nan")


@dataclass
class Reference:
    """What the full cache produced for one sample and protocol: tokens and log-probabilities
    per step `(steps, vocab)` (continuation: per teacher-forced position)."""

    output_ids: list[int]
    logprobs: torch.Tensor
    score: float
    extra: dict[str, Any] = field(default_factory=dict)


def build_samples(cfg: EvalConfig, codec: Codec) -> list[Sample]:
    """Every sample of the grid, in order index -> task -> length (deterministic): a run stopped
    early (or resumed later) has covered every task equally far."""
    out = []
    for i in range(cfg.samples):
        for task in cfg.tasks:
            opts = dict(cfg.task_options.get(task, {}))
            max_new = opts.pop("max_new_tokens", None)
            for length in cfg.lengths:
                s = make_sample(task, codec, length, i, seed=cfg.seed, **opts)
                if max_new is not None:
                    s.max_new_tokens = int(max_new)
                out.append(s)
    return out


def write_prompts(samples: list[Sample], cfg: EvalConfig, path: Path) -> None:
    """One JSON line per sample: the `Sample` fields (texts and token ids), the protocols it runs
    under, `prompt` (context + question as text) and `stop_at_newline` (answer tasks: decoding
    may stop after the first line, the only one scored). Peers read this to run the same prompts."""
    with open(path, "w") as f:
        for s in samples:
            d = s.to_dict()
            d["protocols"] = cfg.protocols_for(s.task)
            d["prompt"] = s.context + s.question
            d["stop_at_newline"] = s.kind == "answer"
            f.write(json.dumps(d) + "\n")


def read_prompts(path: Path) -> list[Sample]:
    samples = []
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            d.pop("protocols", None)
            d.pop("prompt", None)
            d.pop("stop_at_newline", None)
            samples.append(Sample.from_dict(d))
    return samples


class Runner:
    """Executes single runs on one model. `run_reference` first, then `run_policy` per method."""

    def __init__(self, model, codec: Codec, cfg: EvalConfig):
        self.model = model
        self.codec = codec
        self.cfg = cfg
        self.device = next(model.parameters()).device
        self._adapters: dict[str, Any] = {}

    # ---- building ---------------------------------------------------------------------------
    def build_policy(self, spec: PolicySpec):
        from sparsekv import policies

        if spec.name.startswith("learned:"):
            path = spec.name.split(":", 1)[1]
            if path not in self._adapters:
                from sparsekv.adapter import ScorerAdapter

                self._adapters[path] = ScorerAdapter.from_pretrained(path)
            return policies.get("learned", adapter=self._adapters[path], **spec.policy_kwargs)
        return policies.get(spec.name, **spec.policy_kwargs)

    def eviction_config(self, spec: PolicySpec, budget):
        from sparsekv import EvictionConfig

        return EvictionConfig(budget=budget, **{**self.cfg.eviction, **spec.eviction})

    def _make_cache(self, spec: PolicySpec | None, budget):
        if spec is None:
            from transformers import DynamicCache

            return DynamicCache(config=self.model.config)
        from sparsekv import SparseKVCache

        return SparseKVCache(self.model, self.eviction_config(spec, budget), self.build_policy(spec))

    # ---- shared prefill ---------------------------------------------------------------------
    @staticmethod
    def _needs(policy) -> str | None:
        """The attention statistic a policy reads at prefill ("all", "window", "last" or None)."""
        return policy.attention_queries or ("all" if policy.tracks_observed else None)

    def plan(self) -> None:
        """Decide which methods start from the one recorded prefill of each sample (see
        `run_group`) and what that prefill must record. Methods with `prefill_chunk`, or whose
        observation window differs from the most common one, prefill live."""
        from collections import Counter

        built = {}
        for spec in self.cfg.policy_specs:
            try:
                built[spec.spec] = self.build_policy(spec)
            except OSError as e:  # an adapter that is neither a folder nor a reachable Hub repo
                raise ValueError(f"policy {spec.spec!r}: {e}") from e
        windows = Counter(p.window for p in built.values() if self._needs(p) == "window")
        self.record_window = windows.most_common(1)[0][0] if windows else 32
        self.forkable = {
            spec.spec: bool(self.cfg.shared_prefill)
            and self._chunk(spec) is None
            and (self._needs(built[spec.spec]) != "window" or built[spec.spec].window == self.record_window)
            for spec in self.cfg.policy_specs
        }
        needs = {self._needs(built[key]) for key, ok in self.forkable.items() if ok}
        self.record = tuple(sorted(n for n in needs if n)) or ("last",)

    # ---- model calls ------------------------------------------------------------------------
    def _forward(self, ids: list[int], cache, keep: int) -> torch.Tensor:
        t = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=t, cache=cache, use_cache=True, logits_to_keep=keep)
        return out.logits[0].float()  # (keep or len(ids), vocab)

    def _chunk(self, spec: PolicySpec | None) -> int | None:
        if spec is None:
            return None
        return {**self.cfg.eviction, **spec.eviction}.get("prefill_chunk")

    @staticmethod
    def _split(sample: Sample, protocol: str) -> bool:
        """True when only the context is compressed first (the question, or the continuation,
        follows through the compressed cache)."""
        return sample.kind == "continuation" or (protocol == "agnostic" and bool(sample.question_ids))

    @torch.no_grad()
    def _prefill_shared(self, sample: Sample, protocol: str) -> _SharedPrefill:
        """Prefill the compressed part of the prompt once, with the full cache recording what
        every forkable policy needs."""
        from sparsekv import EvictionConfig, SparseKVCache

        ids = sample.context_ids if self._split(sample, protocol) else sample.prompt_ids
        rec = SparseKVCache(self.model, EvictionConfig(budget=1.0), "full", record=self.record,
                            record_window=self.record_window)
        with M.PeakRSS() as rss:
            t0 = time.perf_counter()
            logits = self._forward(ids, rec, 1)
            seconds = time.perf_counter() - t0
        return _SharedPrefill(rec, logits, seconds, rss.peak)

    @torch.no_grad()
    def _execute(self, sample: Sample, protocol: str, start, chunk: int | None,
                 shared: _SharedPrefill | None) -> dict[str, Any]:
        """One run. `start()` returns a cache holding the compressed prefix: a fresh cache that
        this function prefills (shared is None) or a fork of the shared prefill. Returns raw
        outputs (token ids, step logits) and measurements."""
        ctx, q = sample.context_ids, sample.question_ids
        split = self._split(sample, protocol)
        res: dict[str, Any] = {"prefill_shared": shared is not None}
        with M.PeakRSS() as rss:
            t0 = time.perf_counter()
            cache = start()
            if shared is None:
                logits = self._forward(ctx if split else ctx + q, cache, 1)
            else:
                logits = shared.logits
                res["fork_s"] = time.perf_counter() - t0
            res["kv_bytes_compressed"] = M.kv_bytes(cache)
            if split and q:
                logits = self._forward(q, cache, 1)
            res["prefill_s"] = time.perf_counter() - t0 + (shared.seconds if shared is not None else 0.0)
            chunked = chunk is not None and len(ctx) + len(q) > chunk
            res["first_compressed"] = 0 if (split or chunked) else 1
            t1 = time.perf_counter()
            if sample.kind == "continuation":
                tgt = sample.target_ids[:-1]
                step = chunk or len(tgt)
                parts = [self._forward(tgt[i : i + step], cache, 0) for i in range(0, len(tgt), step)]
                res["step_logits"] = torch.cat(parts, 0)  # (K-1, vocab) predicting target[1:]
                res["output_ids"] = []
            else:
                steps = [logits[-1]]
                out = [int(logits[-1].argmax())]
                one_line = sample.kind == "answer"
                while len(out) < sample.max_new_tokens and out[-1] not in self.codec.eos_ids:
                    if one_line and M.answer_complete(self.codec.decode(out)):
                        break  # only the first line is scored
                    logits = self._forward([out[-1]], cache, 1)
                    steps.append(logits[-1])
                    out.append(int(logits[-1].argmax()))
                res["step_logits"] = torch.stack(steps)
                res["output_ids"] = out
            res["decode_s"] = time.perf_counter() - t1
            res["kv_bytes_end"] = M.kv_bytes(cache)
            if shared is None:  # a fork never held the whole prefix itself
                peak = cache.peak_kv_bytes() if hasattr(cache, "peak_kv_bytes") else 0
                res["kv_bytes_peak"] = int(max(peak, res["kv_bytes_compressed"], res["kv_bytes_end"]))
            if hasattr(cache, "close"):
                cache.close()
        peak = max(rss.peak, shared.peak_rss if shared is not None else 0)
        res["peak_rss_mb"] = peak / 2**20
        return res

    def _row(self, sample: Sample, protocol: str, label: str, spec_text: str, budget) -> dict[str, Any]:
        row = {k: None for k in ROW_FIELDS}
        row.update(
            source="sparsekv", sample_id=sample.sample_id, task=sample.task,
            length=sample.metadata["target_length"], n_tokens=sample.metadata["n_tokens"],
            protocol=protocol, policy=label, policy_spec=spec_text, budget=budget,
            answer=sample.answer, depth=sample.metadata.get("depth"),
        )
        return row

    def _fill(self, row: dict, sample: Sample, res: dict, ref: Reference | None) -> tuple[dict, torch.Tensor]:
        """Turn raw outputs into metrics; returns the row and the log-probabilities."""
        lp = torch.log_softmax(res["step_logits"], dim=-1)
        row.update(
            kv_bytes_compressed=res["kv_bytes_compressed"], kv_bytes_end=res["kv_bytes_end"],
            kv_bytes_peak=res.get("kv_bytes_peak"), peak_rss_mb=round(res["peak_rss_mb"], 1),
            prefill_s=round(res["prefill_s"], 4), decode_s=round(res["decode_s"], 4),
            prefill_shared=res["prefill_shared"],
            fork_s=round(res["fork_s"], 4) if "fork_s" in res else None,
        )
        if sample.kind == "continuation":
            tgt = torch.tensor(sample.target_ids[1:], device=lp.device)
            nll = -lp.gather(-1, tgt[:, None])[:, 0]
            row["nll"] = float(nll.mean())
            row["ppl"] = math.exp(row["nll"])
            row["top1"] = float((lp.argmax(-1) == tgt).float().mean())
            row["score"] = row["top1"]
            row["output"] = ""
            row["output_ids"] = []
            if ref is not None:
                kl = M.kl_divergence(ref.logprobs, lp)
                row["kl_mean"] = float(kl.mean())
                row["kl"] = row["kl_mean"]
            return row, lp
        out = res["output_ids"]
        n = len(out)
        row["output_ids"] = out
        row["output"] = self.codec.decode(out)
        row["new_tokens"] = n
        row["decode_tok_s"] = round((n - 1) / res["decode_s"], 2) if n > 1 and res["decode_s"] > 0 else None
        row["repetition"] = M.repetition_rate(out)
        if sample.kind == "answer":
            row["score"] = M.score_answer(row["output"], sample.answer)
        if ref is not None:
            agree, prefix = M.token_agreement(ref.output_ids, out)
            row["agreement"], row["prefix_match"] = agree, prefix
            if sample.kind == "generate":
                row["score"] = agree
            first = res["first_compressed"]
            valid = [t for t in range(first, min(len(ref.logprobs), len(lp))) if t <= prefix]
            if valid:
                kls = M.kl_divergence(ref.logprobs[valid], lp[valid])
                row["kl_mean"] = float(kls.mean())
                row["kl"] = float(kls[0]) if valid[0] == first else NAN
            else:
                row["kl"] = row["kl_mean"] = NAN
        return row, lp

    # ---- public -----------------------------------------------------------------------------
    def run_group(self, sample: Sample, protocol: str):
        """Yield the rows of one sample under one protocol: the full cache first, then every
        policy x budget. With `shared_prefill` the compressed part of the prompt is prefilled
        once (recording the attention statistics the policies read) and each method starts
        from `SparseKVCache.fork` of it: the same kept entries as its own prefill, without
        repeating the forward. Methods that cannot fork prefill live."""
        from sparsekv import EvictionConfig

        if not hasattr(self, "forkable"):
            self.plan()
        shared = self._prefill_shared(sample, protocol) if any(self.forkable.values()) else None
        try:
            if shared is not None:
                row, ref = self.run_reference(
                    sample, protocol, lambda: shared.cache.fork(EvictionConfig(budget=1.0), "full"), shared
                )
            else:
                row, ref = self.run_reference(sample, protocol)
            yield row
            for spec in self.cfg.policy_specs:
                for budget in self.cfg.budgets_of(spec, protocol):
                    use = shared if self.forkable[spec.spec] else None
                    yield self.run_policy(sample, protocol, spec, budget, ref, use)
        finally:
            if shared is not None:
                shared.cache.close()

    def run_reference(self, sample: Sample, protocol: str, start=None,
                      shared: _SharedPrefill | None = None) -> tuple[dict[str, Any], Reference]:
        """The full cache: transformers' DynamicCache prefilled live, or the full-policy fork of
        a shared prefill. Returns the row and what later runs compare with."""
        res = self._execute(sample, protocol, start or (lambda: self._make_cache(None, None)), None, shared)
        row = self._row(sample, protocol, REFERENCE, REFERENCE, 1.0)
        row, lp = self._fill(row, sample, res, None)
        if sample.kind != "continuation":
            row["agreement"], row["prefix_match"] = 1.0, len(res["output_ids"])
            if sample.kind == "generate":
                row["score"] = 1.0
        row["kl"] = row["kl_mean"] = 0.0
        return row, Reference(res["output_ids"], lp, row["score"])

    def run_policy(self, sample: Sample, protocol: str, spec: PolicySpec, budget, ref: Reference,
                   shared: _SharedPrefill | None = None) -> dict[str, Any]:
        """One policy at one budget; a crash becomes a row with `error` set and score 0."""
        row = self._row(sample, protocol, spec.label, spec.spec, budget)
        try:
            if shared is not None:
                def start():
                    return shared.cache.fork(self.eviction_config(spec, budget), self.build_policy(spec))
            else:
                def start():
                    return self._make_cache(spec, budget)
            res = self._execute(sample, protocol, start, self._chunk(spec), shared)
            row, _ = self._fill(row, sample, res, ref)
        except Exception as e:  # a crashing method is a measured miss, not a stop
            row["error"] = f"{type(e).__name__}: {e}"
            row["score"] = 0.0
            row["kl"] = row["kl_mean"] = NAN
            tb = traceback.format_exc(limit=3)
            print(f"\n[sparsekv eval] {spec.label} @ {budget} on {sample.sample_id} failed:\n{tb}", file=sys.stderr)
        return row


@dataclass
class _SharedPrefill:
    """One recorded full-cache prefill: the cache, the last logits `(1, vocab)`, its seconds and
    the process's peak resident memory during it (bytes)."""

    cache: Any
    logits: torch.Tensor
    seconds: float
    peak_rss: int


def grid_size(cfg: EvalConfig, samples: list[Sample]) -> tuple[int, int]:
    """(number of runs, number of prompt tokens processed) of the whole grid."""
    runs = tokens = 0
    for s in samples:
        k = sum(len(_method_keys(cfg, pr)) for pr in cfg.protocols_for(s.task))
        runs += k
        tokens += k * s.metadata["n_tokens"]
    return runs, tokens


def _environment(model, codec) -> dict[str, Any]:
    import transformers

    from sparsekv import __version__

    return {
        "sparsekv": __version__, "torch": str(torch.__version__), "transformers": transformers.__version__,
        "python": platform.python_version(), "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
        "model_class": type(model).__name__, "tokenizer": codec.name,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _json_default(x):
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, torch.Tensor):
        return x.tolist()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def _clean(row: dict) -> dict:
    return {k: (None if isinstance(v, float) and (math.isnan(v) or math.isinf(v)) else v) for k, v in row.items()}


def dump_row(f, row: dict) -> None:
    f.write(json.dumps(_clean(row), default=_json_default) + "\n")
    f.flush()


# Fields of config.yaml that must match for `resume` to reuse earlier rows: the rest (tasks,
# lengths, samples, policies, budgets, protocols, threads, workers) may grow between runs.
_RESUME_FIELDS = ("model", "dtype", "attn_implementation", "seed", "eviction", "task_options", "shared_prefill")


def _method_keys(cfg: EvalConfig, protocol: str) -> set[tuple[str, str]]:
    """(label, budget) of every run of one group under `protocol`, the reference included."""
    return {(REFERENCE, str(1.0))} | {
        (p.label, str(b)) for p in cfg.policy_specs for b in cfg.budgets_of(p, protocol)
    }


def _check_resumable(out: Path, cfg: EvalConfig) -> None:
    path = out / "config.yaml"
    if not path.exists():
        return
    old = yaml.safe_load(path.read_text()) or {}
    new = cfg.to_dict()
    for k in _RESUME_FIELDS:
        if k in old and old[k] != new[k]:
            raise ValueError(
                f"resume: {out} was run with {k}={old[k]!r}, this grid has {k}={new[k]!r}; "
                "use another --out (or the same setting) to resume"
            )
    for o in old.get("policy_specs") or []:
        for p in cfg.policy_specs:
            shared = [pr for pr in cfg.protocols
                      if p.runs_under(pr) and (not o.get("protocols") or pr in o["protocols"])]
            if o["label"] == p.label and shared and o["spec"] != p.spec:
                raise ValueError(
                    f"resume: label {p.label!r} meant {o['spec']!r} under {shared[0]} in {out}, here {p.spec!r}; "
                    "give the new method another @label=NAME"
                )


def _completed_rows(rows: list[dict], cfg: EvalConfig) -> tuple[list[dict], set[tuple[str, str]]]:
    """The rows worth keeping on resume and the (sample_id, protocol) groups they complete.

    A group of our own rows is complete when it holds every (label, budget) of `cfg`; rows of
    incomplete groups are dropped (the group reruns: its reference must be recomputed anyway).
    Rows of peers (`source` other than sparsekv) are always kept."""
    have: dict[tuple[str, str], set] = {}
    for r in rows:
        if r.get("source", "sparsekv") == "sparsekv":
            have.setdefault((r["sample_id"], r["protocol"]), set()).add((r["policy"], str(r["budget"])))
    want = {pr: _method_keys(cfg, pr) for pr in {g[1] for g in have}}
    done = {g for g, keys in have.items() if want[g[1]] <= keys}
    keep = [r for r in rows if r.get("source", "sparsekv") != "sparsekv" or (r["sample_id"], r["protocol"]) in done]
    return keep, done


def merge_parts(out: str | Path) -> tuple[int, int]:
    """Fold the part files a stopped run left in `out` into results.jsonl: the complete
    (sample, protocol) groups are kept, the incomplete ones dropped (a later `resume` reruns
    them). Returns (groups kept, groups dropped); the grid is read from `out`/config.yaml."""
    out = Path(out)
    parts = sorted(out.glob("results.part-*.jsonl"))
    if not parts:
        return 0, 0
    saved = yaml.safe_load((out / "config.yaml").read_text()) or {}
    fields_ = {f for f in EvalConfig.__dataclass_fields__}
    cfg = EvalConfig.from_dict({k: v for k, v in saved.items() if k in fields_})
    results = out / "results.jsonl"
    old = read_rows(results) if results.exists() else []
    new = [r for p in parts for r in read_rows(p)]
    keep, done = _completed_rows(old + new, cfg)
    groups = {(r["sample_id"], r["protocol"]) for r in new}
    _write_rows_atomic(results, keep)
    for p in parts:
        p.unlink()
    return len(groups & done), len(groups - done)


def _write_rows_atomic(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        for r in rows:
            dump_row(f, r)
    tmp.replace(path)


def _run_groups(cfg: EvalConfig, groups: list[tuple[Sample, str]], part: Path, model=None, codec=None,
                on_row=None) -> None:
    """Run `groups` ((sample, protocol) pairs) and append their rows to `part` as they come."""
    from sparsekv.evaluation.models import load_model

    if model is None:
        model, codec = load_model(cfg.model, cfg.dtype, cfg.attn_implementation, seed=cfg.seed)
    runner = Runner(model, codec, cfg)
    runner.plan()
    with open(part, "a") as f:
        for s, protocol in groups:
            for row in runner.run_group(s, protocol):
                dump_row(f, row)
                if on_row is not None:
                    on_row(s, protocol, row)


def _worker(cfg_dict: dict, groups: list[tuple[Sample, str]], part: str, threads: int) -> None:
    """Entry point of one worker process (spawned): its own model, one shard of the groups."""
    torch.set_num_threads(threads)
    cfg = EvalConfig.from_dict(cfg_dict)
    torch.manual_seed(cfg.seed)
    _run_groups(cfg, groups, Path(part))


def _line_count(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def run_eval(cfg: EvalConfig, model=None, codec: Codec | None = None, progress: bool = True,
             report: bool = True, resume: bool = False) -> Path:
    """Run the grid of `cfg` and write everything into `cfg.out`; returns the folder.

    `resume=True` keeps the complete (sample, protocol) groups already in `cfg.out` (from
    results.jsonl and from the part files an interrupted run left) and runs only the rest, so a
    grid can grow (more samples, tasks, methods) or survive a stop. With `cfg.workers` > 1 the
    groups are dealt round-robin to that many spawned processes (each loads its own model and
    uses `threads` or cores / workers torch threads; `model` serves only to plan and tokenize). Rows are
    appended to `results.part-<k>.jsonl` as they finish and merged into results.jsonl at the end.
    """
    import multiprocessing as mp
    import os

    from tqdm.auto import tqdm

    from sparsekv.evaluation.models import load_model

    if cfg.out is None:
        raise ValueError("out is not set: give --out DIR (or out: in the config)")
    out = Path(cfg.out)
    workers = cfg.workers
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // workers)
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    if model is None:
        model, codec = load_model(cfg.model, cfg.dtype, cfg.attn_implementation, seed=cfg.seed)
    elif codec is None:
        raise ValueError("pass the codec together with the model")
    Runner(model, codec, cfg).plan()  # builds every policy once: fails before any work
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    parts = sorted(out.glob("results.part-*.jsonl"))
    if resume:
        _check_resumable(out, cfg)
        old = (read_rows(results) if results.exists() else []) + [r for p in parts for r in read_rows(p)]
        keep, done = _completed_rows(old, cfg)
    else:
        keep, done = [], set()
    _write_rows_atomic(results, keep)
    for p in parts:
        p.unlink()
    samples = build_samples(cfg, codec)
    write_prompts(samples, cfg, out / "prompts.jsonl")
    resolved = {**cfg.to_dict(), "policy_specs": [p.to_dict() for p in cfg.policy_specs],
                "environment": _environment(model, codec)}
    (out / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    todo = [(s, pr) for s in samples for pr in cfg.protocols_for(s.task) if (s.sample_id, pr) not in done]
    bar = tqdm(total=sum(len(_method_keys(cfg, pr)) for _, pr in todo), unit="run", disable=not progress,
               desc="sparsekv eval", dynamic_ncols=True)
    if done and progress:
        bar.write(f"resume: {len(done)} complete groups kept, {len(todo)} to run")
    if workers == 1 or len(todo) <= 1:
        def on_row(s, protocol, row):
            bar.set_postfix_str(f"{s.sample_id} {protocol} {row['policy']}@{row['budget']}", refresh=False)
            bar.update(1)

        _run_groups(cfg, todo, out / "results.part-0.jsonl", model, codec, on_row)
    else:
        ctx = mp.get_context("spawn")
        procs = []
        for k in range(workers):
            shard = todo[k::workers]
            if shard:
                part = out / f"results.part-{k}.jsonl"
                pr = ctx.Process(target=_worker, args=(cfg.to_dict(), shard, str(part), threads), daemon=True)
                pr.start()
                procs.append((pr, part))
        seen = 0
        import signal

        def _stop(signum, frame):  # `kill PID` stops as Ctrl-C does (background jobs ignore SIGINT)
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGTERM, _stop)
        try:
            while any(pr.is_alive() for pr, _ in procs):
                time.sleep(1.0)
                n = sum(_line_count(part) for _, part in procs)
                bar.update(n - seen)
                seen = n
        except KeyboardInterrupt:
            for pr, _ in procs:
                pr.terminate()
            for pr, _ in procs:
                pr.join()
            bar.close()
            kept, dropped = merge_parts(out)
            print(f"stopped: {kept} finished groups saved to {results}, {dropped} unfinished dropped; "
                  "rerun with --resume to continue", file=sys.stderr)
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
        bar.update(sum(_line_count(part) for _, part in procs) - seen)
        failed = [pr.exitcode for pr, _ in procs if pr.exitcode != 0]
        if failed:
            bar.close()
            raise RuntimeError(f"{len(failed)} evaluation worker(s) failed (exit codes {failed}); "
                               f"finished groups are kept: rerun with --resume to continue")
    bar.close()
    merge_parts(out)  # every group is complete here: all rows land in results.jsonl
    if report:
        from sparsekv.evaluation.report import write_reports

        write_reports(out)
    return out


def read_rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i} is not a JSON row: {e}") from None
    return rows


def ingest_rows(out: str | Path, rows_path: str | Path, source: str | None = None) -> int:
    """Add result rows produced elsewhere (e.g. the kvpress peer run on `prompts.jsonl`) to the
    results of `out`, then rewrite the summary and plots. Returns the number of rows added.

    Each row needs `sample_id`, `task`, `length`, `protocol`, `policy`, `budget` and either
    `output` (re-scored here against the answer in `prompts.jsonl`) or `score`; the other
    fields of `ROW_FIELDS` are optional. Rows with the same (source, policy, budget, protocol,
    sample_id) as an existing row replace it.
    """
    from sparsekv.evaluation.report import write_reports

    out = Path(out)
    prompts = {s.sample_id: s for s in read_prompts(out / "prompts.jsonl")}
    new = read_rows(Path(rows_path))
    cleaned = []
    for i, r in enumerate(new, 1):
        missing = [k for k in REQUIRED_PEER_FIELDS if k not in r]
        if missing:
            raise ValueError(
                f"{rows_path} row {i}: missing field(s) {missing}; required: {', '.join(REQUIRED_PEER_FIELDS)}"
            )
        if r["sample_id"] not in prompts:
            raise ValueError(f"{rows_path} row {i}: sample_id {r['sample_id']!r} is not in {out / 'prompts.jsonl'}")
        s = prompts[r["sample_id"]]
        row = {k: None for k in ROW_FIELDS}
        row.update(r)
        row["source"] = source or r.get("source") or "peer"
        row["answer"] = s.answer
        if row.get("error") and row.get("score") is None:
            row["score"] = 0.0  # a crash counts as a miss
        elif row.get("score") is None and s.kind == "answer" and row.get("output") is not None:
            row["score"] = M.score_answer(row["output"], s.answer)
        row.setdefault("n_tokens", s.metadata.get("n_tokens"))
        row.setdefault("depth", s.metadata.get("depth"))
        get_task(row["task"])
        cleaned.append(row)
    def key(r: dict) -> tuple:
        return (r.get("source"), r["policy"], str(r["budget"]), r["protocol"], r["sample_id"])

    results = out / "results.jsonl"
    old = read_rows(results) if results.exists() else []
    replaced = {key(r) for r in cleaned}
    rows = [r for r in old if key(r) not in replaced] + cleaned
    with open(results, "w") as f:
        for r in rows:
            dump_row(f, r)
    write_reports(out)
    return len(cleaned)
