"""Round 3, surface "api": the public API with inputs rounds 1 and 2 (eval/bad_inputs/api.py,
round2_api.py) do not try: adapter ensembles built from the wrong things, `generate` options of
the wrong type passed through a compressed context, paths that are not paths, question lists
that are not lists, the transformers pipeline `sparsekv-text-generation`, the arguments of
`load_default_model` (checked before anything loads) and the tiny models' builder. A case is
clear only when the message names the argument and also what it may be (`allowed`)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

import sparsekv
from eval.bad_inputs.framework import _CACHE, TMP, Verdict, adapter, add3, cfg, ids, model
from eval.bad_inputs.framework import fresh as _fresh

API = "api"



class CharTokenizer:
    """Characters folded into the tiny models' 128-id vocabulary (ids 0-2 special)."""

    bos_token_id = 1
    name_or_path = "char-tokenizer"

    def __call__(self, text, add_special_tokens=True):
        body = [3 + ord(c) % 125 for c in text]
        return {"input_ids": ([1] if add_special_tokens else []) + body}

    def decode(self, got, skip_special_tokens=False):
        return "".join(chr(i - 3 + 32) for i in got if not (skip_special_tokens and i < 3))

    def __len__(self):
        return 128


def ctx():
    if "r3-ctx" not in _CACHE:
        _CACHE["r3-ctx"] = sparsekv.compress(model(), ids(40), cfg())
    return _CACHE["r3-ctx"]


def text_ctx():
    if "r3-text" not in _CACHE:
        _CACHE["r3-text"] = sparsekv.compress_text(
            model(), CharTokenizer(), "The pass key is 41729. " * 3, cfg(), "snapkv")
    return _CACHE["r3-text"]


def saved_ctx() -> Path:
    if "r3-ctx-dir" not in _CACHE:
        _CACHE["r3-ctx-dir"] = ctx().save(TMP / "r3-ctx")
    return _CACHE["r3-ctx-dir"]


# ---------------------------------------------------------------------------------------------
# ScorerAdapter.ensemble and the adapter's other entry points
# ---------------------------------------------------------------------------------------------
AD = "ScorerAdapter"
SA = sparsekv.ScorerAdapter


def _other(**kw):
    return SA.for_model(model(kw.pop("family", "llama")), **{"hidden": 8, **kw})


add3(API, AD, "ensemble(one adapter, not a list)", ("ensemble", "scorers", "adapters"),
     lambda: SA.ensemble(adapter()), allowed=("list", "sequence"))
add3(API, AD, "ensemble(['dir-a', 'dir-b']) (folders, not adapters)", ("adapter 0", "str"),
     lambda: SA.ensemble(["dir-a", "dir-b"]), allowed=("from_pretrained", "ScorerAdapter"))
add3(API, AD, "ensemble([adapter, None])", ("adapter 1", "None"),
     lambda: SA.ensemble([adapter(), None]), allowed=("ScorerAdapter",))
add3(API, AD, "ensemble([adapter]) (one member)", ("ensemble", "2"),
     lambda: SA.ensemble([adapter()]), allowed=("at least 2",))


def _same_twice():
    a = adapter()
    got = SA.ensemble([a, a])
    return Verdict("silent", f"the same adapter twice accepted as a {got.config.ensemble}-member "
                   "ensemble (its heads are copies: nothing is averaged)")


add3(API, AD, "ensemble([a, a]) (the same adapter twice)", ("same", "twice", "identical"),
     _same_twice)
add3(API, AD, "ensemble of a llama head and a qwen3 head", ("model_type",),
     lambda: SA.ensemble([adapter(), _other(family="qwen3")]), allowed=("adapter 0",))
add3(API, AD, "ensemble of hidden 8 and hidden 16", ("hidden",),
     lambda: SA.ensemble([adapter(), _other(hidden=16)]), allowed=("adapter 0",))
add3(API, AD, "for_model(target='kl') (a string, not a TargetConfig)", ("target",),
     lambda: SA.for_model(model(), hidden=8, target="kl"), allowed=("TargetConfig", "mapping"))
add3(API, AD, "attach(model, bogus=3) (an unknown keyword)", ("bogus",),
     lambda: adapter().attach(model(), bogus=3).__enter__(), allowed=("allowed",))
add3(API, AD, "save_pretrained(None)", ("save_directory",),
     lambda: adapter().save_pretrained(None), allowed=("path", "folder"))
add3(API, AD, "from_pretrained(b'...') (a bytes path)", ("path_or_repo_id",),
     lambda: SA.from_pretrained(os.fsencode(str(TMP / "adapter-llama"))),
     allowed=("str", "path", "folder"))


def _learned_pathlike():
    """policies.get('learned', adapter=Path(folder)): a pathlib path of an adapter folder."""
    from eval.bad_inputs.framework import adapter_dir
    try:
        pol = sparsekv.policies.get("learned", adapter=Path(adapter_dir()))
    except ValueError as e:
        return Verdict("unclear", f"a Path to an adapter folder refused: {e}")
    return Verdict("clear", f"a Path to an adapter folder loads: {pol!r}"[:200])


