"""The train / evaluation split of the text: no evaluation prompt reuses training text.

The default training corpus (`data/build.py` with its defaults, synthetic samples included) is
hashed once per session: every 64-character window of its normalised text (ASCII-folded,
lower-cased, whitespace collapsed) becomes a 64-bit polynomial hash, computed with numpy and kept
sorted. An evaluation text fails if any of its windows is in that set (windows of fewer than ten
distinct characters, such as a rule of dashes, are not text and are ignored).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from sparsekv import sources
from sparsekv.evaluation.tasks import TASKS, make_sample
from sparsekv.evaluation.tasks.codec import AsciiCodec
from sparsekv.evaluation.tasks.text import eval_texts

WINDOW = 64
_BASE = np.uint64(1_000_003)
_INV = np.uint64(pow(1_000_003, -1, 2**64))
_FOLD = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"',
                       "\u2013": "-", "\u2014": "-", "\u00a0": " "})


def _normalise(text: str) -> bytes:
    text = text.translate(_FOLD).encode("ascii", "ignore").decode().lower()
    return re.sub(r"\s+", " ", text).encode()


def window_hashes(text: str) -> np.ndarray:
    """64-bit hashes of every 64-character window of the normalised `text`, `(n - 63,)`.

    With prefix sums P[i] = sum_{j<i} a[j] B^j (mod 2**64), the window at i is
    (P[i+64] - P[i]) B^-i: B is odd, so it has an inverse modulo 2**64, and numpy's uint64
    cumsum / cumprod wrap modulo 2**64."""
    a = np.frombuffer(_normalise(text), dtype=np.uint8).astype(np.uint64)
    n = len(a) - WINDOW + 1
    if n <= 0:
        return np.zeros(0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        one = np.ones(1, dtype=np.uint64)
        pw = np.concatenate([one, np.cumprod(np.full(len(a) - 1, _BASE, dtype=np.uint64))])
        inv = np.concatenate([one, np.cumprod(np.full(n - 1, _INV, dtype=np.uint64))])
        prefix = np.concatenate([np.zeros(1, dtype=np.uint64), np.cumsum(a * pw)])
        return (prefix[WINDOW:] - prefix[:n]) * inv


def shared_windows(text: str, train: np.ndarray) -> list[str]:
    """The 64-character windows of `text` (normalised) that occur in the training set."""
    h = window_hashes(text)
    if not len(h):
        return []
    idx = np.searchsorted(train, h).clip(max=len(train) - 1)
    hits = np.nonzero(train[idx] == h)[0]
    norm = _normalise(text).decode()
    spans = [norm[i : i + WINDOW] for i in hits]
    # A rule of dashes or a run of spaces is no text: a span counts if it has >= 10 characters.
    return [w for w in spans if len(set(w)) >= 10][:5]


@pytest.fixture(scope="session")
def train_windows() -> np.ndarray:
    from data.build import BuildConfig, build

    records = build(BuildConfig())
    return np.unique(np.concatenate([window_hashes(r["text"]) for r in records]))


ADDED_TRAIN_FAMILIES = ("metadata", "packages", "manpages")


@pytest.fixture(scope="session")
def added_train_windows(tmp_path_factory) -> np.ndarray:
    """Every 64-character window of the training families added after the default corpus (all
    of their text, not only what a build with a prose cap would take), read in a fresh process
    as a corpus build reads them. (Read inside the full test session, after tests/test_static.py,
    the families held gensim's downloader code, which a fresh process's do not: cause not found.)"""
    import json
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("added") / "texts.json"
    code = (
        "import json, sys\nfrom sparsekv import sources\n"
        f"texts = [t for n in {ADDED_TRAIN_FAMILIES!r} for _, t in sources.read(n)]\n"
        "open(sys.argv[1], 'w', encoding='utf-8').write(json.dumps(texts))\n"
    )
    subprocess.run([sys.executable, "-c", code, str(out)], check=True)
    texts = json.loads(out.read_text(encoding="utf-8"))
    return np.unique(np.concatenate([window_hashes(text) for text in texts]))


def test_families_are_split_and_training_reads_only_its_own():
    from data.build import SOURCES

    names = [f.name for f in sources.FAMILIES]
    assert len(names) == len(set(names))
    assert {f.split for f in sources.FAMILIES} == {"train", "eval"}
    assert set(SOURCES) == {f.name for f in sources.families(split="train")}
    for kind in sources.KINDS:
        assert sources.families(split="eval", kind=kind), kind
    with pytest.raises(ValueError, match="split='test' must be one of: train, eval"):
        sources.families(split="test")
    with pytest.raises(ValueError, match="kind='poems' must be one of"):
        eval_texts("poems")


def test_hashing_finds_a_shared_span():
    train = np.unique(window_hashes("x" * 10 + "The quick brown fox jumps over the lazy dog " * 3))
    assert shared_windows("Intro. " + "the quick brown\nfox JUMPS over the lazy dog  " * 3, train)
    assert not shared_windows("A completely different sentence about weather " * 3, train)


@pytest.mark.parametrize("kind", ["prose", "code", "steps"])
def test_eval_texts_share_no_64_char_span_with_training(kind, train_windows):
    texts = eval_texts(kind)
    assert len(texts) >= {"prose": 300, "code": 50, "steps": 50}[kind]
    bad = {}
    for name, text in texts:
        assert text.isascii() or kind != "prose", name
        hits = shared_windows(text, train_windows)
        if hits:
            bad[name] = hits
    assert not bad, f"{len(bad)} evaluation texts quote training text: {list(bad.items())[:3]}"


@pytest.mark.parametrize("kind", ["prose", "code", "steps"])
def test_eval_texts_share_no_64_char_span_with_the_added_training_families(
    kind, added_train_windows
):
    for name in ADDED_TRAIN_FAMILIES:
        assert sources.get_family(name).split == "train"
    assert len(added_train_windows) > 1_000_000  # the families really were read
    bad = {}
    for name, text in eval_texts(kind):
        hits = shared_windows(text, added_train_windows)
        if hits:
            bad[name] = hits
    assert not bad, f"{len(bad)} evaluation texts quote training text: {list(bad.items())[:3]}"


def test_added_families_leave_out_the_evaluation_packages_and_clean_man_pages():
    assert not any(n.startswith(("metadata:gensim", "metadata:sparsekv")) for n, _ in sources.read("metadata"))
    names = [n for n, _ in sources.read("packages")]
    assert names and not any(n.startswith(("packages:gensim/", "packages:sparsekv/")) for n in names)
    roff = (
        '.\\" a comment\n.TH LS 1\n.SH NAME\nls \\- list directory contents\n.SH DESCRIPTION\n'
        ".PP\nList \\fBinformation\\fR about the \\fIFILE\\/\\fRs.\n.TP\n"
        '\\fB\\-a\\fR, \\fB\\-\\-all\\fR\ndo not ignore entries\n.BR ls (1)\n.TS\ntab;\n.TE\n'
    )
    text = sources.man_to_text(roff)
    assert text.split("\n\n") == [
        "NAME", "ls - list directory contents", "DESCRIPTION",
        "List information about the FILEs.", "-a, --all do not ignore entries ls(1)",
    ]


@pytest.mark.parametrize("seed", [1, 7])
def test_task_contexts_share_no_64_char_span_with_training(seed, train_windows):
    codec = AsciiCodec()
    prompt_kinds = ("answer", "continuation", "generate")  # the decode tasks read eval_texts
    for task in (t for t, spec in TASKS.items() if spec.kind in prompt_kinds):
        for index in range(3):
            s = make_sample(task, codec, 4096, index, seed=seed)
            hits = shared_windows(s.context, train_windows)
            assert not hits, (task, index, hits)


def _pieces(template: str) -> list[str]:
    """The fixed text of a template: the stretches between its {placeholders}."""
    return [p.strip() for p in re.split(r"\{[a-z0-9_]*\}", template) if p.strip()]


def _word_grams(template: str, n: int = 4) -> set[tuple[str, ...]]:
    grams = set()
    for piece in _pieces(template):
        words = re.findall(r"[a-z']+", piece.lower())
        grams |= {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}
    return grams


def test_training_needles_share_no_template_with_the_evaluation():
    """No fixed stretch of a training needle or question wording (>= 12 characters) occurs in an
    evaluation wording or the other way round, and the two share no run of four words."""
    from data.needles import TEMPLATES as TRAIN
    from sparsekv.evaluation.tasks import TEMPLATES as EVAL

    assert len(TRAIN) >= 30 and len(EVAL) >= 30
    eval_text, train_text = "\n".join(EVAL).lower(), "\n".join(TRAIN).lower()
    for mine, other in ((TRAIN, eval_text), (EVAL, train_text)):
        for t in mine:
            for piece in _pieces(t):
                assert len(piece) < 12 or piece.lower() not in other, (t, piece)
    train_grams = set().union(*map(_word_grams, TRAIN))
    shared = [(t, g) for t in EVAL for g in _word_grams(t) if g in train_grams]
    assert not shared, shared[:5]
    # The checks can fail: a wording copied across the split is caught.
    assert _word_grams(EVAL[0]) & set().union(*map(_word_grams, EVAL))


def test_training_synthetic_kinds_cover_the_evaluation_value_types():
    from data.build import KINDS, BuildConfig, collect_prose, synthetic_samples

    cfg = BuildConfig(max_prose_chars=200_000, synthetic=90, kinds=list(KINDS))
    records = synthetic_samples(cfg, [r["text"] for r in collect_prose(cfg)])
    kinds = {r["source"] for r in records}
    assert kinds == {f"synthetic:{k}" for k in cfg.kinds}
    uuid_re = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
    for r in records:
        body, qa = r["text"].rsplit("\n\nQuestion: ", 1)
        assert qa.split("\nAnswer: ", 1)[1] == r["answer"]
        if r["source"] == "synthetic:uuid":
            assert uuid_re.search(r["answer"]).group(0) in body
        if r["source"] == "synthetic:words":
            assert r["answer"].rstrip(".").split()[-1].strip("'") in body
        if r["source"] == "synthetic:multi":  # every value asked sits in the body, in order
            values = re.findall(r"\d{4,7}", r["answer"])
            assert 2 <= len(values) <= 5
            at = [body.index(v) for v in values]
            assert at == sorted(at)
            assert len(re.findall(r"\b\d{4,7}\b", body)) >= len(values) + 1  # + a distractor


def test_wiki_markup_and_procedures_are_cleaned():
    markup = (
        "'''Albedo''' ({{lang|la|albedo}}) is the [[diffuse reflection|diffuse reflectivity]] of a "
        "[[surface]].<ref>{{cite web|url=x}}</ref> {{Infobox|a={{b}}}}\n\n"
        "[[File:A.png|thumb|A [[caption]] here]]\n== History ==\nIt was measured in 1760.\n"
        "* a list item\n\n== References ==\nGone."
    )
    text = sources.wiki_to_text(markup)
    assert "Albedo is the diffuse reflectivity of a surface." in text
    assert "It was measured in 1760." in text
    assert not re.search(r"[\[\]{}|]|caption|list item|Gone|History", text)
    manual = (
        "To build it:\n\n  1. Unpack the archive into a\n     fresh folder.\n"
        "  2. Run the configure script with the defaults.\n"
        "  3. Type make, then make install as root, and read the log for any errors it shows.\n\n"
        "Short list:\n1. a\n2. b\n"
    )
    (proc,) = sources.procedures(manual)  # the two-item list is not a procedure
    assert proc.splitlines() == [
        "To build it:",
        "1. Unpack the archive into a fresh folder.",
        "2. Run the configure script with the defaults.",
        "3. Type make, then make install as root, and read the log for any errors it shows.",
    ]
