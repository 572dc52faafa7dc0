"""LoRA co-adaptation: teach the frozen model to read its own compressed cache.

A LoRA (peft `LoraConfig` + `get_peft_model`) on the attention projections of the
full-attention layers is trained so that the model reading a cache compressed by the learned
policy matches the full-cache model's next-token distribution (the idea behind DMS's retrofit
and RestoreKV). One step, for a block of `context_len + continuation_len` tokens:

- teacher: the base model (LoRA disabled), full attention, no gradient: logits
  `(1, continuation_len, vocab)` at the continuation positions;
- student: the model with the LoRA prefills the context through a `SparseKVCache` with the
  learned policy (the gate, under `use`'s settings) at `budget`, evicting as at inference, then
  the continuation is teacher-forced through that cache: logits `(1, continuation_len, vocab)`;
- loss: KL(teacher || student) per position, summed over the vocabulary, averaged over the
  continuation positions (the context's own positions attend to everything before eviction,
  so they carry no signal). Gradients reach the LoRA only: the base model is frozen and the
  gate scores under `no_grad`; the kept keys and values are gathered, not detached, so the
  continuation's loss flows back into the LoRA of the context's projections.

Config: the `lora:` section of the training YAML (`LoraTrainConfig`). With `lora.adapter` unset
the LoRA is trained after the head, in the same run; with `lora.adapter: DIR` only the LoRA is
trained, for that adapter's gate, and `<output_dir>/final` receives a copy of the adapter with
the LoRA in its `lora/` subfolder (a standard PEFT folder: `PeftModel.from_pretrained` loads it
on its own). The LoRA phase is short and not checkpointed: an interrupted run redoes it.
It knows nothing about the head's training; saving goes through `ScorerAdapter.save_pretrained`.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from train.lora_config import USES, LoraTrainConfig

LORA_METRICS = "lora_metrics.jsonl"


# ---------------------------------------------------------------------- the LoRA model


def lora_layers(model: nn.Module, cfg: LoraTrainConfig) -> list[int]:
    from sparsekv.models.families import model_shape

    shape = model_shape(model)
    layers = cfg.layers if cfg.layers is not None else shape.full_layers
    bad = [x for x in layers if x >= shape.num_layers]
    if bad:
        raise ValueError(
            f"lora.layers={layers}: {bad} out of range; the model has {shape.num_layers} layers"
        )
    return list(layers)


def peft_config(model: nn.Module, cfg: LoraTrainConfig):
    """The peft `LoraConfig`: the chosen projections of the chosen decoder layers."""
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        layers_to_transform=lora_layers(model, cfg),
        layers_pattern="layers",
        bias="none",
        task_type="CAUSAL_LM",
    )


@contextmanager
def trainable_lora(model: nn.Module, cfg: LoraTrainConfig, seed: int = 0) -> Iterator[nn.Module]:
    """`get_peft_model(model, peft_config(...))` for the block (LoRA B initialized to zero, so
    the model starts exactly as the base); on exit the LoRA is unloaded (no merge) and the
    model's modules, `requires_grad` flags and mode come back as they were."""
    from peft import get_peft_model

    from sparsekv.scoring.lora import unload_lora

    grads = {name: p.requires_grad for name, p in model.named_parameters()}
    training = model.training
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft asks transformers' deprecated `is_gradient_checkpointing` (a FutureWarning)
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing", category=FutureWarning
        )
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, peft_config(model, cfg))
    try:
        peft_model.eval()  # no dropout in the frozen model ...
        for name, module in peft_model.named_modules():
            if name.endswith("lora_dropout"):
                module.train()  # ... but the LoRA's own dropout (cfg.dropout) stays on
        yield peft_model
    finally:
        unload_lora(peft_model, model, grads, training)


def lora_parameters(peft_model: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in peft_model.named_parameters() if p.requires_grad and "lora_" in n]


# ---------------------------------------------------------------------- the objective


