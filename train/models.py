"""The frozen base model of a training run: a thin wrapper over the shared loader
(`sparsekv.models.loading`), plus the byte-level tokenizer tiny random models train with.

`load_model` turns `TrainConfig.model` into `(model, tokenizer, base_model_id)`: "default" is
gemma-3-270m (offline), "tiny:<family>" a 4-layer random model built in-process from the seed
(with a `ByteTokenizer`, so no download is ever needed), anything else an HF folder or Hub id.
It knows nothing about heads, data or optimization.
"""

from __future__ import annotations

import torch

from sparsekv.models.loading import load_model as _load


class ByteTokenizer:
    """UTF-8 bytes folded into a small vocabulary: ids 0/1/2 are pad/bos/eos, text uses 3..vocab-1.

    Lossy (bytes share ids when the vocabulary is smaller than 259) but deterministic and
    offline: all a tiny random model needs. Called like an HF tokenizer on a list of texts.
    """

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __init__(self, vocab_size: int):
        if vocab_size < 4:
            raise ValueError(f"vocab_size={vocab_size!r} must be >= 4")
        self.vocab_size = vocab_size

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> dict:
        span = self.vocab_size - 3
        ids = [[3 + b % span for b in t.encode("utf-8")] for t in texts]
        if add_special_tokens:
            ids = [[self.bos_token_id, *x] for x in ids]
        return {"input_ids": ids}


def load_model(
    spec: str,
    dtype: str = "float32",
    attn_implementation: str = "sdpa",
    seed: int = 0,
    device: str | torch.device = "cpu",
):
    """`(model, tokenizer, base_model_id)` for a `TrainConfig.model` spec, frozen, in eval mode
    (`sparsekv.models.loading.load_model`; Hub ids allowed). Tiny models get a `ByteTokenizer`."""
    loaded = _load(spec, dtype, attn_implementation, seed=seed, device=device, hub=True)
    tok = ByteTokenizer(loaded.model.config.vocab_size) if loaded.is_tiny else loaded.tokenizer
    return loaded.model, tok, loaded.base_model_id
