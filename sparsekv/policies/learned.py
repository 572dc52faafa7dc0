"""The learned policy: a trained gating head scores each token once, when it enters the cache.

With `recency` > 0 the score of a token at absolute position `p` is `logit + recency * p / 1000`:
an exponential recency prior on the head's log-importance (see `AdapterConfig.recency`). Because
the bonus is linear in the absolute position, the ranking it gives never changes as new tokens
arrive, so a token is still scored once, when it enters the cache.

At prefill and at each global re-rank the head's prior can be blended with observed attention:
the observation window's at prefill (the last `window` queries of the prompt, as SnapKV reads
it), the attention the kept entries received since the last re-rank at a re-rank (`blend` in
[0, 1]; 0 = prior only). Both are turned into per-head standard scores first, so that neither
scale dominates, then combined by `blend_mode`:

- "mix": `(1 - blend) * z_prior + blend * z_observed`, a weighted average;
- "max": `max((1 - blend) * z_prior, blend * z_observed)`, a union: a token is kept when either
  signal ranks it high (a needle the head flags that the window does not look at, or a token
  the window attends to that the head rates low). An average would drop both kinds.

The policy needs only a `LayerScorer` (anything with `score_layer`); it does not import the
adapter module. A scorer that also has `settings(use)` (a `ScorerAdapter`) supplies the
recorded settings of a use, and one with `check_compatible(shape)` is checked against the model
when the cache is built. A string (`policies.get("learned:DIR")`) is loaded as a `TrainedScorer`
(`sparsekv.scoring.scorer`, which imports neither the cache nor the policies).
"""

from __future__ import annotations

import os
from typing import Any, Protocol, runtime_checkable

import torch

from sparsekv.config import BLEND_MODES, HEAD_LAYERS, LEARNED_FALLBACK, check_learned_settings
from sparsekv.policies.base import (
    Policy,
    ScoreContext,
    check_int,
    close_words,
    fill_spans,
    max_pool_seq,
    register,
)
from sparsekv.policies.words import check_tokenizer, word_starts, word_table
from sparsekv.scoring.scorer import TrainedScorer

__all__ = [
    "BLEND_MODES",
    "HEAD_LAYERS",
    "LayerScorer",
    "LearnedPolicy",
    "check_settings",
]

check_settings = check_learned_settings  # the name older callers import


