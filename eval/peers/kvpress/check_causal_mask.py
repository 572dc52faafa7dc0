"""Why the peer run feeds multi-token inputs one token at a time when only the full-attention
layers are compressed: a check, in the peer environment, that transformers 5.2 (what kvpress
accepts) builds a non-causal mask for a multi-token forward over such a cache, while one token at
a time is exact. A tiny random Gemma 3 (3 sliding layers, window 32, 1 full layer): prefill 64
tokens, keep every second entry of the full layer, then feed 5 tokens at once and one by one.

    eval/peers/kvpress/.venv/bin/python eval/peers/kvpress/check_causal_mask.py

Measured (transformers 5.2.0): positions 0-3 differ by 2e-2 .. 5e-3 in the logits (they saw the
tokens after them); the last position agrees to 2e-7. With transformers 5.24 all agree to 3e-7.
"""

import torch
from transformers import AutoModelForCausalLM, DynamicCache, Gemma3TextConfig

cfg = Gemma3TextConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=8192,
    sliding_window=32,
    layer_types=["sliding_attention"] * 3 + ["full_attention"],
)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
g = torch.Generator().manual_seed(1)
ctx = torch.randint(0, 128, (1, 64), generator=g)
q = torch.randint(0, 128, (1, 5), generator=g)


def prefill():
    c = DynamicCache(config=model.config)
    with torch.no_grad():
        model.model(input_ids=ctx, past_key_values=c)
    L = c.layers[3]
    keep = torch.arange(0, 64, 2)
    L.keys, L.values = L.keys[:, :, keep], L.values[:, :, keep]
    return c


c1 = prefill()
with torch.no_grad():
    one = model(input_ids=q, past_key_values=c1, position_ids=torch.arange(64, 69)[None]).logits[0]
c2 = prefill()
steps = []
with torch.no_grad():
    for i in range(5):
        steps.append(
            model(
                input_ids=q[:, i : i + 1], past_key_values=c2, position_ids=torch.tensor([[64 + i]])
            ).logits[0, -1]
        )
steps = torch.stack(steps)
import transformers  # noqa: E402

print(
    transformers.__version__,
    "per position max |logit diff|, one forward vs one token at a time:",
    [(one[i] - steps[i]).abs().max().item() for i in range(5)],
)
