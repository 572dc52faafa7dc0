"""Building a teacher store (`build_store`): the frozen model's forward over each token block,
the statistics of every signal and the head's input hidden states, written shard by shard with
`sparsekv.io.atomic_path` (a kill loses at most the shard being written; `resume` rebuilds what
is incomplete), with a progress bar and an ETA; and `text_blocks`, a training config's text as
the store's token blocks. The format is `sparsekv.teacher.store_format`'s, the reader
`sparsekv.teacher.store_read`'s; `sparsekv.teacher.store` describes the whole."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sparsekv.io import atomic_path, write_atomic
from sparsekv.teacher.store_format import (
    STORE_FILE,
    StoreError,
    StoreSpec,
    _flatten,
    _row_digests,
    _show,
    blocks_digest,
    differences,
    encode_hidden,
    sha256_of,
)
from sparsekv.teacher.store_read import TeacherStore
from sparsekv.teacher.store_rows import compute_row


def _write_shard(
    path: Path, rows: list[dict[str, torch.Tensor]], spec: StoreSpec, first: int
) -> None:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name in rows[0]:
        stacked = torch.stack([r[name] for r in rows])
        if name.startswith("hidden."):
            tensors.update(encode_hidden(name, stacked, spec.hidden))
        else:
            tensors[name] = stacked
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    digests = _row_digests(tensors, len(rows))
    meta = {
        "fingerprint": spec.fingerprint,
        "first_row": str(first),
        "rows_sha256": json.dumps(digests),
        "sha256": sha256_of(*(d.encode() for d in digests)),
    }
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)


def _remove_leftovers(path: Path, mine: Callable[[int], bool] = lambda s: True) -> int:
    """Temporary files of shard writes cut short by a kill (atomic_path's `.shard-*.tmp`), of
    the shards `mine` names (another worker's shard being written is left alone)."""
    n = 0
    for p in path.glob(".shard-*.tmp"):
        index = p.name.split(".")[1].removeprefix("shard-")
        if index.isdigit() and not mine(int(index)):
            continue
        p.unlink(missing_ok=True)
        n += 1
    return n


def build_store(
    path: str | Path,
    model: nn.Module,
    spec: StoreSpec,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    block_size: int = 512,
    resume: bool = False,
    progress: bool = True,
    compute: Callable[..., dict[str, torch.Tensor]] = compute_row,
    worker: int = 0,
    workers: int = 1,
) -> dict[str, Any]:
    """Build (or with `resume`, complete) the store at `path` for the first
    `spec.text["sequences"]` rows of `input_ids`, `attention_mask` `(blocks, length)`.

    `worker` of `workers`: this process builds only the shards `s` with `s % workers ==
    worker`, so that several processes (one thread each) build one store side by side; rows
    are the same as one process builds (each row depends on its tokens alone).

    A folder that already holds a store is refused unless `resume`; with `resume`, a store of
    other settings is refused by name (`StoreError`), complete shards are kept, and every other
    shard (missing, torn, short, of another fingerprint) is computed again. Returns a summary:
    sequences, new ones, seconds, bytes."""
    from tqdm.auto import tqdm

    path = Path(path)
    if not (isinstance(workers, int) and workers >= 1):
        raise ValueError(f"workers={workers!r} must be an integer >= 1")
    if not (isinstance(worker, int) and 0 <= worker < workers):
        raise ValueError(f"worker={worker!r} must be an integer in 0..{workers - 1}")
    total = int(spec.text["sequences"])
    if input_ids.shape[0] < total:
        raise StoreError(
            f"the text yields {input_ids.shape[0]} sequences of {spec.length} tokens, not "
            f"{total}: ask for fewer, or build more text (the config's build section)"
        )
    if input_ids.shape[1] != spec.length:
        raise ValueError(
            f"token blocks of {input_ids.shape[1]} tokens; the spec says {spec.length}"
        )
    meta_file = path / STORE_FILE
    if meta_file.is_file():
        if not resume:
            raise StoreError(f"{path} already holds a teacher store; pass --resume to continue it")
        old = TeacherStore(path, warn=lambda msg: None)
        settings = spec.to_dict()
        stored = old.spec.to_dict()
        # the number of sequences may grow: everything else must match
        settings["text"] = {k: v for k, v in settings["text"].items() if k != "sequences"}
        stored["text"] = {k: v for k, v in stored["text"].items() if k != "sequences"}
        names = differences(stored, settings)
        if names:
            flat_s, flat_w = _flatten(stored), _flatten(settings)
            raise StoreError(
                f"{path} holds a teacher store built with other settings; differs in "
                + "; ".join(
                    f"{n}: the store has {_show(flat_s.get(n))}, this build {_show(flat_w[n])}"
                    for n in names
                )
            )
    path.mkdir(parents=True, exist_ok=True)

    def mine(s: int) -> bool:
        return s % workers == worker

    _remove_leftovers(path, mine)
    payload = {**spec.to_dict(), "fingerprint": spec.fingerprint}
    write_atomic(meta_file, json.dumps(payload, indent=1, sort_keys=True) + "\n")
    store = TeacherStore(path, warn=lambda msg: None)
    shards = math.ceil(total / spec.shard_size)
    done = {s for s in store.complete if len(store._meta[s]["rows"]) == store.expected_rows(s)}
    own = [s for s in range(shards) if mine(s)]
    have = sum(store.expected_rows(s) for s in own if s in done)
    t0 = time.perf_counter()
    new = 0
    bar = tqdm(
        total=sum(store.expected_rows(s) for s in own),
        initial=have,
        unit="seq",
        desc=f"teacher store {path.name}" + (f" [{worker}/{workers}]" if workers > 1 else ""),
        dynamic_ncols=True,
        disable=not progress,
        smoothing=0.05,
    )
    layers = spec.layers
    for s in own:
        if s in done:
            continue
        first = s * spec.shard_size
        rows = []
        for r in range(first, first + store.expected_rows(s)):
            rows.append(
                compute(model, input_ids[r], attention_mask[r], spec.target, layers, block_size)
            )
            bar.update(1)
            new += 1
        _write_shard(store.shard_path(s), rows, spec, first)
    bar.close()
    seconds = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    return {"sequences": total, "new": new, "seconds": seconds, "bytes": size, "path": str(path)}


# ---------------------------------------------------------------------- the command line


def text_blocks(cfg, tokenizer, length: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """A training config's token blocks of `length` tokens (its dataset, built if missing, cut
    with its packing) and the text settings they come from."""
    from train.data import config_texts, tokenize_blocks

    texts = config_texts(cfg)
    ids, mask = tokenize_blocks(tokenizer, texts, length, cfg.packing)
    text = {
        "dataset": cfg.dataset,
        "build": cfg.build,
        "text_field": cfg.text_field,
        "dataset_split": cfg.dataset_split,
        "dataset_config": cfg.dataset_config,
        "max_documents": cfg.max_documents,
        "packing": cfg.packing,
        "blocks": int(ids.shape[0]),
        "digest": blocks_digest(ids, mask),
    }
    return ids, mask, text
