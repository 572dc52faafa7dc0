"""The task families beyond digits, built offline in the manner of RULER's synthetic suite.

- wordkey: `num_keys` keyed needles whose values are ordinary English words (one asked, the
  others distractors); score = exact match of the word (accuracy).
- uuidkey: the same with UUID-like values (`8-4-4-4-12` hex digits); score = exact match.
- multiquery: `num_keys` keyed numbers; the question asks for two keys at once; score = recall
  of the two values.
- commonwords: the context is a long numbered list of words on one line ("1. word 2. word
  ...", as in RULER) from the evaluation prose's vocabulary; `num_common` words appear
  `common_freq` times each (by default length/128, up to 30), every other word `rare_freq`
  times; the question asks for the `num_common` most common; score = recall.
- freqwords: the context is a coded text of made-up words drawn from a Zipf distribution
  (exponent `alpha`); the question asks for the three most frequent; score = recall.

What the default model (gemma-3-270m) does with the full cache, 4 samples per family (seed 1,
`sparsekv eval --policy full --tasks wordkey,uuidkey,multiquery,commonwords,freqwords
--lengths 2048,4096 --samples 4 --seed 1`): at 2K / 4K tokens wordkey 0.50 / 0.25, uuidkey
0.75 / 0.75, multiquery 0.38 / 0.25, commonwords 0.25 / 0.15, freqwords 0.42 / 0.33. The last
two are near the floor: the model copies the first words of the list or repeats one coded word,
so what they score is mostly luck; they are kept so that a model that can count shows it.

Each sample draws one of several wordings (`WORDKEY`, `UUIDKEY`, `MULTIQUERY`, ...), so no
single sentence is the task. The needles sit in evaluation-only prose (`tasks_base.prose_filler`);
the word lists draw their words from the same prose. `TEMPLATES` holds every fixed wording, for
the test that training needles never share one (tests/test_text_split.py).
"""

from __future__ import annotations

import functools
import random
import re
import uuid
from collections import Counter

from sparsekv.evaluation.tasks.base import (
    Sample,
    chars_for,
    fit,
    fit_items,
    magic_key,
    number,
    prose_filler,
    register,
)
from sparsekv.evaluation.tasks.text import join_sentences, sentence_stream

# (needle with {key} and {value}, question with {key}, start of the answer line with {key}).
WORDKEY = (
    ('The word chosen for {key} is "{value}".', "Which word was chosen for {key}?",
     "The word chosen for {key} is"),
    ("Keep this in mind: the code word assigned to {key} is {value}.",
     "Which code word is assigned to {key} in the text above?",
     "The code word assigned to {key} is"),
    ("A note pinned to the wall says that the password of the {key} club is {value}.",
     "What is the password of the {key} club?", "The password of the {key} club is"),
    ("One of the special magic words for {key} is: {value}.",
     "What is the special magic word for {key} mentioned in the provided text?",
     "The special magic word for {key} mentioned in the provided text is"),
)
UUIDKEY = (
    ("The identifier of the {key} record is {value}.",
     "What is the identifier of the {key} record?", "The identifier of the {key} record is"),
    ("One of the special magic uuids for {key} is: {value}.",
     "What is the special magic uuid for {key} mentioned in the provided text?",
     "The special magic uuid for {key} mentioned in the provided text is"),
    ("Serial number of the {key} device: {value}.",
     "What is the serial number of the {key} device?", "The serial number of the {key} device is"),
)
# (needle with {key}, {value}; question with {key1}, {key2}; answer start with {key1}, {key2}).
MULTIQUERY = (
    ("One of the special magic numbers for {key} is: {value}.",
     "What are the special magic numbers for {key1} and {key2} mentioned in the provided text?",
     "The special magic numbers for {key1} and {key2} mentioned in the provided text are"),
    ("The registration number of the {key} account is {value}.",
     "What are the registration numbers of the {key1} and {key2} accounts?",
     "The registration numbers of the {key1} and {key2} accounts are"),
    ("The {key} warehouse shipped {value} parcels last year.",
     "How many parcels did the {key1} and {key2} warehouses ship last year?",
     "The {key1} and {key2} warehouses shipped"),
)
# (introduction before the list, question with {n}, answer start with {n}).
COMMONWORDS = (
    (("Below is a numbered list of words. In these words, some appear more often than others. "
      "Memorize the ones that appear most often."),
     "What are the {n} most common words in the list above?",
     "The {n} words that appear most often in the list are:"),
    ("Here is a long numbered inventory of words. Some of them repeat many times.",
     "Which {n} words are repeated most often in the inventory above?",
     "The {n} most repeated words in the inventory are:"),
)
FREQWORDS = (
    ("Read the following coded text and track the frequency of each coded word.",
     "What are the three most frequently appearing coded words in the text above?",
     "According to the coded text above, the three most frequent coded words are:"),
    ("The message below is written in made-up words. Count how often each one occurs.",
     "Which three made-up words occur most often in the message above?",
     "The three made-up words that occur most often are:"),
)
TEMPLATES: tuple[str, ...] = tuple(
    t
    for group in (WORDKEY, UUIDKEY, MULTIQUERY, COMMONWORDS, FREQWORDS)
    for row in group
    for t in row
)

