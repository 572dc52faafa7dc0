"""The language-model task families: perplexity and KL over a held-out continuation (ppl),
next-token accuracy in an unrelated passage (nexttok), free generation compared with the full
cache's output (gen). No question: only the agnostic protocol applies."""

from __future__ import annotations

from sparsekv.evaluation.tasks.base import TASKS, Sample, chars_for, fit, prose_filler, register
from sparsekv.evaluation.tasks.text import join_sentences


def _continuation(rng, codec, length, target_tokens, far: bool):
    """(context, context_ids, target_ids): prose fitted to `length - target_tokens`, then
    `target_tokens` tokens of either the same text continued or (far) an unrelated passage."""
    if target_tokens < 2 or target_tokens >= length // 2:
        raise ValueError(f"target_tokens={target_tokens} must be in [2, length/2)")
    filler = prose_filler(rng, chars_for(length))
    ctx, cids, _, (n, k) = fit(codec, filler, [], "", length - target_tokens)
    if far:  # an unrelated passage from elsewhere in the corpus
        nxt = prose_filler(rng, 6 * target_tokens + 200, avoid=None)
    elif k:  # the same text, continued from the middle of the sentence where the context stops
        nxt = [(" ".join(filler[n][0].split()[k:]), False)] + filler[n + 1 :]
    else:  # the same text, continued (the filler always extends well past what fits)
        nxt = filler[n:]
    cont = ("\n\n" if nxt[0][1] else " ") + join_sentences(nxt)
    target = codec.encode(cont)[:target_tokens]
    if len(target) < target_tokens:
        raise ValueError(f"not enough prose for a {target_tokens}-token continuation")
    return ctx, cids, target


@register("ppl", "continuation", max_new_tokens=0, metric="perplexity", protocols=("agnostic",),
           target_tokens=64)
def _ppl(rng, codec, length, index, seed, target_tokens: int = 64) -> Sample:
    """A long real text; its next `target_tokens` tokens are teacher-forced after the prefix is
    compressed: perplexity and mean KL from the full cache over the continuation."""
    ctx, cids, target = _continuation(rng, codec, length, target_tokens, far=False)
    return Sample("ppl", f"ppl-{length}-{index}", "continuation", ctx, "", codec.decode(target),
                  cids, [], target_ids=target)


@register("nexttok", "continuation", max_new_tokens=0, metric="top1", protocols=("agnostic",),
           target_tokens=48)
def _nexttok(rng, codec, length, index, seed, target_tokens: int = 48) -> Sample:
    """A long real text, then a short unrelated real passage: top-1 next-token accuracy inside
    the passage (its own few tokens are the only context that matters)."""
    ctx, cids, target = _continuation(rng, codec, length, target_tokens, far=True)
    return Sample("nexttok", f"nexttok-{length}-{index}", "continuation", ctx, "",
                  codec.decode(target), cids, [], target_ids=target)


@register("gen", "generate", max_new_tokens=48, metric="agreement", protocols=("agnostic",))
def _gen(rng, codec, length, index, seed) -> Sample:
    """A long real text, then free greedy generation: token agreement with the full cache's
    output and repetition rate."""
    filler = prose_filler(rng, chars_for(length))
    ctx, cids, _, _ = fit(codec, filler, [], "", length - TASKS["gen"].max_new_tokens)
    return Sample("gen", f"gen-{length}-{index}", "generate", ctx, "", None, cids, [])
