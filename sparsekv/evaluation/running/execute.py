"""Running one (sample, protocol) group on one model: the full cache first (the reference), then
every policy x budget the plan asks for, one result row each.

Shared prefill (the default, `EvalConfig.shared_prefill`): each prompt's compressed part is
prefilled once and every method forks from it (`shared_prefill`); `shared_prefill: false`
prefills every run live.

How one run goes (batch 1, greedy, no sampling): `one_run`.

The metrics of a row (score, KL, ...) are taken by `outcome.fill_row`; the row format is
described in `rows.py` (learned policies' rows carry `adapter_hash`).

A learned method whose adapter carries a LoRA (and whose spec does not say `lora: false`) runs
with that LoRA applied to the model (`sparsekv.scoring.lora.apply_lora`) for its whole run:
prefill, question and decoding. It never forks from the plain model's shared prefill: each LoRA
gets its own shared prefill, recorded with that LoRA applied, and its budgets fork from that one
(one LoRA prefill per prompt instead of one per budget; `shared_prefill: false` prefills it live).
The LoRA is removed after each use, so the reference and the other methods see the plain model
(checked after each group: the same parameter tensors, unmodified).
Its rows' `policy_spec` ends in `@lora=true`; `adapter_hash` covers the LoRA tensors.
"""

from __future__ import annotations

import sys
import traceback
from contextlib import nullcontext
from typing import Any

import torch

from sparsekv.evaluation.config import REFERENCE, EvalConfig, PolicySpec, lora_spec_text
from sparsekv.evaluation.rows.identity import row_identity
from sparsekv.evaluation.rows.store import ROW_FIELDS
from sparsekv.evaluation.running.one_run import execute_run
from sparsekv.evaluation.running.outcome import Reference, fill_row
from sparsekv.evaluation.running.plan import (
    REFERENCE_KEY,
    ForkPlan,
    check_eviction,
    plan_forks,
    prefill_chunk,
    uses_lora,
)
from sparsekv.evaluation.running.shared_prefill import _SharedPrefill, prefill_shared
from sparsekv.evaluation.tasks import Sample
from sparsekv.evaluation.tasks.codec import Codec

NAN = float("nan")


