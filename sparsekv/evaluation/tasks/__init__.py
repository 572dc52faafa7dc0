"""The digit, multi-hop, qa and language-model task families, and the one task registry.

Tasks (`TASKS`, in `sparsekv eval --list` order):
- passkey: one pass key at a depth of 10-90% (the depth cycles over a seeded order of
  10%, 20%, ..., 90% across samples).
- multikey: several "special magic number for <key>" needles; the question asks for one.
- multivalue: one key with several values; the question asks for all (score = recall).
- vartrack: chains of variable assignments (`VAR X = 12345.`, `VAR Y = VAR X.`, ...) and a
  distractor chain; asks which variables hold the value (multi-hop, score = recall).
- qa: a real sentence from elsewhere in the corpus is placed in the context; the answer line
  starts with its first words and the model must copy the next words from the text.
- wordkey, uuidkey, multiquery, commonwords, freqwords: `tasks_words` (values that are words or
  UUIDs, two keys asked at once, the most common words of a list, the most frequent made-up
  words).
- ppl: a long real text and its held-out continuation (teacher-forced): perplexity and the
  KL divergence from the full cache over the continuation.
- nexttok: a long real text followed by a short unrelated passage: top-1 next-token accuracy
  inside the passage (short-context ability after the long prefix is compressed).
- gen: a long real text, then free greedy generation: agreement with the full cache's output
  and repetition rate.

Questions follow a "Question: ...\nAnswer: ..." layout that ends where the answer starts: with
a base model of this size that finds a pass key in 5 of 6 probes at 2K tokens where a
one-line question found 2 of 6. All prose is evaluation-only (`sparsekv.evaluation.tasks.text`).

`kind` says how the runner executes a sample: "answer" (generate, then match the answer),
"continuation" (teacher-force `target_ids` after the context) or "generate" (generate, then
compare with the full cache's output). Continuation and generation tasks have no question, so
only the agnostic protocol applies to them. Samples, the registry and the haystack machinery are
`base`'s; the names below are re-exported from it.
"""

from sparsekv.evaluation.tasks import decode, language, needles, words
from sparsekv.evaluation.tasks.base import (
    DEPTHS,
    PROTOCOLS,
    TASKS,
    Sample,
    TaskSpec,
    get_task,
    make_sample,
    task_names,
)

# The registry's order (`sparsekv eval --list`, the reports): the digit, multi-hop and qa
# families, the word families, the language-model tasks, the decode-heavy tasks. Each module
# registers its own tasks when imported; the registry is put in this order once all are.
_FAMILY_MODULES = tuple(m.__name__ for m in (needles, words, language, decode))
_ordered = sorted(TASKS.items(), key=lambda item: _FAMILY_MODULES.index(item[1].builder.__module__))
TASKS.clear()
TASKS.update(_ordered)

TEMPLATES: tuple[str, ...] = (
    *needles.PASSKEY, needles.MAGIC_NEEDLE, *needles.MULTIKEY, *needles.MULTIVALUE,
    *needles.VARTRACK, needles.QA_QUESTION, *words.TEMPLATES,
)

__all__ = ["DEPTHS", "PROTOCOLS", "TASKS", "TEMPLATES", "Sample", "TaskSpec", "get_task",
           "make_sample", "task_names"]
