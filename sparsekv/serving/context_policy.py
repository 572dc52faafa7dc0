"""Which policy a compressed context scores with, and how that is recorded and checked: a policy
name, a `Policy` instance or a `ScorerAdapter` resolved to the `Policy` a `SparseKVCache` takes
plus a JSON spec of it (`context.json`'s "policy"), the policy a loaded context continues with
(checked against that spec: the adapter's fingerprint, its LoRA), and the adapter's LoRA applied
to the model for a block. Used by `sparsekv.serving.compressed`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sparsekv.policies import Policy, available
from sparsekv.policies import get as get_policy
from sparsekv.serving.context_files import META_FILE

__all__ = ["adapter_lora", "lora_applied", "policy_for_load", "resolve_policy"]


def resolve_policy(policy: Any) -> tuple[Policy, dict[str, Any]]:
    """`policy` -> (the Policy the cache scores with, a JSON spec of it for `save`).

    Spec kinds: "name" (rebuilt from the name on load), "adapter" (a `ScorerAdapter` or
    "learned:DIR" under its agnostic use; its fingerprint is checked on load) and "policy"
    (an instance: `load` needs it passed again)."""
    if isinstance(policy, str):
        if policy.startswith("learned:"):
            built, spec = resolve_policy(get_policy(policy).adapter)  # loads the folder / Hub repo
            return built, {**spec, "source": policy.partition(":")[2]}
        built = get_policy(policy)
        return built, {"kind": "name", "name": built.name, "spec": policy, "repr": repr(built)}
    if isinstance(policy, Policy):
        spec = {"kind": "policy", "name": policy.name, "repr": repr(policy)}
        if getattr(policy, "adapter", None) is not None:
            spec = {**_adapter_spec(policy, source=None), "kind": "policy"}
        return policy, spec
    if hasattr(policy, "score_layer"):  # a ScorerAdapter (or any LayerScorer)
        built = get_policy(
            "learned", adapter=policy, use="agnostic" if hasattr(policy, "settings") else None
        )
        return built, _adapter_spec(built, source=None)
    raise ValueError(
        f"policy={policy!r} must be a policy name, a Policy or a ScorerAdapter; known policies: "
        f"{', '.join(available())}"
    )


def _adapter_spec(policy: Policy, source: str | None) -> dict[str, Any]:
    adapter = getattr(policy, "adapter", None)
    fp = getattr(adapter, "fingerprint", None)
    return {
        "kind": "adapter",
        "name": policy.name,
        "source": source,
        "use": getattr(policy, "use", None),
        "adapter_fingerprint": fp() if callable(fp) else None,
        "repr": repr(policy),
    }


def policy_for_load(spec: dict[str, Any], policy: Any, path: Path) -> Policy:
    """The policy a loaded context continues with: `policy` when given (checked against the
    recorded spec), else rebuilt from the spec when it names one."""
    if policy is None:
        if spec["kind"] == "name":
            return get_policy(spec.get("spec", spec["name"]))
        if spec["kind"] == "adapter" and spec.get("source"):
            if not spec.get("adapter_fingerprint"):  # checked before anything is downloaded
                raise ValueError(
                    f"{path}: {META_FILE} names the adapter {spec['source']!r} but records no "
                    "adapter_fingerprint to check it against; pass the adapter it was "
                    "compressed with as CompressedContext.load(path, model, policy=...)"
                )
            policy = f"learned:{spec['source']}"
        else:
            raise ValueError(
                f"{path}: this context was compressed with {spec['repr']}; pass it again as "
                "CompressedContext.load(path, model, policy=...)"
            )
    built, given = resolve_policy(policy)
    want, got = spec.get("adapter_fingerprint"), given.get("adapter_fingerprint")
    if want is not None and got != want:
        raise ValueError(
            f"{path}: the context was compressed with an adapter of fingerprint {want[:12]}…, "
            f"but policy= has {str(got)[:12]}…: another adapter would score its questions "
            "differently"
        )
    if spec.get("lora") and adapter_lora(built) is None:
        raise ValueError(
            f"{path}: the context was compressed with its adapter's LoRA applied, but policy= "
            "carries no LoRA; pass the same adapter (with its lora/)"
        )
    if given["name"] != spec["name"]:
        raise ValueError(
            f"{path}: the context was compressed with {spec['repr']}, not {given['repr']}"
        )
    return built


def adapter_lora(policy: Policy):
    """The LoRA of the model that the policy's adapter carries (`ScorerAdapter.lora`), or None."""
    return getattr(getattr(policy, "adapter", None), "lora", None)


@contextmanager
def lora_applied(model, lora) -> Iterator[None]:
    """Run the block with `lora` injected into `model` (and removed after), or as is for None."""
    if lora is None:
        yield
        return
    from sparsekv.scoring.lora import apply_lora

    with apply_lora(model, lora):
        yield