# Ordinary English words for wordkey's values: concrete, common, one token or two.
VALUE_WORDS = (
    "apple arrow basket beach blanket bottle bread brick button cabbage camera carpet cherry "
    "chimney cloud coffee copper cotton crayon crystal curtain daisy diamond dinner donkey "
    "drawer eagle elbow feather fence fiddle finger flower forest fountain garlic giraffe glove "
    "grape guitar hammer helmet honey horse jungle kitchen ladder lemon letter library lizard "
    "marble meadow mirror monkey mountain muffin napkin ocean onion orange oyster paddle palace "
    "parrot peach pencil pillow pirate planet pocket potato pumpkin puzzle rabbit radio ribbon "
    "rocket saddle salmon sandal scarf shadow shovel silver spider spoon squirrel stable statue "
    "strawberry sugar summer sunset teapot thunder tiger tomato tractor trumpet turtle violin "
    "wagon walnut wheel whistle window winter wizard yogurt"
).split()


def _choose(rng: random.Random, group: tuple) -> tuple[str, ...]:
    return group[rng.randrange(len(group))]


def _keyed(rng, codec, length, task, index, values, wording, target=0) -> Sample:
    """Needles `wording[0]` for fresh keys with `values` at random depths in prose; asks for
    the key of `values[target]`."""
    filler = prose_filler(rng, chars_for(length))
    keys: set[str] = set()
    pairs = [(magic_key(rng, keys), v) for v in values]
    needles = [(rng.uniform(0.1, 0.9), wording[0].format(key=k, value=v)) for k, v in pairs]
    k, v = pairs[target]
    question = f"\n\nQuestion: {wording[1].format(key=k)}\nAnswer: {wording[2].format(key=k)}"
    ctx, cids, qids, _ = fit(codec, filler, needles, question, length)
    return Sample(task, f"{task}-{length}-{index}", "answer", ctx, question, v, cids, qids,
                  metadata={"depth": round(needles[target][0], 3), "num_keys": len(values),
                            "wording": wording[0]})


@register("wordkey", "answer", max_new_tokens=12, metric="accuracy", num_keys=3)
def _wordkey(rng, codec, length, index, seed, num_keys: int = 3) -> Sample:
    """Keyed needles whose values are ordinary English words; the question asks for one key's
    word (exact match)."""
    if num_keys < 1:
        raise ValueError(f"num_keys={num_keys} must be >= 1")
    wording = _choose(rng, WORDKEY)
    values = rng.sample(VALUE_WORDS, num_keys)
    return _keyed(rng, codec, length, "wordkey", index, values, wording, rng.randrange(num_keys))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


@register("uuidkey", "answer", max_new_tokens=40, metric="accuracy", num_keys=1)
def _uuidkey(rng, codec, length, index, seed, num_keys: int = 1) -> Sample:
    """Keyed needles whose values are UUID-like strings; the question asks for one key's UUID
    (exact match)."""
    if num_keys < 1:
        raise ValueError(f"num_keys={num_keys} must be >= 1")
    wording = _choose(rng, UUIDKEY)
    values = [_uuid(rng) for _ in range(num_keys)]
    return _keyed(rng, codec, length, "uuidkey", index, values, wording, rng.randrange(num_keys))


@register("multiquery", "answer", max_new_tokens=40, metric="recall", num_keys=4, digits=7)
def _multiquery(rng, codec, length, index, seed, num_keys: int = 4, digits: int = 7) -> Sample:
    """Keyed numbers; the question asks for two keys at once (recall of the two values)."""
    if num_keys < 2:
        raise ValueError(f"num_keys={num_keys} must be >= 2 (two keys are asked)")
    wording = _choose(rng, MULTIQUERY)
    filler = prose_filler(rng, chars_for(length))
    text = join_sentences(filler)
    keys: set[str] = set()
    vals: set[str] = set()
    pairs = [(magic_key(rng, keys), number(rng, digits, vals, text)) for _ in range(num_keys)]
    needles = [(rng.uniform(0.1, 0.9), wording[0].format(key=k, value=v)) for k, v in pairs]
    a, b = sorted(rng.sample(range(num_keys), 2))
    names = {"key1": pairs[a][0], "key2": pairs[b][0]}
    question = f"\n\nQuestion: {wording[1].format(**names)}\nAnswer: {wording[2].format(**names)}"
    ctx, cids, qids, _ = fit(codec, filler, needles, question, length)
    return Sample("multiquery", f"multiquery-{length}-{index}", "answer", ctx, question,
                  [pairs[a][1], pairs[b][1]], cids, qids,
                  metadata={"depths": [round(needles[i][0], 3) for i in (a, b)],
                            "num_keys": num_keys})


