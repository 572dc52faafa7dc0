"""Why kvpress's SnapKV answers " 42000." where sparsekv's answers " 42097.": the two SnapKVs
differ in how they smooth scores, and kvpress's smoothing drops single digits of a number.

Runs in the main environment (sparsekv, transformers 5.24). On a committed learned-4k prompt
(passkey-4096-0, aware protocol, budget 0.3 in the three full-attention layers of the default
model) it prefills through sparsekv's cache twice:
- `kvpress-snapkv`: kvpress 0.5.5's SnapKV formula written as a sparsekv policy: the attention of
  the last 64 prompt queries, averaged, then `avg_pool1d(kernel 5)`; the last 64 entries kept;
- `snapkv`: sparsekv's SnapKV (last 32 queries, `max_pool` over 7 entries);
then decodes greedily and prints the answer and which of the pass key's tokens layer 5 kept.

    python eval/peers/kvpress/explain_snapkv.py

Measured (2-core CPU box, 2026-11-30): kvpress-snapkv " 42000." with the digit "9" evicted in
layer 5 -- the same output and the same evicted digit as kvpress's own pipeline on that prompt
(snapkv-full at 0.3); snapkv " 42097." with every digit kept. An average over five neighbours
lets one weakly attended digit fall under the cut, and the model completes the number with
zeros; a maximum keeps a span whole. So kvpress's SnapKV rows are a weaker smoothing choice
measured correctly, not a broken run.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from sparsekv import EvictionConfig, SparseKVCache, load_default_model
from sparsekv.policies.base import Policy, ScoreContext

HERE = Path(__file__).resolve().parent


class KVPressSnapKV(Policy):
    """kvpress 0.5.5 `SnapKVPress`'s score: mean attention of the last `window` queries (over
    queries and the KV group: a constant factor from sparsekv's sum), avg-pooled over 5."""

    name = "kvpress_snapkv"
    attention_queries = "window"

    def __init__(self, window: int = 64, kernel_size: int = 5):
        self.window, self.kernel_size = window, kernel_size

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        if ctx.attention is None:
            return ctx.carry()
        b, h, n = ctx.attention.shape
        x = ctx.attention.reshape(b * h, 1, n)
        pad = self.kernel_size // 2
        return F.avg_pool1d(x, self.kernel_size, stride=1, padding=pad).reshape(b, h, n)


def main() -> None:
    torch.set_num_threads(1)
    model, tok = load_default_model()
    with gzip.open(HERE / "gate-prompts.jsonl.gz", "rt") as f:
        sample = json.loads(f.readline())  # passkey-4096-0
    ids = sample["context_ids"] + sample["question_ids"]
    digits = list(sample["answer"])
    pieces = [tok.decode([t]) for t in ids]
    start = next(i for i in range(len(ids)) if pieces[i : i + len(digits)] == digits)
    for label, policy in (("kvpress-snapkv", KVPressSnapKV()), ("snapkv", "snapkv")):
        cfg = EvictionConfig(budget=0.3, sink_tokens=0, recent_window=64, schedule="uniform")
        cache = SparseKVCache(model, cfg, policy)
        out = []
        with torch.no_grad():
            model(input_ids=torch.tensor([ids[:-1]]), cache=cache, logits_to_keep=1)
            nxt = ids[-1]
            for _ in range(7):
                logits = model(input_ids=torch.tensor([[nxt]]), cache=cache, logits_to_keep=1)
                nxt = int(logits.logits[0, -1].argmax())
                out.append(nxt)
        kept = set(cache.layers[5].positions[0, 0].tolist())
        span = range(start, start + len(digits))
        print(
            f"{label:<15} answer {tok.decode(out)!r:<14} (true {sample['answer']}); layer 5 keeps "
            + " ".join(f"{tok.decode([ids[i]])!r}:{'y' if i in kept else 'n'}" for i in span)
        )
        cache.close()


if __name__ == "__main__":
    main()
