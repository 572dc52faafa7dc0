"""Per-sample metrics: answer matching, KL divergence, perplexity, agreement, repetition, memory.

Pure functions of outputs and log-probabilities; nothing here runs a model. Conventions:
- `score_answer` is the accuracy of one sample in [0, 1]: 1/0 for one answer ("contains"
  match after normalisation), the fraction found for a list of answers (multi-value, variable
  tracking). Only the first non-empty line of the output counts: answers are one line, and a
  base model tends to continue with more text (the runner stops decoding there; with greedy
  decoding that equals truncating a longer output).
- `kl_divergence(ref, pol)` is KL(full cache || policy) in nats, per position, from
  log-probabilities `(..., vocab)`.

This module imports only the standard library and torch (psutil optionally), so a peer run in
another environment (eval/peers/kvpress) loads it from its file and scores exactly as we do.
"""

from __future__ import annotations

import math
import os
import re
import resource
import threading
import time
from collections.abc import Sequence

import torch


def normalize(text: str) -> str:
    """Lower-case, quotes and surrounding punctuation dropped, whitespace collapsed."""
    text = text.lower().replace('"', " ").replace("'", " ")
    return re.sub(r"\s+", " ", text).strip()


def _contains(output: str, answer: str) -> bool:
    a, o = normalize(answer), normalize(output)
    if not a:
        return False
    if a.replace(" ", "").isdigit():  # numbers: digits may come out spaced ("4 8 2 1 3")
        return a.replace(" ", "") in re.sub(r"(?<=\d) (?=\d)", "", o)
    return re.search(r"(?<![a-z0-9])" + re.escape(a) + r"(?![a-z0-9])", o) is not None


def first_line(text: str) -> str:
    """The first non-empty line of `text` (leading blank lines and spaces dropped)."""
    return text.lstrip().split("\n", 1)[0]


def answer_complete(text: str) -> bool:
    """True once `text` holds a line break after some content: the answer line is over."""
    return "\n" in text.lstrip()


def score_answer(output: str, answer: str | Sequence[str] | None) -> float:
    """Accuracy of one generated `output` against `answer` (see the module docstring)."""
    output = first_line(output)
    if answer is None:
        return float("nan")
    if isinstance(answer, str):
        return 1.0 if _contains(output, answer) else 0.0
    answer = list(answer)
    if not answer:
        return float("nan")
    return sum(_contains(output, a) for a in answer) / len(answer)


def kl_divergence(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) per position: `(..., vocab)` log-probabilities -> `(...)` nats (float32)."""
    r, p = ref_logprobs.float(), logprobs.float()
    return (r.exp() * (r - p)).sum(-1).clamp_min(0.0)


def token_agreement(reference: Sequence[int], output: Sequence[int]) -> tuple[float, int]:
    """(fraction of the reference's positions where `output` has the same token, length of the
    common prefix)."""
    if not reference:
        return float("nan"), 0
    same = sum(a == b for a, b in zip(reference, output))
    prefix = 0
    for a, b in zip(reference, output):
        if a != b:
            break
        prefix += 1
    return same / len(reference), prefix


def repetition_rate(ids: Sequence[int], n: int = 4) -> float:
    """Fraction of the `n`-grams of `ids` that repeat an earlier one (0 = none repeated)."""
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else float("nan")


def kv_bytes(cache) -> int:
    """Bytes held by a cache's key and value tensors: `cache.kv_bytes()` when it has one, else
    the sum over transformers' cache layers."""
    if hasattr(cache, "kv_bytes"):
        return int(cache.kv_bytes())
    total = 0
    for layer in getattr(cache, "layers", []):
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
            total += k.nbytes + v.nbytes
    return total


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        try:
            import psutil

            return int(psutil.Process().memory_info().rss)
        except ImportError:  # pragma: no cover
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakRSS:
    """Context manager sampling the process's resident memory every `interval` seconds in a
    background thread; `.peak` is the highest value seen (bytes), start and end included."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, _rss_bytes())

    def __enter__(self) -> PeakRSS:
        self.peak = _rss_bytes()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


class Timer:
    """`with Timer() as t: ...` then `t.seconds`."""

    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start
