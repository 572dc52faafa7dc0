"""Scorer adapters: a trained gating head packaged for one base model, saved, loaded and attached.

This module owns the adapter format and its life cycle: building a fresh head for a model,
saving/loading a folder, pushing to and pulling from the Hugging Face Hub, checking that a model
has the shape the head was trained for, and applying the head to `model.generate`. It does not
train (see `train.py`) and does not evict (see `sparsekv.cache`).

An adapter folder holds three files, never a pickle:

- `adapter_model.safetensors`: the `GatingHead` state dict (float32; keys `heads.<layer>.<i>.*`);
- `adapter_config.json`: `AdapterConfig`: the base model's id and shape (model type, layers, KV
  heads, head dim, hidden size), the budgeted layers the head scores, the head's kind and width,
  the teacher target definition (`sparsekv.teacher.TargetConfig`), the sparsekv version, and
  optionally the training config and an evaluation table;
- `README.md`: a generated model card (Hub metadata, the shape, the target, the training config
  and evaluation table when present, and how to use it).

`save_pretrained` writes into a temporary sibling folder and renames it into place; an existing
folder is first renamed aside and deleted only after the new one is in place, so a reader sees
the old adapter, the new one, or (for an instant) none, never a mix.

Usage::

    adapter = ScorerAdapter.from_pretrained("user/gemma3-270m-sparsekv")   # Hub id or folder
    with adapter.attach(model, budget=0.3, schedule="pyramid", rerank_every=16):
        out = model.generate(**inputs, max_new_tokens=64)
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sparsekv.families import ModelShape, model_shape, text_config
from sparsekv.scorer import KINDS, GatingHead
from sparsekv.teacher import TargetConfig, default_layers

WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
CARD_NAME = "README.md"
ADAPTER_FILES = (WEIGHTS_NAME, CONFIG_NAME, CARD_NAME)
FORMAT_VERSION = 1
POLICY_DEFAULTS = ("recency", "kernel_size", "blend", "blend_mode", "head_layer")
"""AdapterConfig fields that are the learned policy's defaults (they do not change training)."""


def _version() -> str:
    from sparsekv import __version__

    return __version__


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
    sparsekv_version: str = field(default_factory=_version)
    training_config: dict[str, Any] | None = None
    """The resolved training config, when the adapter was trained with `train.py`."""
    eval_table: str | None = None
    """A Markdown evaluation table for the model card."""
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "hidden_size", "hidden"):
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
                f"layers={self.layers!r} must be a non-empty list of distinct layer indices in [0, {self.num_layers})"
            )
        self.layers = sorted(layers)
        if self.kind not in KINDS:
            raise ValueError(
                f"kind={self.kind!r} is not supported; allowed values: {', '.join(KINDS)}"
            )
        if isinstance(self.target, TargetConfig):
            self.target = self.target.to_dict()
        if not isinstance(self.target, dict):
            raise ValueError(f"target={self.target!r} must be a TargetConfig dict")
        self.target = TargetConfig.from_dict(self.target).to_dict()  # validates, fills defaults
        from sparsekv.policies.learned import check_settings

        for k, v in check_settings(**{k: getattr(self, k) for k in POLICY_DEFAULTS}).items():
            setattr(self, k, v)
        if self.training_config is not None and not isinstance(self.training_config, dict):
            raise ValueError("training_config must be a dict or None")
        if self.eval_table is not None and not isinstance(self.eval_table, str):
            raise ValueError("eval_table must be a Markdown string or None")
        if self.format_version != FORMAT_VERSION:
            raise ValueError(
                f"format_version={self.format_version!r}: this sparsekv reads adapter format {FORMAT_VERSION}"
            )

    @property
    def target_config(self) -> TargetConfig:
        return TargetConfig.from_dict(self.target)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AdapterConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"unknown AdapterConfig field(s) {unknown}; allowed: {', '.join(sorted(known))}"
            )
        return cls(**d)


# fields compared by check_compatible, with the words used in its error messages
_SHAPE_FIELDS = (
    ("model_type", "model type"),
    ("num_layers", "layers"),
    ("num_kv_heads", "KV heads"),
    ("head_dim", "head dim"),
    ("hidden_size", "hidden size"),
)


def _base_model_id(model: nn.Module) -> str | None:
    name = getattr(text_config(model), "_name_or_path", None) or getattr(
        model, "name_or_path", None
    )
    if not name:
        return None
    try:  # the converted offline default model lives in a cache folder: record its Hub id
        from sparsekv.default_model import DEFAULT_MODEL_ID, default_model_path

        if Path(name).resolve() == default_model_path().resolve():
            return DEFAULT_MODEL_ID
    except (ImportError, OSError):
        pass
    return str(name)


