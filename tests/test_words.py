"""Words kept whole (`span_words`): the vocabulary table, word starts, the closing of scores over a
word, and the learned policy applying it through the cache on a tiny model."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from sparsekv import EvictionConfig, SparseKVCache, policies
from sparsekv.policies.base import close_words
from sparsekv.policies.words import BEGINS, BREAKS, CONTINUES, word_starts, word_table


class PieceTokenizer:
    """A stand-in tokenizer: 128 pieces, every 4th one begins a word (SentencePiece's '▁'),
    id 1 is a line break, id 0 special."""

    all_special_ids = (0,)

    def __init__(self, marker: str = "▁", newline: str = "\n", n: int = 128):
        self.pieces = [
            "<pad>" if i == 0 else newline if i == 1 else f"{marker}w{i}" if i % 4 == 0 else f"x{i}"
            for i in range(n)
        ]

    def __len__(self) -> int:
        return len(self.pieces)

    def convert_ids_to_tokens(self, ids):
        return [self.pieces[i] for i in ids]


def test_word_table_reads_both_space_markers_and_marks_breaks():
    for marker, newline in (("▁", "\n"), ("Ġ", "Ċ")):
        table = word_table(PieceTokenizer(marker, newline))
        assert table.dtype == torch.int8 and table.shape == (128,)
        assert table[0] == BREAKS and table[1] == BREAKS  # special, line break
        assert table[4] == BEGINS and table[8] == BEGINS and table[5] == CONTINUES
    with pytest.raises(ValueError, match="space marker"):
        word_table(PieceTokenizer(marker="#"))
    with pytest.raises(ValueError, match="tokenizer"):
        word_table(object())


def test_word_starts_begin_at_markers_breaks_after_breaks_and_the_first_token():
    table = word_table(PieceTokenizer())
    ids = torch.tensor([[5, 6, 4, 5, 6, 1, 7, 8, 999, 9]])
    #                    c  c  B  c  c  br c  B  out c
    expected = [True, False, True, False, False, True, True, True, True, True]
    assert word_starts(ids, table)[0].tolist() == expected
    with pytest.raises(ValueError, match="batch"):
        word_starts(ids[0], table)


def test_close_words_raises_each_word_to_its_best_and_leaves_long_words():
    x = torch.tensor([[[0.0, 3.0, 1.0, 0.5, 2.0, 0.0, 0.0, 0.0, 0.0, 7.0]]])
    starts = torch.tensor([[True, False, False, True, True, False, False, False, False, False]])
    # words: 0-2 (best 3), 3 (alone), 4-9 (6 tokens, best 7)
    assert close_words(x, starts, 6)[0, 0].tolist() == [3, 3, 3, 0.5, 7, 7, 7, 7, 7, 7]
    # longest 5: the 6-token word keeps its own scores
    assert close_words(x, starts, 5)[0, 0].tolist() == [3, 3, 3, 0.5, 2, 0, 0, 0, 0, 7]
    assert torch.equal(close_words(x, starts, 0), x)
    # batch rows have their own words, heads share them; -inf only where the whole word is -inf
    y = torch.tensor([[[1.0, 0.0, float("-inf")], [0.0, 2.0, 0.0]], [[1.0, 0.0, 5.0], [0.0, 0.0, 0.0]]])
    s = torch.tensor([[True, False, True], [True, True, False]])
    assert close_words(y, s, 4).tolist() == [
        [[1.0, 1.0, float("-inf")], [2.0, 2.0, 0.0]],
        [[1.0, 5.0, 5.0], [0.0, 0.0, 0.0]],
    ]


class Flagged:
    """A head that ranks the tokens at `flagged` positions of a prefill highest."""

    def __init__(self, flagged, kv_heads=2):
        self.flagged, self.kv_heads = flagged, kv_heads

    def score_layer(self, layer_idx, hidden_states):
        b, n, _ = hidden_states.shape
        out = torch.linspace(0, 0.5, n).expand(b, self.kv_heads, n).clone()
        if n > 1:
            out[..., self.flagged] = 10.0
        return out


def _kept(model, policy, ids, budget=16, **kw):
    cfg = EvictionConfig(budget=budget, sink_tokens=0, recent_window=0, **kw)
    with SparseKVCache(model, cfg, policy) as cache:
        model(input_ids=ids, cache=cache)
        return [set(cache.layers[i].positions[0, 0].tolist()) for i in range(4)]


def test_learned_span_words_keeps_a_flagged_word_whole_through_the_cache():
    model = tiny_model("llama")
    tok = PieceTokenizer()
    # 64 tokens: a word begins every 8 tokens except one 12-token word at 20-31 (a UUID, say)
    ids = torch.tensor([[4 if i % 8 == 0 and not 20 < i < 32 else 5 for i in range(64)]])
    ids[0, 20] = 4
    uuid = set(range(20, 32))
    head = Flagged([25])  # the head flags one token inside it
    plain = _kept(model, policies.get("learned", adapter=head), ids)
    whole = _kept(model, policies.get("learned", adapter=head, span_words=16, tokenizer=tok), ids)
    assert all(not uuid <= kept for kept in plain)
    assert all(uuid <= kept for kept in whole)
    # a word longer than span_words is left as the head scored it (the 8-token words are closed)
    short = _kept(model, policies.get("learned", adapter=head, span_words=8, tokenizer=tok), ids)
    assert all(not uuid <= kept and 25 in kept for kept in short)
    # a fork of a recorded prefill closes the same words as the live prefill
    base = SparseKVCache(model, EvictionConfig(budget=1.0), "full", record=("window",))
    model(input_ids=ids, cache=base)
    pol = policies.get("learned", adapter=head, span_words=16, tokenizer=tok)
    forked = base.fork(EvictionConfig(budget=16, sink_tokens=0, recent_window=0), pol)
    assert [set(forked.layers[i].positions[0, 0].tolist()) for i in range(4)] == whole
    for c in (base, forked):
        c.close()
    # chunked prefill: each chunk's words are closed with the ids of that chunk; the head flags
    # index 25 of each 32-token chunk: the words 20-31 and 56-63 fill the budget of 20
    chunked = _kept(
        model, policies.get("learned", adapter=head, span_words=16, tokenizer=tok), ids,
        budget=20, prefill_chunk=32,
    )
    assert chunked == [uuid | set(range(56, 64))] * 4


def test_span_words_errors_name_the_setting():
    head = Flagged([3])
    for bad in (-1, 1.5, True, 5000):
        with pytest.raises(ValueError, match="span_words"):
            policies.get("learned", adapter=head, span_words=bad)
    model = tiny_model("llama")  # built from a config: no tokenizer to load
    pol = policies.get("learned", adapter=head, span_words=16)
    with pytest.raises(ValueError, match="span_words=16 needs the model's tokenizer"):
        _kept(model, pol, torch.tensor([[4, 5, 6, 7] * 8]))
    pol = policies.get("learned", adapter=head, span_words=16, tokenizer=PieceTokenizer())
    embeds = model.get_input_embeddings()(torch.tensor([[4, 5, 6, 7] * 8]))
    with (
        SparseKVCache(model, EvictionConfig(budget=8), pol) as cache,
        pytest.raises(ValueError, match="span_words=16 reads the token ids"),
    ):
        model(inputs_embeds=embeds, cache=cache)
