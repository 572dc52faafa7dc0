"""The compress side of serving in vLLM, in sparsekv's own environment (no vLLM needed): a
per-layer schedule becomes one K per request (the largest layer's budget rounded up to a block),
every budgeted layer keeping its own top K, which the vLLM-side reader of the saved context
(`sparsekv.serving.vllm.context`, torch + safetensors only) then serves; a context compressed
with the pyramid itself is refused there, naming the way to compress for vLLM."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_model

from sparsekv import EvictionConfig, compress
from sparsekv.cache.schedules import layer_capacity, layer_fractions
from sparsekv.models.families import model_shape
from sparsekv.serving.vllm import compress_for_vllm, slots_for_vllm
from sparsekv.serving.vllm.context import SavedContext

SMALL = {"sink_tokens": 2, "recent_window": 8, "rerank_every": 4, "evict_slack": 2}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_pyramid_is_served_as_one_k_per_request(tmp_path, family):
    model = tiny_model(family).eval()
    ids = torch.randint(3, 120, (1, 300), generator=torch.Generator().manual_seed(0))
    cfg = EvictionConfig(budget=0.3, schedule="pyramid", **SMALL)
    nb = len(model_shape(model).full_layers)
    most = max(layer_capacity(cfg, f, 300) for f in layer_fractions(cfg, nb))
    k = slots_for_vllm(model, cfg, 300, block_size=16)
    assert k == math.ceil(most / 16) * 16 and k % 16 == 0 and most <= k < most + 16
    with pytest.warns(UserWarning, match=rf"every budgeted layer keeps K = {k} of the 300"):
        ctx = compress_for_vllm(model, ids, cfg, "snapkv", block_size=16)
    served = SavedContext(ctx.save(tmp_path / "for-vllm"))
    assert served.num_slots == k and served.position_offset == 300 - k
    kept = [m["kept"] for m in served.meta["layers"] if m.get("kind") == "evicting"]
    assert kept and set(kept) == {k}
    # the pyramid's own context keeps fewer in its deepest layer: vLLM refuses it by name
    own = compress(model, ids, cfg, "snapkv").save(tmp_path / "pyramid")
    if nb > 1:  # (the tiny Gemma 3 has one full-attention layer: its pyramid is one layer)
        with pytest.raises(ValueError, match="compress_for_vllm"):
            SavedContext(own)


def test_k_is_capped_by_the_context_and_the_block_is_checked():
    model = tiny_model("llama")
    cfg = EvictionConfig(budget=0.9, **SMALL)
    assert slots_for_vllm(model, cfg, 100, block_size=128) == 100  # one partial block
    with pytest.raises(ValueError, match="block_size=0 must be an int >= 1"):
        slots_for_vllm(model, cfg, 100, block_size=0)
