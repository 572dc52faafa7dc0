"""The context-reconstruction prompt: the one definition shared by everything that asks the
frozen model to repeat its context (KVzip's scoring pass, the reconstruction training targets).

This module owns the repeat prompt's text and how the token ids of one repeat pass are laid
out; it runs no model. KVzip (Kim et al., 2025) scores a cached entry by the attention the model
pays to it while repeating the context; the same pass, teacher-forced, is a question-free
training signal.

A context longer than `CHUNK_TOKENS` is repeated chunk by chunk: the first chunk after
`REPEAT_PROMPT`, every later chunk after `REPEAT_PROMPT_CONTINUED` followed by the last
`OVERLAP_TOKENS` tokens of the chunk before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPEAT_PROMPT = "\n\nRepeat the previous context exactly."
REPEAT_PROMPT_CONTINUED = "\n\nRepeat the part of the previous context exactly, starting with"
CHUNK_TOKENS = 2048
OVERLAP_TOKENS = 8


def chunk_bounds(n: int, chunk: int = CHUNK_TOKENS) -> list[tuple[int, int]]:
    """`[start, end)` of each repeat chunk of an `n`-token context."""
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} must be an int >= 1")
    return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def repeat_ids(
    context_ids: Sequence[int],
    encode: Callable[[str], list[int]],
    chunk: int = CHUNK_TOKENS,
    overlap: int = OVERLAP_TOKENS,
) -> list[tuple[list[int], int, int]]:
    """The inputs of the repeat passes over `context_ids`: one `(ids, start, end)` per chunk,
    where `ids` = the prompt tokens (`encode` of the prompt text, no special tokens) followed by
    `context_ids[start:end]` teacher-forced; the prompt part is `len(ids) - (end - start)` long."""
    out = []
    for k, (s, e) in enumerate(chunk_bounds(len(context_ids), chunk)):
        if k == 0:
            prompt = list(encode(REPEAT_PROMPT))
        else:
            prompt = list(encode(REPEAT_PROMPT_CONTINUED)) + list(context_ids[max(0, s - overlap) : s])
        out.append((prompt + list(context_ids[s:e]), s, e))
    return out