# --------------------------------------------------------------------------- word counting


@functools.lru_cache(maxsize=1)
def prose_vocabulary() -> tuple[str, ...]:
    """Lower-case alphabetic words of 4-10 letters that the evaluation prose uses at least
    twice, sorted (the word lists of commonwords draw from it)."""
    counts: Counter[str] = Counter()
    for s, _ in sentence_stream():
        counts.update(w for w in re.findall(r"\b[a-z]{4,10}\b", s))
    return tuple(sorted(w for w, c in counts.items() if c >= 2))


@register("commonwords", "answer", max_new_tokens=40, metric="recall", num_common=5,
          common_freq=0, rare_freq=2)
def _commonwords(rng, codec, length, index, seed, num_common: int = 5, common_freq: int = 0,
                 rare_freq: int = 2) -> Sample:
    """A long numbered list of words in which a few are common; the question asks for the
    `num_common` most common words (recall). `common_freq=0` scales with the length: each common
    word appears length/128 times (4 at 512 tokens, 16 at 2K), between rare_freq + 2 and 30."""
    if common_freq == 0:
        common_freq = min(30, max(rare_freq + 2, length // 128))
    if num_common < 1 or rare_freq < 1 or common_freq <= rare_freq:
        raise ValueError(f"num_common={num_common} must be >= 1 and common_freq={common_freq} > "
                         f"rare_freq={rare_freq} >= 1")
    wording = _choose(rng, COMMONWORDS)
    vocab = prose_vocabulary()
    most = 4 * length // rare_freq + 8  # more rare words than can fit (>= 1 token per item)
    words = rng.sample(vocab, min(len(vocab), num_common + most))
    common, rare = words[:num_common], words[num_common:]
    order_seed = rng.random()

    def make(n: int) -> str:
        items = [w for w in common for _ in range(common_freq)]
        items += [w for w in rare[:n] for _ in range(rare_freq)]
        random.Random(f"{order_seed}:{n}").shuffle(items)
        listed = " ".join(f"{i}. {w}" for i, w in enumerate(items, 1))  # inline, as in RULER
        return f"{wording[0]}\n\n{listed}"

    question = (f"\n\nQuestion: {wording[1].format(n=num_common)}\n"
                f"Answer: {wording[2].format(n=num_common)}")
    n, ctx, cids, qids = fit_items(codec, make, question, length, len(rare))
    return Sample("commonwords", f"commonwords-{length}-{index}", "answer", ctx, question,
                  list(common), cids, qids,
                  metadata={"rare_words": n, "common_freq": common_freq, "rare_freq": rare_freq})


_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def _made_up_word(rng: random.Random, taken: set[str], real: frozenset[str]) -> str:
    while True:
        w = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(2, 3)))
        if w not in taken and w not in real:
            taken.add(w)
            return w


@register("freqwords", "answer", max_new_tokens=32, metric="recall", vocab_size=60, alpha=2.0)
def _freqwords(rng, codec, length, index, seed, vocab_size: int = 60, alpha: float = 2.0) -> Sample:
    """A coded text of made-up words drawn from a Zipf distribution; the question asks for the
    three most frequent (recall)."""
    if vocab_size < 4 or alpha <= 0:
        raise ValueError(f"vocab_size={vocab_size} must be >= 4 and alpha={alpha} > 0")
    wording = _choose(rng, FREQWORDS)
    taken: set[str] = set()
    real = frozenset(prose_vocabulary())
    vocab = [_made_up_word(rng, taken, real) for _ in range(vocab_size)]
    weights = [1 / (r + 1) ** alpha for r in range(vocab_size)]
    most = 4 * length + 8
    stream = rng.choices(vocab, weights=weights, k=most)

    def make(n: int) -> str:
        return f"{wording[0]}\n\n" + " ".join(stream[:n])

    question = f"\n\nQuestion: {wording[1]}\nAnswer: {wording[2]}"
    n, ctx, cids, qids = fit_items(codec, make, question, length, most)
    ranked = Counter(stream[:n]).most_common(4)
    if len(ranked) == 4 and ranked[2][1] == ranked[3][1]:  # a tie for third place: no one answer
        raise ValueError("freqwords: a tie for the third most frequent word; choose another alpha")
    return Sample("freqwords", f"freqwords-{length}-{index}", "answer", ctx, question,
                  [w for w, _ in ranked[:3]], cids, qids,
                  metadata={"counts": [c for _, c in ranked], "words": n})
