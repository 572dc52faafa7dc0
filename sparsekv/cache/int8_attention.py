"""Decode attention that reads the INT8 store itself: no dequantized copy of a layer's entries.

With `quantize="int8"` a budgeted layer stores keys and values as int8 with one scale per token
and KV head (`sparsekv.cache.quantize`). Attending over them by first dequantizing the layer
writes and reads a copy twice the size of the store, every layer and step: on a GPU that copy is
both the largest transient of a decode step and most of its memory traffic, so INT8 would admit a
larger batch and then spend it on copying. Here one new token per sequence attends over the
int8 slots directly:

    logit[t] = (q . kq[t]) * key_scale[t] * scaling          (int8 -> float is exact)
    out      = sum_t softmax(logit)[t] * value_scale[t] * vq[t]

The scales factor out of the dot products, so a kernel converts int8 to the compute dtype in
registers. The step's own entry, just written to `slot` as int8, is attended at full precision
instead (`new_key`, `new_value`), as the dynamic layout does; masked slots (`valid` False:
empty, padding) get no weight.

Two implementations of the same arithmetic:
- `kernel="triton"`: a split-K ("flash-decoding") Triton kernel, one program per (sequence,
  KV head, split of the slots), the query heads of the KV group as the rows of its dot products,
  online softmax inside a split; the splits and the new entry merge in a few small torch ops.
  The default on CUDA when Triton is importable, head_dim is a power of two >= 16 and the
  model's dtype is float16, bfloat16 or float32. It runs
  inside `torch.compile` and CUDA graphs (a user-defined Triton kernel). Tested on CPU with
  Triton's interpreter (`TRITON_INTERPRET=1`, tests/test_int8_attention.py).
- `kernel="torch"`: the same in torch ops over blocks of `block` slots, so the transient is one
  block's float copy, never the layer's. The default elsewhere (CPU), and the reference.
"""

from __future__ import annotations

import torch

try:  # the GPU kernel, defined at import (so a compiled forward only reads a module global)
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: the torch implementation serves
    triton = tl = None

KERNELS = ("auto", "torch", "triton")
BLOCK = 1024
"""Slots per block of the torch implementation (its transient is one block's float copy)."""


def triton_available() -> bool:
    return triton is not None


def _check(query, kq, ks, vq, vs, valid, new_key, new_value):
    b, hq, q, d = query.shape
    if q != 1:
        raise ValueError(f"query must hold one new token per sequence; got {q}")
    if kq.dtype != torch.int8 or vq.dtype != torch.int8:
        raise ValueError(f"keys and values must be int8; got {kq.dtype} and {vq.dtype}")
    hk, s = kq.shape[1], kq.shape[2]
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of the KV heads ({hk})")
    want = {
        "keys": (kq, (b, hk, s, d)),
        "values": (vq, (b, hk, s, vq.shape[-1])),
        "key_scale": (ks, (b, hk, s, 1)),
        "value_scale": (vs, (b, hk, s, 1)),
        "valid": (valid, (b, hk, s)),
        "new_key": (new_key, (b, hk, 1, d)),
        "new_value": (new_value, (b, hk, 1, vq.shape[-1])),
    }
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {shape}")


