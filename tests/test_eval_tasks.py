"""Task generators, prose corpus and metrics of the evaluation harness (no model needed)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from sparsekv.evaluation import metrics as M
from sparsekv.evaluation.tasks import DEPTHS, TASKS, make_sample
from sparsekv.evaluation.tasks.codec import AsciiCodec
from sparsekv.evaluation.tasks.text import corpus, join_sentences, sentence_stream

CODEC = AsciiCodec()
# The prompt tasks of tasks.py / tasks_words.py (the decode tasks have tests of their own).
PROMPT_TASKS = [t for t, s in TASKS.items() if s.kind in ("answer", "continuation", "generate")]
RETRIEVAL = [t for t, s in TASKS.items() if s.kind == "answer"]
LENGTH = 1024


def test_corpus_is_real_prose_and_ordered():
    docs = corpus()
    assert len(docs) > 50
    sources = {d.source.split(":")[0] for d in docs}
    assert {"news", "wikipedia"} <= sources  # evaluation-only families (sparsekv.sources)
    stream = sentence_stream()
    assert sum(len(s) for s, _ in stream) > 200_000
    text = join_sentences(list(stream[:200]))
    assert text.isascii()
    assert "::=" not in text and ">>>" not in text
    words = re.findall(r"[A-Za-z]+", text)
    assert len(words) > 2000


@pytest.mark.parametrize("task", PROMPT_TASKS)
def test_generator_is_deterministic(task):
    a = make_sample(task, CODEC, LENGTH, 3, seed=7)
    b = make_sample(task, CODEC, LENGTH, 3, seed=7)
    assert a.to_dict() == b.to_dict()
    c = make_sample(task, CODEC, LENGTH, 3, seed=8)
    d = make_sample(task, CODEC, LENGTH, 4, seed=7)
    assert c.context != a.context and d.context != a.context


@pytest.mark.parametrize("task", PROMPT_TASKS)
@pytest.mark.parametrize("length", [512, 2048])
def test_prompt_fits_the_length_in_tokens(task, length):
    s = make_sample(task, CODEC, length, 0, seed=1)
    total = len(s.prompt_ids) + len(s.target_ids) + (s.max_new_tokens if s.kind == "generate" else 0)
    assert total <= length
    assert total >= length - 40  # filled up to the last word that fits
    assert s.metadata["n_tokens"] == len(s.prompt_ids) + len(s.target_ids)
    assert s.context_ids == CODEC.bos_ids + CODEC.encode(s.context)
    assert s.question_ids == CODEC.encode(s.question)


@pytest.mark.parametrize("task", RETRIEVAL)
@pytest.mark.parametrize("index", range(4))
def test_answer_is_findable_in_the_prompt(task, index):
    s = make_sample(task, CODEC, LENGTH, index, seed=0)
    answers = [s.answer] if isinstance(s.answer, str) else list(s.answer)
    assert answers and all(answers)
    for a in answers:
        assert a in s.context, (task, a)
    # Scoring the context itself finds every answer; an unrelated text finds none.
    assert M.score_answer(s.context.replace("\n", " "), s.answer) == 1.0
    assert M.score_answer("nothing to see here", s.answer) == 0.0


def test_passkey_depths_cover_10_to_90_percent():
    depths, positions = [], []
    for i in range(len(DEPTHS)):
        s = make_sample("passkey", CODEC, 2048, i, seed=0)
        depths.append(s.metadata["depth"])
        positions.append(s.context.index(f"The pass key is {s.answer}") / len(s.context))
    assert sorted(depths) == list(DEPTHS)
    for d, p in zip(depths, positions):
        assert abs(d - p) < 0.08, (d, p)


def test_multikey_asks_for_one_of_several_keys():
    s = make_sample("multikey", CODEC, LENGTH, 0, seed=0, num_keys=5)
    needles = re.findall(r"special magic numbers for ([a-z]+-[a-z]+) is: (\d+)", s.context)
    assert len(needles) == 5 and len({k for k, _ in needles}) == 5
    asked = re.search(r"number for ([a-z]+-[a-z]+) mentioned", s.question).group(1)
    assert dict(needles)[asked] == s.answer


def test_vartrack_chain_resolves_to_the_value():
    s = make_sample("vartrack", CODEC, LENGTH, 2, seed=0)
    assign = dict(re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", s.context))
    value = re.search(r"assigned the value (\d+)", s.question).group(1)

    def resolve(name):
        v = assign[name]
        return resolve(v[4:]) if v.startswith("VAR ") else v

    holders = sorted(n for n in assign if resolve(n) == value)
    assert holders == sorted(s.answer)
    assert len(s.answer) == 4  # hops=3: the value and three hops


def test_qa_answer_follows_the_cue_in_the_context():
    s = make_sample("qa", CODEC, LENGTH, 1, seed=0)
    cue = re.search(r"Answer: (.*)$", s.question).group(1)
    assert s.context.count(cue) == 1
    after = s.context[s.context.index(cue) + len(cue):]
    assert after.lstrip().startswith(s.answer)


def test_ppl_continuation_is_the_same_text_continued():
    s = make_sample("ppl", CODEC, LENGTH, 0, seed=0)
    assert len(s.target_ids) == 64 and s.question_ids == []
    stream_text = join_sentences(list(sentence_stream()))
    last = s.context[-60:]
    cont = CODEC.decode(s.target_ids).lstrip()[:40]
    assert last in stream_text and cont in stream_text
    i = stream_text.index(last)
    assert cont in stream_text[i : i + 200]


def test_unknown_task_and_options_give_clear_errors():
    with pytest.raises(ValueError, match="known tasks: passkey"):
        make_sample("needle", CODEC, LENGTH, 0)
    with pytest.raises(ValueError, match="allowed: num_keys, digits"):
        make_sample("multikey", CODEC, LENGTH, 0, keys=3)
    with pytest.raises(ValueError, match="too short"):
        make_sample("vartrack", CODEC, 64, 0)


def test_metrics():
    assert M.score_answer("The pass key is 4 8 2 1 3.", "48213") == 1.0
    assert M.score_answer("The pass key is 482135", "48213") == 1.0  # contains
    assert M.score_answer("they are: AAA, BBB", ["AAA", "BBB", "CCC", "DDD"]) == 0.5
    assert M.score_answer(" Than there Are formal parameter", "than there are formal") == 1.0
    assert M.score_answer("thanks", "than") == 0.0
    assert math.isnan(M.score_answer("x", None))
    lp = torch.log_softmax(torch.randn(3, 50), -1)
    assert torch.allclose(M.kl_divergence(lp, lp), torch.zeros(3), atol=1e-6)
    other = torch.log_softmax(torch.randn(3, 50), -1)
    kl = M.kl_divergence(lp, other)
    ref = (lp.exp() * (lp - other)).sum(-1)
    assert torch.allclose(kl, ref, atol=1e-6) and (kl > 0).all()
    assert M.repetition_rate([1, 2, 3, 4, 5, 6]) == 0.0
    assert M.repetition_rate([1, 2, 1, 2, 1, 2, 1, 2], n=2) == pytest.approx(5 / 7)
    assert M.token_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == (0.75, 2)
    # Only the first non-empty line of an output is scored.
    assert M.score_answer("\n\n 48213.\nWhat is the pass key? 11111", "48213") == 1.0
    assert M.score_answer(" a key.\n\nThe pass key is 48213", "48213") == 0.0
    assert not M.answer_complete("\n 482") and M.answer_complete(" 48213.\n")


# --------------------------------------------------------------------------- beyond digits


def test_wordkey_and_uuidkey_values_and_wordings_vary():
    from sparsekv.evaluation.tasks.words import VALUE_WORDS

    uuid_re = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
    wordings = set()
    for i in range(8):
        w = make_sample("wordkey", CODEC, LENGTH, i, seed=0)
        assert w.answer in VALUE_WORDS and w.context.count(w.answer) >= 1
        assert M.score_answer(f" {w.answer}.", w.answer) == 1.0
        assert M.score_answer(f" {w.answer}s", w.answer) == 0.0  # a word, not a prefix
        wordings.add(w.metadata["wording"])
        u = make_sample("uuidkey", CODEC, LENGTH, i, seed=0)
        assert uuid_re.match(u.answer) and u.answer in u.context
        assert M.score_answer(f' "{u.answer.upper()}".', u.answer) == 1.0
        assert M.score_answer(" " + u.answer[1:], u.answer) == 0.0  # one character short
        wordings.add(u.metadata["wording"])
    assert len(wordings) >= 4


def test_multiquery_asks_two_keys_scored_as_both_values():
    s = make_sample("multiquery", CODEC, LENGTH, 0, seed=2, num_keys=5)
    assert isinstance(s.answer, list) and len(s.answer) == 2 and len(set(s.answer)) == 2
    assert all(v in s.context for v in s.answer)
    assert M.score_answer(f" {s.answer[0]} and {s.answer[1]}.", s.answer) == 1.0
    assert M.score_answer(f" {s.answer[1]}.", s.answer) == 0.5
    with pytest.raises(ValueError, match="num_keys=1 must be >= 2"):
        make_sample("multiquery", CODEC, LENGTH, 0, num_keys=1)


def test_commonwords_answer_is_the_most_common_words():
    s = make_sample("commonwords", CODEC, 2048, 1, seed=0, num_common=4)
    listed = re.findall(r"\b\d+\. ([a-z]+)\b", s.context)
    counts = __import__("collections").Counter(listed)
    top = [w for w, _ in counts.most_common(4)]
    assert sorted(top) == sorted(s.answer)
    assert min(counts[w] for w in s.answer) > max(c for w, c in counts.items() if w not in s.answer)
    assert "4 most common words" in s.question or "4 most repeated" in s.question
    numbers = [int(n) for n in re.findall(r"\b(\d+)\. [a-z]", s.context)]
    assert numbers == list(range(1, len(numbers) + 1))


def test_freqwords_answer_is_the_three_most_frequent_made_up_words():
    from sparsekv.evaluation.tasks.words import prose_vocabulary

    s = make_sample("freqwords", CODEC, 2048, 2, seed=0)
    words = s.context.split("\n\n", 1)[1].split()
    counts = __import__("collections").Counter(words)
    assert [w for w, _ in counts.most_common(3)] == s.answer
    assert not set(counts) & set(prose_vocabulary())  # made up, not English words of the prose
    assert s.metadata["counts"][2] > s.metadata["counts"][3]