add3(API, "policies.get", "learned: adapter=Path(folder) (a pathlib path)", ("adapter",),
     _learned_pathlike)
add3(API, "policies.get", "'snapkv@window=8' (the CLI's spec syntax) in SparseKVCache",
     ("snapkv@window=8", "policy"),
     lambda: sparsekv.SparseKVCache(model(), cfg(), "snapkv@window=8"),
     allowed=("known policies",))

# ---------------------------------------------------------------------------------------------
# compress / CompressedContext
# ---------------------------------------------------------------------------------------------
CP = "compress / CompressedContext"
Q = [5, 6, 7]
add3(API, CP, "compress(model=None)", ("model",),
     lambda: sparsekv.compress(None, ids(), cfg()), allowed=("causal LM", "transformers"))
add3(API, CP, "save(None)", ("path=",), lambda: ctx().save(None), allowed=("folder", "str"))
add3(API, CP, "save(123) (an int)", ("path=",), lambda: ctx().save(123),
     allowed=("folder", "str"))
add3(API, CP, "generate(num_beams=2.0) (a float)", ("num_beams",),
     lambda: ctx().generate(Q, max_new_tokens=2, num_beams=2.0), allowed=("1",))
add3(API, CP, "generate(num_return_sequences='2')", ("num_return_sequences",),
     lambda: ctx().generate(Q, max_new_tokens=2, num_return_sequences="2"), allowed=("1",))
add3(API, CP, "generate(generation_config='greedy') (a string)", ("generation_config",),
     lambda: ctx().generate(Q, max_new_tokens=2, generation_config="greedy"),
     allowed=("GenerationConfig",))
add3(API, CP, "generate(use_cache=False)", ("use_cache",),
     lambda: ctx().generate(Q, max_new_tokens=2, use_cache=False), allowed=("leave it out",))
add3(API, CP, "generate(bogus=1) (an argument generate does not know)", ("bogus",),
     lambda: ctx().generate(Q, max_new_tokens=2, bogus=1), allowed=("generate", "model_kwargs"))
add3(API, CP, "generate(do_sample=True, temperature=0)", ("temperature",),
     lambda: ctx().generate(Q, max_new_tokens=2, do_sample=True, temperature=0.0),
     allowed=("positive", "do_sample=False"))
add3(API, CP, "ask_many(None)", ("questions",),
     lambda: text_ctx().ask_many(None, max_new_tokens=2), allowed=("list",))


def _ask_set():
    got = text_ctx().ask_many({"Where?", "Who?", "What?"}, max_new_tokens=2)
    return Verdict("silent", f"a set of questions answered in the set's arbitrary order: {got}")


add3(API, CP, "ask_many({set of questions}) (no order)", ("questions", "set"), _ask_set)
add3(API, CP, "ask_many(['Who?', '']) (an empty question in the list)", ("question",),
     lambda: text_ctx().ask_many(["Who?", ""], max_new_tokens=2), allowed=("non-empty",))


def _load_tokenizer_string():
    got = sparsekv.CompressedContext.load(saved_ctx(), model(), tokenizer="char-tokenizer")
    return Verdict("silent", f"tokenizer='char-tokenizer' (a string) accepted by load: "
                   f"{got.tokenizer!r}; ask() fails only later")


add3(API, CP, "load(path, model, tokenizer='name') (a name, not a tokenizer)", ("tokenizer",),
     _load_tokenizer_string)
add3(API, CP, "load(path/context.json) (the file, not its folder)", ("context.json", "folder"),
     lambda: sparsekv.CompressedContext.load(saved_ctx() / "context.json", model()),
     allowed=("folder",))
add3(API, CP, "load(path, model, policy='h2o') (a context of snapkv)", ("h2o", "policy", "H2O"),
     lambda: sparsekv.CompressedContext.load(saved_ctx(), model(), policy="h2o"),
     allowed=("SnapKV",))

# ---------------------------------------------------------------------------------------------
# pipeline("sparsekv-text-generation")
# ---------------------------------------------------------------------------------------------
PI = "pipeline"
CONTEXT = "The pass key is 41729. Remember it. " + "The grass is green. " * 6
QUESTION = " What is the pass key?"


def pipe():
    if "r3-pipe" not in _CACHE:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast, pipeline

        import sparsekv.serving.pipeline as sk

        words = ["the", "pass", "key", "is", "remember", "it", "grass", "green", "what", "?",
                 ".", *"0123456789"]
        vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3,
                 **{w: i + 4 for i, w in enumerate(words)}}
        raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        raw.pre_tokenizer = pre_tokenizers.Whitespace()
        tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                      pad_token="<pad>", unk_token="<unk>")
        _CACHE["r3-pipe"] = pipeline(sk.TASK, model=model(), tokenizer=tok)
    return _CACHE["r3-pipe"]


