"""The kvpress side of the peer run: one press at a time through kvpress's
`kv-press-text-generation` pipeline, measured as the harness measures its own runs. Runs in the
peer environment (kvpress, transformers < 5.3); imports nothing from sparsekv.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvp_plan import PRESSES, PressSpec, RawRun, compression_ratio, split_prompt
from kvp_rows import load_harness_metrics


class _Collect(logging.Handler):
    """Keeps the messages kvpress logs during a run (e.g. that a model is untested or a press
    experimental): they go into the row instead of being silenced."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg not in self.messages:
            self.messages.append(msg)


class KVPressRunner:
    """Runs one press at a time through kvpress's `kv-press-text-generation` pipeline.

    One change to the pipeline's own decoding, made for soundness: when only the full-attention
    layers are compressed ("full" mode on Gemma 3), transformers builds the full-attention mask
    of a multi-token forward from the first layer's token count (a sliding layer, uncompressed),
    so every token of a multi-token question (or teacher-forced continuation) would also see the
    tokens after it. Here such inputs are fed one token at a time through the same cache (a
    single query needs no causal mask), which is exactly the causal computation; the pipeline
    then decodes as it always does. Without compression (the no-press reference, "all" mode)
    the layers agree and the pipeline's one forward is kept.
    """

    def __init__(self, model_path: str, dtype: str = "float32", attn_implementation: str = "sdpa"):
        import kvpress
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.log = _Collect()
        logging.getLogger("kvpress").addHandler(self.log)
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
        self._pipeline_answer = self.pipe.generate_answer
        self.pipe.generate_answer = self._generate_answer
        self._rec: dict[str, Any] | None = None
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

    @staticmethod
    def _stored(cache) -> list[int]:
        return [
            int(layer.keys.shape[-2])
            if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4
            else 0
            for layer in cache.layers
        ]

    def _uneven(self, cache) -> bool:
        """True when the full-attention layers hold fewer entries than the tokens seen (they
        were compressed while the sliding layers were not)."""
        if not self.has_sliding_layers:
            return False
        seen = cache.get_seq_length()
        full = [n for n, t in zip(self._stored(cache), self.layer_types) if t == "full_attention"]
        return any(n != seen for n in full)

    def _generate_answer(self, question_ids, cache, context_length: int, max_new_tokens: int):
        """The pipeline's `generate_answer`, with the question fed causally (see the class)."""
        torch = self.torch
        rec = self._rec if self._rec is not None else {}
        rec["t_ctx"] = time.perf_counter()
        rec["kv_compressed"] = int(self.metrics.kv_bytes(cache))
        rec["lengths"] = self._stored(cache)
        q = question_ids.shape[1]
        rec["fed_one_by_one"] = q > 1 and self._uneven(cache)
        if rec["fed_one_by_one"]:
            with torch.no_grad():
                for i in range(q - 1):
                    self.model.model(
                        input_ids=question_ids[:, i : i + 1],
                        past_key_values=cache,
                        position_ids=torch.tensor(
                            [[context_length + i]], device=question_ids.device
                        ),
                    )
            question_ids = question_ids[:, -1:]
            context_length += q - 1
        return self._pipeline_answer(question_ids, cache, context_length, max_new_tokens)

    def run(self, sample: dict[str, Any], protocol: str, spec: PressSpec | None, budget) -> RawRun:
        torch = self.torch
        ctx, q, max_new = split_prompt(sample, protocol)
        ratio = 0.0 if spec is None else compression_ratio(budget, len(ctx))
        press = None if spec is None else self._press(spec, ratio)
        cache = self._cache(spec)
        cont = sample["kind"] == "continuation"
        rec: dict[str, Any] = {"steps": [], "inner_calls": 0, "hidden": []}
        self._rec = rec
        self.log.messages = []

        def post_top(module, args, kwargs, output):
            rec["steps"].append(output.logits[0, -1].float())
            rec["t_last"] = time.perf_counter()
            if len(rec["steps"]) == 1:
                rec["t_q"] = rec["t_last"]
            rec["kv_end"] = int(self.metrics.kv_bytes(cache))

        def post_inner(module, args, kwargs, output):
            rec["inner_calls"] += 1
            if cont and rec["inner_calls"] >= 2:  # the teacher-forced targets' forward(s)
                rec["hidden"].append(output.last_hidden_state[0])

        need_eager = spec is not None and spec.needs_eager and self.attn != "eager"
        hooks = [
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
            self._rec = None
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
            "question_fed_one_by_one": rec.get("fed_one_by_one", False),
            "peer_warnings": list(self.log.messages) or None,
            "peer_env": ", ".join(f"{k} {v}" for k, v in self.versions.items()),
        }
        if cont:
            hidden = torch.cat(rec["hidden"], dim=0)[: len(q)]
            with torch.no_grad():
                logits = self._logits(hidden).float()  # (K-1, vocab) predicting target[1:]
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

    def _logits(self, hidden):
        logits = self.model.lm_head(hidden)
        cap = getattr(self.model.config.get_text_config(), "final_logit_softcapping", None)
        if cap:
            logits = self.torch.tanh(logits / cap) * cap
        return logits


def _version(pkg: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(pkg)
    except Exception:  # noqa: BLE001
        return None
