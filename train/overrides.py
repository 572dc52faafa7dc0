"""The `key=value` overrides of a training command line (`python train.py --config C.yaml
max_steps=50 loss.kl_weight=0.5 inference.uses.agnostic.blend=0.5`): each value read as YAML,
nested keys under the config's mappings (target, loss, build, inference, lora), a key without a
value refused. `train.config.load_config` applies them before `TrainConfig` checks the result."""

from __future__ import annotations

from typing import Any

import yaml

from sparsekv.configfile import yaml_problem

__all__ = ["apply_overrides", "parse_value"]


def parse_value(text: str) -> Any:
    """An override's value as YAML (`4` -> 4, `[5, 11]` -> list, `null` -> None).

    "none" stays a string (log_with=none); fields that may be None read it as None.
    """
    if text.strip() in ("", "~", "null", "Null", "NULL"):
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"value {text!r} is not valid YAML ({yaml_problem(e)})") from None


def apply_overrides(d: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `key=value` (or nested `loss.kl_weight=0.5`) overrides to a config dict."""
    d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in d.items()}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like key=value (e.g. max_steps=50)")
        if not raw.strip():
            raise ValueError(
                f"override {item!r} has no value (an unset shell variable?); give one, or "
                f"{key}=null to leave {key} unset"
            )
        try:
            parse_value(raw)
        except ValueError as e:
            raise ValueError(f"override {item!r}: {e}") from None
        head, dot, sub = key.partition(".")
        if dot:
            if head not in ("target", "loss", "build", "inference", "lora"):
                raise ValueError(
                    f"override {item!r}: only target., loss., build., inference. and lora. take "
                    "sub-keys"
                )
            *path, last = sub.split(".")  # inference.uses.agnostic.blend: a key of a key
            node = d[head] = dict(d.get(head) or {})
            for i, part in enumerate(path):
                inner = node.get(part)
                if inner is not None and not isinstance(inner, dict):
                    where = ".".join([head, *path[: i + 1]])
                    raise ValueError(
                        f"override {item!r}: {where} is {inner!r}, not a mapping of keys"
                    )
                node[part] = dict(inner or {})
                node = node[part]
            node[last] = parse_value(raw)
        else:
            d[key] = parse_value(raw)
    return d