def pcall(context=CONTEXT, **kw):
    return pipe()(context, **{"max_new_tokens": 2, **kw})


add3(API, PI, "eviction={'bogus': 1}", ("bogus",),
     lambda: pcall(question=QUESTION, eviction={"bogus": 1}), allowed=("allowed",))
add3(API, PI, "eviction={'schedule': 'zigzag'}", ("schedule",),
     lambda: pcall(question=QUESTION, eviction={"schedule": "zigzag"}), allowed=("uniform",))
add3(API, PI, "budget=2.0", ("budget",), lambda: pcall(question=QUESTION, budget=2.0),
     allowed=("(0, 1]",))
add3(API, PI, "an empty list of contexts", ("context",), lambda: pcall([], question=QUESTION),
     allowed=("string", "non-empty"))
add3(API, PI, "two contexts with batch_size=2", ("batch_size",),
     lambda: pcall([CONTEXT, CONTEXT], question=QUESTION, batch_size=2),
     allowed=("one context", "batch_size=1"))


def _no_questions():
    got = pcall(questions=[])
    return Verdict("silent", f"questions=[] compressed the context and answered nothing: {got}")


add3(API, PI, "questions=[] (no question)", ("questions", "empty"), _no_questions)


def _question_set():
    got = pcall(questions={QUESTION, " Remember it?"})
    return Verdict("silent", f"questions as a set answered in arbitrary order: {got}")


add3(API, PI, "questions={a set}", ("questions", "set"), _question_set)
add3(API, PI, "question=[q, q] (a list under question=)", ("question",),
     lambda: pcall(question=[QUESTION, QUESTION]), allowed=("string",))
add3(API, PI, "return_full_text=False (a text-generation option)", ("return_full_text",),
     lambda: pcall(question=QUESTION, return_full_text=False), allowed=("allowed",))
add3(API, PI, "no question at all", ("question",), lambda: pcall(), allowed=("questions=",))
add3(API, PI, "context={'context': ...} (a dict)", ("context",),
     lambda: pcall({"context": CONTEXT}, question=QUESTION), allowed=("string",))
add3(API, PI, "max_new_tokens=0", ("max_new_tokens",), lambda: pcall(question=QUESTION,
                                                                     max_new_tokens=0),
     allowed=(">= 1",))

# ---------------------------------------------------------------------------------------------
# load_default_model (arguments checked before the model loads) and the tiny models
# ---------------------------------------------------------------------------------------------
DM = "load_default_model / tiny"


def _default(**kw):
    return sparsekv.load_default_model(**kw)


add3(API, DM, "load_default_model(device='gpu')", ("device", "gpu"),
     lambda: _default(device="gpu"), allowed=("cpu", "cuda"))
add3(API, DM, "load_default_model(device='cuda') without a GPU", ("device", "cuda"),
     lambda: _default(device="cuda") if not torch.cuda.is_available() else
     Verdict("clear", "a GPU is here: not this case"), allowed=("cpu", "GPU", "available"))
add3(API, DM, "load_default_model(dtype=torch.int8)", ("dtype",),
     lambda: _default(dtype=torch.int8), allowed=("float32",))


def _cache_a_file():
    f = _fresh("sparsekv-cache-file")
    f.write_text("not a folder\n")
    old = os.environ.get("SPARSEKV_CACHE")
    os.environ["SPARSEKV_CACHE"] = str(f)
    try:
        return _default()
    finally:
        if old is None:
            os.environ.pop("SPARSEKV_CACHE", None)
        else:
            os.environ["SPARSEKV_CACHE"] = old


add3(API, DM, "SPARSEKV_CACHE set to a file", ("SPARSEKV_CACHE",), _cache_a_file,
     allowed=("folder",))


def _tiny(*a, **kw):
    from sparsekv.models.tiny import tiny_model
    return tiny_model(*a, **kw)


def _tiny_unknown_override():
    m = _tiny("llama", num_layers=2)
    return Verdict("silent", f"num_layers=2 (not a config attribute) accepted: the model has "
                   f"{m.config.num_hidden_layers} layers")


add3(API, DM, "tiny_model('llama', num_layers=2) (not a config attribute)", ("num_layers",),
     _tiny_unknown_override)
add3(API, DM, "tiny_model('llama', seed='x')", ("seed",), lambda: _tiny("llama", seed="x"),
     allowed=("int",))


def _tiny_float_seed():
    a, b = _tiny("llama", seed=1.5), _tiny("llama", seed=1)
    same = all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    return Verdict("silent", f"seed=1.5 accepted{' as seed 1' if same else ''}")


add3(API, DM, "tiny_model('llama', seed=1.5)", ("seed",), _tiny_float_seed)
add3(API, DM, "tiny_model('Llama') (capitalised)", ("Llama", "family"),
     lambda: _tiny("Llama"), allowed=("llama",))
