"""The digit, multi-hop and qa task families: needles of numbers (one pass key, several keys,
several values, chains of variables) and real sentences asked back, placed in evaluation prose.

Their fixed wordings are module constants (`PASSKEY`, ...); `sparsekv.evaluation.tasks.TEMPLATES`
lists every evaluation wording, for the test that training needles never share one."""

from __future__ import annotations

import random
import re

from sparsekv.evaluation.tasks.base import (
    Sample,
    chars_for,
    depth_for,
    fit,
    magic_key,
    number,
    prose_filler,
    register,
)
from sparsekv.evaluation.tasks.text import join_sentences, sentence_stream

# The fixed wordings of the needles and questions ({...} are the values filled in); TEMPLATES
# (below) lists every evaluation wording, for the test that training needles never share one.
PASSKEY = ("The pass key is {key}. Remember it. {key} is the pass key.", "What is the pass key?",
           "The pass key is")
MAGIC_NEEDLE = "One of the special magic numbers for {key} is: {value}."
MULTIKEY = ("What is the special magic number for {key} mentioned in the text above?",
            "The special magic number for {key} mentioned in the text above is")
MULTIVALUE = ("What are all the special magic numbers for {key} mentioned in the text above?",
              "The special magic numbers for {key} mentioned in the text above are")
VARTRACK = ("VAR {a} = {value}.", "VAR {b} = VAR {a}.",
            "Find all variables that are assigned the value {value} in the text above.",
            ("According to the chain(s) of variable assignment in the text above, {n} variables "
             "are assigned the value {value}, they are:"))
QA_QUESTION = "Continue this sentence from the text above."



# --------------------------------------------------------------------------- retrieval tasks


@register("passkey", "answer", max_new_tokens=12, metric="accuracy")
def _passkey(rng, codec, length, index, seed, digits: int = 5) -> Sample:
    """One pass key hidden in prose at a depth of 10-90%; asked for at the end."""
    depth = depth_for(seed, index)
    filler = prose_filler(rng, chars_for(length))
    key = number(rng, digits, set(), join_sentences(filler))
    needle = PASSKEY[0].format(key=key)
    question = f"\n\nQuestion: {PASSKEY[1]}\nAnswer: {PASSKEY[2]}"
    ctx, cids, qids, _ = fit(codec, filler, [(depth, needle)], question, length)
    return Sample("passkey", f"passkey-{length}-{index}", "answer", ctx, question, key, cids, qids,
                  metadata={"depth": depth})


@register("multikey", "answer", max_new_tokens=14, metric="accuracy", num_keys=4, digits=7)
def _multikey(rng, codec, length, index, seed, num_keys: int = 4, digits: int = 7) -> Sample:
    """Several keys with one magic number each (distractors); the question asks for one key."""
    if num_keys < 1:
        raise ValueError(f"num_keys={num_keys} must be >= 1")
    filler = prose_filler(rng, chars_for(length))
    text = join_sentences(filler)
    keys, vals = set(), set()
    needles, pairs = [], []
    for _ in range(num_keys):
        k, v = magic_key(rng, keys), number(rng, digits, vals, text)
        pairs.append((k, v))
        needles.append((rng.uniform(0.1, 0.9), MAGIC_NEEDLE.format(key=k, value=v)))
    target = rng.randrange(num_keys)
    k, v = pairs[target]
    question = f"\n\nQuestion: {MULTIKEY[0].format(key=k)}\nAnswer: {MULTIKEY[1].format(key=k)}"
    ctx, cids, qids, _ = fit(codec, filler, needles, question, length)
    return Sample("multikey", f"multikey-{length}-{index}", "answer", ctx, question, v, cids, qids,
                  metadata={"depth": round(needles[target][0], 3), "num_keys": num_keys})