@dataclass
class Attachment:
    """What `ScorerAdapter.attach` yields: the settings in use and the last generate's cache."""

    model: nn.Module
    config: Any  # EvictionConfig
    policy: Any  # Policy
    last_cache: Any = None  # the SparseKVCache of the most recent generate call (closed)


class ScorerAdapter:
    """A `GatingHead` (`.head`) plus its `AdapterConfig` (`.config`)."""

    def __init__(self, head: GatingHead, config: AdapterConfig):
        if (
            head.layers != config.layers
            or head.kind != config.kind
            or head.num_kv_heads != config.num_kv_heads
        ):
            raise ValueError(
                f"head (layers={head.layers}, kind={head.kind}, kv_heads={head.num_kv_heads}) does not match "
                f"config (layers={config.layers}, kind={config.kind}, kv_heads={config.num_kv_heads})"
            )
        if head.hidden_size != config.hidden_size or (
            head.kind == "mlp" and head.hidden != config.hidden
        ):
            raise ValueError(
                f"head (hidden_size={head.hidden_size}, hidden={head.hidden}) does not match "
                f"config (hidden_size={config.hidden_size}, hidden={config.hidden})"
            )
        self.head = head
        self.config = config

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        layers: Sequence[int] | None = None,
        kind: str = "mlp",
        hidden: int = 64,
        target: TargetConfig | None = None,
        base_model_id: str | None = None,
        **policy_defaults: Any,
    ) -> ScorerAdapter:
        """A fresh, untrained adapter for `model` (default layers: its full-attention layers).
        `policy_defaults` (recency, kernel_size, blend, blend_mode, head_layer) are the learned policy's
        defaults recorded in the config."""
        bad = sorted(set(policy_defaults) - set(POLICY_DEFAULTS))
        if bad:
            raise ValueError(f"unknown policy default(s) {bad}; allowed: {', '.join(POLICY_DEFAULTS)}")
        shape = model_shape(model)
        layers = list(default_layers(model) if layers is None else layers)
        config = AdapterConfig(
            model_type=shape.model_type,
            num_layers=shape.num_layers,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            hidden_size=shape.hidden_size,
            layers=layers,
            base_model_id=base_model_id if base_model_id is not None else _base_model_id(model),
            kind=kind,
            hidden=hidden,
            target=(TargetConfig() if target is None else target).to_dict(),
            **policy_defaults,
        )
        head = GatingHead(
            shape.hidden_size, shape.num_kv_heads, config.layers, kind=kind, hidden=hidden
        )
        return cls(head, config)

    # ---- files ---------------------------------------------------------------------------
    def save_pretrained(self, save_directory: str | os.PathLike) -> Path:
        """Write the adapter folder (weights, config, model card) atomically; returns its path."""
        from safetensors.torch import save_file

        target = Path(save_directory).expanduser()
        if target.exists() and not target.is_dir():
            raise ValueError(f"save_directory={str(target)!r} exists and is not a folder")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        old = None
        try:
            os.chmod(tmp, 0o755)
            state = {
                k: v.detach().to("cpu", torch.float32).contiguous()
                for k, v in self.head.state_dict().items()
            }
            save_file(
                state,
                str(tmp / WEIGHTS_NAME),
                metadata={"format": "pt", "sparsekv_version": _version()},
            )
            (tmp / CONFIG_NAME).write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
            (tmp / CARD_NAME).write_text(self.model_card())
            if target.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
                os.rename(target, old / "adapter")
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        return target

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo_id: str | os.PathLike,
        revision: str | None = None,
        token: str | bool | None = None,
    ) -> ScorerAdapter:
        """Load from a local adapter folder, else from a Hub repo (`huggingface_hub.snapshot_download`,
        which honours `HF_HUB_OFFLINE=1` by using only the local Hub cache)."""
        from safetensors.torch import load_file

        folder = Path(path_or_repo_id).expanduser()
        if not folder.is_dir():
            if folder.exists():
                raise ValueError(
                    f"{str(path_or_repo_id)!r} is a file; expected an adapter folder or a Hub repo id"
                )
            folder = cls._download(str(path_or_repo_id), revision, token)
        missing = [n for n in (WEIGHTS_NAME, CONFIG_NAME) if not (folder / n).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{folder} is not a sparsekv adapter folder: missing {', '.join(missing)}"
            )
        try:
            config = AdapterConfig.from_dict(json.loads((folder / CONFIG_NAME).read_text()))
        except (ValueError, TypeError) as e:
            raise ValueError(f"invalid {folder / CONFIG_NAME}: {e}") from e
        head = GatingHead(
            config.hidden_size,
            config.num_kv_heads,
            config.layers,
            kind=config.kind,
            hidden=config.hidden,
        )
        state = load_file(str(folder / WEIGHTS_NAME))
        try:
            head.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise ValueError(f"{folder / WEIGHTS_NAME} does not match {CONFIG_NAME}: {e}") from e
        head.eval()
        return cls(head, config)

    @staticmethod
    def _download(repo_id: str, revision: str | None, token: str | bool | None) -> Path:
        from huggingface_hub import constants, snapshot_download

        try:
            return Path(
                snapshot_download(
                    repo_id,
                    revision=revision,
                    token=token,
                    allow_patterns=list(ADAPTER_FILES),
                    library_name="sparsekv",
                    library_version=_version(),
                )
            )
        except Exception as e:  # HF raises many kinds: invalid id, offline, not found, network
            offline = (
                " (HF_HUB_OFFLINE=1: only the local Hub cache is searched)"
                if constants.HF_HUB_OFFLINE
                else ""
            )
            raise OSError(
                f"{repo_id!r} is not a local adapter folder, and downloading it from the Hugging Face Hub "
                f"failed{offline}: {type(e).__name__}: {e}"
            ) from e

    def push_to_hub(
        self,
        repo_id: str,
        private: bool | None = None,
        token: str | None = None,
        commit_message: str = "Upload sparsekv scorer adapter",
        revision: str | None = None,
    ):
        """Create `repo_id` if needed and upload the adapter folder; returns the `CommitInfo`."""
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        with tempfile.TemporaryDirectory(prefix="sparsekv-push-") as tmp:
            folder = self.save_pretrained(Path(tmp) / "adapter")
            return api.upload_folder(
                repo_id=repo_id,
                folder_path=str(folder),
                repo_type="model",
                commit_message=commit_message,
                revision=revision,
            )

    def model_card(self) -> str:
        """The README.md written beside the weights (Hub metadata + description)."""
        from huggingface_hub import ModelCardData

        c = self.config
        meta = ModelCardData(
            library_name="sparsekv",
            base_model=c.base_model_id
            if c.base_model_id and "/" in c.base_model_id and not os.path.isabs(c.base_model_id)
            else None,
            tags=["sparsekv", "kv-cache", "kv-cache-eviction"],
        )
        base = c.base_model_id or "(unrecorded base model)"
        lines = [
            "---",
            meta.to_yaml(),
            "---",
            "",
            f"# sparsekv scorer for {base}",
            "",
            (
                "A gating head trained with sparsekv on the frozen base model: it scores every token "
                "as it enters the KV cache so that an evicting cache keeps what the model will attend "
                "to and frees the rest."
            ),
            "",
            "| field | value |",
            "| --- | --- |",
            f"| base model | `{base}` ({c.model_type}) |",
            f"| shape | {c.num_layers} layers, {c.num_kv_heads} KV heads, head dim {c.head_dim}, hidden size {c.hidden_size} |",
            f"| scored layers | {', '.join(map(str, c.layers))} |",
            f"| head | {c.kind}"
            + (f", hidden {c.hidden}" if c.kind == "mlp" else "")
            + f", {self.head.num_parameters():,} parameters |",
            f"| target | {c.target_config.describe()} |",
            f"| policy defaults | blend {c.blend:g} ({c.blend_mode}), head_layer {c.head_layer}, "
            f"kernel_size {c.kernel_size}, recency {c.recency:g} |",
            f"| sparsekv | {c.sparsekv_version} |",
            "",
            "## Usage",
            "",
            "```python",
            "from sparsekv import ScorerAdapter",
            'adapter = ScorerAdapter.from_pretrained("<this repo id or folder>")',
            'with adapter.attach(model, budget=0.3, schedule="pyramid", rerank_every=16):',
            "    out = model.generate(**inputs, max_new_tokens=64)",
            "```",
            "",
            "With the question in the prompt, the defaults blend the head's scores with the attention "
            "of the prompt's last tokens. A context compressed before its question is known (a "
            "prefix cached for later questions) gains nothing from that window: pass `blend=0.0` "
            "to `attach` (or `policy`) to rank by the head alone, and a wider `kernel_size` so that "
            "a value's neighbours (the key it belongs to) stay with it: on gemma-3-270m, "
            "`attach(model, blend=0.0, kernel_size=9)`.",
            "",
            "Loading it onto a model of another shape raises an error naming the mismatch.",
            "",
        ]
        if c.eval_table:
            lines += ["## Evaluation", "", c.eval_table.strip(), ""]
        if c.training_config:
            lines += [
                "## Training config",
                "",
                "```json",
                json.dumps(c.training_config, indent=2, sort_keys=True, default=str),
                "```",
                "",
            ]
        return "\n".join(lines)

    # ---- identity ------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """sha256 hex digest of what makes this adapter score the way it does: every head tensor
        (name, dtype, shape and raw bytes, in sorted name order) and the scoring settings the
        learned policy takes by default (`POLICY_DEFAULTS`, the "aware" use). File bytes, file
        format and metadata (card, training config, version) do not enter it, so converting an
        adapter folder keeps its fingerprint and changed weights change it. Eval rows record it."""
        import hashlib

        h = hashlib.sha256(b"sparsekv-adapter-fingerprint/1\n")
        for name, t in sorted(self.head.state_dict().items()):
            t = t.detach().to("cpu").contiguous()
            h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}\n".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        settings = {k: getattr(self.config, k) for k in POLICY_DEFAULTS}
        h.update(json.dumps(settings, sort_keys=True).encode())
        return h.hexdigest()

    # ---- use -----------------------------------------------------------------------------
    def check_compatible(self, model_or_shape: nn.Module | ModelShape) -> None:
        """Raise ValueError naming the first field where the model's shape differs from the adapter's."""
        shape = (
            model_or_shape
            if isinstance(model_or_shape, ModelShape)
            else model_shape(model_or_shape)
        )
        for name, words in _SHAPE_FIELDS:
            mine, theirs = getattr(self.config, name), getattr(shape, name)
            if mine != theirs:
                raise ValueError(
                    f"adapter/model mismatch in {words} ({name}): the adapter was trained for "
                    f"{mine!r} ({self.config.base_model_id or 'unknown base model'}) but the model has {theirs!r}"
                )

    def to(self, device: torch.device | str) -> ScorerAdapter:
        self.head.to(device)
        return self

    def score_layer(self, layer_idx: int, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states `(batch, new, hidden)` of layer `layer_idx`'s self_attn -> logits
        `(batch, kv_heads, new)` float32, higher = keep. No gradient; the head follows the input's
        device on first use (it computes in float32 whatever the input dtype). Training calls
        `adapter.head` directly instead."""
        param = next(self.head.parameters())
        if param.device != hidden_states.device:
            self.head.to(hidden_states.device)
        with torch.no_grad():
            return self.head.forward_layer(layer_idx, hidden_states)

    def policy(self, **kwargs):
        """The "learned" policy backed by this adapter; unset arguments (blend, blend_mode,
        recency, kernel_size) take the defaults recorded in `config`."""
        from sparsekv import policies

        return policies.get("learned", adapter=self, **kwargs)

    @contextmanager
    def attach(
        self,
        model: nn.Module,
        budget: float = 0.3,
        schedule: str | list[float] = "pyramid",
        rerank_every: int = 16,
        blend: float | None = None,
        **eviction_kwargs: Any,
    ) -> Iterator[Attachment]:
        """Inside the `with` block, plain `model.generate(...)` runs with a fresh
        `SparseKVCache(model, EvictionConfig(budget=..., ...), self.policy(blend=blend, ...))` per
        call (closed after the call). Keyword arguments named in `POLICY_DEFAULTS` (`blend`,
        `blend_mode`, `kernel_size`, `recency`, `head_layer`) go to the policy, unset ones taking
        the adapter's recorded defaults; the others to `EvictionConfig`. A context compressed
        before its question is known ranks best by the head alone with wider pooling:
        `attach(model, blend=0.0, kernel_size=9)` (docs/learned-scorer.md, round 4). A call that
        passes its own `cache=` (or `past_key_values=`) is left alone. On exit `model.generate`
        and the model's attention implementation are restored, also after an error. Yields an
        `Attachment` (its `last_cache` is the most recent call's cache, for `kv_bytes()` and
        friends)."""
        from sparsekv.cache import SparseKVCache
        from sparsekv.config import EvictionConfig

        self.check_compatible(model)
        settings = {k: eviction_kwargs.pop(k) for k in POLICY_DEFAULTS if k in eviction_kwargs}
        if blend is not None:
            settings["blend"] = blend
        config = EvictionConfig(
            budget=budget, schedule=schedule, rerank_every=rerank_every, **eviction_kwargs
        )
        policy = self.policy(**settings)
        attachment = Attachment(model=model, config=config, policy=policy)
        had_own = "generate" in vars(model)
        own = vars(model).get("generate")
        original = model.generate
        attn_before = text_config(model)._attn_implementation

        @functools.wraps(original)
        def generate(*args: Any, **kwargs: Any):
            if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
                return original(*args, **kwargs)
            cache = SparseKVCache(model, config, policy)
            attachment.last_cache = cache
            try:
                return original(*args, cache=cache, **kwargs)
            finally:
                cache.close()

        model.generate = generate
        try:
            yield attachment
        finally:
            if had_own:
                model.generate = own
            else:
                del model.generate
            if text_config(model)._attn_implementation != attn_before and attn_before is not None:
                model.set_attn_implementation(attn_before)

    def __repr__(self) -> str:
        c = self.config
        return (
            f"ScorerAdapter(base_model_id={c.base_model_id!r}, layers={c.layers}, kind={c.kind!r}, "
            f"parameters={self.head.num_parameters():,})"
        )
