"""`TrainedScorer`: a trained gating head packaged for one base model, saved, loaded, pushed.

This module owns the adapter's files and identity: building a fresh head for a model, saving and
loading a folder (format: `sparsekv.scoring.files`; model card: `sparsekv.scoring.card`),
pushing to and pulling from the Hugging Face Hub (`sparsekv.scoring.hub`), its `fingerprint`, checking that a model has
the shape the head was trained for, and scoring a layer's attention inputs (`score_layer`, what
the learned policy calls). It imports neither the cache nor the policies: `ScorerAdapter`
(`sparsekv.scoring.adapter`) adds the policy and `attach` on top, and the learned policy loads a
`TrainedScorer` when it is named by a string ("learned:DIR").

A folder holds `config.json` (type tag, format version 2, the base model's shape, the target, the
learned policy's settings per use), `model.safetensors` (the head), `README.md` (the card) and
optionally `lora/` (a standard PEFT LoRA folder). Format-1 folders (`adapter_config.json` +
`adapter_model.safetensors`) still load. Saving is atomic (a new folder is a temporary sibling
renamed into place; in an existing one each file is replaced atomically) and never removes a file
it did not write.

LoRA: `save_pretrained(folder, lora=peft_model)` (a trained `peft.PeftModel`, a `LoraWeights`, or
a PEFT folder) stores a LoRA of the base model beside the head, in `lora/`; `from_pretrained`
loads it into `.lora`.
"""


from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sparsekv.config import without_later_defaults
from sparsekv.io import as_path
from sparsekv.models.families import ModelShape, model_shape, text_config
from sparsekv.scoring.adapter_config import LORA_DIR, POLICY_DEFAULTS, AdapterConfig
from sparsekv.scoring.files import (
    adapter_files,
    folder_files,
    hash_tensors,
    head_for,
    read_config,
    read_weights,
)
from sparsekv.scoring.folder import recover, write_folder
from sparsekv.scoring.head import GatingHead
from sparsekv.scoring.hub import locate, push_folder
from sparsekv.scoring.lora import LoraWeights, as_lora, check_lora_folder
from sparsekv.teacher.statistics import TargetConfig, default_layers

__all__ = ["TrainedScorer"]


def _version() -> str:
    from sparsekv._version import __version__

    return __version__


# fields compared by check_compatible, with the words used in its error messages
_SHAPE_FIELDS = (
    ("model_type", "model type"),
    ("num_layers", "layers"),
    ("num_kv_heads", "KV heads"),
    ("head_dim", "head dim"),
    ("hidden_size", "hidden size"),
)


def _same_weights(a: TrainedScorer, b: TrainedScorer) -> bool:
    """Whether two adapters' heads hold the same tensors (the same adapter loaded twice)."""
    sa, sb = a.head.state_dict(), b.head.state_dict()
    return sa.keys() == sb.keys() and all(
        sa[k].shape == sb[k].shape and torch.equal(sa[k].cpu(), sb[k].cpu()) for k in sa
    )


def _base_model_id(model: nn.Module) -> str | None:
    name = getattr(text_config(model), "_name_or_path", None) or getattr(
        model, "name_or_path", None
    )
    if not name:
        return None
    try:  # the converted offline default model lives in a cache folder: record its Hub id
        from sparsekv.models.default import DEFAULT_MODEL_ID, default_model_path

        if Path(name).resolve() == default_model_path().resolve():
            return DEFAULT_MODEL_ID
    except (ImportError, OSError):
        pass
    return str(name)


