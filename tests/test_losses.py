"""Ranking loss: it falls as the prediction approaches the target; recall; padding is ignored."""

from __future__ import annotations

import itertools

import pytest
import torch

from sparsekv.teacher.losses import LossConfig, ranked_positions, ranking_loss


def _target(b=2, h=2, n=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(b, h, n, generator=g) ** 3
    return t / t.sum(-1, keepdim=True)


def test_loss_decreases_as_pred_moves_toward_target():
    target = _target()
    valid = torch.ones(2, 20, dtype=torch.bool)
    good = target.log()  # softmax(good) == target
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(good.shape, generator=g) * 3
    losses = [ranking_loss(good + a * noise, target, valid)[0].item() for a in (1.0, 0.5, 0.2, 0.0)]
    assert all(x > y for x, y in itertools.pairwise(losses)), losses


def test_gradient_descent_reduces_loss_and_raises_recall():
    target = _target(n=30)
    valid = torch.ones(2, 30, dtype=torch.bool)
    pred = torch.zeros(2, 2, 30, requires_grad=True)
    opt = torch.optim.Adam([pred], lr=0.1)
    first = ranking_loss(pred, target, valid)[1]
    for _ in range(200):
        loss, metrics = ranking_loss(pred, target, valid)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert metrics["loss"] < first["loss"] and metrics["recall"] == 1.0


def test_recall_is_one_for_pred_equal_target_and_low_for_reversed():
    target = _target()
    valid = torch.ones(2, 20, dtype=torch.bool)
    _, m = ranking_loss(target.clone(), target, valid)
    assert m["recall"] == 1.0 and m["mass_recall"] == pytest.approx(1.0)
    _, m = ranking_loss(-target, target, valid, LossConfig(budget=0.3))
    assert m["recall"] == 0.0 and m["mass_recall"] < 0.5


def test_recall_counts_the_overlap():
    target = torch.tensor([[[10.0, 9, 8, 7, 1, 1, 1, 1, 1, 1]]])
    pred = torch.tensor([[[10.0, 9, 0, 0, 8, 7, 0, 0, 0, 0]]])  # top-4 shares 2 of 4
    _, m = ranking_loss(pred, target, torch.ones(1, 10, dtype=torch.bool), LossConfig(budget=0.4))
    assert m["recall"] == pytest.approx(0.5)
    assert m["mass_recall"] == pytest.approx((10 + 9 + 1 + 1) / (10 + 9 + 8 + 7))


def test_padding_is_ignored():
    target = _target(b=1, n=12)
    pred = torch.randn(1, 2, 12, generator=torch.Generator().manual_seed(3))
    valid = torch.ones(1, 12, dtype=torch.bool)
    loss, m = ranking_loss(pred, target, valid)
    # left-pad with 5 positions holding arbitrary (even huge) values: same loss and metrics
    pad_pred = torch.cat([torch.full((1, 2, 5), 1e4), pred], -1)
    pad_target = torch.cat([torch.full((1, 2, 5), 7.0), target], -1)
    pad_valid = torch.cat([torch.zeros(1, 5, dtype=torch.bool), valid], -1)
    pad_pred.requires_grad_(True)
    loss2, m2 = ranking_loss(pad_pred, pad_target, pad_valid)
    torch.testing.assert_close(loss2, loss)
    assert m2 == pytest.approx(m)
    loss2.backward()
    assert (pad_pred.grad[..., :5] == 0).all()


def test_rows_of_different_lengths_in_one_batch():
    target = _target(b=2, n=10)
    pred = torch.randn(2, 2, 10, generator=torch.Generator().manual_seed(4))
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, :4] = False
    _, m = ranking_loss(pred, target, valid)
    _, m0 = ranking_loss(pred[:1], target[:1], valid[:1])
    _, m1 = ranking_loss(pred[1:, :, 4:], target[1:, :, 4:], valid[1:, 4:])
    assert m["kl"] == pytest.approx((m0["kl"] + m1["kl"]) / 2, rel=1e-5)
    assert m["recall"] == pytest.approx((m0["recall"] + m1["recall"]) / 2)


def test_protected_positions_are_left_out():
    valid = torch.tensor([[False, False, True, True, True, True, True, True]])
    assert ranked_positions(valid, 2, 1).tolist() == [
        [False, False, False, False, True, True, True, False]
    ]
    target = _target(b=1, n=8)
    pred = torch.randn(1, 2, 8, generator=torch.Generator().manual_seed(5))
    cfg = LossConfig(sink_tokens=2, recent_window=1)
    base, _ = ranking_loss(pred, target, valid, cfg)
    changed = pred.clone()
    changed[..., 2:4] = 50.0
    changed[..., 7] = -50.0
    torch.testing.assert_close(ranking_loss(changed, target, valid, cfg)[0], base)


