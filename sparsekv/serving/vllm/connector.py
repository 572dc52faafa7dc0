"""`SparseKVConnector`: a vLLM V1 KV connector that serves a saved sparsekv `CompressedContext` as
the first K tokens of a request.

A request names its context in its KV transfer params (`SamplingParams(extra_args=
{"kv_transfer_params": {"sparsekv_context": "/path/to/ctx"}})`, or the OpenAI server's
`kv_transfer_params` field) and its prompt is the context's K placeholder ids followed by the
question (`SavedContext.prompt_ids`). Scheduler side: the connector claims the placeholder tokens
that vLLM's prefix cache does not already hold as computed externally (`get_num_new_matched_tokens`),
and tells the workers, in each step's metadata, which slots to fill and every live request's
position offset N - K. Worker side: `start_load_kv` writes the context's per-layer keys and
values into those slots through the attention backend's own cache write (`do_kv_cache_update`),
before the step's forward; `_patch_vllm_0_32` makes RoPE read true positions. Once loaded, the
context's full blocks are in the prefix cache under the placeholder ids and the context's
`cache_salt`, so the next question about the same context loads only its last, partial block.

The salt keeps the prefix cache honest. A request that sends a context's placeholder ids without
naming the context gets the KV of the placeholder tokens themselves computed, and vLLM caches
those blocks; were they hashed like the context's, the next request for the context would take
them from the prefix cache and the connector would load only the rest. So every request the
connector serves from a context is hashed under that context's salt (`SavedContext.cache_salt`, or
it followed by "-" and a client's own salt), which `ask_many`, `prompts_for` and the context's CLI
send; `on_new_request` gives it to a request that names the context without it (a client's own
salt is kept after it), and moves a salt of that form off a request that names no context, so no
block hashed under a context's salt holds KV that the connector did not load from that context.

Enable it with `sparsekv.serving.vllm.kv_transfer_config()` (what `LLM(kv_transfer_config=...)`
and `vllm serve --kv-transfer-config` take).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from sparsekv.serving.vllm import _patch_vllm_0_32 as _patch

_patch.check_version()

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from sparsekv.serving.vllm.context import SALT_PREFIX, load_context  # noqa: E402

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = [
    "PARAM",
    "SparseKVConnector",
    "SparseKVConnectorMetadata",
    "SparseKVConnectorOneGroup",
    "kv_transfer_config",
]

logger = logging.getLogger("sparsekv.serving.vllm")

PARAM = "sparsekv_context"  # the kv_transfer_params key naming the saved context's folder
UNSERVED = "unserved-"  # put before a context-form salt on a request that names no context
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class _Load:
    req_id: str
    path: str
    start: int  # first slot to write (the prefix cache holds the slots before it)
    stop: int  # K
    block_ids: tuple[list[int], ...]  # per KV-cache group: the request's blocks


@dataclass
class SparseKVConnectorMetadata(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)
    # every live request served from a context: request id -> N - K (read by the position patch)
    position_offsets: dict[str, int] = field(default_factory=dict)


class _SparseKVConnectorBase(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _patch.check_runner(vllm_config)
        _patch.apply()
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._stats_path = extra.get("stats_path")  # JSON lines of what was served (tests)
        # scheduler side
        self._offsets: dict[str, int] = {}
        self._pending: dict[str, tuple[str, int, int]] = {}  # req -> (path, start, K)
        self._paths: dict[str, str] = {}
        self._looked_up: set[str] = set()
        self._warned: set[str] = set()  # salt warnings logged (once per context or salt)
        # worker side
        self._slots: dict[tuple[str, int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self._group_of: dict[str, int] | None = None

    # ================================================================ scheduler side
    def on_new_request(self, request: Request) -> None:
        """Before vLLM looks the request up in its prefix cache: a request that names a context
        is hashed under the context's `cache_salt` (a request without it gets it; one with
        another salt gets `cache_salt + "-" + its salt`, so tenants that salt their requests stay
        apart), and a request that names no context but carries a salt of a context's form gets
        `UNSERVED` before it (the KV vLLM computes for it is not the context's). Both are logged
        once per context or salt, naming the fix; the request is then served as usual."""
        given = getattr(request, "cache_salt", None)
        path = (getattr(request, "kv_transfer_params", None) or {}).get(PARAM)
        if path:
            try:
                ctx = load_context(path)
            except Exception:  # noqa: BLE001 - get_num_new_matched_tokens refuses it, by name
                return
            if ctx.salts(given):
                return
            salt = ctx.cache_salt if not given else f"{ctx.cache_salt}-{given}"
            if str(ctx.path) not in self._warned:
                self._warned.add(str(ctx.path))
                logger.warning(
                    "sparsekv: request %s names the compressed context %s without its cache_salt "
                    "(got %r); the connector salts it itself (%r), so that it never reads "
                    "prefix-cache blocks a request without the context computed. Send "
                    "cache_salt=%r with the request (SavedContext.prompt, prompts_for and ask_many "
                    "do; so does the JSON of python -m sparsekv.serving.vllm.context)",
                    request.request_id, ctx.path, given, salt, ctx.cache_salt,
                )
        elif given and given.startswith(SALT_PREFIX):
            salt = UNSERVED + given
            if given not in self._warned:
                self._warned.add(given)
                logger.warning(
                    "sparsekv: request %s carries the cache_salt %r of a compressed context but "
                    "names no context in its kv_transfer_params, so vLLM computes the KV of the "
                    "placeholder tokens themselves; the connector renames its salt to %r, so those "
                    "blocks are never served for the context. Name the context: "
                    "kv_transfer_params={%r: CONTEXT_DIR}",
                    request.request_id, given, salt, PARAM,
                )
        else:
            return
        _patch.resalt(request, salt)
        self._record(
            {"event": "salt", "req_id": request.request_id, "path": path, "given": given,
             "salt": salt}
        )

    def _context_of(self, request: Request):
        params = getattr(request, "kv_transfer_params", None) or {}
        path = params.get(PARAM)
        if not path:
            return None
        ctx = load_context(path)
        prompt = list(request.prompt_token_ids or [])
        if not ctx.matches(prompt):
            raise ValueError(
                f"request {request.request_id} names the compressed context {path} but its prompt "
                f"does not start with the context's {ctx.num_slots} placeholder ids followed by a "
                "question; build it with SavedContext.prompt_ids(question_ids) (ask_many does)"
            )
        if not ctx.salts(getattr(request, "cache_salt", None)):
            # on_new_request salts every request that names a context; a request that reaches
            # here without the salt came by a path of vLLM that skipped it
            raise RuntimeError(
                f"request {request.request_id} names the compressed context {path} but is not "
                f"hashed under its cache_salt {ctx.cache_salt!r} (got {request.cache_salt!r}), so "
                "it could read prefix-cache blocks the connector did not load; "
                "SparseKVConnector.on_new_request was not called for it (a vLLM other than "
                f"{_patch.VLLM_VERSION}?)"
            )
        return ctx

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._stats_path and request.request_id not in self._looked_up:
            self._looked_up.add(request.request_id)
            self._record(
                {
                    "event": "lookup",
                    "req_id": request.request_id,
                    "prompt_len": len(request.prompt_token_ids or []),
                    "local_hit": num_computed_tokens,
                }
            )
        ctx = self._context_of(request)
        if ctx is None:
            return 0, False
        self._offsets[request.request_id] = ctx.position_offset
        self._paths[request.request_id] = str(ctx.path)
        return max(0, ctx.num_slots - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ):
        if num_external_tokens <= 0:
            if self._stats_path:  # a plain prompt, or a context wholly in the prefix cache
                self._record_alloc(request, blocks, self._paths.get(request.request_id), 0)
            return
        path = self._paths[request.request_id]
        k = load_context(path).num_slots
        self._pending[request.request_id] = (path, k - num_external_tokens, k)
        self._record_alloc(request, blocks, path, num_external_tokens)

    def _record_alloc(
        self, request: Request, blocks: KVCacheBlocks, path: str | None, loaded: int
    ) -> None:
        ctx = load_context(path) if path is not None else None
        self._record(
            {
                "event": "alloc",
                "req_id": request.request_id,
                "path": path,
                "num_slots": ctx.num_slots if ctx is not None else None,
                "num_tokens": ctx.num_tokens if ctx is not None else None,
                "loaded_slots": loaded,
                "prompt_len": len(request.prompt_token_ids or []),
                # per KV-cache group: blocks of the request, and those that are not the null
                # block (a sliding window's skipped blocks are null), after the prompt's alloc
                "blocks": [len(b) for b in blocks.get_block_ids()],
                "held": [sum(1 for i in b if i != 0) for b in blocks.get_block_ids()],
                "groups": [
                    type(g.kv_cache_spec).__name__ for g in self._kv_cache_config.kv_cache_groups
                ],
                "block_size": self._kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size,
            }
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = SparseKVConnectorMetadata(position_offsets=dict(self._offsets))
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._pending:
                path, start, stop = self._pending.pop(new.req_id)
                meta.loads.append(_Load(new.req_id, path, start, stop, new.block_ids))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in self._pending and req_id in cached.resumed_req_ids:
                path, start, stop = self._pending.pop(req_id)
                block_ids = cached.new_block_ids[i]
                assert block_ids is not None
                meta.loads.append(_Load(req_id, path, start, stop, block_ids))
        if self._pending:  # allocated but not scheduled: cannot happen for synchronous loads
            logger.warning("sparsekv: loads not scheduled this step: %s", sorted(self._pending))
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._record_finish(request, (block_ids,))
        self._forget(request)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._record_finish(request, block_ids)
        self._forget(request)
        return False, None

    def _record_finish(self, request: Request, block_ids) -> None:
        if self._stats_path:
            self._record(
                {
                    "event": "finish",
                    "req_id": request.request_id,
                    "path": self._paths.get(request.request_id),
                    "num_tokens": request.num_tokens,
                    # per KV-cache group: the blocks the request holds when it ends (a sliding
                    # window's out-of-window blocks are the null block by then)
                    "held": [sum(1 for i in b if i != 0) for b in block_ids],
                    "groups": [
                        type(g.kv_cache_spec).__name__
                        for g in self._kv_cache_config.kv_cache_groups
                    ],
                }
            )

    def _forget(self, request: Request) -> None:
        self._offsets.pop(request.request_id, None)
        self._paths.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        self._looked_up.discard(request.request_id)

    def _record(self, row: dict[str, Any]) -> None:
        if self._stats_path:
            with open(self._stats_path, "a") as f:
                f.write(json.dumps(row) + "\n")

    # ================================================================ worker side
    def _groups(self) -> dict[str, int]:
        if self._group_of is None:
            self._group_of = {}
            for g, group in enumerate(self._kv_cache_config.kv_cache_groups):
                for name in group.layer_names:
                    self._group_of[name] = g
        return self._group_of

    def _layer_slots(self, path: str, layer: int, dtype: torch.dtype):
        key = (path, layer, dtype)
        if key not in self._slots:
            k, v = load_context(path).layer_slots(layer)
            self._slots[key] = (k.to(dtype), v.to(dtype))
            if len(self._slots) > 64 * 32:  # bound the worker's copies (most recent kept)
                self._slots.pop(next(iter(self._slots)))
        return self._slots[key]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, SparseKVConnectorMetadata)
        if not meta.loads:
            return
        groups = self._groups()
        cfg = self._kv_cache_config
        for load in meta.loads:
            ctx = load_context(load.path)
            for name, layer in forward_context.no_compile_layers.items():
                kv_cache = getattr(layer, "kv_cache", None)
                impl = getattr(layer, "impl", None)
                if kv_cache is None or impl is None or name not in groups:
                    continue
                if isinstance(kv_cache, (list, tuple)):
                    kv_cache = kv_cache[0]
                m = _LAYER.search(name)
                if m is None:
                    raise ValueError(f"sparsekv: cannot tell the layer index of {name!r}")
                g = groups[name]
                block_size = cfg.kv_cache_groups[g].kv_cache_spec.block_size
                blocks = torch.tensor(load.block_ids[g], dtype=torch.long)
                tokens = torch.arange(load.start, load.stop)
                block_of = tokens // block_size
                if int(block_of.max()) >= len(blocks):
                    raise RuntimeError(
                        f"sparsekv: request {load.req_id} has {len(blocks)} blocks in group {g}, "
                        f"too few for {load.stop} slots"
                    )
                block = blocks[block_of]
                keep = block != 0  # block 0 is vLLM's null block (slots outside a window)
                if not bool(keep.any()):
                    continue
                slots = (block * block_size + tokens % block_size)[keep]
                keys, values = self._layer_slots(str(ctx.path), int(m.group(1)), kv_cache.dtype)
                sel = tokens[keep]
                impl.do_kv_cache_update(
                    layer,
                    keys[sel].to(kv_cache.device),
                    values[sel].to(kv_cache.device),
                    kv_cache,
                    slots.to(kv_cache.device),
                )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs):
        return

    def wait_for_save(self):
        return


class SparseKVConnector(_SparseKVConnectorBase, SupportsHMA):
    """The connector, with vLLM's hybrid KV-cache manager kept on: Gemma 3's sliding-window layers
    hold only the blocks of their window (the context's slots below it are vLLM's null block, and
    the connector writes only the slots that have a block)."""


class SparseKVConnectorOneGroup(_SparseKVConnectorBase):
    """The connector without hybrid-allocator support: vLLM then turns its hybrid KV-cache manager
    off and every layer holds blocks for the whole request (what `hybrid=False` selects)."""


def kv_transfer_config(
    stats_path: str | os.PathLike | None = None, hybrid: bool = True
) -> dict[str, Any]:
    """The `kv_transfer_config` that enables the connector (a dict: `LLM(kv_transfer_config=...)`
    takes it as is; `vllm serve --kv-transfer-config` takes its JSON). `hybrid=False`: the
    connector that turns vLLM's hybrid KV-cache manager off (one block table for all layers)."""
    extra: dict[str, Any] = {}
    if stats_path is not None:
        extra["stats_path"] = str(stats_path)
    return {
        "kv_connector": "SparseKVConnector" if hybrid else "SparseKVConnectorOneGroup",
        "kv_connector_module_path": "sparsekv.serving.vllm.connector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": extra,
    }
