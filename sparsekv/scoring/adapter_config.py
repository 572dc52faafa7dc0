"""The record an adapter keeps about itself (`config.json`, `AdapterConfig`) and its checks:
the base model's id and shape, the budgeted layers, the head's kind and width, the teacher
target, the learned policy's settings per use, the LoRA subfolder, the format version. The
files around it are `sparsekv.scoring.files`'.

`uses` maps a use name to the learned-policy settings (`recency`, `kernel_size`, `blend`,
`blend_mode`, `head_layer`, and `span_fill` / `span_peaks` / `span_words` where they are not 0)
that serve it (the "aware" entry complete, the others the keys they set, the rest following
"aware"): `"aware"` (the question is in the prompt when the cache is compressed; the defaults,
what `attach(model)` applies), `"agnostic"` (a context compressed before its question; a fresh
adapter records `blend=0, kernel_size=9`) and optionally `"decode"` (eviction while generating).
In memory the "aware" settings are the `AdapterConfig` fields of the same names and
`AdapterConfig.uses` holds the other uses; `AdapterConfig.settings(use)` gives the complete
settings of any use.

`target` is read tolerantly: keys that this version's `TargetConfig` does not define (a newer
trainer's target kinds) are kept as recorded, with a warning; they never change how the head
scores. Other unknown keys are an error.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from sparsekv.config import LEARNED_SETTINGS, check_learned_settings, without_later_defaults
from sparsekv.configfile import from_fields
from sparsekv.scoring.head import KINDS
from sparsekv.teacher.statistics import TargetConfig

TYPE_KEY = "sparsekv_type"
TYPE_TAG = "scorer_adapter"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
LORA_DIR = "lora"
"""The subfolder of an adapter's LoRA (a PEFT folder), when it has one."""
POLICY_DEFAULTS = LEARNED_SETTINGS
"""AdapterConfig fields that are the learned policy's "aware" settings (they do not change
training)."""
USES = ("aware", "agnostic", "decode")
"""The use names an adapter may record settings for."""
DEFAULT_USES = {"agnostic": {"blend": 0.0, "kernel_size": 9}}
"""What a fresh (or format-1) adapter records beyond "aware"; unset keys copy "aware"."""


def _version() -> str:
    from sparsekv._version import __version__

    return __version__



def check_uses(
    uses: Any, aware: dict[str, Any], name: str = "uses"
) -> dict[str, dict[str, Any]]:
    """The per-use settings an adapter records (use -> the learned settings the use sets; the
    others follow `aware`), checked; `name` is the parameter the errors name (the training
    config calls it "inference.uses")."""
    allowed = ", ".join(USES[1:])
    if not isinstance(uses, dict):
        raise ValueError(f"{name}={uses!r} must be a dict of use name ({allowed}) -> settings")
    out = {}
    for use, settings in uses.items():
        if use == "aware":
            raise ValueError(
                f'{name} must not hold "aware": its settings are the fields '
                f"{', '.join(POLICY_DEFAULTS)}"
            )
        if use not in USES:
            raise ValueError(f"{name} has unknown use {use!r}; allowed: {allowed}")
        if not isinstance(settings, dict):
            raise ValueError(
                f"{name}[{use!r}]={settings!r} must be a dict over {', '.join(POLICY_DEFAULTS)}"
            )
        bad = sorted(set(settings) - set(POLICY_DEFAULTS))
        if bad:
            raise ValueError(
                f"{name}[{use!r}] has unknown setting(s) {bad}; allowed: "
                f"{', '.join(POLICY_DEFAULTS)}"
            )
        try:
            full = check_learned_settings(**{**aware, **settings})
        except ValueError as e:
            raise ValueError(f"{name}[{use!r}]: {e}") from e
        out[use] = {k: full[k] for k in settings}  # what the use sets; the rest follows aware
    return out


def _check_target(target: Any) -> dict[str, Any]:
    """The target dict validated by `TargetConfig` (defaults filled in); keys it does not know
    are kept as recorded, with a warning."""
    if isinstance(target, TargetConfig):
        return target.to_dict()
    if not isinstance(target, dict):
        raise ValueError(f"target={target!r} must be a TargetConfig dict")
    known = {f.name for f in fields(TargetConfig)}
    extra = {k: target[k] for k in sorted(set(target) - known)}
    if extra:
        warnings.warn(
            f"adapter target has field(s) {sorted(extra)} this sparsekv's TargetConfig does not "
            "define; kept as recorded (they do not change scoring)",
            stacklevel=3,
        )
    out = TargetConfig.from_dict({k: v for k, v in target.items() if k in known}).to_dict()
    return {**out, **extra}


