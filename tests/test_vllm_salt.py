"""The prefix-cache salt of a context served in vLLM, in sparsekv's own environment (no vLLM
needed): `SavedContext.cache_salt` is the content's own (stable for a context, another for
another context, within what vLLM's OpenAI server accepts), and every request sparsekv builds
carries it: `SavedContext.prompt`, `prompts_for`, and the JSON that `python -m
sparsekv.serving.vllm.context` prints for a client of the OpenAI server. (That the connector
keeps it, and that it stops a request without the context from poisoning the context's
prefix-cache blocks, is `tests/test_vllm.py`, in vLLM's environment.)"""

from __future__ import annotations

import json
import shutil

import torch
from conftest import tiny_model

from sparsekv import EvictionConfig, compress
from sparsekv.serving.vllm.api import prompts_for
from sparsekv.serving.vllm.context import SALT_PREFIX, SavedContext, main

SMALL = {"sink_tokens": 2, "recent_window": 8, "rerank_every": 4, "evict_slack": 2}


def test_the_cache_salt_is_the_contexts_own_and_every_request_carries_it(tmp_path, capsys):
    model = tiny_model("llama").eval()
    cfg = EvictionConfig(budget=0.3, **SMALL)
    paths = []
    for seed in (0, 1):
        ids = torch.randint(3, 120, (1, 200), generator=torch.Generator().manual_seed(seed))
        paths.append(compress(model, ids, cfg, "snapkv").save(tmp_path / f"ctx{seed}"))
    a, b = SavedContext(paths[0]), SavedContext(paths[1])
    # stable for a context: read again, or a copy of its files elsewhere (the content's salt)
    shutil.copytree(paths[0], tmp_path / "copy")
    again, copy = SavedContext(paths[0]), SavedContext(tmp_path / "copy")
    assert a.cache_salt == again.cache_salt == copy.cache_salt
    assert a.cache_salt == SALT_PREFIX + a.digest
    # another context, another salt (and other placeholders)
    assert b.cache_salt != a.cache_salt and b.placeholder_ids != a.placeholder_ids
    # what vLLM's OpenAI server accepts (validate_cache_salt, vllm/entrypoints/generate/base)
    for salt in (a.cache_salt, b.cache_salt):
        assert 0 < len(salt) <= 128 and not set(salt) & set("@/\\\x00"), salt
    # the salts the connector keeps for a's requests: a's, or a's then "-" and a client's own
    assert a.salts(a.cache_salt) and a.salts(a.cache_salt + "-tenant-a")
    assert not a.salts(None) and not a.salts("") and not a.salts(b.cache_salt)
    assert not a.salts(a.cache_salt + "x") and not a.salts("unserved-" + a.cache_salt)

    q = [5, 6, 7]
    prompt = {"prompt_token_ids": a.placeholder_ids + q, "cache_salt": a.cache_salt}
    assert a.prompt(q) == prompt
    assert prompts_for(paths[0], [q, [9]]) == [prompt, a.prompt([9])]

    # the client's JSON: prompt, kv_transfer_params and cache_salt, the /v1/completions fields
    assert main([str(paths[0]), "--question-ids", *map(str, q)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt"] == a.prompt_ids(q)
    assert out["kv_transfer_params"] == {"sparsekv_context": str(a.path)}
    assert out["cache_salt"] == a.cache_salt
    assert main([str(paths[1])]) == 0
    assert json.loads(capsys.readouterr().out)["cache_salt"] == b.cache_salt
