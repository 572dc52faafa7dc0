"""The gating head: shapes, parameter budget, errors, dtype handling."""

from __future__ import annotations

import pytest
import torch

from sparsekv.scoring.head import GatingHead


@pytest.mark.parametrize("kind", ["linear", "mlp", "kvzap"])
def test_shapes_and_parameter_count(kind):
    head = GatingHead(hidden_size=64, num_kv_heads=2, layers=[3, 1], kind=kind, hidden=16)
    assert head.layers == [1, 3] and sorted(head.heads) == ["1", "3"]
    per_layer = 64 * 2 + 2 if kind == "linear" else 64 * 16 + 16 + 16 * 2 + 2
    assert head.num_parameters() == 2 * per_layer
    h = torch.randn(3, 7, 64)
    out = head.forward_layer(3, h)
    assert out.shape == (3, 2, 7) and out.dtype == torch.float32
    both = head({1: h, 3: h})
    assert set(both) == {1, 3}
    torch.testing.assert_close(both[3], out)
    assert not torch.equal(both[1], both[3])  # independent modules per layer


def test_scores_are_per_token_and_scale_invariant():
    head = GatingHead(64, 2, [0])
    h = torch.randn(1, 5, 64)
    full = head.forward_layer(0, h)
    # each token is scored on its own: scoring a prefix gives the same logits
    torch.testing.assert_close(head.forward_layer(0, h[:, :3]), full[..., :3])
    # the input RMS norm makes the head blind to the base model's activation scale
    torch.testing.assert_close(head.forward_layer(0, 40.0 * h), full, atol=1e-5, rtol=1e-5)


def test_bf16_input_is_scored_in_float32():
    head = GatingHead(64, 2, [0])
    h = torch.randn(2, 4, 64).to(torch.bfloat16)
    out = head.forward_layer(0, h)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, head.forward_layer(0, h.float()))


def test_errors_name_the_problem():
    head = GatingHead(64, 2, [5])
    with pytest.raises(ValueError, match="no module for layer 4.*\\[5\\]"):
        head.forward_layer(4, torch.randn(1, 2, 64))
    with pytest.raises(ValueError, match="expected \\(batch, seq, 64\\)"):
        head.forward_layer(5, torch.randn(1, 2, 32))
    with pytest.raises(ValueError, match="kind='conv'.*linear, mlp"):
        GatingHead(64, 2, [0], kind="conv")
    with pytest.raises(ValueError, match="layers"):
        GatingHead(64, 2, [1, 1])
    with pytest.raises(ValueError, match="hidden=0"):
        GatingHead(64, 2, [0], hidden=0)


def test_gradients_reach_every_layer_module():
    head = GatingHead(64, 2, [0, 2])
    loss = sum(
        o.square().mean()
        for o in head({0: torch.randn(1, 3, 64), 2: torch.randn(1, 3, 64)}).values()
    )
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())


@pytest.mark.integration
def test_head_is_under_one_percent_of_the_default_model(default_model):
    from sparsekv.models.families import model_shape

    model, _ = default_model
    shape = model_shape(model)
    head = GatingHead(shape.hidden_size, shape.num_kv_heads, shape.full_layers)
    base = sum(p.numel() for p in model.parameters())
    print(
        f"gating head: {head.num_parameters():,} parameters = {head.num_parameters() / base:.4%} of {base:,}"
    )
    assert head.num_parameters() <= 0.01 * base


def test_kvzap_kind_is_kvzaps_mlp_without_a_norm():
    """Linear -> GELU -> Linear on the raw input: scaling the input changes the scores (the
    normed kinds are scale-invariant), and the output is exactly the three modules composed."""
    head = GatingHead(64, 2, [0], kind="kvzap", hidden=512)
    lin1, act, lin2 = head.heads["0"]
    assert isinstance(act, torch.nn.GELU) and lin1.out_features == 512 and lin2.in_features == 512
    h = torch.randn(1, 5, 64)
    out = head.forward_layer(0, h)
    torch.testing.assert_close(out, lin2(act(lin1(h))).transpose(1, 2))
    assert not torch.allclose(head.forward_layer(0, 3 * h), out)
    assert head.forward_layer(0, h.bfloat16()).dtype == torch.float32