class TrainedScorer:
    """A `GatingHead` (`.head`), its `AdapterConfig` (`.config`) and optionally a LoRA of the base
    model (`.lora`, a `LoraWeights`)."""

    def __init__(self, head: GatingHead, config: AdapterConfig, lora: LoraWeights | None = None):
        if (
            head.layers != config.layers
            or head.kind != config.kind
            or head.num_kv_heads != config.num_kv_heads
        ):
            raise ValueError(
                f"head (layers={head.layers}, kind={head.kind}, kv_heads={head.num_kv_heads}) "
                "does not match "
                f"config (layers={config.layers}, kind={config.kind}, "
                f"kv_heads={config.num_kv_heads})"
            )
        if head.hidden_size != config.hidden_size or (
            head.kind == "mlp" and head.hidden != config.hidden
        ):
            raise ValueError(
                f"head (hidden_size={head.hidden_size}, hidden={head.hidden}) does not match "
                f"config (hidden_size={config.hidden_size}, hidden={config.hidden})"
            )
        if getattr(head, "members", 1) != config.ensemble:
            raise ValueError(
                f"head (members={getattr(head, 'members', 1)}) does not match config "
                f"(ensemble={config.ensemble})"
            )
        self.head = head
        self.config = config
        self.lora: LoraWeights | None = None
        self.set_lora(lora)

    def set_lora(self, lora: Any) -> None:
        """Carry `lora` (None, a `LoraWeights`, a `peft.PeftModel` or a PEFT folder) beside the
        head; `save_pretrained` writes it into `lora/` and `attach` applies it."""
        self.lora = as_lora(lora)
        self.config.lora = LORA_DIR if self.lora is not None else None

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        layers: Sequence[int] | None = None,
        kind: str = "mlp",
        hidden: int = 64,
        target: TargetConfig | None = None,
        base_model_id: str | None = None,
        uses: dict[str, dict[str, Any]] | None = None,
        **policy_defaults: Any,
    ) -> TrainedScorer:
        """A fresh, untrained adapter for `model` (default layers: its full-attention layers).
        `policy_defaults` (recency, kernel_size, blend, blend_mode, head_layer) are the learned
        policy's "aware" settings recorded in the config; `uses` the settings of the other uses
        ({"agnostic": {...}, "decode": {...}}, unset keys copying "aware"; default
        `adapter_format.DEFAULT_USES`)."""
        bad = sorted(set(policy_defaults) - set(POLICY_DEFAULTS))
        if bad:
            raise ValueError(
                f"unknown policy default(s) {bad}; allowed: {', '.join(POLICY_DEFAULTS)}"
            )
        if target is not None and not isinstance(target, TargetConfig):
            raise TypeError(
                f"target={target!r} must be a TargetConfig (sparsekv.teacher.statistics."
                f"TargetConfig) or None (the default target), got {type(target).__name__}"
            )
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
            **({} if uses is None else {"uses": uses}),
            **policy_defaults,
        )
        head = GatingHead(
            shape.hidden_size, shape.num_kv_heads, config.layers, kind=kind, hidden=hidden
        )
        return cls(head, config)

    @classmethod
    def ensemble(cls, scorers: Sequence[TrainedScorer]) -> TrainedScorer:
        """One adapter whose head averages the logits of `scorers` (k >= 2 adapters trained apart
        for one model, e.g. with k head seeds): same base model shape, layers, head kind and
        width and target, else a ValueError naming the field. Settings, uses and the record come
        from the first; `training_config` lists each member's. Adapters with a LoRA, or that
        are ensembles themselves, are refused."""
        import copy

        if isinstance(scorers, (TrainedScorer, str, os.PathLike)) or not isinstance(
            scorers, Sequence
        ):
            raise TypeError(
                f"ensemble(scorers) takes a list (or tuple) of 2 or more ScorerAdapter objects, "
                f"got a {type(scorers).__name__}"
            )
        scorers = list(scorers)
        if len(scorers) < 2:
            raise ValueError(f"an ensemble needs at least 2 adapters, got {len(scorers)}")
        for i, s in enumerate(scorers):
            if not isinstance(s, TrainedScorer):
                raise TypeError(
                    f"adapter {i} is a {type(s).__name__} ({s!r:.80}): ensemble takes ScorerAdapter "
                    "objects; load a folder first with ScorerAdapter.from_pretrained(path)"
                )
            for j in range(i):
                if s is scorers[j] or _same_weights(s, scorers[j]):
                    raise ValueError(
                        f"adapters {j} and {i} are the same adapter twice (identical weights): "
                        "an ensemble averages heads trained apart, e.g. with other head seeds"
                    )
        first = scorers[0].config
        same = ("model_type", "num_layers", "num_kv_heads", "head_dim", "hidden_size", "layers",
                "kind", "hidden", "target")
        for i, s in enumerate(scorers):
            if s.lora is not None:
                raise ValueError(f"adapter {i} carries a LoRA: an ensemble averages heads only")
            if s.config.ensemble != 1:
                raise ValueError(f"adapter {i} is an ensemble itself (ensemble={s.config.ensemble})")
            for name in same:
                if getattr(s.config, name) != getattr(first, name):
                    raise ValueError(
                        f"adapter {i} has {name}={getattr(s.config, name)!r} but adapter 0 has "
                        f"{getattr(first, name)!r}: an ensemble's heads share it"
                    )
        config = copy.deepcopy(first)
        config.ensemble = len(scorers)
        config.training_config = {"ensemble_of": [s.config.training_config for s in scorers]}
        head = GatingHead(first.hidden_size, first.num_kv_heads, first.layers, kind=first.kind,
                          hidden=first.hidden, members=len(scorers))
        for layer in first.layers:
            for m, s in enumerate(scorers):
                head.heads[str(layer)].members[m].load_state_dict(
                    s.head.heads[str(layer)].state_dict()
                )
        return cls(head.eval(), config)

    # ---- files ---------------------------------------------------------------------------
    def save_pretrained(
        self, save_directory: str | os.PathLike, lora: Any = None, *, overwrite: bool = False
    ) -> Path:
        """Write the adapter folder (format 2: `config.json`, `model.safetensors`, `README.md`,
        and `lora/` when the adapter carries a LoRA); returns its path. `lora` (a
        `peft.PeftModel`, a `LoraWeights` or a PEFT folder) is first attached to this adapter
        (`set_lora`). Two saves of the same adapter write the same weight bytes.

        Saving never removes a file it did not write: a new folder appears complete (a
        temporary sibling renamed into place); in an existing adapter folder each file is
        replaced atomically (temporary file, fsync, `os.replace`) and nothing else is touched.
        A folder holding anything else (a training run's `step-*/`, `metrics.jsonl`, ...) is
        refused with a ValueError naming those files, unless `overwrite=True`, which writes the
        adapter's files beside them and leaves them in place."""
        if not isinstance(overwrite, bool):
            raise ValueError(f"overwrite={overwrite!r} must be True or False")
        folder = as_path(save_directory, "save_directory")
        if lora is not None:
            self.set_lora(lora)
        state = {
            k: v.detach().to("cpu", torch.float32).contiguous()
            for k, v in self.head.state_dict().items()
        }
        files: dict[str, bytes] = {}
        if self.lora is not None:
            with tempfile.TemporaryDirectory(prefix="sparsekv-lora-") as tmp:
                self.lora.save(Path(tmp))
                files.update(
                    (f"{LORA_DIR}/{p.name}", p.read_bytes())
                    for p in sorted(Path(tmp).iterdir())
                    if p.is_file()
                )
        files.update(adapter_files(self.config, state, self.model_card()))
        return write_folder(folder, files, overwrite=overwrite)

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo_id: str | os.PathLike,
        *,
        revision: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
        subfolder: str | None = None,
        token: str | bool | None = None,
        force_download: bool = False,
    ) -> TrainedScorer:
        """Load from a local adapter folder, else from a Hub repo
        (`huggingface_hub.snapshot_download` with the given `revision`, `cache_dir`,
        `local_files_only`, `token`, `force_download`; `HF_HUB_OFFLINE=1` searches only the
        local Hub cache). `subfolder`: the adapter's folder
        inside the local folder or the repo. Reads format 2 and format 1. Raises ValueError naming
        the file for a damaged config or weights file (see `sparsekv.scoring.files`)."""
        folder = locate(
            path_or_repo_id,
            subfolder=subfolder,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
            token=token,
            force_download=force_download,
        )
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder} is not a folder (subfolder={subfolder!r})")
        recover(folder)  # a save killed while it replaced this folder's files: undone
        config_path, weights_path, version = folder_files(folder)
        config = read_config(config_path, version)
        # the header is checked before any tensor is read; format 2 always records a digest
        state = read_weights(weights_path, config, require_digest=version >= 2)
        head = head_for(config)
        try:
            head.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise ValueError(f"{weights_path} does not match {config_path.name}: {e}") from e
        head.eval()
        lora = None
        if config.lora is not None:
            if not (folder / config.lora).is_dir():
                raise FileNotFoundError(
                    f"{config_path} names a LoRA subfolder {config.lora!r} that "
                    f"{folder} does not have"
                )
            lora = LoraWeights.from_folder(folder / config.lora)
            check_lora_folder(folder / config.lora, lora)
        return cls(head, config, lora=lora)

    def push_to_hub(
        self,
        repo_id: str,
        private: bool | None = None,
        token: str | None = None,
        commit_message: str = "Upload sparsekv scorer adapter",
        revision: str | None = None,
    ):
        """Create `repo_id` if needed and upload the adapter folder; returns the `CommitInfo`."""
        return push_folder(
            self.save_pretrained, repo_id, private=private, token=token,
            commit_message=commit_message, revision=revision,
        )

    def model_card(self) -> str:
        """The README.md written beside the weights (`sparsekv.scoring.card.build_card`)."""
        from sparsekv.scoring.card import build_card

        lora_params = self.lora.num_parameters() if self.lora is not None else None
        return build_card(self.config, self.head.num_parameters(), lora_params)

    # ---- identity ------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """sha256 hex digest of what makes this adapter score the way it does: every head tensor
        (name, dtype, shape and raw bytes, in sorted name order), the scoring settings the
        learned policy takes by default (`POLICY_DEFAULTS`, the "aware" use) and, when the
        adapter carries one, its LoRA's tensors. File bytes, file format and metadata (card,
        training config, version, the other uses' settings) do not enter it, so converting an
        adapter folder keeps its fingerprint and changed weights change it. Eval rows record it."""
        h = hash_tensors(
            hashlib.sha256(b"sparsekv-adapter-fingerprint/1\n"), self.head.state_dict()
        )
        settings = without_later_defaults({k: getattr(self.config, k) for k in POLICY_DEFAULTS})
        h.update(json.dumps(settings, sort_keys=True).encode())
        if self.lora is not None:
            h.update(b"lora\n")
            hash_tensors(h, self.lora.state)
        return h.hexdigest()

    # ---- use -----------------------------------------------------------------------------
    def check_compatible(self, model_or_shape: nn.Module | ModelShape) -> None:
        """Raise ValueError naming the first field where the model's shape differs from the "
        "adapter's."""
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
                    f"{mine!r} ({self.config.base_model_id or 'unknown base model'}) but the "
                    f"model has {theirs!r}"
                )

    def to(self, device: torch.device | str) -> TrainedScorer:
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

    def settings(self, use: str | None = None) -> dict[str, Any]:
        """The learned-policy settings recorded for `use` ("aware" when None, "agnostic", "decode"
        when recorded); an unrecorded use is a ValueError naming the recorded ones."""
        return self.config.settings(use)

    def __repr__(self) -> str:
        c = self.config
        lora = f", lora={self.lora.num_parameters():,} parameters" if self.lora is not None else ""
        return (
            f"{type(self).__name__}(base_model_id={c.base_model_id!r}, layers={c.layers}, kind={c.kind!r}, "
            f"parameters={self.head.num_parameters():,}{lora})"
        )
