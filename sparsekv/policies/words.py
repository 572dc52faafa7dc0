"""Where words begin, from a tokenizer's vocabulary: the table the learned policy's `span_words`
setting reads to keep or drop a word (a number of digit tokens, a UUID, a long name) whole.

A word is what sits between two spaces or line breaks of the text. A tokenizer marks the space
before a word on the word's first piece: SentencePiece with "▁" (Gemma, Llama), byte-level BPE
with "Ġ" (GPT-2, Qwen). `word_table` classes every vocabulary id once:

- `CONTINUES` (0): a piece inside a word ("e", "2", "-", a trailing ".");
- `BEGINS` (1): a piece that starts a word (it carries the space marker);
- `BREAKS` (2): a line break, tab, special token or raw byte: it is a word of its own, and the
  piece after it begins a new word even without a space marker.

`word_starts(ids, table)` turns token ids `(batch, n)` into a boolean `(batch, n)`, True where a
word begins. Ids outside the table (an embedding larger than the tokenizer) count as breaks.
Only the tokenizer's vocabulary is read; nothing here knows models or caches.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BEGINS", "BREAKS", "CONTINUES", "check_tokenizer", "word_starts", "word_table"]

CONTINUES, BEGINS, BREAKS = 0, 1, 2


def check_tokenizer(tokenizer: Any) -> Any:
    """`tokenizer` if it can list its vocabulary, else a ValueError naming the argument."""
    for name in ("convert_ids_to_tokens", "__len__"):
        if not hasattr(tokenizer, name):
            raise ValueError(
                f"tokenizer={type(tokenizer).__name__} has no {name}: pass a transformers tokenizer"
            )
    return tokenizer


def word_table(tokenizer: Any) -> torch.Tensor:
    """`(vocab,)` int8: the class of every id of `tokenizer` (anything with `__len__`,
    `convert_ids_to_tokens` and `all_special_ids`, as a transformers tokenizer has)."""
    check_tokenizer(tokenizer)
    n = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    # the space marker this vocabulary uses: whichever of the two starts more pieces
    sp = sum(1 for p in pieces if isinstance(p, str) and p.startswith("▁"))
    bpe = sum(1 for p in pieces if isinstance(p, str) and p.startswith("Ġ"))
    if sp == 0 and bpe == 0:
        raise ValueError(
            f"tokenizer={type(tokenizer).__name__}: no piece of its vocabulary starts with a space "
            "marker ('▁' or 'Ġ'), so word boundaries cannot be read from it"
        )
    marker, newline = ("▁", ("\n", "\r", "\t")) if sp >= bpe else ("Ġ", ("Ċ", "č", "ĉ"))
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    table = torch.zeros(n, dtype=torch.int8)
    for i, p in enumerate(pieces):
        raw = not isinstance(p, str) or not p or (p.startswith("<0x") and p.endswith(">"))
        if raw or i in special or any(c in p for c in newline):
            table[i] = BREAKS
        elif p.startswith(marker):
            table[i] = BEGINS
    return table


def word_starts(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """`(batch, n)` bool, True where a word begins: at a piece that begins one, at a break, after
    a break, and at the first token. `ids` `(batch, n)` token ids, `table` from `word_table`."""
    if ids.dim() != 2:
        raise ValueError(f"ids of shape {tuple(ids.shape)} must be (batch, n)")
    table = table.to(ids.device)
    inside = (ids >= 0) & (ids < table.numel())
    kind = torch.where(inside, table[ids.clamp(0, table.numel() - 1)].long(), BREAKS)
    starts = kind != CONTINUES
    after_break = torch.zeros_like(starts)
    after_break[:, 1:] = kind[:, :-1] == BREAKS
    starts = starts | after_break
    starts[:, :1] = True
    return starts
