"""Reconstruction targets and KVzip+ against slow references built from eager float64 attention."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from sparsekv.models.families import attention_modules, model_shape
from sparsekv.teacher.reconstruction import (
    kvzip_plus_received,
    reconstruction_layout,
    training_targets,
)
from sparsekv.teacher.statistics import TargetConfig, cumulative_targets, teacher_targets

PROMPT = [5, 9, 17, 33]  # stands for the tokenized REPEAT_PROMPT
BOS = 1  # the tiny models' bos_token_id


def _batch():
    """Two rows: one full, one right-padded; both open with BOS."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (2, 40), generator=g)
    ids[:, 0] = BOS
    mask = torch.ones_like(ids)
    mask[1, -11:] = 0
    ids[1, -11:] = 0
    return ids, mask


def _eager(model, ids):
    """Attention probabilities `(1, heads, L, L)` and self_attn inputs / values per layer, float64."""
    hidden = {}

    def hook(i):
        def fn(module, args, kwargs):
            hidden[i] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

        return fn

    mods = attention_modules(model)
    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(mods)]
    try:
        out = model(input_ids=torch.tensor([ids]), output_attentions=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return out.attentions, hidden


def _reference_stat(probs, kv_heads, rows, m, stat, normalize):
    """Reduce `probs` `(1, heads, L, L)` over query `rows` for the first `m` keys."""
    b, heads, L, _ = probs.shape
    a = probs.view(b, kv_heads, heads // kv_heads, L, L).sum(2)[:, :, rows, :m]
    if stat == "max":
        return a.amax(-2)
    r = a.sum(-2)
    return r / len(rows) if normalize == "length" else r


def _questions_reference(model64, context, target, layer_types, layers):
    """The questions target of a plain forward over `context` alone (exclude_self, causal)."""
    probs, _ = _eager(model64, context)
    shape = model_shape(model64)
    m = len(context)
    pos = torch.arange(m)
    received = {}
    for layer, p in enumerate(probs):
        allowed = pos[None, :] <= pos[:, None]
        if layer_types[layer] == "sliding_attention":
            allowed &= pos[None, :] > pos[:, None] - shape.sliding_window
        counted = allowed & ~torch.eye(m, dtype=torch.bool)
        a = p.view(1, shape.num_kv_heads, -1, m, m).sum(2) * counted
        if target.stat == "max":
            received[layer] = a.amax(-2).float()
        else:
            c = counted.sum(-2).double()
            received[layer] = torch.where(c > 0, a.sum(-2) / c.clamp_min(1), 0.0).float()
    return cumulative_targets(received, layers, target, layer_types)


# layer 0 full with sliding layers 1-2 after it: "all" sources mix sliding layers into the
# questions part of "both" and are left out of the reconstruction part
MIXED = {
    "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
}


def _model(family: str, impl: str):
    if family == "gemma3-mixed":
        return tiny_model("gemma3", impl, **MIXED)
    return tiny_model(family, impl)


@pytest.mark.parametrize("family", ["llama", "gemma3", "gemma3-mixed"])
@pytest.mark.parametrize(
    "signal,stat,normalize",
    [
        ("reconstruction", "max", "none"),
        ("reconstruction", "mass", "length"),
        ("both", "max", "length"),
        ("both", "mass", "length"),
        ("questions", "max", "length"),
    ],
)
def test_reconstruction_targets_equal_slow_reference(family, signal, stat, normalize):
    model = _model(family, "sdpa")
    model64 = _model(family, "eager").double()
    shape = model_shape(model)
    types = shape.layer_types
    layers = shape.full_layers
    target = TargetConfig(
        stat=stat,
        normalize=normalize,
        signal=signal,
        source_layers="all",
        reconstruction_weight=0.3,
    )
    ids, mask = _batch()
    targets, hidden = training_targets(
        model, ids, mask, target, layers, block_size=7, repeat_prompt_ids=PROMPT
    )
    if signal == "questions":  # the existing teacher, unchanged
        ref_t, _ = teacher_targets(model, ids, mask, target, layers, block_size=7)
        for i in layers:
            torch.testing.assert_close(targets[i], ref_t[i])
        return
    for row in range(2):
        context = ids[row][mask[row].bool()].tolist()
        m = len(context)
        full, cs = reconstruction_layout(context, PROMPT, BOS)
        assert full[cs:] == context[1:] and full[m:cs] == PROMPT
        probs, h64 = _eager(model64, full)
        received = {
            i: _reference_stat(
                probs[i], shape.num_kv_heads, range(cs, len(full)), m, stat, normalize
            ).float()
            for i in shape.full_layers
        }
        ref = cumulative_targets(received, layers, target, types, full_only=True)
        if signal == "both":
            q = _questions_reference(model64, context, target, types, layers)
            ref = {i: 0.7 * q[i] + 0.3 * ref[i] for i in layers}
        for i in layers:
            got = targets[i][row]
            assert got.shape == (shape.num_kv_heads, ids.shape[1])
            torch.testing.assert_close(got[:, :m], ref[i][0], atol=1e-5, rtol=1e-4)
            assert (got[:, m:] == 0).all()  # padding
            torch.testing.assert_close(got[:, :m].sum(-1), torch.ones(shape.num_kv_heads))
            # the head's inputs are those of the context positions of the same pass
            torch.testing.assert_close(
                hidden[i][row, :m], h64[i][0, :m].float(), atol=1e-4, rtol=1e-4
            )


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3"])
def test_kvzip_plus_equals_its_formula(family):
    model = tiny_model(family, "sdpa")
    model64 = tiny_model(family, "eager").double()
    shape = model_shape(model)
    layers = shape.full_layers
    target = TargetConfig(signal="reconstruction", kind="kvzip_plus")
    ids, mask = _batch()
    targets, _ = training_targets(model, ids, mask, target, layers, 5, repeat_prompt_ids=PROMPT)
    mods = attention_modules(model64)
    for row in range(2):
        context = ids[row][mask[row].bool()].tolist()
        m = len(context)
        full, cs = reconstruction_layout(context, PROMPT, BOS)
        probs, h64 = _eager(model64, full)
        for i in layers:
            mod = mods[i]
            h = h64[i][0]  # (L, hidden)
            d = mod.head_dim
            v = mod.v_proj(h).view(len(full), shape.num_kv_heads, d)  # (L, kv, d); no v_norm here
            heads = probs[i].shape[1]
            g = heads // shape.num_kv_heads
            wo = mod.o_proj.weight  # (hidden, heads * d)
            ref = torch.empty(shape.num_kv_heads, m, dtype=torch.float64)
            for kv in range(shape.num_kv_heads):
                best = torch.zeros(m, dtype=torch.float64)
                for hh in range(kv * g, (kv + 1) * g):
                    wov = (v[:m, kv] @ wo[:, hh * d : (hh + 1) * d].T).norm(dim=-1)  # (m,)
                    for j in range(cs, len(full)):
                        s = probs[i][0, hh, j, :m] * wov / h[j].norm()
                        best = torch.maximum(best, s)
                ref[kv] = best.log()
            got = targets[i][row]
            torch.testing.assert_close(got[:, :m].double(), ref, atol=1e-4, rtol=1e-5)
            assert (got[:, m:] == 0).all()


def test_kvzip_plus_block_size_and_softcap():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 9, 8, generator=gen)
    k = torch.randn(1, 2, 20, 8, generator=gen)
    v = torch.randn(1, 2, 20, 8, generator=gen)
    h = torch.randn(1, 9, 12, generator=gen)
    w = torch.randn(12, 32, generator=gen)
    kw = {"scaling": 0.4, "softcap": 3.0, "num_kv_groups": 2}
    a = kvzip_plus_received(q, k, v, h, w, block_size=2, **kw)
    b = kvzip_plus_received(q, k, v, h, w, block_size=100, **kw)
    torch.testing.assert_close(a, b)
    assert a.shape == (1, 2, 20) and (a > 0).all()


def test_training_targets_validation():
    model = tiny_model("gemma3", "sdpa")
    ids, mask = _batch()
    with pytest.raises(ValueError, match="repeat_prompt_ids"):
        training_targets(model, ids, mask, TargetConfig(signal="reconstruction"))
    with pytest.raises(ValueError, match="slide"):
        training_targets(
            model, ids, mask, TargetConfig(signal="both"), [0, 3], repeat_prompt_ids=PROMPT
        )
    with pytest.raises(ValueError, match="training_targets"):
        teacher_targets(model, ids, mask, TargetConfig(signal="reconstruction"))
    with pytest.raises(ValueError, match="nothing to reconstruct"):
        reconstruction_layout([BOS], PROMPT, BOS)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"signal": "repeat"}, "signal='repeat' is not supported; allowed values: questions"),
        ({"kind": "kvzap"}, "kind='kvzap' is not supported; allowed values: attention, kvzip_plus"),
        ({"kind": "kvzip_plus"}, "needs signal='reconstruction'"),
        ({"kind": "kvzip_plus", "signal": "both"}, "needs signal='reconstruction'"),
        ({"signal": "both", "reconstruction_weight": 1.5}, "reconstruction_weight=1.5"),
    ],
)
def test_target_signal_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TargetConfig(**kwargs)


def test_target_config_round_trip_and_describe():
    t = TargetConfig(signal="both", reconstruction_weight=0.25, stat="max")
    assert TargetConfig.from_dict(t.to_dict()) == t
    assert "0.25 x a repeat of the context" in t.describe()
    k = TargetConfig(signal="reconstruction", kind="kvzip_plus")
    assert k.log_scale and not t.log_scale
    assert "KVzip+" in k.describe()
