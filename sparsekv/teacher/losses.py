"""Ranking-aware losses for the gating head. What matters is which entries fall inside the budget.

This module owns the training objective and its metrics; it knows nothing about models or data.

Inputs, per budgeted layer: `pred` `(batch, kv_heads, seq)` head logits, `target`
`(batch, kv_heads, seq)` teacher targets (>= 0, see `sparsekv.teacher.statistics`), `valid_mask`
`(batch, seq)` bool (False = padding). Positions the cache always keeps anyway (the first
`sink_tokens` and last `recent_window` real tokens of each row) can be left out of the loss, so
the head spends its capacity on the entries the budget actually decides about. Over the
remaining "ranked" positions of each (batch, kv head) row:

- **listwise KL** (`kl_weight`): `KL(p_t || softmax(pred))` with the target distribution
  `p_t ∝ target ** (1 / temperature)` (temperature < 1 sharpens it, > 1 flattens it). It teaches
  the whole ordering, weighted by how much attention is at stake, and is invariant to a shift of
  the logits.
- **top-budget membership** (`topk_weight`): binary cross-entropy of `pred` against the label
  "this entry is in the target's top `budget` fraction" (k = max(1, round(budget x ranked
  positions)) per row). It concentrates on the budget boundary and anchors the logits' offset
  (a logit > 0 reads "inside the budget"). With `balance_topk`, positives and negatives weigh
  equally (pos_weight = (1 - budget) / budget).

Each term is averaged over rows with at least one ranked position; the loss is
`kl_weight * kl + topk_weight * bce` (`kind="ranking"`, the default).

`kind="mse"` is KVzap's regression instead: the mean over the ranked (row, position) pairs of
`(pred - log_target)^2`, where `log_target` is the target itself when it is already a log score
(`log_target=True`, e.g. `TargetConfig(kind="kvzip_plus")`) and `log(max(target, 1e-12))` for a
distribution. It learns the target's values, not only its order (KVzap thresholds them). The
ranking kind given a log-score target uses `exp(target)` as its weights. `compute_loss` serves
both kinds; the KL/BCE weights, `temperature` and `balance_topk` are unused under "mse".

Metrics (python floats): `loss`, `kl` and `bce` (ranking) or `mse`, `recall` = recall@budget (the
fraction of the target's top-k entries that the prediction's top-k contains; 1 when the rankings agree on the
set), and `mass_recall` = target mass inside the prediction's top-k divided by the target mass
inside the target's own top-k (1 = as good as the teacher's own choice).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from sparsekv.configfile import from_fields

KINDS = ("ranking", "mse")
MSE_FLOOR = 1e-12


@dataclass
class LossConfig:
    kind: str = "ranking"
    """"ranking": listwise KL + top-budget BCE (ours); "mse": squared error against the log
    target (KVzap's)."""
    kl_weight: float = 1.0
    """Weight of the listwise KL term (>= 0)."""
    topk_weight: float = 1.0
    """Weight of the top-budget membership (BCE) term (>= 0)."""
    budget: float = 0.3
    """Fraction of the ranked positions that counts as "kept" for the BCE labels and recall; in (0, 1]."""
    temperature: float = 1.0
    """Target distribution ∝ target ** (1 / temperature); > 0."""
    sink_tokens: int = 0
    """Leave the first real tokens of each row out of the loss (the cache always keeps them)."""
    recent_window: int = 0
    """Leave the last real tokens of each row out of the loss (the cache always keeps them)."""
    balance_topk: bool = False
    """Weigh BCE positives by (1 - budget) / budget so both classes count equally."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(
                f"kind={self.kind!r} is not supported; allowed values: {', '.join(KINDS)}"
            )
        for name in ("kl_weight", "topk_weight"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"{name}={v!r} must be a number >= 0")
        if self.kind == "ranking" and self.kl_weight == 0 and self.topk_weight == 0:
            raise ValueError("kl_weight and topk_weight are both 0: at least one must be > 0")
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not (0.0 < b <= 1.0):
            raise ValueError(f"budget={b!r} must be a fraction in (0, 1]")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise ValueError(f"temperature={t!r} must be a number > 0")
        for name in ("sink_tokens", "recent_window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}={v!r} must be an int >= 0")
        if not isinstance(self.balance_topk, bool):
            raise ValueError(f"balance_topk={self.balance_topk!r} must be true or false")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LossConfig:
        return from_fields(cls, d)


def ranked_positions(
    valid_mask: torch.Tensor, sink_tokens: int = 0, recent_window: int = 0
) -> torch.Tensor:
    """`(batch, seq)` bool: real tokens that are neither among the first `sink_tokens` nor the
    last `recent_window` real tokens of their row."""
    valid = valid_mask.bool()
    rank = valid.long().cumsum(-1) - 1  # index among the row's real tokens
    n_real = valid.sum(-1, keepdim=True)
    return valid & (rank >= sink_tokens) & (rank < n_real - recent_window)


def _top_k_mask(scores: torch.Tensor, ranked: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """scores `(batch, heads, seq)`, ranked `(batch, 1, seq)`, k `(batch, 1, 1)` -> bool top-k."""
    masked = scores.float().masked_fill(~ranked, float("-inf"))
    order = masked.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order).scatter_(
        -1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order)
    )
    return (ranks < k) & ranked


def _recall_metrics(pred, weight, in_target, ranked, k, rows, n_rows) -> dict[str, float]:
    """recall@budget and mass_recall of `pred` against the target's top-k `in_target`; `weight`
    `(batch, kv_heads, seq)` >= 0 is the target mass. See the module docstring."""
    with torch.no_grad():
        in_pred = _top_k_mask(pred, ranked, k)
        hit = (in_pred & in_target).sum(-1).float()
        recall_rows = hit / k.squeeze(-1).float()
        mass = torch.where(ranked, weight, torch.zeros_like(weight))
        best = (mass * in_target).sum(-1)
        got = (mass * in_pred).sum(-1)
        mass_rows = torch.where(best > 0, got / best.clamp_min(1e-30), torch.ones_like(best))
        return {
            "recall": float((recall_rows * rows).sum() / n_rows),
            "mass_recall": float((mass_rows * rows).sum() / n_rows),
        }


def _check_shapes(pred: torch.Tensor, target: torch.Tensor, valid_mask: torch.Tensor) -> None:
    if pred.shape != target.shape or pred.ndim != 3:
        raise ValueError(
            f"pred {tuple(pred.shape)} and target {tuple(target.shape)} must both be (batch, kv_heads, seq)"
        )
    if valid_mask.shape != (pred.shape[0], pred.shape[2]):
        raise ValueError(
            f"valid_mask has shape {tuple(valid_mask.shape)}; expected {(pred.shape[0], pred.shape[2])}"
        )


def compute_loss(
    pred: torch.Tensor,
    target: torch.Tensor,
    valid_mask: torch.Tensor,
    cfg: LossConfig | None = None,
    log_target: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss `cfg.kind` names, and its metrics. pred, target `(batch, kv_heads, seq)`;
    valid_mask `(batch, seq)`; `log_target`: the target holds log scores (else weights >= 0)."""
    cfg = LossConfig() if cfg is None else cfg
    if cfg.kind == "mse":
        return mse_loss(pred, target, valid_mask, cfg, log_target)
    if log_target:
        target = torch.where(valid_mask[:, None].bool(), target.detach().float().exp(), 0.0)
    return ranking_loss(pred, target, valid_mask, cfg)


def mse_loss(
    pred: torch.Tensor,
    target: torch.Tensor,
    valid_mask: torch.Tensor,
    cfg: LossConfig | None = None,
    log_target: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean squared error of `pred` against the log target over the ranked positions (module
    docstring), with `loss`, `mse`, `recall` and `mass_recall` (mass = exp of the log target)."""
    cfg = LossConfig(kind="mse") if cfg is None else cfg
    _check_shapes(pred, target, valid_mask)
    pred = pred.float()
    target = target.detach().float()
    log_t = target if log_target else target.clamp_min(MSE_FLOOR).log()
    ranked = ranked_positions(valid_mask.to(pred.device), cfg.sink_tokens, cfg.recent_window)[
        :, None
    ]  # (b, 1, s)
    n_ranked = ranked.sum(-1, keepdim=True)
    rows = (n_ranked > 0).expand(-1, pred.shape[1], -1).squeeze(-1)
    n_rows = rows.sum().clamp_min(1)
    sq = torch.where(ranked, (pred - torch.where(ranked, log_t, 0.0)) ** 2, 0.0)
    count = (ranked.expand_as(sq)).sum().clamp_min(1)
    loss = sq.sum() / count
    k = (cfg.budget * n_ranked).round().clamp_min(1).long()
    in_target = _top_k_mask(log_t, ranked, k)
    weight = torch.where(ranked, log_t.exp(), 0.0)
    metrics = {
        "loss": float(loss.detach()),
        "mse": float(loss.detach()),
        **_recall_metrics(pred, weight, in_target, ranked, k, rows, n_rows),
    }
    return loss, metrics


def ranking_loss(
    pred: torch.Tensor,
    target: torch.Tensor,
    valid_mask: torch.Tensor,
    cfg: LossConfig | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss (scalar, differentiable w.r.t. `pred`) and metrics; see the module docstring.

    pred, target `(batch, kv_heads, seq)`; valid_mask `(batch, seq)` bool; cfg defaults to `LossConfig()`.
    """
    cfg = LossConfig() if cfg is None else cfg
    _check_shapes(pred, target, valid_mask)
    pred = pred.float()
    target = target.detach().float().clamp_min(0.0)
    ranked = ranked_positions(valid_mask.to(pred.device), cfg.sink_tokens, cfg.recent_window)[
        :, None
    ]  # (b, 1, s)
    n_ranked = ranked.sum(-1, keepdim=True)  # (b, 1, 1)
    rows = (n_ranked > 0).expand(-1, pred.shape[1], -1).squeeze(-1)  # (b, h)
    n_rows = rows.sum().clamp_min(1)

    # listwise KL(p_t || q)
    t = torch.where(ranked, target, torch.zeros_like(target))
    if cfg.temperature != 1.0:
        t = t.pow(1.0 / cfg.temperature)
    total = t.sum(-1, keepdim=True)
    p_t = torch.where(total > 0, t / total.clamp_min(1e-30), ranked / n_ranked.clamp_min(1))
    log_q = torch.log_softmax(pred.masked_fill(~ranked, float("-inf")), dim=-1)
    log_q = torch.where(ranked, log_q, torch.zeros_like(log_q))
    kl_rows = (torch.xlogy(p_t, p_t) - p_t * log_q).sum(-1)  # (b, h)
    kl = (kl_rows * rows).sum() / n_rows

    # top-budget membership
    k = (cfg.budget * n_ranked).round().clamp_min(1).long()
    in_target = _top_k_mask(target, ranked, k)
    pos_weight = None
    if cfg.balance_topk and cfg.budget < 1.0:
        pos_weight = torch.tensor((1.0 - cfg.budget) / cfg.budget, device=pred.device)
    bce_all = F.binary_cross_entropy_with_logits(
        pred, in_target.float(), reduction="none", pos_weight=pos_weight
    )
    bce_rows = (bce_all * ranked).sum(-1) / n_ranked.squeeze(-1).clamp_min(1)
    bce = (bce_rows * rows).sum() / n_rows

    loss = cfg.kl_weight * kl + cfg.topk_weight * bce

    metrics = {
        "loss": float(loss.detach()),
        "kl": float(kl.detach()),
        "bce": float(bce.detach()),
        **_recall_metrics(pred, target, in_target, ranked, k, rows, n_rows),
    }
    return loss, metrics