@register("multivalue", "answer", max_new_tokens=40, metric="recall", num_values=4, digits=6)
def _multivalue(rng, codec, length, index, seed, num_values: int = 4, digits: int = 6) -> Sample:
    """One key with several magic numbers spread over the text; the question asks for all."""
    if num_values < 1:
        raise ValueError(f"num_values={num_values} must be >= 1")
    filler = prose_filler(rng, chars_for(length))
    text = join_sentences(filler)
    k = magic_key(rng, set())
    vals: set[str] = set()
    values = [number(rng, digits, vals, text) for _ in range(num_values)]
    depths = sorted(rng.uniform(0.1, 0.9) for _ in values)
    needles = [(d, MAGIC_NEEDLE.format(key=k, value=v)) for d, v in zip(depths, values)]
    question = (f"\n\nQuestion: {MULTIVALUE[0].format(key=k)}\n"
                f"Answer: {MULTIVALUE[1].format(key=k)}")
    ctx, cids, qids, _ = fit(codec, filler, needles, question, length)
    return Sample("multivalue", f"multivalue-{length}-{index}", "answer", ctx, question, values,
                  cids, qids, metadata={"depths": [round(d, 3) for d in depths]})


def _var_name(rng: random.Random, taken: set[str]) -> str:
    while True:
        n = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if n not in taken:
            taken.add(n)
            return n


@register("vartrack", "answer", max_new_tokens=32, metric="recall", hops=3, chains=2, digits=5)
def _vartrack(rng, codec, length, index, seed, hops: int = 3, chains: int = 2,
              digits: int = 5) -> Sample:
    """Chains of assignments (VAR B = VAR A ...) spread in order over the text, plus distractor
    chains; the question asks for every variable holding the first chain's value (multi-hop)."""
    if hops < 1 or chains < 1:
        raise ValueError(f"hops={hops} and chains={chains} must be >= 1")
    filler = prose_filler(rng, chars_for(length))
    text = join_sentences(filler)
    names: set[str] = set()
    vals: set[str] = set()
    needles, first = [], None
    for c in range(chains):
        v = number(rng, digits, vals, text)
        chain = [_var_name(rng, names) for _ in range(hops + 1)]
        depths = sorted(rng.uniform(0.05, 0.95) for _ in chain)
        needles.append((depths[0], VARTRACK[0].format(a=chain[0], value=v)))
        for a, b, d in zip(chain, chain[1:], depths[1:]):
            needles.append((d, VARTRACK[1].format(a=a, b=b)))
        if first is None:
            first = (v, chain)
    v, chain = first
    question = (f"\n\nQuestion: {VARTRACK[2].format(value=v)}\n"
                f"Answer: {VARTRACK[3].format(n=len(chain), value=v)}")
    ctx, cids, qids, _ = fit(codec, filler, needles, question, length)
    return Sample("vartrack", f"vartrack-{length}-{index}", "answer", ctx, question, chain, cids,
                  qids, metadata={"hops": hops, "chains": chains})


_WORD = re.compile(r"^[A-Za-z][A-Za-z'\-]*[,;]?$")


@register("qa", "answer", max_new_tokens=16, metric="accuracy", cue_words=6, answer_words=4)
def _qa(rng, codec, length, index, seed, cue_words: int = 6, answer_words: int = 4) -> Sample:
    """A real sentence from elsewhere in the corpus sits at a depth of 10-90%; the answer line
    starts with its first words and the model must copy the words that follow (extractive QA).
    The cue is not quoted in the question, so the only earlier copy to continue is the one in
    the context."""
    depth = depth_for(seed + 1, index)
    filler = prose_filler(rng, chars_for(length))
    text = join_sentences(filler)
    stream = sentence_stream()
    for _ in range(10_000):
        s, _par = stream[rng.randrange(len(stream))]
        words = s.split()
        if len(words) < cue_words + answer_words + 2 or s in text:
            continue
        span = words[: cue_words + answer_words]
        if not all(_WORD.match(w) for w in span[1:]):
            continue
        cue = " ".join(words[:cue_words])
        if cue.lower() in text.lower():
            continue
        break
    else:  # pragma: no cover - the corpus always has such sentences
        raise RuntimeError("no suitable sentence for the qa task")
    answer = " ".join(words[cue_words : cue_words + answer_words]).rstrip(",;")
    question = f"\n\nQuestion: {QA_QUESTION}\nAnswer: {cue}"
    ctx, cids, qids, _ = fit(codec, filler, [(depth, s)], question, length)
    return Sample("qa", f"qa-{length}-{index}", "answer", ctx, question, answer, cids, qids,
                  metadata={"depth": depth, "sentence": s})