def continuation_kl(
    peft_model: nn.Module,
    policy,
    eviction,
    ids: torch.Tensor,
    context_len: int,
    teacher: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(full-cache base model || compressed-cache LoRA model) on the continuation of `ids`.

    ids `(1, context_len + K)`. Returns (scalar mean KL over the K positions, teacher log-probs
    `(1, K, vocab)` for reuse). Differentiable in the LoRA parameters."""
    from sparsekv.cache import SparseKVCache

    model = peft_model.get_base_model()
    k = ids.shape[1] - context_len
    if k < 1:
        raise ValueError(f"ids of {ids.shape[1]} tokens leave no continuation after {context_len}")
    if teacher is None:
        with torch.no_grad(), peft_model.disable_adapter():
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=k).logits
            teacher = F.log_softmax(logits.float(), dim=-1)
    with SparseKVCache(model, eviction, policy) as cache:
        model(input_ids=ids[:, :context_len], cache=cache, use_cache=True, logits_to_keep=1)
        student = model(input_ids=ids[:, context_len:], cache=cache, use_cache=True).logits
    log_q = F.log_softmax(student.float(), dim=-1)
    kl = F.kl_div(log_q, teacher, log_target=True, reduction="none").sum(-1)  # (1, K)
    return kl.mean(), teacher


def gate_policy(adapter, cfg: LoraTrainConfig):
    """The learned policy the cache evicts with while training: the adapter's gate under `use`."""
    from sparsekv import policies

    return policies.get("learned", adapter=adapter, use=cfg.use)


@torch.no_grad()
def mean_kl(peft_model, policy, eviction, blocks: torch.Tensor, context_len: int) -> float:
    """Mean continuation KL over `(n, context_len + K)` blocks (nan when there are none)."""
    if blocks.shape[0] == 0:
        return float("nan")
    vals = [continuation_kl(peft_model, policy, eviction, b[None], context_len)[0] for b in blocks]
    return float(torch.stack(vals).mean())


# ---------------------------------------------------------------------- training


def lora_blocks(
    cfg_lora: LoraTrainConfig, texts: list[str], tokenizer
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) blocks of `context_len + continuation_len` tokens: the last
    `eval_sequences` blocks are held out."""
    from train.data import tokenize_blocks

    ids, _ = tokenize_blocks(
        tokenizer, texts, cfg_lora.context_len + cfg_lora.continuation_len, "pack"
    )
    n_eval = min(cfg_lora.eval_sequences, max(0, ids.shape[0] - 1))
    return ids[: ids.shape[0] - n_eval], ids[ids.shape[0] - n_eval :]


def train_lora(
    model: nn.Module,
    adapter,
    cfg: LoraTrainConfig,
    train_blocks: torch.Tensor,
    eval_blocks: torch.Tensor,
    seed: int = 0,
    log_path: Path | None = None,
    progress: bool = False,
):
    """Train a LoRA on `model` for `adapter`'s gate; returns (`LoraWeights`, metrics). The model
    comes back unchanged (the LoRA is unloaded). Blocks `(n, context_len + continuation_len)`."""
    from transformers import get_cosine_schedule_with_warmup

    from sparsekv.scoring.lora import LoraWeights

    adapter.check_compatible(model)
    device = next(model.parameters()).device
    policy, eviction = gate_policy(adapter, cfg), cfg.eviction_config()
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(train_blocks.shape[0], generator=g)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with trainable_lora(model, cfg, seed) as peft_model:
        params = lora_parameters(peft_model)
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        sched = get_cosine_schedule_with_warmup(opt, cfg.warmup_steps, cfg.steps)
        before = mean_kl(peft_model, policy, eviction, eval_blocks.to(device), cfg.context_len)
        log = log_path.open("w") if log_path is not None else None
        try:
            for step in range(1, cfg.steps + 1):
                ids = train_blocks[order[(step - 1) % len(order)]][None].to(device)
                loss, _ = continuation_kl(peft_model, policy, eviction, ids, cfg.context_len)
                loss.backward()
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                row = {
                    "lora_step": step,
                    "kl": loss.item(),
                    "lr": sched.get_last_lr()[0],
                    "elapsed_s": round(time.perf_counter() - t0, 2),
                }
                rows.append(row)
                if log is not None:
                    log.write(json.dumps(row) + "\n")
                    log.flush()
                if progress:
                    print(f"lora step {step}/{cfg.steps}: kl {row['kl']:.4f}", flush=True)
        finally:
            if log is not None:
                log.close()
        after = mean_kl(peft_model, policy, eviction, eval_blocks.to(device), cfg.context_len)
        weights = LoraWeights.from_peft(peft_model)
    # the base model's id, not the local folder it was loaded from (which peft records)
    weights.config.base_model_name_or_path = adapter.config.base_model_id
    metrics = {
        "steps": cfg.steps,
        "budget": cfg.budget,
        "use": cfg.use,
        "heldout_sequences": int(eval_blocks.shape[0]),
        "heldout_kl_before": round(before, 6),
        "heldout_kl_after": round(after, 6),
        "train_kl_first": rows[0]["kl"],
        "train_kl_last": rows[-1]["kl"],
        "lora_parameters": weights.num_parameters(),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return weights, metrics


def heldout_kl(
    model: nn.Module,
    tokenizer,
    adapter,
    budgets: list[float],
    blocks: int = 8,
    context_len: int = 512,
    continuation_len: int = 64,
    use: str = "agnostic",
) -> list[dict[str, Any]]:
    """KL(full cache || compressed cache) on the evaluation's prose (never trained on), per
    budget, with the gate alone and with the gate plus the adapter's LoRA: one row per budget
    (`kl_gate`, `kl_gate_lora`, `blocks`). The first `blocks` blocks of `context_len +
    continuation_len` tokens of `sparsekv.evaluation.tasks.text.eval_texts("prose")`."""
    from sparsekv.evaluation.tasks.text import eval_texts
    from sparsekv.scoring.lora import apply_lora
    from train.data import tokenize_blocks

    if adapter.lora is None:
        raise ValueError("the adapter carries no LoRA (its folder has no lora/ subfolder)")
    texts = [t for _, t in eval_texts("prose")]
    ids, _ = tokenize_blocks(tokenizer, texts, context_len + continuation_len, "pack")
    ids = ids[:blocks].to(next(model.parameters()).device)
    rows = []
    for budget in budgets:
        cfg = LoraTrainConfig(
            budget=budget, use=use, context_len=context_len, continuation_len=continuation_len
        )
        policy, eviction = gate_policy(adapter, cfg), cfg.eviction_config()
        with trainable_lora(model, cfg) as zero:  # LoRA B = 0: exactly the base model
            gate = mean_kl(zero, policy, eviction, ids, context_len)
        with apply_lora(model, adapter.lora) as peft_model:
            both = mean_kl(peft_model, policy, eviction, ids, context_len)
        rows.append(
            {
                "budget": budget,
                "blocks": int(ids.shape[0]),
                "kl_gate": round(gate, 5),
                "kl_gate_lora": round(both, 5),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """`python -m train.lora ADAPTER [--budgets 0.1,0.2,0.3] [--blocks 8] [--model default]`:
    the held-out KL of an adapter with and without its LoRA (`heldout_kl`)."""
    import argparse

    from sparsekv.scoring.adapter import ScorerAdapter
    from train.models import load_model

    p = argparse.ArgumentParser(prog="python -m train.lora", description=main.__doc__)
    p.add_argument("adapter", help="adapter folder or Hub id with a lora/ subfolder")
    p.add_argument("--model", default="default", help="default, tiny:<family> or an HF folder")
    p.add_argument("--budgets", default="0.1,0.2,0.3")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--continuation-len", type=int, default=64)
    p.add_argument("--use", default="agnostic", choices=USES)
    args = p.parse_args(argv)
    try:
        budgets = [float(b) for b in args.budgets.split(",")]
    except ValueError:
        p.error(f"--budgets={args.budgets!r} must be comma-separated fractions, e.g. 0.1,0.2")
    model, tok, _ = load_model(args.model)
    adapter = ScorerAdapter.from_pretrained(args.adapter)
    rows = heldout_kl(
        model, tok, adapter, budgets, args.blocks, args.context_len, args.continuation_len, args.use
    )
    print("| budget | blocks | KL, gate alone | KL, gate + LoRA |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['budget']} | {r['blocks']} | {r['kl_gate']:.4f} | {r['kl_gate_lora']:.4f} |")
    return rows


def train_for_adapter(cfg) -> dict[str, Any]:
    """`lora.adapter` mode of train.py: train only the LoRA for a trained adapter, then write the
    adapter with its LoRA to `<output_dir>/final` (atomically) and the LoRA's log beside it.
    `cfg` is the `TrainConfig`; its model, dataset and seed keys apply."""
    from sparsekv.scoring.adapter import ScorerAdapter
    from train.config import dump_yaml
    from train.data import config_texts
    from train.models import load_model

    lcfg = cfg.lora_config()
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    model, tok, _ = load_model(cfg.model, cfg.dtype, cfg.attn_implementation, cfg.seed)
    adapter = ScorerAdapter.from_pretrained(lcfg.adapter)
    adapter.check_compatible(model)

    texts = config_texts(cfg)
    train_blocks, eval_blocks = lora_blocks(lcfg, texts, tok)
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / ".config.yaml.tmp"  # the resolved config beside the result, atomically
    tmp.write_text(dump_yaml(cfg, f"Resolved config of the LoRA run {cfg.run_name!r}"))
    tmp.replace(run_dir / "config.yaml")
    weights, metrics = train_lora(
        model,
        adapter,
        lcfg,
        train_blocks,
        eval_blocks,
        cfg.seed,
        run_dir / LORA_METRICS,
        progress=cfg.progress_bar,
    )
    training = dict(adapter.config.training_config or {})
    training["lora"] = {"config": lcfg.to_dict(), "result": metrics}
    adapter.config.training_config = training
    adapter.save_pretrained(run_dir / "final", lora=weights)
    print(
        f"done: LoRA of {metrics['lora_parameters']} parameters, {lcfg.steps} steps for "
        f"{lcfg.adapter}; held-out KL(full || compressed at {lcfg.budget}) "
        f"{metrics['heldout_kl_before']:.4f} -> {metrics['heldout_kl_after']:.4f} "
        f"({metrics['heldout_sequences']} blocks); adapter in {run_dir / 'final'} "
        f"({metrics['seconds']:.0f} s)"
    )
    return {"final": str(run_dir / "final"), "lora": metrics}


if __name__ == "__main__":
    main()