def decode_attention(
    query: torch.Tensor,
    kq: torch.Tensor,
    ks: torch.Tensor,
    vq: torch.Tensor,
    vs: torch.Tensor,
    valid: torch.Tensor,
    new_key: torch.Tensor,
    new_value: torch.Tensor,
    slot: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
    kernel: str = "auto",
    block: int = BLOCK,
) -> torch.Tensor:
    """One decode step of grouped-query attention over an INT8 store plus the step's own entry.

    query `(batch, heads, 1, dim)`; kq, vq int8 `(batch, kv_heads, slots, dim)`; ks, vs
    `(batch, kv_heads, slots, 1)`; valid bool `(batch, kv_heads, slots)` (True = may attend);
    new_key, new_value `(batch, kv_heads, 1, dim)` at full precision; slot `(1,)` long, or
    `(batch, kv_heads, 1)` long when each sequence and head wrote it elsewhere: where the new entry
    was written (its int8 copy there is ignored). Returns `(batch, 1, heads, dim)` in
    the query's dtype (the layout transformers' attention functions return)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not supported; allowed values: {', '.join(KERNELS)}")
    _check(query, kq, ks, vq, vs, valid, new_key, new_value)
    if kernel == "auto":
        kernel = "triton" if _triton_fits(query, vq) else "torch"
    elif kernel == "triton" and not triton_available():
        raise ValueError("kernel='triton' needs the triton package; use kernel='torch'")
    # the new entry's int8 copy at `slot` is replaced by the full-precision one (below)
    if slot.ndim == 1:
        valid = valid.index_fill(-1, slot, False)
    else:  # one slot per sequence and KV head
        valid = valid.scatter(-1, slot, False)
    if kernel == "triton":
        acc, m, lse = _triton_splits(query, kq, ks, vq, vs, valid, scaling, softcap)
    else:
        acc, m, lse = _torch_splits(query, kq, ks, vq, vs, valid, scaling, softcap, block)
    return _merge(query, acc, m, lse, new_key, new_value, scaling, softcap)


def _triton_fits(query: torch.Tensor, vq: torch.Tensor) -> bool:
    d, dv = query.shape[-1], vq.shape[-1]
    pow2 = all(x >= 16 and x & (x - 1) == 0 for x in (d, dv))
    floats = query.dtype in (torch.float16, torch.bfloat16, torch.float32)
    return query.is_cuda and pow2 and floats and triton_available()


def _accumulate(query: torch.Tensor) -> torch.dtype:
    """float32, or float64 for a float64 model (tests compare layouts to 1e-10 there)."""
    return torch.promote_types(query.dtype, torch.float32)


def _capped(x: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return x if softcap is None else torch.tanh(x / softcap) * softcap


def _torch_splits(query, kq, ks, vq, vs, valid, scaling, softcap, block):
    """Per block of slots: the block's weighted value sum `acc`, its max logit `m` and the sum of
    exp(logit - m) `l`, as `(batch, kv_heads, blocks, groups, dim)` and `(..., groups)`."""
    b, hq, _, d = query.shape
    hk, s = kq.shape[1], kq.shape[2]
    dt = _accumulate(query)
    q = query.reshape(b, hk, hq // hk, d).to(dt)
    accs, ms, ls = [], [], []
    for start in range(0, max(s, 1), block):
        sl = slice(start, start + block)
        logits = torch.einsum("bhgd,bhkd->bhgk", q, kq[:, :, sl].to(dt))
        logits = _capped(logits * (ks[:, :, sl, 0].to(dt) * scaling)[:, :, None, :], softcap)
        logits = logits.masked_fill(~valid[:, :, None, sl], float("-inf"))
        m = logits.amax(-1)
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(logits - m_safe[..., None])  # masked slots: exp(-inf) = 0
        ls.append(p.sum(-1))
        p = p * vs[:, :, sl, 0].to(dt)[:, :, None, :]
        accs.append(torch.einsum("bhgk,bhkd->bhgd", p, vq[:, :, sl].to(dt)))
        ms.append(m)
    return torch.stack(accs, 2), torch.stack(ms, 2), torch.stack(ls, 2)


def _merge(query, acc, m, lsum, new_key, new_value, scaling, softcap):
    """Combine the splits and the step's own entry (full precision) into the softmax average."""
    b, hq, _, d = query.shape
    hk, dt = acc.shape[1], acc.dtype
    q = query.reshape(b, hk, hq // hk, d).to(dt)
    own = _capped((q * new_key.to(dt)).sum(-1) * scaling, softcap)  # (b, hk, g)
    top = torch.maximum(m.amax(2), own)  # finite: the own entry always counts
    w = torch.exp(m - top[:, :, None])  # (b, hk, splits, g); an all-masked split: exp(-inf) = 0
    w_own = torch.exp(own - top)
    num = (w[..., None] * acc).sum(2) + w_own[..., None] * new_value.to(dt)  # (b, hk, g, dv)
    den = (w * lsum).sum(2) + w_own
    out = num / den[..., None]
    return out.reshape(b, hq, 1, -1).transpose(1, 2).to(query.dtype).contiguous()


# ---- the Triton kernel --------------------------------------------------------------------------
SPLIT_BLOCK = 64
"""Slots per inner iteration of the Triton kernel."""


def split_size(slots: int, programs: int, target: int = 1024) -> int:
    """Slots per split: enough splits that (sequence, KV head, split) programs number at least
    `target` (a few per streaming multiprocessor), none shorter than 4 inner blocks. A power of
    two times `SPLIT_BLOCK`: the kernel is compiled per split size (a constant of its loop), so a
    cache that grows every step (the dynamic layout) compiles a handful of variants, not one per
    length."""
    splits = max(1, min(-(-slots // (4 * SPLIT_BLOCK)), -(-target // max(programs, 1))))
    blocks = -(-slots // (splits * SPLIT_BLOCK))
    return SPLIT_BLOCK << (blocks - 1).bit_length()


def _define_kernel():
    @triton.jit
    def int8_decode_splits(
        Q, KQ, KS, VQ, VS, VALID, ACC, M, L,
        s_qb, s_qh, s_qg,
        s_kb, s_kh, s_kn,
        s_ksb, s_ksh, s_ksn,
        s_vb, s_vh, s_vn,
        s_vsb, s_vsh, s_vsn,
        s_mb, s_mh, s_mn,
        s_ab, s_ah, s_as, s_ag,
        s_lb, s_lh, s_ls,
        HK, G, N, scaling, softcap,
        SPLIT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    ):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // HK
        h = bh % HK
        g = tl.arange(0, BLOCK_G)
        dk = tl.arange(0, D)
        dv = tl.arange(0, DV)
        q = tl.load(Q + b * s_qb + h * s_qh + g[:, None] * s_qg + dk[None, :],
                    mask=g[:, None] < G, other=0.0)
        m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, DV), tl.float32)
        start = split * SPLIT
        for off in range(0, SPLIT, BLOCK_N):
            n = start + off + tl.arange(0, BLOCK_N)
            inside = n < N
            k = tl.load(KQ + b * s_kb + h * s_kh + n[:, None] * s_kn + dk[None, :],
                        mask=inside[:, None], other=0).to(q.dtype)  # int8 -> exact
            kscale = tl.load(KS + b * s_ksb + h * s_ksh + n * s_ksn, mask=inside, other=0.0)
            ok = tl.load(VALID + b * s_mb + h * s_mh + n * s_mn, mask=inside, other=0) != 0
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            s = s * (kscale.to(tl.float32) * scaling)[None, :]
            if HAS_SOFTCAP:
                s = (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0) * softcap  # tanh
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(VQ + b * s_vb + h * s_vh + n[:, None] * s_vn + dv[None, :],
                        mask=inside[:, None], other=0).to(q.dtype)
            vscale = tl.load(VS + b * s_vsb + h * s_vsh + n * s_vsn, mask=inside, other=0.0)
            pv = (p * vscale.to(tl.float32)[None, :]).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=PRECISION)
            m_i = m_new
        row = g < G
        tl.store(ACC + b * s_ab + h * s_ah + split * s_as + g[:, None] * s_ag + dv[None, :],
                 acc, mask=row[:, None])
        tl.store(M + b * s_lb + h * s_lh + split * s_ls + g, m_i, mask=row)
        tl.store(L + b * s_lb + h * s_lh + split * s_ls + g, l_i, mask=row)

    return int8_decode_splits


_KERNEL = _define_kernel() if triton is not None else None


def _triton_splits(query, kq, ks, vq, vs, valid, scaling, softcap):
    b, hq, _, d = query.shape
    hk, n, dv = kq.shape[1], kq.shape[2], vq.shape[-1]
    g = hq // hk
    q = query.reshape(b, hk, g, d).contiguous()
    if kq.stride(-1) != 1 or vq.stride(-1) != 1:
        kq, vq = kq.contiguous(), vq.contiguous()
    size = split_size(n, b * hk)
    splits = max(1, -(-n // size))
    acc = torch.empty(b, hk, splits, g, dv, dtype=torch.float32, device=query.device)
    m = torch.empty(b, hk, splits, g, dtype=torch.float32, device=query.device)
    lsum = torch.empty_like(m)
    valid = valid.to(torch.int8)
    _KERNEL[(b * hk, splits)](
        q, kq, ks, vq, vs, valid, acc, m, lsum,
        q.stride(0), q.stride(1), q.stride(2),
        kq.stride(0), kq.stride(1), kq.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2),
        vq.stride(0), vq.stride(1), vq.stride(2),
        vs.stride(0), vs.stride(1), vs.stride(2),
        valid.stride(0), valid.stride(1), valid.stride(2),
        acc.stride(0), acc.stride(1), acc.stride(2), acc.stride(3),
        m.stride(0), m.stride(1), m.stride(2),
        hk, g, n, float(scaling), float(softcap or 1.0),
        SPLIT=size, HAS_SOFTCAP=softcap is not None,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        BLOCK_G=max(16, 1 << (g - 1).bit_length()), BLOCK_N=SPLIT_BLOCK, D=d, DV=dv,
    )
    return acc, m, lsum


__all__ = ["BLOCK", "KERNELS", "decode_attention", "split_size", "triton_available"]
