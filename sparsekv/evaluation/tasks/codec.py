"""Text <-> token ids for the harness: a thin wrapper over a Hugging Face tokenizer, plus an
ASCII codec for the tiny random test models (vocabulary 128, one token per character).

Tasks count lengths and build prompts through a `Codec`, so they never depend on a particular
tokenizer library. Prompts are always `bos_ids + encode(context)` followed by
`encode(question)`: the same ids in both protocols.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Codec(Protocol):
    name: str
    bos_ids: list[int]
    eos_ids: frozenset[int]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` without special tokens."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens dropped."""


class HFCodec:
    """A Hugging Face tokenizer seen as a `Codec`."""

    def __init__(self, tokenizer, eos_ids: Sequence[int] = (), name: str | None = None):
        self.tokenizer = tokenizer
        self.name = name or getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        bos = tokenizer.bos_token_id
        self.bos_ids = [bos] if bos is not None else []
        eos = set(eos_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


class AsciiCodec:
    """One token per ASCII character (ids 3..127); ids 0, 1, 2 are pad, bos, eos.

    Characters outside 3..127 (control characters) become '?'. Meant for tiny random models in
    tests: lengths in tokens equal lengths in characters.
    """

    name = "ascii"

    def __init__(self, vocab_size: int = 128):
        if vocab_size < 128:
            raise ValueError(f"vocab_size={vocab_size} must be >= 128 for the ASCII codec")
        self.bos_ids = [1]
        self.eos_ids = frozenset({2})

    def encode(self, text: str) -> list[int]:
        q = ord("?")
        return [c if 3 <= c < 128 else q for c in (ord(ch) for ch in text)]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in ids if 3 <= i < 128)