def test_weights_and_temperature():
    target = _target()
    valid = torch.ones(2, 20, dtype=torch.bool)
    pred = torch.randn(2, 2, 20, generator=torch.Generator().manual_seed(6))
    _, m = ranking_loss(pred, target, valid)
    kl_only, _ = ranking_loss(pred, target, valid, LossConfig(topk_weight=0.0))
    bce_only, _ = ranking_loss(pred, target, valid, LossConfig(kl_weight=0.0, topk_weight=2.0))
    assert kl_only.item() == pytest.approx(m["kl"], rel=1e-5)
    assert bce_only.item() == pytest.approx(2 * m["bce"], rel=1e-5)
    # a flattened target (high temperature) is closer to a flat prediction
    flat = torch.zeros(2, 2, 20)
    sharp = ranking_loss(flat, target, valid, LossConfig(topk_weight=0.0, temperature=0.5))[0]
    soft = ranking_loss(flat, target, valid, LossConfig(topk_weight=0.0, temperature=4.0))[0]
    assert soft < sharp


def test_config_validation():
    for kwargs, field in (
        ({"kl_weight": -1}, "kl_weight"),
        ({"budget": 0.0}, "budget"),
        ({"budget": 1.5}, "budget"),
        ({"temperature": 0}, "temperature"),
        ({"sink_tokens": -1}, "sink_tokens"),
        ({"kl_weight": 0, "topk_weight": 0}, "both 0"),
    ):
        with pytest.raises(ValueError, match=field):
            LossConfig(**kwargs)
    cfg = LossConfig(budget=0.2, sink_tokens=4)
    assert LossConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown LossConfig"):
        LossConfig.from_dict({"margin": 1})
    with pytest.raises(ValueError, match="valid_mask"):
        ranking_loss(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.ones(1, 5, dtype=torch.bool))


# ---------------------------------------------------------------------- mse (KVzap's loss)


def test_mse_equals_its_formula_on_the_ranked_positions():
    from sparsekv.teacher.losses import compute_loss, mse_loss

    g = torch.Generator().manual_seed(4)
    pred = torch.randn(2, 3, 12, generator=g)
    log_t = torch.randn(2, 3, 12, generator=g) - 3.0
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, -4:] = False
    cfg = LossConfig(kind="mse", sink_tokens=1, recent_window=2)
    loss, m = compute_loss(pred, log_t, valid, cfg, log_target=True)
    ranked = ranked_positions(valid, 1, 2)[:, None].expand_as(pred)
    expected = ((pred - log_t)[ranked] ** 2).mean()
    torch.testing.assert_close(loss, expected)
    assert m["mse"] == pytest.approx(expected.item()) and set(m) >= {"recall", "mass_recall"}
    # a distribution target is regressed in log space
    dist = log_t.exp()
    loss2, _ = mse_loss(pred, dist, valid, cfg, log_target=False)
    torch.testing.assert_close(loss2, expected, rtol=1e-5, atol=1e-6)
    # prediction equal to the target: zero loss, perfect recall
    zero, mz = compute_loss(log_t.clone(), log_t, valid, cfg, log_target=True)
    assert zero.item() == 0.0 and mz["recall"] == 1.0 and mz["mass_recall"] == 1.0


def test_mse_gradient_only_on_ranked_positions_and_descends():
    from sparsekv.teacher.losses import compute_loss

    g = torch.Generator().manual_seed(5)
    log_t = torch.randn(1, 2, 16, generator=g)
    valid = torch.ones(1, 16, dtype=torch.bool)
    valid[0, :3] = False
    pred = torch.zeros(1, 2, 16, requires_grad=True)
    cfg = LossConfig(kind="mse")
    loss, _ = compute_loss(pred, log_t, valid, cfg, log_target=True)
    loss.backward()
    assert (pred.grad[..., :3] == 0).all() and (pred.grad[..., 3:] != 0).all()
    opt = torch.optim.Adam([pred], lr=0.1)
    for _ in range(300):
        loss, m = compute_loss(pred, log_t, valid, cfg, log_target=True)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert m["mse"] < 1e-3 and m["recall"] == 1.0


def test_ranking_loss_on_a_log_target_uses_its_exponential():
    from sparsekv.teacher.losses import compute_loss

    target = _target()
    valid = torch.ones(2, 20, dtype=torch.bool)
    pred = torch.randn(2, 2, 20, generator=torch.Generator().manual_seed(2))
    a, _ = compute_loss(pred, target.log(), valid, LossConfig(), log_target=True)
    b, _ = ranking_loss(pred, target, valid, LossConfig())
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"kind": "l2"}, "kind='l2' is not supported; allowed values: ranking, mse"),
        ({"kind": "ranking", "kl_weight": 0, "topk_weight": 0}, "both 0"),
    ],
)
def test_loss_kind_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossConfig(**kwargs)
    LossConfig(kind="mse", kl_weight=0, topk_weight=0)  # unused under mse: allowed