@dataclass
class AdapterConfig:
    """What an adapter records about itself and the model it was trained for (JSON round trip)."""

    model_type: str
    """transformers `model_type` of the base model's text config (e.g. "gemma3_text", "llama")."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    layers: list[int]
    """The budgeted layers the head has a module for (sorted)."""
    base_model_id: str | None = None
    """Hub id (or path) of the base model, for the record and the model card."""
    kind: str = "mlp"
    """Head module per layer: "linear" or "mlp"."""
    hidden: int = 64
    """Width of the MLP's hidden layer (unused for "linear")."""
    ensemble: int = 1
    """Number of heads whose logits are averaged (`TrainedScorer.ensemble` joins k adapters
    trained apart, e.g. with k head seeds); their weights are checked like one head's. 1 = one
    head. Written to `config.json` only when > 1, so single heads stay readable by sparsekv 0.1.0."""
    target: dict[str, Any] = field(default_factory=lambda: TargetConfig().to_dict())
    """The teacher target definition (`TargetConfig.to_dict()`)."""
    recency: float = 0.0
    """Recency prior the learned policy adds at inference: `recency * position / 1000` on top of
    the head's logit. The head's logits are log-importances (it is trained with a softmax over
    positions), so this ranks tokens by importance x exp(-age * recency / 1000): a token 1,000
    positions older must be e**recency times more important to be kept. The ranking it implies
    does not change as decoding proceeds, so each token is still scored once. 0 = head alone."""
    kernel_size: int = 1
    """Max-pooling width (odd) the learned policy applies to the head's scores of tokens that
    enter the cache together, so a needle split into several tokens survives whole. 1 = none."""
    blend: float = 0.0
    """The learned policy's default weight of observed attention (see `blend_mode`), in [0, 1]."""
    blend_mode: str = "mix"
    """How the learned policy combines the head's prior with observed attention: "mix" or "max"."""
    head_layer: str = "own"
    """Which head scores each budgeted layer in the learned policy: "own" (its own module on its
    own attention inputs) or "first" (the first budgeted layer's module, once per token, shared
    by all budgeted layers)."""
    span_fill: int = 0
    """Gap filling the learned policy applies after the max-pooling (`sparsekv.policies.base.
    fill_spans`): a token between two high-scoring tokens, each within `span_fill` positions,
    scores as high as the lower of them, so a run such as a UUID is kept whole. 0 = off. Written
    to `config.json` only when set, so adapters that do not use it stay readable by sparsekv
    0.1.0."""
    span_peaks: float = 0.0
    """With `span_fill`: only tokens at or above this quantile of the scores entering together
    count as the ends of a gap to fill (0 = every token), so that runs between strongly flagged
    tokens (a needle) are filled and the ordinary ups and downs of prose are left alone. Written
    only when set, like `span_fill`."""
    span_words: int = 0
    """Last of the learned policy's transforms (`sparsekv.policies.base.close_words`): every token
    of a word of at most `span_words` tokens scores as its word's best, so a number or a UUID is
    kept or dropped whole (words read from the token ids with the model's tokenizer). 0 = off.
    Written only when set, like `span_fill`."""
    uses: dict[str, dict[str, Any]] = field(
        default_factory=lambda: json.loads(json.dumps(DEFAULT_USES))
    )
    """Settings per use other than "aware" (whose settings are the five fields above): for each,
    the `POLICY_DEFAULTS` keys it sets; the others follow the "aware" fields (`settings(use)`)."""
    lora: str | None = None
    """The adapter folder's LoRA subfolder (a PEFT folder), or None when there is none."""
    sparsekv_version: str = field(default_factory=_version)
    training_config: dict[str, Any] | None = None
    """The resolved training config, when the adapter was trained with `train.py`."""
    eval_table: str | None = None
    """A Markdown evaluation table for the model card."""
    eval_results: list[dict[str, Any]] | None = None
    """Evaluation results as `huggingface_hub.EvalResult` keyword dicts (task_type, dataset_type,
    dataset_name, metric_type, metric_value, ...), written into the model card's metadata."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "hidden_size", "hidden", "ensemble"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        if not isinstance(self.model_type, str) or not self.model_type:
            raise ValueError(f"model_type={self.model_type!r} must be a non-empty string")
        layers = list(self.layers) if isinstance(self.layers, (list, tuple)) else None
        if (
            not layers
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
            or len(set(layers)) != len(layers)
            or not all(0 <= x < self.num_layers for x in layers)
        ):
            raise ValueError(
                f"layers={self.layers!r} must be a non-empty list of distinct layer indices in "
                f"[0, {self.num_layers})"
            )
        self.layers = sorted(layers)
        if self.kind not in KINDS:
            raise ValueError(
                f"kind={self.kind!r} is not supported; allowed values: {', '.join(KINDS)}"
            )
        self.target = _check_target(self.target)
        aware = check_learned_settings(**{k: getattr(self, k) for k in POLICY_DEFAULTS})
        for k, v in aware.items():
            setattr(self, k, v)
        self.uses = check_uses(self.uses, aware)
        if self.lora is not None and (
            not isinstance(self.lora, str)
            or not self.lora
            or "/" in self.lora
            or self.lora.startswith(".")
        ):
            raise ValueError(
                f"lora={self.lora!r} must be None or a subfolder name such as {LORA_DIR!r}"
            )
        if self.training_config is not None and not isinstance(self.training_config, dict):
            raise ValueError("training_config must be a dict or None")
        if self.eval_table is not None and not isinstance(self.eval_table, str):
            raise ValueError("eval_table must be a Markdown string or None")
        if self.eval_results is not None:
            from huggingface_hub import EvalResult

            if not isinstance(self.eval_results, list) or not all(
                isinstance(r, dict) for r in self.eval_results
            ):
                raise ValueError(
                    "eval_results must be a list of huggingface_hub.EvalResult keyword dicts "
                    "or None"
                )
            for r in self.eval_results:
                try:
                    EvalResult(**r)
                except (TypeError, ValueError) as e:
                    raise ValueError(
                        f"eval_results entry {r!r} is not a valid EvalResult: {e}"
                    ) from e

    @property
    def target_config(self) -> TargetConfig:
        known = {f.name for f in fields(TargetConfig)}
        return TargetConfig.from_dict({k: v for k, v in self.target.items() if k in known})

    def settings(self, use: str | None = None) -> dict[str, Any]:
        """The complete learned-policy settings recorded for `use` (None = "aware"): the keys the
        use sets, the others the current "aware" fields. Validated on every call, so a use
        edited in place (`config.uses[...] = ...`) is checked too."""
        aware = {k: getattr(self, k) for k in POLICY_DEFAULTS}
        if use is None or use == "aware":
            return check_learned_settings(**aware)
        if not isinstance(use, str) or use not in self.uses:
            recorded = ", ".join(["aware", *self.uses])
            raise ValueError(
                f"use={use!r} is not recorded by this adapter; allowed values: {recorded}"
            )
        check_uses({use: self.uses[use]}, aware)
        return check_learned_settings(**{**aware, **self.uses[use]})

    def to_dict(self) -> dict[str, Any]:
        """The format-2 `config.json` content (type tag and version first, "aware" in `uses`)."""
        d = asdict(self)
        for k in POLICY_DEFAULTS:
            d.pop(k)
        if d["ensemble"] == 1:  # a later field left at its default is not written
            d.pop("ensemble")
        uses = check_uses(self.uses, self.settings("aware"))  # refuses "aware" among them
        # a later setting left off is not written, so older readers still load the folder
        d["uses"] = {"aware": without_later_defaults(self.settings("aware")), **uses}
        return {TYPE_KEY: TYPE_TAG, "format_version": FORMAT_VERSION, **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AdapterConfig:
        """Read a format-2 dict (`to_dict`) or a format-1 one (settings as top-level fields)."""
        if not isinstance(d, dict):
            raise ValueError(f"an adapter config is a JSON object, got {type(d).__name__}")
        d = dict(d)
        version = d.pop("format_version", 1)
        tag = d.pop(TYPE_KEY, None)
        if version not in READABLE_VERSIONS:
            raise ValueError(
                f"format_version={version!r}: this sparsekv ({_version()}) reads adapter formats "
                f"{', '.join(map(str, READABLE_VERSIONS))}; a newer sparsekv wrote this adapter"
            )
        if version >= 2:
            if tag != TYPE_TAG:
                raise ValueError(
                    f"{TYPE_KEY}={tag!r}: expected {TYPE_TAG!r} (not a sparsekv scorer adapter)"
                )
            uses = d.get("uses")
            if not isinstance(uses, dict) or not isinstance(uses.get("aware"), dict):
                raise ValueError('uses must be a dict with an "aware" entry (format 2)')
            uses = dict(uses)
            aware = uses.pop("aware")
            bad = sorted(set(aware) - set(POLICY_DEFAULTS))
            if bad or any(k in d for k in POLICY_DEFAULTS):
                raise ValueError(
                    f'uses["aware"] holds the settings {", ".join(POLICY_DEFAULTS)} '
                    f"(found {bad or [k for k in POLICY_DEFAULTS if k in d]} elsewhere)"
                )
            d = {**d, **aware, "uses": uses}
        elif "uses" in d:
            raise ValueError("uses is a format-2 field; this config says format_version 1")
        return from_fields(cls, d)

