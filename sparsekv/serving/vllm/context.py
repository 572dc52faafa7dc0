"""A saved `CompressedContext` as vLLM serves it: a small, self-contained reader of the folder that
`CompressedContext.save` writes (`context.json` + `context.safetensors`), with no sparsekv module
that needs transformers and no vLLM either (torch, safetensors and json only), so it runs inside
vLLM's environment, and any client can build its prompts with it.

What vLLM sees of a context of N tokens: its first K prompt tokens, placeholder ids unique to the
context (a seeded draw from a hash of the saved files, so vLLM's prefix cache shares the context's
full blocks across all questions about it and never with another context or a real prompt), whose
KV the connector writes into the request's blocks instead of computing it. K is the largest number
of entries a budgeted layer kept. Every request about the context carries its `cache_salt`
("sparsekv-" + the digest), which vLLM hashes into the first block of the request: the blocks of
a request that sends the placeholder ids without naming the context (vLLM then computes the KV of
the placeholder tokens themselves) are hashed without it, so a request that names the context
never reads them from the prefix cache. Per layer, slot i of KV head h holds:

- budgeted layers (sparsekv's evicting layers): the layer's i-th kept entry of head h (keys are
  stored after RoPE at their true positions, so per-layer and per-KV-head kept sets survive; in
  decoding every kept key is in the past, so their order inside the K slots does not matter);
- sliding-window layers (Gemma 3): their last min(K, window) tokens in order, in the last slots
  (vLLM's window is counted in slots, and the window of a new token at slot K + i reaches back to
  slot K + i - window + 1, which holds the true token N + i - window + 1); the slots before them are
  never read and stay zero.

New tokens take position N + i (their true position) for RoPE while their KV goes to slot K + i:
`position_offset` = N - K, applied by `sparsekv.serving.vllm._patch_vllm_0_32`.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

__all__ = ["PLACEHOLDER_RANGE", "SALT_PREFIX", "SavedContext", "load_context"]

TENSORS_FILE = "context.safetensors"
META_FILE = "context.json"
FORMAT_VERSION = 1  # the CompressedContext format this reader was written for
# placeholder ids are drawn from this range (any valid id will do: they are never embedded, only
# hashed by the prefix cache; every common vocabulary has at least 32000 ids)
PLACEHOLDER_RANGE = (100, 30_000)
# every context's cache_salt starts with it (the connector keeps salts of this form for the
# requests it serves from that context)
SALT_PREFIX = "sparsekv-"


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


class SavedContext:
    """The placeholder prompt and per-layer KV slots of a saved compressed context.

    `num_tokens` (N), `num_slots` (K), `position_offset` (N - K), `placeholder_ids` (K ids),
    `cache_salt` (the prefix-cache salt every request about the context carries),
    `layer_slots(i)` -> (keys, values) `(K, kv_heads, head_dim)` for cache layer i."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser().resolve()
        meta_path, tensors_path = self.path / META_FILE, self.path / TENSORS_FILE
        if not meta_path.is_file() or not tensors_path.is_file():
            raise FileNotFoundError(
                f"{self.path} is not a saved compressed context (needs {META_FILE} and "
                f"{TENSORS_FILE}, as CompressedContext.save writes them)"
            )
        self.meta: dict[str, Any] = json.loads(meta_path.read_text())
        if self.meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{meta_path}: format_version={self.meta.get('format_version')!r}; this reader "
                f"serves compressed contexts of format {FORMAT_VERSION}"
            )
        self.digest = hashlib.sha256(
            (_file_digest(meta_path) + _file_digest(tensors_path)).encode()
        ).hexdigest()
        self._tensors_path = tensors_path
        self._tensors: dict[str, torch.Tensor] | None = None
        self._lock = threading.Lock()
        self.num_tokens = int(self.meta["num_tokens"])
        shape = self.meta["model_shape"]
        self.layer_types: list[str] = list(shape.get("layer_types") or [])
        self.sliding_window: int | None = shape.get("sliding_window")
        self.num_kv_heads = int(shape["num_kv_heads"])
        self.head_dim = int(shape["head_dim"])
        layers = self.meta["layers"]
        evicting = [m for m in layers if m.get("kind") == "evicting" and not m["empty"]]
        if not evicting:
            raise ValueError(f"{self.path}: the context has no budgeted (evicting) layer")
        self.num_slots = max(int(m["kept"]) for m in evicting)
        uneven = sorted({int(m["kept"]) for m in evicting})
        if len(uneven) > 1:
            # vLLM gives all layers of a request one sequence length; a layer that kept fewer
            # entries than K would attend to K - kept slots it does not have.
            raise ValueError(
                f"{self.path}: the budgeted layers kept different numbers of entries {uneven} "
                "(a per-layer schedule); vLLM serves one length per request: compress it with "
                "sparsekv.serving.vllm.compress_for_vllm (every budgeted layer keeps the largest "
                "layer's K, its own top K) or with schedule='uniform'"
            )
        self.position_offset = self.num_tokens - self.num_slots
        self.placeholder_ids = self._placeholders()
        # vLLM's `cache_salt`, hashed into the first block of a request: 73 characters, within
        # the OpenAI server's limits (at most 128, no '@', '/', backslash or NUL)
        self.cache_salt = SALT_PREFIX + self.digest

    # ---- the prompt ---------------------------------------------------------------------------
    def _placeholders(self) -> list[int]:
        lo, hi = PLACEHOLDER_RANGE
        rng = random.Random(int(self.digest[:16], 16))
        return [rng.randrange(lo, hi) for _ in range(self.num_slots)]

    def prompt_ids(self, question_ids: list[int]) -> list[int]:
        """The token ids vLLM is asked with: the K placeholders, then the question's ids."""
        q = [int(t) for t in question_ids]
        if not q:
            raise ValueError("question_ids is empty: vLLM needs at least one token to compute")
        return self.placeholder_ids + q

    def prompt(self, question_ids: list[int]) -> dict[str, Any]:
        """The vLLM token prompt of a question: `{"prompt_token_ids": prompt_ids(question_ids),
        "cache_salt": cache_salt}` (what `LLM.generate` takes; the request must also name the
        context in its `kv_transfer_params`)."""
        return {"prompt_token_ids": self.prompt_ids(question_ids), "cache_salt": self.cache_salt}

    def salts(self, salt: str | None) -> bool:
        """Whether a request's `cache_salt` is this context's: `cache_salt` itself, or
        `cache_salt + "-" + anything` (a client's own salt after it, e.g. one per tenant)."""
        return bool(salt) and (salt == self.cache_salt or salt.startswith(self.cache_salt + "-"))

    def matches(self, prompt_ids: list[int]) -> bool:
        """Whether a prompt starts with this context's placeholders (and has a question)."""
        k = self.num_slots
        return len(prompt_ids) > k and list(prompt_ids[:k]) == self.placeholder_ids

    # ---- the KV -------------------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        with self._lock:
            if self._tensors is None:
                from safetensors.torch import load_file

                self._tensors = load_file(str(self._tensors_path))
            return self._tensors

    def _dense(self, i: int, name: str) -> torch.Tensor:
        t = self.tensors()
        x = t[f"layers.{i}.{name}"]
        scale = t.get(f"layers.{i}.{'key' if name == 'keys' else 'value'}_scale")
        if scale is not None:  # quantize="int8": int8 entries times their per-entry scale
            x = x.float() * scale.float()
        return x

    def is_sliding(self, i: int) -> bool:
        return bool(self.layer_types) and self.layer_types[i] == "sliding_attention"

    def layer_slots(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of cache layer `i` in the K slots: `(K, kv_heads, head_dim)`."""
        m = self.meta["layers"][i]
        k_slots = self.num_slots
        shape = (k_slots, self.num_kv_heads, self.head_dim)
        if m["empty"]:
            raise ValueError(f"{self.path}: cache layer {i} is empty")
        keys, values = self._dense(i, "keys"), self._dense(i, "values")  # (1, h, kept, d)
        if keys.shape[0] != 1:
            raise ValueError(f"{self.path}: layer {i} holds a batch of {keys.shape[0]}, not 1")
        kept = keys.shape[2]
        if m.get("kind") == "evicting":
            # slot j of head h = the layer's j-th kept entry of head h
            return keys[0].transpose(0, 1).contiguous(), values[0].transpose(0, 1).contiguous()
        # a sliding-window layer: its last min(K, kept) tokens in order, in the last slots
        n = min(k_slots, kept)
        out_k = torch.zeros(shape, dtype=keys.dtype)
        out_v = torch.zeros(shape, dtype=values.dtype)
        out_k[k_slots - n :] = keys[0, :, kept - n :].transpose(0, 1)
        out_v[k_slots - n :] = values[0, :, kept - n :].transpose(0, 1)
        return out_k, out_v

    def __repr__(self) -> str:
        return (
            f"SavedContext({str(self.path)!r}, tokens={self.num_tokens}, slots={self.num_slots}, "
            f"offset={self.position_offset})"
        )


_CACHE: OrderedDict[str, SavedContext] = OrderedDict()
_CACHE_LOCK = threading.Lock()


def load_context(path: str | os.PathLike, keep: int = 64) -> SavedContext:
    """`SavedContext(path)`, memoized per process (the `keep` most recently used folders): every
    question about a context reads its files once. A folder rewritten since is read again."""
    key = str(Path(path).expanduser().resolve())
    try:
        stamp = tuple(os.stat(Path(key) / f).st_mtime_ns for f in (META_FILE, TENSORS_FILE))
    except OSError:
        stamp = None
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
        if hit is not None and getattr(hit, "_stamp", None) == stamp:
            _CACHE.move_to_end(key)
            return hit
    ctx = SavedContext(key)
    ctx._stamp = stamp  # type: ignore[attr-defined]
    with _CACHE_LOCK:
        _CACHE[key] = ctx
        while len(_CACHE) > keep:
            _CACHE.popitem(last=False)
    return ctx


def main(argv: list[str] | None = None) -> int:
    """`python -m sparsekv.serving.vllm.context CTX [--question-ids 1 2 3]`: the JSON a client of
    vLLM's OpenAI-compatible server needs: the prompt (placeholders, then the question's ids), the
    `kv_transfer_params` that name the context and its `cache_salt` (`prompt`,
    `kv_transfer_params` and `cache_salt` are fields of the `/v1/completions` body)."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    ap.add_argument("ctx")
    ap.add_argument("--question-ids", type=int, nargs="*", default=[])
    args = ap.parse_args(argv)
    ctx = load_context(args.ctx)
    out = {
        "num_tokens": ctx.num_tokens,
        "num_slots": ctx.num_slots,
        "prompt": ctx.prompt_ids(args.question_ids) if args.question_ids else ctx.placeholder_ids,
        "kv_transfer_params": {"sparsekv_context": str(ctx.path)},
        "cache_salt": ctx.cache_salt,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
