"""One stored row of a teacher store: computing its tensors from the frozen model
(`compute_row`) and combining a training target from them (`combine_targets`, the formulas of
`sparsekv.teacher.reconstruction.training_targets`).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from sparsekv.teacher.reconstruction import repeat_received


@torch.no_grad()
def compute_row(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    settings: dict[str, Any],
    layers: Sequence[int],
    block_size: int = 512,
) -> dict[str, torch.Tensor]:
    """The stored tensors of one row: `(length,)` ids and mask in, name -> tensor out (statistics
    `(kv_heads, length)` float32 with 0 on padding, `hidden.<l>` `(length, hidden)` in the
    model's dtype). `settings` is `target_settings(...)`. One frozen forward over the real tokens
    `c` into a cache, which the repeat pass (`repeat prompt + copy`, when a repeat signal is
    stored) and the probes (`sparsekv.teacher.probes`, which must not see the copy) each
    continue: c's forward runs once. A sequence too short for any probe stores a zero probe
    statistic (its probe target is empty and `combine_targets` leaves it out)."""
    from sparsekv.models.families import model_shape, text_config
    from sparsekv.teacher.forward import layer_scaling, teacher_forward
    from sparsekv.teacher.probes import probe_layout
    from sparsekv.teacher.reconstruction import reconstruction_layout
    from sparsekv.teacher.statistics import attention_received

    shape = model_shape(model)
    n = input_ids.shape[-1]
    valid = attention_mask.to(torch.bool).cpu()
    context = input_ids.cpu()[valid].tolist()
    m = len(context)
    if m == 0:
        raise ValueError("a row without real tokens cannot be stored")
    q_layers = set(settings["question_layers"])
    r_layers = set(settings["reconstruction_layers"])
    z_layers = set(settings["kvzip_plus_layers"])
    p_layers = set(settings.get("probe_layers") or [])
    probes = None
    if p_layers:
        pr = settings["probe"]
        probes = probe_layout(
            context,
            pr["prompt_ids"],
            count=pr["count"],
            cue=pr["cue"],
            answer=pr["answer"],
            seed=pr["seed"],
            sink=pr["sink"],
        )
    if r_layers or z_layers:
        bos = getattr(text_config(model), "bos_token_id", None)
        ids, copy_start = reconstruction_layout(context, settings["repeat_prompt_ids"], bos)
    got: dict[str, torch.Tensor] = {}

    def probe_stat(module, layer, query, key, kwargs):
        # `query` holds the probes' part only (positions m onwards); `key` spans c too
        qpos = torch.tensor(probes.query_positions, device=query.device)
        r, _ = repeat_received(
            query[:, :, qpos - m],
            key,
            None,
            None,
            None,
            scaling=layer_scaling(module, kwargs),
            softcap=kwargs.get("softcap"),
            num_kv_groups=query.shape[1] // key.shape[1],
            block_size=block_size,
            stat=settings["stat"],
            normalize=settings["normalize"],
            kvzip_plus=False,
            query_positions=qpos,
        )
        got[f"probe.{layer}"] = r[..., :m]

    def common(module, query, key, kwargs) -> dict[str, Any]:
        return {
            "scaling": layer_scaling(module, kwargs),
            "softcap": kwargs.get("softcap"),
            "num_kv_groups": query.shape[1] // key.shape[1],
            "block_size": block_size,
        }

    def questions(module, layer, query, key, value, hidden, kwargs):
        got[f"questions.{layer}"] = attention_received(
            query,
            key,
            stat=settings["stat"],
            sliding_window=kwargs.get("sliding_window"),
            normalize=settings["normalize"],
            exclude_self=settings["exclude_self"],
            min_distance=settings["min_distance"],
            **common(module, query, key, kwargs),
        )

    def repeat(module, layer, query, key, value, hidden, kwargs):
        # the continuation `prompt + copy` after c: its copy starts at copy_start - m
        r, z = repeat_received(  # one softmax serves both
            query[:, :, copy_start - m :],
            key,
            value,
            hidden[:, copy_start - m :],
            module.o_proj.weight,
            stat=settings["stat"],
            normalize=settings["normalize"],
            reconstruction=layer in r_layers,
            kvzip_plus=layer in z_layers,
            **common(module, query, key, kwargs),
        )
        if r is not None:
            got[f"reconstruction.{layer}"] = r[..., :m]
        if z is not None:
            got[f"kvzip_plus.{layer}"] = z[..., :m]

    # c once, into a cache; the repeat pass and the probes each continue it (the probes never
    # see the copy), so c's forward is not run again for either
    device = next(model.parameters()).device
    tensor = functools.partial(torch.tensor, dtype=torch.long, device=device)
    cache = DynamicCache(config=text_config(model)) if (r_layers or z_layers or p_layers) else None
    hidden = teacher_forward(
        model, tensor([context]), None, questions, layers=sorted(q_layers),
        hidden_layers=list(layers), cache=cache,
    )
    if p_layers and not probes.query_positions:
        for layer in p_layers:
            got[f"probe.{layer}"] = torch.zeros(1, shape.num_kv_heads, m)
    elif p_layers:
        branch = copy.deepcopy(cache) if (r_layers or z_layers) else cache
        teacher_forward(
            model, tensor([probes.ids[m:]]), None,
            lambda module, layer, query, key, value, hidden_, kwargs: probe_stat(
                module, layer, query, key, kwargs
            ),
            layers=sorted(p_layers), hidden_layers=[], cache=branch,
        )
        del branch
    if r_layers or z_layers:
        teacher_forward(
            model, tensor([ids[m:]]), None, repeat, layers=sorted(r_layers | z_layers),
            hidden_layers=[], cache=cache,
        )
    del cache
    where = valid.nonzero().squeeze(-1)
    out: dict[str, torch.Tensor] = {
        "input_ids": input_ids.detach().to("cpu", torch.int64).clone(),
        "attention_mask": valid.to(torch.uint8),
    }
    for name, stat in got.items():
        full = torch.zeros(shape.num_kv_heads, n, dtype=torch.float32)
        full[:, where] = stat[0].float().cpu()
        out[name] = full
    for i in layers:
        h = hidden[i][0, :m].cpu()
        full = h.new_zeros(n, h.shape[-1])
        full[where] = h
        out[f"hidden.{i}"] = full
    return out


def combine_targets(
    stats: dict[str, torch.Tensor],
    valid: torch.Tensor,
    target,
    layers: Sequence[int],
    layer_types: Sequence[str],
) -> dict[int, torch.Tensor]:
    """The training target of each of `layers` for one row, `(kv_heads, length)`, from its stored
    statistics (name -> `(kv_heads, length)`) and `(length,)` mask: exactly what
    `sparsekv.teacher.reconstruction.training_targets` computes from the model (distributions over
    the real tokens; kvzip_plus: log scores, 0 on padding)."""
    from sparsekv.teacher.statistics import cumulative_targets

    def group(prefix: str) -> dict[int, torch.Tensor]:
        return {
            int(k.split(".", 1)[1]): v[None].float()
            for k, v in stats.items()
            if k.startswith(prefix + ".")
        }

    valid = valid.to(torch.bool)
    if target.kind == "kvzip_plus":
        z = group("kvzip_plus")
        tiny = torch.finfo(torch.float32).tiny
        return {
            i: torch.where(valid, z[i][0].clamp_min(tiny).log(), torch.zeros_like(z[i][0]))
            for i in layers
        }
    if target.signal == "questions":
        r = cumulative_targets(group("questions"), layers, target, layer_types)
    else:
        r = cumulative_targets(group("reconstruction"), layers, target, layer_types, full_only=True)
        if target.signal == "both":
            w = target.reconstruction_weight
            q = cumulative_targets(group("questions"), layers, target, layer_types)
            r = {i: (1.0 - w) * q[i] + w * r[i] for i in layers}
    if target.probe_weight:
        p = target.probe_weight
        t = cumulative_targets(group("probe"), layers, target, layer_types, full_only=True)
        # a sequence too short for any probe has an empty probe target: its base target stays
        r = {i: (1.0 - p) * r[i] + p * t[i] if t[i].sum() > 0 else r[i] for i in layers}
    return {i: r[i][0] for i in layers}