class Runner:
    """Executes single runs on one model. `run_reference` first, then `run_policy` per method."""

    def __init__(self, model, codec: Codec, cfg: EvalConfig):
        self.model = model
        self.codec = codec
        self.cfg = cfg
        self.device = next(model.parameters()).device
        self._adapters: dict[str, Any] = {}
        self._hashes: dict[str, str] = {}
        self._prompt_hashes: dict[str, str] = {}

    # ---- building ---------------------------------------------------------------------------
    def build_policy(self, spec: PolicySpec):
        from sparsekv import policies

        path = self._adapter_path(spec)
        if path is not None:
            return policies.get("learned", adapter=self._adapter(path), **spec.policy_kwargs)
        if spec.name == "kvzip":  # its repeat prompt becomes ids through the harness's codec
            return policies.get("kvzip", **{"encode": self.codec.encode, **spec.policy_kwargs})
        return policies.get(spec.name, **spec.policy_kwargs)

    @staticmethod
    def _adapter_path(spec: PolicySpec) -> str | None:
        return spec.name.split(":", 1)[1] if spec.name.startswith("learned:") else None

    def _adapter(self, path: str):
        if path not in self._adapters:
            from sparsekv.scoring.adapter import ScorerAdapter

            self._adapters[path] = ScorerAdapter.from_pretrained(path)
        return self._adapters[path]

    def eviction_config(self, spec: PolicySpec, budget):
        from sparsekv import EvictionConfig

        return EvictionConfig(budget=budget, **{**self.cfg.eviction, **spec.eviction})

    def _make_cache(self, spec: PolicySpec | None, budget):
        if spec is None:
            from transformers import DynamicCache

            return DynamicCache(config=self.model.config)
        from sparsekv import SparseKVCache

        return SparseKVCache(
            self.model, self.eviction_config(spec, budget), self.build_policy(spec)
        )

    # ---- planning -------------------------------------------------------------------------
    def plan(self) -> ForkPlan:
        """Build every policy of the grid once (an unloadable adapter fails here, before any
        work), take each learned policy's adapter fingerprint (`hashes`, by spec text) and
        resolved settings (`settings`, by spec text), and
        decide which methods fork from the shared prefill (`plan.plan_forks`)."""
        from sparsekv.models.families import model_shape

        shape = model_shape(self.model)
        built = {}
        for spec in self.cfg.policy_specs:
            try:
                built[spec.spec] = self.build_policy(spec)
                # a head trained for another model is refused before any work, not per row
                built[spec.spec].check_model(shape)
            except (OSError, ValueError) as e:  # OSError: neither a folder nor a Hub repo
                raise ValueError(f"policy {spec.spec!r}: {e}") from e
            check_eviction(self.cfg, spec, built[spec.spec], len(shape.full_layers))
        self.hashes = {spec.spec: self.adapter_hash(spec) for spec in self.cfg.policy_specs}
        # what each learned method scores with (its use's settings are not in the fingerprint)
        self.settings = {
            spec.spec: built[spec.spec].settings()
            for spec in self.cfg.policy_specs
            if self._adapter_path(spec) is not None
        }
        self.loras = {
            spec.spec: built[spec.spec].adapter.lora
            for spec in self.cfg.policy_specs
            if uses_lora(spec, built[spec.spec])
        }
        self.forks = plan_forks(self.cfg, built)
        return self.forks

    def adapter_hash(self, spec: PolicySpec) -> str | None:
        """`ScorerAdapter.fingerprint()` of a learned method's adapter (None for other policies)."""
        path = self._adapter_path(spec)
        if path is None:
            return None
        if path not in self._hashes:
            self._hashes[path] = self._adapter(path).fingerprint()
        return self._hashes[path]

    def lora_of(self, spec: PolicySpec | None):
        """The LoRA (`LoraWeights`) a method runs with, or None (see `plan.uses_lora`; None for
        the reference, `spec` None)."""
        if spec is None:
            return None
        if not hasattr(self, "loras"):
            self.plan()
        return self.loras.get(spec.spec)

    def applied(self, spec: PolicySpec | None):
        """A context in which the model is the one `spec` runs on: with its adapter's LoRA
        injected (removed on exit), or the plain model."""
        lora = self.lora_of(spec)
        if lora is None:
            return nullcontext()
        from sparsekv.scoring.lora import apply_lora

        return apply_lora(self.model, lora)

    def _weights_state(self) -> dict[str, tuple]:
        """Each parameter and buffer's identity, storage and in-place version counter: equal
        before and after a group exactly when no tensor was replaced or modified in place."""
        tensors = [*self.model.named_parameters(), *self.model.named_buffers()]
        return {n: (id(t), t.data_ptr(), tuple(t.shape), t._version) for n, t in tensors}

    # ---- model calls ------------------------------------------------------------------------
    def _forward(self, ids: list[int], cache, keep: int) -> torch.Tensor:
        t = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=t, cache=cache, use_cache=True, logits_to_keep=keep)
        return out.logits[0].float()  # (keep or len(ids), vocab)

    @staticmethod
    def _split(sample: Sample, protocol: str) -> bool:
        """True when only the context is compressed first (the question, or the continuation,
        follows through the compressed cache)."""
        return sample.kind == "continuation" or (
            protocol == "agnostic" and bool(sample.question_ids)
        )

    def _prefill_shared(
        self, sample: Sample, protocol: str, spec: PolicySpec | None = None
    ) -> _SharedPrefill:
        """`shared_prefill.prefill_shared` on this runner's model."""
        return prefill_shared(self, sample, protocol, spec)

    def _execute(
        self, sample: Sample, protocol: str, start, chunk: int | None, shared: _SharedPrefill | None
    ) -> dict[str, Any]:
        """One run (`one_run.execute_run` on this runner's model)."""
        return execute_run(self, sample, protocol, start, chunk, shared)

    def _row(
        self,
        sample: Sample,
        protocol: str,
        label: str,
        spec_text: str,
        budget,
        spec: PolicySpec | None = None,
    ) -> dict[str, Any]:
        row = {k: None for k in ROW_FIELDS}
        row.update(
            source="sparsekv",
            sample_id=sample.sample_id,
            task=sample.task,
            length=sample.metadata["target_length"],
            n_tokens=sample.metadata["n_tokens"],
            protocol=protocol,
            policy=label,
            policy_spec=spec_text,
            budget=budget,
            answer=sample.answer,
            depth=sample.metadata.get("depth"),
        )
        row.update(row_identity(self.cfg, sample, self._prompt_hashes))
        if spec is not None:
            row["adapter_hash"] = self.adapter_hash(spec)
            if self.lora_of(spec) is not None:  # (plans the grid first if it was not yet)
                row["policy_spec"] = lora_spec_text(spec_text)
            row["learned_settings"] = self.settings.get(spec.spec)
        return row

    # ---- public -----------------------------------------------------------------------------
    def run_group(self, sample: Sample, protocol: str, skip: frozenset = frozenset()):
        """Yield the rows of one sample under one protocol: the full cache first, then every
        policy x budget, leaving out the method keys (label, budget) in `skip` (rows a resume
        keeps; the reference still runs for the others' KL, its row is yielded only when it is
        not in `skip`). With `shared_prefill` the compressed part of the prompt is prefilled
        once (recording the attention statistics the policies read) and each method starts
        from `SparseKVCache.fork` of it: the same kept entries as its own prefill, without
        repeating the forward. Methods that cannot fork prefill live."""
        from sparsekv import EvictionConfig

        if not hasattr(self, "forks"):
            self.plan()
        runs = [
            (spec, budget)
            for spec in self.cfg.policy_specs
            for budget in self.cfg.budgets_of(spec, protocol)
            if (spec.label, str(budget)) not in skip
        ]
        if not runs and REFERENCE_KEY in skip:
            return
        if sample.kind == "decode":  # a long continuation fed token by token: decode_grid runs it
            from sparsekv.evaluation.running.decode_runs import decode_rows

            yield from decode_rows(self, sample, skip)
            return
        forkable = self.forks.forkable
        plain = [s for s in self.cfg.policy_specs if self.lora_of(s) is None]
        # the reference row comes from the shared prefill whenever the grid has one (as in a
        # fresh run); a reference needed only for KL is taken the cheapest way
        wanted = any(forkable[s.spec] and self.lora_of(s) is None for s, _ in runs) or (
            REFERENCE_KEY not in skip and any(forkable[s.spec] for s in plain)
        )
        shared = self._prefill_shared(sample, protocol) if wanted else None
        # one prefill per LoRA, recorded with it applied, made when its first run needs it
        lora_shared: dict[int, _SharedPrefill] = {}

        def prefill_of(spec: PolicySpec) -> _SharedPrefill | None:
            if not forkable[spec.spec]:
                return None
            lora = self.lora_of(spec)
            if lora is None:
                return shared
            if id(lora) not in lora_shared:
                lora_shared[id(lora)] = self._prefill_shared(sample, protocol, spec)
            return lora_shared[id(lora)]

        lora_runs = any(self.lora_of(s) is not None for s, _ in runs)
        before = self._weights_state() if lora_runs else None
        try:
            if shared is not None:
                row, ref = self.run_reference(
                    sample,
                    protocol,
                    lambda: shared.cache.fork(EvictionConfig(budget=1.0), "full"),
                    shared,
                )
            else:
                row, ref = self.run_reference(sample, protocol)
            if REFERENCE_KEY not in skip:
                yield row
            for spec, budget in runs:
                yield self.run_policy(sample, protocol, spec, budget, ref, prefill_of(spec))
            if before is not None and self._weights_state() != before:
                raise RuntimeError(
                    f"the model's weights changed during {sample.sample_id} ({protocol}): an "
                    "adapter's LoRA was not removed exactly; the rows after it are not valid"
                )
        finally:
            for pre in (shared, *lora_shared.values()):
                if pre is not None:
                    pre.cache.close()

    def run_reference(
        self, sample: Sample, protocol: str, start=None, shared: _SharedPrefill | None = None
    ) -> tuple[dict[str, Any], Reference]:
        """The full cache: transformers' DynamicCache prefilled live, or the full-policy fork of
        a shared prefill. Returns the row and what later runs compare with."""
        res = self._execute(
            sample, protocol, start or (lambda: self._make_cache(None, None)), None, shared
        )
        row = self._row(sample, protocol, REFERENCE, REFERENCE, 1.0)
        row, lp = fill_row(row, sample, res, None, self.codec)
        if sample.kind != "continuation":
            row["agreement"], row["prefix_match"] = 1.0, len(res["output_ids"])
            if sample.kind == "generate":
                row["score"] = 1.0
        row["kl"] = row["kl_mean"] = 0.0
        return row, Reference(res["output_ids"], lp, row["score"])

    def run_policy(
        self,
        sample: Sample,
        protocol: str,
        spec: PolicySpec,
        budget,
        ref: Reference,
        shared: _SharedPrefill | None = None,
    ) -> dict[str, Any]:
        """One policy at one budget; a crash becomes a row with `error` set and score 0."""
        row = self._row(sample, protocol, spec.label, spec.spec, budget, spec)
        try:
            if shared is not None and shared.lora is not self.lora_of(spec):
                raise ValueError(
                    f"{spec.spec} cannot fork a prefill recorded on another model (its adapter's "
                    "LoRA applied or not): a fork must start from a prefill of the model it runs on"
                )
            if shared is not None:

                def start():
                    return shared.cache.fork(
                        self.eviction_config(spec, budget), self.build_policy(spec)
                    )
            else:

                def start():
                    return self._make_cache(spec, budget)

            with self.applied(spec):  # the LoRA for the whole run, removed after it
                res = self._execute(sample, protocol, start, prefill_chunk(self.cfg, spec), shared)
            row, _ = fill_row(row, sample, res, ref, self.codec)
        except Exception as e:  # a crashing method is a measured miss, not a stop
            row["error"] = f"{type(e).__name__}: {e}"
            row["score"] = 0.0
            row["kl"] = row["kl_mean"] = NAN
            tb = traceback.format_exc(limit=3)
            print(
                f"\n[sparsekv eval] {spec.label} @ {budget} on {sample.sample_id} failed:\n{tb}",
                file=sys.stderr,
            )
        return row
