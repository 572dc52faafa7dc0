"""KVzip (Kim et al., 2025): query-agnostic scores from how much the model attends to each cached
entry while it repeats its context.

The policy only scores. Its `scores_after_prefill` tells the cache to hold back eviction during
a prefill; when the prefill forward returns, `sparsekv.policies.repeat_pass` runs one extra forward per
chunk of <= 2,048 prefilled tokens over the repeat prompt (`sparsekv.policies.reconstruction`) and hands
each budgeted layer, in `ctx.attention` `(batch, kv_heads, seq)`, the maximum attention the
repeat paid to each new entry (softmax over the sinks, the chunk and the repeat itself; maximum
over the query heads of the KV group and the repeat queries). That maximum is the score. Under
the query-aware protocol the prefill is the whole prompt, so the repeat covers the question too.
The sinks in that softmax are the cache's `sink_tokens` first real tokens (kvpress: 4, the
cache's default). The repeat input is the prompt text then the chunk, with no chat-turn markers
(sparsekv's default model is a base model; kvpress appends a newline there instead).

Eviction is top-k per layer and KV head (KVzip's "uniform" variant; the original thresholds
globally across layers and heads). A later multi-token forward (a question appended to a
compressed context) is repeated the same way over its own tokens; older entries keep their
scores. Tokens generated one at a time cannot be repeated: each enters with the highest score
its head holds, so the newest tokens are kept before context the repeat found unimportant (they
are inside the protected recent window at first anyway).

It needs the whole uncompressed context during the repeat: `prefill_chunk` is refused by the
cache, and `SparseKVCache.fork` of a recorded full prefill runs the repeat on the fork before
evicting (once per recorded prefill: later forks with the same `repeat_key`, e.g. the other
budgets, reuse its attention). The repeat prompt's text becomes ids through the model's tokenizer: pass
`tokenizer=` (a Hugging Face tokenizer) or `encode=` (any `str -> list[int]` without special
tokens, e.g. the evaluation codec's `encode`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sparsekv.policies.base import Policy, ScoreContext, register
from sparsekv.policies.reconstruction import CHUNK_TOKENS, OVERLAP_TOKENS, repeat_ids


@register("kvzip")
class KVzipPolicy(Policy):
    """KVzip: the attention an entry receives while the model repeats the context."""

    scores_after_prefill = True

    def __init__(
        self,
        tokenizer=None,
        encode: Callable[[str], list[int]] | None = None,
        chunk: int = CHUNK_TOKENS,
        overlap: int = OVERLAP_TOKENS,
    ):
        """`tokenizer`: a Hugging Face tokenizer (or an evaluation `Codec`); `encode`: text -> ids
        without special tokens;
        exactly one of the two. `chunk`: context tokens repeated per forward; `overlap`: tokens
        of the previous chunk quoted in the prompt of the next."""
        if (tokenizer is None) == (encode is None):
            raise ValueError(
                "policy 'kvzip' turns its repeat prompt into token ids: pass exactly one of "
                "tokenizer=<Hugging Face tokenizer> or encode=<callable str -> list[int]>"
            )
        if encode is None:
            if not callable(getattr(tokenizer, "encode", None)):
                raise ValueError(f"tokenizer={tokenizer!r} has no encode(); pass encode= instead")
            encode = _hf_encode(tokenizer)
        elif not callable(encode):
            raise ValueError(f"encode={encode!r} must be a callable str -> list[int]")
        for name, v, low in (("chunk", chunk, 1), ("overlap", overlap, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name}={v!r} must be an int >= {low}")
        if overlap >= chunk:
            raise ValueError(
                f"overlap={overlap} must be less than chunk={chunk}: each repeat forward quotes "
                "`overlap` tokens of the previous chunk before its own `chunk` tokens"
            )
        self.encode, self.chunk, self.overlap = encode, chunk, overlap

    def repeat_inputs(self, ids: Sequence[int]) -> list[tuple[list[int], int, int]]:
        """The repeat forwards over the prefilled `ids`: `(input ids, start, end)` per chunk."""
        return repeat_ids(ids, self.encode, self.chunk, self.overlap)

    def repeat_key(self) -> tuple:
        """The repeat depends on the prompt's ids (`encode`) and the chunk layout only."""
        return ("kvzip", self.encode, self.chunk, self.overlap)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        out = ctx.carry()
        n = out.shape[-1]
        if not ctx.num_new:  # a re-rank: the repeat's scores stand
            return out
        if ctx.phase == "prefill" and ctx.attention is not None:
            out[..., n - ctx.num_new :] = ctx.attention[..., n - ctx.num_new :].to(out.dtype)
            return out
        old = out[..., : n - ctx.num_new]  # a decode token: the highest score of its head
        top = old.amax(dim=-1, keepdim=True) if old.shape[-1] else out.new_ones(out.shape[:-1] + (1,))
        out[..., n - ctx.num_new :] = top
        return out

    def __repr__(self) -> str:
        return f"KVzipPolicy(chunk={self.chunk}, overlap={self.overlap})"


def _hf_encode(tokenizer) -> Callable[[str], list[int]]:
    """`tokenizer.encode` without special tokens (a Hugging Face tokenizer adds them unless told
    not to; a `sparsekv.evaluation.tasks.codec.Codec` never does)."""
    import inspect

    if "add_special_tokens" not in inspect.signature(tokenizer.encode).parameters:
        return tokenizer.encode

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    return encode
