"""What a compressed context checks in its inputs before anything runs: token ids (int64 or int32,
one sequence, inside the vocabulary, never truncated from floats), `generate` arguments asking for
more than one sequence (beams, several returned sequences), the length against the model's
positions, and a text context's tokenizer against the one it recorded. Used by
`sparsekv.serving.compressed`; each refusal is a ValueError naming the argument and what it may be.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from sparsekv.models.families import text_config

__all__ = [
    "LENGTHS", "ONE_SEQUENCE", "as_ids", "check_one_sequence", "check_tokenizer", "tokenizer_record",
    "vocab_size", "warn_positions",
]

ONE_SEQUENCE = {
    "num_beams": "beam search is not supported by SparseKVCache (beams would need per-beam "
    "eviction histories); use greedy decoding or sampling",
    "num_return_sequences": "a compressed context answers with one sequence per call; call "
    "generate again (with do_sample=True) for another answer",
}
"""`generate` arguments a compressed context refuses above 1, and why."""


def as_ids(ids: Any, name: str, device: torch.device, vocab: int | None = None) -> torch.Tensor:
    """A list of ints, a 1-D tensor or a `(1, n)` tensor -> `(1, n)` long tensor on `device`.
    Token ids are int64 or int32 (never truncated from floats), >= 0 and below `vocab`."""
    if isinstance(ids, str):
        raise TypeError(f"{name} must be token ids, got a string (compress_text takes text)")
    if isinstance(ids, (set, frozenset, dict)) or (
        not isinstance(ids, torch.Tensor) and not hasattr(ids, "__array__")
        and not isinstance(ids, (list, tuple, range))
    ):
        raise TypeError(
            f"{name} must be token ids in order: a list of ints, a 1-D tensor or shape (1, n); "
            f"got a {type(ids).__name__}"
            + (" (a set or dict has no order)" if isinstance(ids, (set, frozenset, dict)) else "")
        )
    if isinstance(ids, torch.Tensor):
        t = ids
    else:
        try:
            t = torch.as_tensor(ids) if hasattr(ids, "__array__") else torch.tensor(list(ids))
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise ValueError(
                f"{name} must be token ids (a list of ints, a 1-D tensor or shape (1, n)); got "
                f"a {type(ids).__name__} that is not one ({e})"
            ) from None
    if t.ndim == 1:
        t = t[None]
    if t.ndim != 2 or t.shape[0] != 1:
        raise ValueError(
            f"{name} must be token ids of one sequence: a list, a 1-D tensor or shape (1, n); got "
            f"shape {tuple(t.shape)} (ask several questions one after the other)"
        )
    if t.shape[1] == 0:
        raise ValueError(f"{name} is empty: at least one token is needed")
    if t.dtype not in (torch.long, torch.int32):
        got = str(t.dtype).removeprefix("torch.")
        if t.is_floating_point() or t.is_complex():
            odd = t[t != t.round()] if not t.is_complex() else t.flatten()
            if odd.numel():
                got += f" values such as {odd.flatten()[0].item()!r}"
            got += " (a token id is an int: nothing is rounded or truncated)"
        elif t.dtype != torch.bool:
            got += " (narrower than int32: it cannot hold every id of a vocabulary; convert with .long())"
        raise ValueError(f"{name} must hold integer token ids as int64 (torch.long) or int32, got {got}")
    if int(t.min()) < 0:
        raise ValueError(f"{name} holds a negative token id ({int(t.min())})")
    if vocab is not None and int(t.max()) >= vocab:
        raise ValueError(
            f"{name} holds token id {int(t.max())}, beyond the vocabulary ({vocab} ids: 0 to "
            f"{vocab - 1})"
        )
    return t.to(device, torch.long)


def vocab_size(model) -> int:
    return model.get_input_embeddings().num_embeddings


def check_one_sequence(model, kwargs: dict[str, Any]) -> None:
    """Refuse, before anything runs, `generate` arguments (or the model's generation config)
    asking for more than one sequence: beams, several returned sequences."""
    given_config = kwargs.get("generation_config")
    if given_config is not None:
        from transformers import GenerationConfig

        if not isinstance(given_config, GenerationConfig):
            raise ValueError(
                f"generation_config={given_config!r:.80} must be a transformers GenerationConfig "
                f"(or left out), got {type(given_config).__name__}"
            )
    config = given_config or getattr(model, "generation_config", None)
    for name, why in ONE_SEQUENCE.items():
        given = name in kwargs
        v = kwargs[name] if given else getattr(config, name, None)
        if given and v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name}={v!r} must be the int 1 (or left out): {why}")
        if isinstance(v, int) and not isinstance(v, bool) and v > 1:
            where = "" if given else " (from the generation config)"
            raise ValueError(f"{name}={v}{where}: {why}; allowed value: {name}=1")
    for name in LENGTHS:
        v = kwargs.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < LENGTHS[name]):
            raise ValueError(
                f"{name}={v!r} must be an int >= {LENGTHS[name]} (or left out), got "
                f"{type(v).__name__}"
            )


LENGTHS = {"max_new_tokens": 1, "min_new_tokens": 0, "max_length": 1, "min_length": 0}
"""`generate`'s length arguments and their smallest values, checked before anything runs."""


def tokenizer_record(tokenizer: Any) -> dict[str, Any]:
    """What `context.json` records of a text context's tokenizer (its name and size)."""
    name = getattr(tokenizer, "name_or_path", None)
    try:
        size = len(tokenizer)
    except TypeError:
        size = None
    return {"name_or_path": name if isinstance(name, str) else None, "size": size}


def check_tokenizer(recorded: Any, tokenizer: Any, folder: Path) -> None:
    """A tokenizer passed to `load` has the size the text context recorded (when both known)."""
    if tokenizer is None or not isinstance(recorded, dict) or recorded.get("size") is None:
        return
    size = tokenizer_record(tokenizer)["size"]
    if size is not None and size != recorded["size"]:
        raise ValueError(
            f"{folder}: the context was compressed from text with a tokenizer of "
            f"{recorded['size']} tokens ({recorded.get('name_or_path')!r}), but tokenizer= has "
            f"{size}: pass the tokenizer it was compressed with"
        )


def warn_positions(model, n: int) -> None:
    limit = getattr(text_config(model), "max_position_embeddings", None)
    if isinstance(limit, int) and not isinstance(limit, bool) and n > limit:
        warnings.warn(
            f"context_ids has {n} tokens, more than the model's max_position_embeddings "
            f"({limit}): positions past {limit} were never trained, so the compressed context "
            f"and its answers may be wrong; give at most {limit} tokens",
            UserWarning,
            stacklevel=4,
        )
