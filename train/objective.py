"""What the head is trained on and against: the frozen teacher's targets for a batch, the head's
logits on the same hidden states, the loss between them (`Objective`), and the head seen by the
training engine as tuples in and out (`LayerwiseHead`). Knows nothing of accelerate or files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from train.config import TrainConfig


class LayerwiseHead(nn.Module):
    """The gating head as the training engine sees it: hidden states in, logits out, as tuples.

    `forward(*hidden)` takes `(batch, seq, hidden)` per layer of `layers` and returns
    `(batch, kv_heads, seq)` per layer, in the same order. Tuples rather than the head's
    int-keyed dicts, because DeepSpeed ZeRO-3's module hooks only understand tensors, tuples and
    string-keyed outputs. Parameters are the head's own (`head.*`); nothing is copied.
    """

    def __init__(self, head: nn.Module, layers: list[int]):
        super().__init__()
        self.head = head
        self.layers = list(layers)

    def forward(self, *hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.head.forward_layer(i, h) for i, h in zip(self.layers, hidden))


@dataclass
class Objective:
    """Teacher targets from the frozen model (cached per example when `cache` is set), head
    predictions, the configured loss averaged over layers."""

    target: Any  # sparsekv.teacher.statistics.TargetConfig
    loss: Any  # sparsekv.teacher.losses.LossConfig
    layers: list[int]
    block_size: int = 512
    repeat_prompt_ids: list[int] | None = None
    """Tokens of sparsekv.policies.reconstruction.REPEAT_PROMPT (reconstruction signals only)."""
    cache: Any = None  # train.targets.TargetCache | None
    store: Any = None
    """sparsekv.teacher.store.TeacherStore | None: targets and hidden states read from it (the
    model is not run)."""

    def __post_init__(self) -> None:
        from train.targets import TeacherTargets

        if self.store is not None:
            self.teacher = self.store.teacher(self.target, self.layers)
            return
        self.teacher = TeacherTargets(
            self.target, self.layers, self.block_size, self.repeat_prompt_ids, self.cache
        )

    def __call__(
        self,
        model: nn.Module,
        head: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """`input_ids`, `attention_mask` `(batch, seq)` -> (scalar loss, metrics).

        `head` is a `LayerwiseHead` over `self.layers` (possibly wrapped by accelerate).
        """
        from sparsekv.teacher.losses import compute_loss

        hits = self.cache.hits if self.cache is not None else 0
        with torch.no_grad():
            targets, hidden = self.teacher(model, input_ids, attention_mask)
        preds = head(*(hidden[i] for i in self.layers))  # the head computes in float32
        valid = attention_mask.bool()
        total, metrics = 0.0, {}
        for layer, pred in zip(self.layers, preds):
            loss, m = compute_loss(pred, targets[layer], valid, self.loss, self.target.log_scale)
            total = total + loss
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + v / len(self.layers)
            metrics[f"recall/layer{layer}"] = m["recall"]
        if self.cache is not None:  # share of this micro-batch's rows read from the cache
            metrics["teacher_cached"] = (self.cache.hits - hits) / input_ids.shape[0]
        return total / len(self.layers), metrics


def build_objective(
    cfg: TrainConfig, model: nn.Module, tokenizer, base_id: str, layers
) -> Objective:
    """The run's `Objective`: the repeat prompt tokenized for reconstruction signals, and the
    on-disk teacher cache when `teacher_cache` is set."""
    from sparsekv.policies.reconstruction import REPEAT_PROMPT
    from train.targets import TargetCache, model_identity

    target = cfg.target_config()
    prompt = None
    if target.signal != "questions":
        prompt = list(tokenizer([REPEAT_PROMPT], add_special_tokens=False)["input_ids"][0])
    cache = None
    if cfg.teacher_cache is not None:
        cache = TargetCache(
            cfg.teacher_cache,
            target=target.to_dict(),
            layers=layers,
            repeat_prompt_ids=prompt,
            model=model_identity(model, base_id),
        )
    store = _checked_store(cfg, model, base_id, layers, target, prompt)
    return Objective(
        target, cfg.loss_config(), list(layers), cfg.teacher_block_size, prompt, cache, store
    )


def _checked_store(cfg: TrainConfig, model: nn.Module, base_id: str, layers, target, prompt):
    """The run's teacher store (`dataset: store:PATH`), refused by name (`RunError`) when it was
    built for another model, length, layers or statistic settings; None without one."""
    from sparsekv.models.families import model_shape
    from sparsekv.teacher.store import StoreError, model_identity, needed_settings
    from train.run import RunError, open_store

    store = open_store(cfg)
    if store is None:
        return None
    need = needed_settings(target, list(layers), model_shape(model).layer_types)
    if target.kind == "kvzip_plus" or target.signal != "questions":
        need["repeat_prompt_ids"] = prompt
    wanted = {
        "model": model_identity(model, base_id),
        "length": cfg.seq_len,
        "layers": list(layers),
        "target": need,
    }
    try:
        store.check(wanted, what=f"this run (model={cfg.model!r})")
    except StoreError as e:
        raise RunError(f"dataset={cfg.dataset!r}: {e}") from None
    return store


def count_parameters(module: nn.Module, trainable: bool | None = None) -> int:
    """Parameters of `module` (full sizes also under DeepSpeed ZeRO-3, which empties `.data`)."""
    return sum(
        getattr(p, "ds_numel", p.numel())
        for p in module.parameters()
        if trainable is None or p.requires_grad == trainable
    )
