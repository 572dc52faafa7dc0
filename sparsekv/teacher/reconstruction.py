"""Question-free teacher targets: what the frozen model attends to while it repeats its context.

This module owns the reconstruction signals of `TargetConfig` (`signal="reconstruction"` and
`"both"`, `kind="kvzip_plus"`) and `training_targets`, the one entry that serves every signal
(`signal="questions"` is `sparsekv.teacher.statistics.teacher_targets`). It runs the frozen model through
`sparsekv.teacher.forward.teacher_forward` and knows nothing about heads, losses or caches.

**The pass.** Per batch row, its real tokens `c` (length m, padding dropped) are followed by the
repeat prompt (`sparsekv.policies.reconstruction.REPEAT_PROMPT`, tokenized by the caller) and by `c`
again, teacher-forced (without its first token when that is the model's BOS): one forward over
`c + prompt + copy`, about 2m tokens, as KVzap trains. The copy's queries are the queries at the
positions of `copy`. Causal attention makes everything at positions < m exactly what a forward
over `c` alone gives: the head's inputs and the questions statistic come from the same pass.

- `kind="attention"`, `"reconstruction"`: for each budgeted layer and source layer, the
  attention a context token receives from the copy's queries, reduced as `target.stat` says
  (sum over the group's query heads, then "mass" or "max" over the copy's queries, `normalize`
  as in `sparsekv.teacher.statistics`; every copy query sees every context token), then combined across
  layers by `cumulative_targets` with sliding-window layers left out (a 512-token window cannot
  see the copy, so Gemma 3 uses its full-attention layers only). A distribution per row.
- `"both"`: `(1 - w) * questions target + w * reconstruction target`, `w =
  target.reconstruction_weight`; the questions target is read from the queries at positions < m
  of the same pass. A distribution per row.
- `kind="kvzip_plus"` (KVzap's target; signal must be "reconstruction"): per budgeted layer and
  KV head `g`, `log max_{j in copy, h in g} A^h[j, i] * ||W_O^h v_i|| / ||h_j||`, with `A^h` the
  softmax attention of query head h, `W_O^h` its slice of o_proj, `v_i` the cached value and
  `h_j` the query token's self_attn input. Per layer, no cross-layer mix, log scale.

Memory: the copy's queries are processed `block_size` at a time; no `seq x seq` matrix is built.
The repeat roughly doubles the tokens of a teacher forward: `train.targets` caches the results.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from sparsekv.models.families import model_shape, text_config
from sparsekv.teacher.forward import layer_scaling, teacher_forward, valid_mask
from sparsekv.teacher.statistics import (
    TargetConfig,
    attention_received,
    cumulative_targets,
    default_layers,
    source_layers,
    teacher_targets,
)


def reconstruction_layout(
    context: Sequence[int], prompt_ids: Sequence[int], bos_token_id: int | None = None
) -> tuple[list[int], int]:
    """`(ids, copy_start)`: `context + prompt_ids + copy`, copy = `context` without its first
    token when that is `bos_token_id`; the copy occupies `ids[copy_start:]`."""
    context = [int(t) for t in context]
    if not context:
        raise ValueError("context is empty: nothing to reconstruct")
    copy = context[1:] if bos_token_id is not None and context[0] == bos_token_id else context
    if not copy:
        raise ValueError("context holds only a BOS token: nothing to reconstruct")
    ids = context + [int(t) for t in prompt_ids] + copy
    return ids, len(ids) - len(copy)


def _value_output_norms(
    value: torch.Tensor, o_weight: torch.Tensor, num_kv_groups: int
) -> torch.Tensor:
    """`||W_O^h v_i||` per query head: value `(batch, kv_heads, seq, head_dim)`, o_weight
    `(hidden, heads * head_dim)` -> `(batch, heads, seq)` float32, through the per-head Gram
    matrix `W_O^h^T W_O^h` (no `(batch, heads, seq, hidden)` tensor)."""
    hk, d = value.shape[1], value.shape[3]
    heads = hk * num_kv_groups
    w = o_weight.float().T.reshape(heads, d, -1)  # (heads, d, hidden)
    gram = torch.matmul(w, w.transpose(1, 2))  # (heads, d, d)
    v = value.float().repeat_interleave(num_kv_groups, dim=1)  # (b, heads, n, d)
    sq = torch.einsum("bhnd,hde,bhne->bhn", v, gram, v)
    return sq.clamp_min(0.0).sqrt()


@torch.no_grad()
def repeat_received(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    hidden: torch.Tensor | None,
    o_weight: torch.Tensor | None,
    *,
    scaling: float,
    softcap: float | None = None,
    num_kv_groups: int,
    block_size: int = 512,
    stat: str = "mass",
    normalize: str = "none",
    reconstruction: bool = True,
    kvzip_plus: bool = True,
    query_positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """What the keys receive from a run of later queries, from one softmax per block:
    `(reconstruction, kvzip_plus)`, each `(batch, kv_heads, seq)` float32 or None when not asked.

    query `(batch, heads, q, head_dim)`: the queries, at absolute positions `query_positions`
    (`(q,)` ascending; default `seq - q` .. `seq - 1`, the repeated copy); key, value `(batch,
    kv_heads, seq, head_dim)` (after RoPE and norms); hidden `(batch, q, hidden)`: the self_attn
    inputs of those queries; o_weight `(hidden, heads * head_dim)`: the layer's o_proj weight (value,
    hidden, o_weight are read only for `kvzip_plus`). Causal, full attention (query at position p
    sees keys 0..p), no padding.

    - reconstruction: the attention a key receives, summed over the group's query heads, then
      "mass" (sum) or "max" over the queries, `normalize` as `attention_received` (equal to
      `attention_received(query, key, stat=stat, normalize=normalize, exclude_self=False)` for the
      default positions);
    - kvzip_plus: KVzap's `max_{j, h in group} A^h[j, i] * ||W_O^h v_i|| / ||h_j||` (the log is
      taken by the caller).

    Extra memory O(batch x heads x block x seq)."""
    if block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be >= 1")
    b, hq, q_len, d = query.shape
    _, hk, n, _ = key.shape
    g = num_kv_groups
    if hq != hk * g:
        raise ValueError(
            f"query {tuple(query.shape)} and key {tuple(key.shape)} do not match with "
            f"num_kv_groups={num_kv_groups}"
        )
    if kvzip_plus and (hidden is None or hidden.shape[:2] != (b, q_len)):
        got = None if hidden is None else tuple(hidden.shape)
        raise ValueError(f"hidden {got} must be (batch, q) = {(b, q_len)} plus the hidden size")
    dev = query.device
    positions = torch.arange(n, device=dev)
    if query_positions is None:
        query_positions = positions[n - q_len :]
    query_positions = query_positions.to(dev)
    if query_positions.shape != (q_len,):
        raise ValueError(f"query_positions {tuple(query_positions.shape)} must be ({q_len},)")
    out_r = torch.zeros(b, hk, n, dtype=torch.float32, device=dev) if reconstruction else None
    out_z = torch.zeros(b, hk, n, dtype=torch.float32, device=dev) if kvzip_plus else None
    per_query = normalize in ("length", "uniform") and stat == "mass"
    count = (
        torch.zeros(n, dtype=torch.float32, device=dev) if reconstruction and per_query else None
    )
    if kvzip_plus:
        wov = _value_output_norms(value, o_weight, g).view(b, hk, g, 1, n)
        inv_h = 1.0 / hidden.float().norm(dim=-1).clamp_min(1e-12)  # (b, q)
    kf = key.float()
    for s in range(0, q_len, block_size):
        e = min(s + block_size, q_len)
        qpos = query_positions[s:e]
        hi = int(qpos[-1]) + 1
        allowed = positions[None, :hi] <= qpos[:, None]  # (B, K)
        qb = query[:, :, s:e].float().reshape(b, hk, g * (e - s), d)
        logits = torch.matmul(qb, kf[:, :, :hi].transpose(-1, -2)).mul_(scaling)
        logits = logits.view(b, hk, g, e - s, hi)
        if softcap is not None:
            logits.div_(softcap).tanh_().mul_(softcap)
        logits.masked_fill_(~allowed, torch.finfo(torch.float32).min)
        probs = torch.softmax(logits, dim=-1)
        del logits
        probs.masked_fill_(~allowed, 0.0)
        if kvzip_plus:
            z = probs * inv_h[:, None, None, s:e, None]
            z.mul_(wov[..., :hi])
            out_z[:, :, :hi] = torch.maximum(out_z[:, :, :hi], z.amax(dim=(2, 3)))
            del z
        if reconstruction:
            if normalize == "uniform":
                probs.mul_(allowed.sum(-1).to(torch.float32)[:, None])
            a = probs.sum(2)  # (b, hk, B, K)
            if stat == "mass":
                out_r[:, :, :hi] += a.sum(-2)
            else:
                out_r[:, :, :hi] = torch.maximum(out_r[:, :, :hi], a.amax(-2))
            if count is not None:
                count[:hi] += allowed.sum(0).to(torch.float32)
            del a
        del probs
    if count is not None:
        c = count.view(1, 1, n)
        out_r = torch.where(c > 0, out_r / c.clamp_min(1.0), torch.zeros_like(out_r))
    return out_r, out_z


def kvzip_plus_received(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor,
    o_weight: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    num_kv_groups: int,
    block_size: int = 512,
) -> torch.Tensor:
    """KVzip+ statistic of every key: `max_{j, h in group} A^h[j, i] * ||W_O^h v_i|| / ||h_j||`.

    query `(batch, heads, q, head_dim)`: the copy's queries, at absolute positions `seq - q` ..
    `seq - 1`; key, value `(batch, kv_heads, seq, head_dim)` (after RoPE and norms); hidden
    `(batch, q, hidden)`: the self_attn inputs of those queries; o_weight `(hidden, heads *
    head_dim)`: the layer's o_proj weight. Causal, full attention (the softmax of query j runs over
    keys 0..j). Returns `(batch, kv_heads, seq)` float32 (the log is taken by the caller).
    `repeat_received` with the reconstruction statistic left out.
    """
    _, z = repeat_received(
        query,
        key,
        value,
        hidden,
        o_weight,
        scaling=scaling,
        softcap=softcap,
        num_kv_groups=num_kv_groups,
        block_size=block_size,
        reconstruction=False,
    )
    return z


def _row_statistics(
    model: nn.Module,
    ids: list[int],
    copy_start: int,
    m: int,
    target: TargetConfig,
    layers: list[int],
    q_layers: set[int],
    r_layers: set[int],
    block_size: int,
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """One reconstruction pass over one row: `(questions, reconstruction, hidden)` statistics,
    layer -> `(1, kv_heads, m)` for the `m` context tokens, and layer -> `(1, m, hidden)`."""
    received_q: dict[int, torch.Tensor] = {}
    received_r: dict[int, torch.Tensor] = {}

    def compute(module, layer, query, key, value, hidden, kwargs):
        common = {
            "scaling": layer_scaling(module, kwargs),
            "softcap": kwargs.get("softcap"),
            "num_kv_groups": query.shape[1] // key.shape[1],
            "block_size": block_size,
        }
        if layer in q_layers:
            received_q[layer] = attention_received(
                query[:, :, :m],
                key[:, :, :m],
                stat=target.stat,
                sliding_window=kwargs.get("sliding_window"),
                normalize=target.normalize,
                exclude_self=target.exclude_self,
                min_distance=target.min_distance,
                **common,
            )
        if layer not in r_layers:
            return
        if target.kind == "kvzip_plus":
            r = kvzip_plus_received(
                query[:, :, copy_start:],
                key,
                value,
                hidden[:, copy_start:],
                module.o_proj.weight,
                **common,
            )
        else:
            r = attention_received(
                query[:, :, copy_start:],
                key,
                stat=target.stat,
                normalize=target.normalize,
                exclude_self=False,
                **common,
            )
        received_r[layer] = r[..., :m]

    device = next(model.parameters()).device
    hidden = teacher_forward(
        model,
        torch.tensor([ids], dtype=torch.long, device=device),
        None,
        compute,
        layers=sorted(q_layers | r_layers),
        hidden_layers=layers,
    )
    return received_q, received_r, {i: h[:, :m] for i, h in hidden.items()}


def training_targets(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    target: TargetConfig | None = None,
    layers: Sequence[int] | None = None,
    block_size: int = 512,
    *,
    repeat_prompt_ids: Sequence[int] | None = None,
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Targets and head inputs for the budgeted `layers`, for any `target.signal`.

    input_ids, attention_mask `(batch, seq)` (1 = real token). Returns `(targets, hidden)`:
    layer -> `(batch, kv_heads, seq)` float32 targets (distributions for kind "attention", log
    scores for "kvzip_plus"; 0 on padding) and layer -> `(batch, seq, hidden)` self_attn inputs.
    `repeat_prompt_ids`: the tokens of `sparsekv.policies.reconstruction.REPEAT_PROMPT` (no special
    tokens), required unless `target.signal == "questions"`. Reconstruction rows run one pass
    each (rows differ in length); their real tokens are placed at positions 0..m-1, as a
    right-padded or unpadded row already has them.
    """
    target = TargetConfig() if target is None else target
    if target.probe_weight:
        raise ValueError(
            f"target.probe_weight={target.probe_weight:g}: the probe target is read from a teacher "
            "store built with the probe signal (dataset: store:PATH; python -m "
            "sparsekv.teacher.store build --signals questions,reconstruction,kvzip_plus,probe)"
        )
    if target.signal == "questions":
        return teacher_targets(model, input_ids, attention_mask, target, layers, block_size)
    if repeat_prompt_ids is None or len(repeat_prompt_ids) == 0:
        raise ValueError(
            f"signal={target.signal!r} needs repeat_prompt_ids (the tokenized "
            "sparsekv.policies.reconstruction.REPEAT_PROMPT)"
        )
    shape = model_shape(model)
    types = shape.layer_types
    layers = list(default_layers(model) if layers is None else layers)
    sliding = [i for i in layers if types[i] != "full_attention"]
    if sliding:
        raise ValueError(
            f"layers {sliding} slide: signal={target.signal!r} reads the repeated copy, which only "
            "full-attention layers see; budget the full-attention layers"
        )
    if target.kind == "kvzip_plus":
        r_layers, q_layers = set(layers), set()
    else:
        r_layers = {s for i in layers for s in source_layers(i, target, types, full_only=True)}
        q_layers = set()
        if target.signal == "both":
            q_layers = {s for i in layers for s in source_layers(i, target, types)}
    valid = valid_mask(input_ids, attention_mask)
    b, n = input_ids.shape
    bos = getattr(text_config(model), "bos_token_id", None)
    targets = {i: torch.zeros(b, shape.num_kv_heads, n, device=input_ids.device) for i in layers}
    hidden: dict[int, torch.Tensor] = {}
    for row in range(b):
        context = input_ids[row][valid[row]].tolist()
        ids, copy_start = reconstruction_layout(context, repeat_prompt_ids, bos)
        m = len(context)
        rq, rr, h = _row_statistics(
            model, ids, copy_start, m, target, layers, q_layers, r_layers, block_size
        )
        if target.kind == "kvzip_plus":
            tiny = torch.finfo(torch.float32).tiny
            row_t = {i: rr[i].clamp_min(tiny).log() for i in layers}
        else:
            row_t = cumulative_targets(rr, layers, target, types, full_only=True)
            if target.signal == "both":
                w = target.reconstruction_weight
                tq = cumulative_targets(rq, layers, target, types)
                row_t = {i: (1.0 - w) * tq[i] + w * row_t[i] for i in layers}
        where = valid[row].nonzero().squeeze(-1)
        for i in layers:
            targets[i][row, :, where] = row_t[i][0].to(targets[i].device)
            if i not in hidden:
                hidden[i] = h[i].new_zeros(b, n, h[i].shape[-1])
            hidden[i][row, where] = h[i][0]
    return targets, hidden