@runtime_checkable
class LayerScorer(Protocol):
    """What the learned policy scores with: one logit per KV head per new token."""

    def score_layer(self, layer_idx: int, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states `(batch, new, hidden)` of budgeted layer `layer_idx` -> `(batch, kv_heads,
        new)` float32, higher = keep."""
        ...


def _load_scorer(spec: str) -> LayerScorer:
    return TrainedScorer.from_pretrained(spec)


_WORDS: dict[str, torch.Tensor] = {}  # word tables per model path: read once per process


def _model_words(model: Any, span_words: int) -> torch.Tensor:
    """The word table (`sparsekv.policies.words.word_table`) of the tokenizer saved with `model` (its
    `name_or_path`), for `span_words`."""
    path = getattr(model, "name_or_path", None) or getattr(
        getattr(model, "config", None), "_name_or_path", None
    )
    hint = f"span_words={span_words} needs the model's tokenizer: pass tokenizer=... to the policy"
    if not path:
        raise ValueError(f"{hint} (the model has no name_or_path to load it from)")
    if path in _WORDS:
        return _WORDS[path]
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as err:  # any failure means the same to the user
        raise ValueError(f"{hint} (loading one from {path!r} failed: {err})") from err
    _WORDS[path] = word_table(tokenizer)
    return _WORDS[path]


def _moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head mean and standard deviation over the finite entries of `(batch, heads, seq)`."""
    finite = torch.isfinite(x)
    cnt = finite.sum(-1, keepdim=True).clamp_min(1)
    mean = torch.where(finite, x, 0.0).sum(-1, keepdim=True) / cnt
    var = (torch.where(finite, x - mean, 0.0) ** 2).sum(-1, keepdim=True) / cnt
    return mean, var.sqrt() + 1e-6


@register("learned")
class LearnedPolicy(Policy):
    """Scores from a `ScorerAdapter` (gating head on each layer's attention inputs)."""

    needs_hidden_states = True

    def __init__(
        self,
        adapter: LayerScorer | str,
        blend: float | None = None,
        window: int = 32,
        recency: float | None = None,
        blend_mode: str | None = None,
        kernel_size: int | None = None,
        head_layer: str | None = None,
        use: str | None = None,
        span_fill: int | None = None,
        span_peaks: float | None = None,
        span_words: int | None = None,
        tokenizer: Any = None,
    ):
        """`adapter`: a `ScorerAdapter`, a folder or Hub id to load one from, or any `LayerScorer`
        (`score_layer(layer_idx, hidden_states (batch, new, hidden)) -> (batch, kv_heads, new)`).
        `use`: which of the adapter's recorded uses supplies the unset settings ("aware" when
        None; see `ScorerAdapter.settings`); a plain scorer without recorded settings takes 0,
        "mix", 0, 1, "own" and 0 for `blend`, `blend_mode`, `recency`, `kernel_size`,
        `head_layer`, `span_fill`, `span_peaks`, `span_words`.
        `head_layer`: "own" (each budgeted layer's head reads that layer's attention inputs) or
        "first" (the first budgeted layer's head scores each token once, from that layer's
        inputs, and every budgeted layer uses that score: one cross-layer importance per token).
        `kernel_size` (odd): the head's scores of the tokens entering together (a prefill chunk)
        are max-pooled over that many neighbours, as SnapKV pools attention, so that a number
        split into digit tokens is kept or dropped as a whole; the prefill window attention used
        by blending is pooled the same way. `span_fill` (int >= 0, 0 = off): then the gaps between
        high scores are filled (`fill_spans`): a token with a high-scoring token within
        `span_fill` positions on each side scores as high as the lower of the two, so a run whose
        ends the head ranks high (a UUID of 36 tokens, a clause) is kept whole; with `span_peaks`
        (a quantile in [0, 1), 0 = every token) only tokens at or above that quantile of the
        chunk's scores count as ends. `span_words` (int >= 0, 0 = off): last, every token of a
        word of at most that many tokens scores as its word's best token (`close_words`), so a
        number or a UUID is kept or dropped whole; words are read from the token ids with the
        model's `tokenizer` (`sparsekv.policies.words`): pass it, or it is loaded from the model's
        `name_or_path` on first use. `window`: the observation window (queries) read when
        blending."""
        if isinstance(adapter, os.PathLike):  # a pathlib path of an adapter folder
            adapter = os.fspath(adapter)
        if isinstance(adapter, str):
            if not adapter:
                raise ValueError("adapter='' must name an adapter folder or Hub repo id")
            adapter = _load_scorer(adapter)
        if not isinstance(adapter, LayerScorer):
            raise ValueError(
                f"adapter={adapter!r} must be a ScorerAdapter, an adapter folder or Hub repo "
                "id, or "
                "an object with score_layer(layer_idx, hidden_states)"
            )
        if hasattr(adapter, "settings"):
            recorded = adapter.settings(use)  # raises naming the recorded uses
        elif use is not None:
            raise ValueError(f"use={use!r} needs an adapter that records uses (a ScorerAdapter)")
        else:  # a bare scorer; one with a `config` carrying settings supplies those
            config = getattr(adapter, "config", None)
            recorded = {k: getattr(config, k, v) for k, v in LEARNED_FALLBACK.items()}
        given = {
            "blend": blend,
            "blend_mode": blend_mode,
            "recency": recency,
            "kernel_size": kernel_size,
            "head_layer": head_layer,
            "span_fill": span_fill,
            "span_peaks": span_peaks,
            "span_words": span_words,
        }
        settings = check_learned_settings(
            **{k: recorded[k] if v is None else v for k, v in given.items()}
        )
        self.adapter = adapter
        self.use = use
        self.blend, self.blend_mode = settings["blend"], settings["blend_mode"]
        self.recency, self.kernel_size = settings["recency"], settings["kernel_size"]
        self.head_layer = settings["head_layer"]
        self.span_fill, self.span_peaks = settings["span_fill"], settings["span_peaks"]
        self.span_words = settings["span_words"]
        self.needs_input_ids = self.span_words > 0
        if tokenizer is not None:
            check_tokenizer(tokenizer)
        self._words = None if tokenizer is None or not self.span_words else word_table(tokenizer)
        self.hidden_from_first = self.head_layer == "first"
        # the head that scores the tokens of a budgeted layer: its own, or the first layer's
        self._first_layer = self._adapter_first_layer() if self.hidden_from_first else None
        self.window = check_int("window", window, 1)
        # With blending on, the cache tracks the attention kept entries receive (observed) and
        # also hands over the prompt's observation-window attention at prefill.
        self.tracks_observed = self.blend > 0
        self.attention_queries = "window" if self.blend > 0 else None

    def settings(self) -> dict[str, Any]:
        """The settings this policy scores with, resolved (given, else the adapter's recorded
        use, else the fallback): `blend`, `blend_mode`, `recency`, `kernel_size`, `head_layer`,
        `span_fill`, `span_peaks`, `span_words`. Eval rows record them, since a use's settings
        can change in an adapter whose weights (and fingerprint) do not."""
        return {k: getattr(self, k) for k in LEARNED_FALLBACK}

    def check_model(self, shape: Any) -> None:
        """The adapter's own check (`ScorerAdapter.check_compatible`), when it has one."""
        check = getattr(self.adapter, "check_compatible", None)
        if check is not None:
            check(shape)

    def __repr__(self) -> str:
        return (
            f"LearnedPolicy(blend={self.blend:g}, blend_mode={self.blend_mode!r}, "
            f"kernel_size={self.kernel_size}, recency={self.recency:g}, "
            f"head_layer={self.head_layer!r}, span_fill={self.span_fill}, "
            f"span_peaks={self.span_peaks:g}, span_words={self.span_words})"
        )

    def _adapter_first_layer(self) -> int:
        layers = getattr(getattr(self.adapter, "config", None), "layers", None)
        if not layers:
            raise ValueError("head_layer='first' needs an adapter whose config lists its layers")
        return min(layers)

    def _word_starts(self, ctx: ScoreContext) -> torch.Tensor:
        if ctx.input_ids is None:
            raise ValueError(
                f"span_words={self.span_words} reads the token ids of the entries it scores, and "
                "this forward had none (inputs_embeds?): pass input_ids, or span_words=0"
            )
        if self._words is None:
            self._words = _model_words(ctx.model, self.span_words)
        return word_starts(ctx.input_ids, self._words)

    def _head_scores(self, layer_idx: int, hidden_states: torch.Tensor) -> torch.Tensor:
        """The head's float32 logits `(batch, kv_heads, new)` for the new tokens of a layer."""
        layer = layer_idx if self._first_layer is None else self._first_layer
        return self.adapter.score_layer(layer, hidden_states).to(torch.float32)

    def _with_recency(self, new: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`new` plus the recency prior of entries at `positions` (see the module docstring)."""
        if not self.recency:
            return new
        return new + self.recency / 1000.0 * positions.to(torch.float32)

    def score_arrival(self, layer_idx, hidden_states, positions) -> torch.Tensor:
        """What `score` gives a decode step's one new entry: pooling and span filling leave a
        single token's logit as it is, and no observed attention enters before a re-rank."""
        return self._with_recency(self._head_scores(layer_idx, hidden_states), positions)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        out = ctx.carry()
        if ctx.num_new:
            new = self._head_scores(ctx.layer_idx, ctx.hidden_states)  # (b, kv_heads, new)
            new = fill_spans(max_pool_seq(new, self.kernel_size), self.span_fill, self.span_peaks)
            if self.span_words and ctx.num_new > 1:
                new = close_words(new, self._word_starts(ctx), self.span_words)
            new = self._with_recency(new, ctx.positions[..., -ctx.num_new :])
            out[..., out.shape[-1] - ctx.num_new :] = new
        if self.blend > 0:
            obs = (
                ctx.attention
                if ctx.phase == "prefill"
                else (ctx.observed if ctx.phase == "rerank" else None)
            )
            if obs is not None:
                # Mix standard scores, then map back onto the prior's scale so that tokens
                # scored later by the head alone stay comparable with the blended ones.
                mean, std = _moments(out)
                if ctx.phase == "prefill":
                    obs = max_pool_seq(obs.float(), self.kernel_size)
                seen = torch.log(obs.float().clamp_min(1e-9))
                seen_mean, seen_std = _moments(seen)
                prior, observed = (
                    (1 - self.blend) * (out - mean) / std,
                    self.blend * (seen - seen_mean) / seen_std,
                )
                z = torch.maximum(prior, observed) if self.blend_mode == "max" else prior + observed
                return torch.where(torch.isfinite(out), mean + std * z, out)
        return out
