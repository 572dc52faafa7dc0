"""eval/kept_spans.py: the needle's tokens are located from the tokenizer's offsets, and a prompt
whose ids the offsets do not reproduce is skipped rather than misread."""

from __future__ import annotations

from types import SimpleNamespace

from eval import kept_spans


class CharTokenizer:
    """One token per character, id = code point (BOS is passed separately)."""

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        return SimpleNamespace(
            input_ids=[ord(c) for c in text], offset_mapping=[(i, i + 1) for i in range(len(text))]
        )


def prompt(context, answer, **meta):
    return {
        "context": context,
        "context_ids": [1] + [ord(c) for c in context],
        "answer": answer,
        "metadata": meta,
    }


def test_a_value_is_located_after_bos():
    p = prompt("abc 73865 def", "73865")
    pos = kept_spans.needle_positions(CharTokenizer(), p, bos=1)
    assert pos == list(range(5, 10))  # characters 4..8, shifted by the BOS
    assert "".join(chr(p["context_ids"][i]) for i in pos) == "73865"


def test_qa_reads_the_sentence_up_to_the_end_of_its_answer():
    s = "Cue words come first and then the answer words follow here."
    p = prompt("Some prose. " + s + " More prose.", "then the answer", sentence=s)
    pos = kept_spans.needle_positions(CharTokenizer(), p, bos=1)
    text = "".join(chr(p["context_ids"][i]) for i in pos)
    assert text == "Cue words come first and then the answer"


def test_a_missing_needle_or_other_ids_give_nothing():
    tok = CharTokenizer()
    assert kept_spans.needle_positions(tok, prompt("abc def", "xyz"), bos=1) == []
    p = prompt("abc 123 def", "123")
    p["context_ids"][3] += 1  # the offsets no longer reproduce the prompt's ids
    assert kept_spans.needle_positions(tok, p, bos=1) == []
