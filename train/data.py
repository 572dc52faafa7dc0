"""Training data: texts in, fixed-length token blocks out, in a seeded order addressed by position.

This module owns reading the texts (`load_texts`: local JSONL/JSON/parquet, a saved `datasets`
folder or a `datasets` Hub name; a missing local .jsonl is built by data/build.py), turning them
into `(num_samples, seq_len)` token blocks (`tokenize_blocks`), optionally a seeded subset of
them (`select_samples`), and serving them in a
deterministic order (`BlockDataset`). The order depends only on the seed: epoch e visits the
blocks in `randperm(num_samples, seed + e)`, so the *position* (samples consumed so far,
summed over processes) is all a checkpoint needs to resume the stream exactly. It knows nothing
about models beyond a tokenizer, nor about optimization.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


def _read_jsonl(path: Path, text_field: str, limit: int | None) -> list[str]:
    """The `text_field` strings of a JSONL file; a line that is not a JSON object holding a
    string there, or bytes that are not UTF-8, are a ValueError naming `path:line`."""
    texts = []
    try:
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if limit is not None and len(texts) >= limit:
                    break
                if not line.strip():
                    continue
                texts.append(_jsonl_text(path, n, line, text_field))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{_bad_utf8_line(path)}: not UTF-8 text ({e.reason})") from None
    return texts


def _jsonl_text(path: Path, n: int, line: str, text_field: str) -> str:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno}); each line must be a "
            f"JSON object with a string field text_field={text_field!r}"
        ) from None
    if not isinstance(rec, dict):
        raise ValueError(
            f"{path}:{n}: a JSON {type(rec).__name__}, not an object with a string field "
            f"text_field={text_field!r}"
        )
    if text_field not in rec:
        raise ValueError(f"{path}:{n}: no field text_field={text_field!r} (has {sorted(rec)})")
    return _text(rec[text_field], f"{path}:{n}: field {text_field!r}")


def _text(value, where: str) -> str:
    if not isinstance(value, str):
        kind = "null" if value is None else type(value).__name__
        raise ValueError(f"{where} holds {value!r} ({kind}); the texts must be strings")
    return value


def _bad_utf8_line(path: Path) -> int:
    """1-based number of the first line of `path` that is not UTF-8."""
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return n
    return n


def _load_with_datasets(name: str, config: str | None, split: str):
    import datasets

    p = Path(name)
    saved = (p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists()
    if p.is_dir() and saved:
        ds = datasets.load_from_disk(str(p))
        return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
    if p.is_dir() and not any(q.is_file() for q in p.rglob("*")):
        raise ValueError(
            f"dataset={name!r} is an empty folder; point dataset at a data file "
            f"({', '.join(LOCAL_SUFFIXES)}), a folder of them or a saved `datasets` folder"
        )
    try:
        if p.suffix in (".parquet", ".json") and p.is_file():
            kind = p.suffix.lstrip(".")
            return datasets.load_dataset(kind, data_files=str(p), split="train")
        return datasets.load_dataset(name, config, split=split)
    except Exception as e:  # datasets wraps the reader's error; its cause says what is wrong
        cause = e.__cause__ or e
        what = " ".join(str(cause).split()) or type(cause).__name__
        where = "the file" if p.is_file() else "the folder" if p.is_dir() else "the dataset"
        raise ValueError(f"dataset={name!r}: {where} could not be read ({what})") from e


def load_texts(
    dataset: str,
    text_field: str = "text",
    split: str = "train",
    config: str | None = None,
    limit: int | None = None,
    build: Callable[[Path], None] | None = None,
) -> list[str]:
    """The texts of `dataset` (at most `limit`). A missing local .jsonl is made by `build(path)`."""
    p = Path(dataset)
    if p.is_file() and p.suffix not in LOCAL_SUFFIXES:
        raise ValueError(
            f"dataset={dataset!r} is a file of a kind not read here; allowed local files: "
            f"{', '.join(LOCAL_SUFFIXES)} (JSON lines of {{{text_field!r}: ...}}, JSON, parquet), "
            "a folder of them, a saved `datasets` folder or a Hub dataset id"
        )
    if p.suffix in LOCAL_SUFFIXES and (p.is_file() or p.suffix == ".jsonl"):
        for key, value, default in (("dataset_split", split, "train"),
                                    ("dataset_config", config, None)):
            if value != default:
                raise ValueError(
                    f"{key}={value!r} applies to a Hub dataset or a saved `datasets` folder; "
                    f"dataset={dataset!r} is one local file, read whole: leave {key} "
                    f"{'at train' if default else 'null'}"
                )
    if p.suffix in LOCAL_SUFFIXES and p.is_dir():
        raise ValueError(
            f"dataset={dataset!r} is a folder, not a {p.suffix} file; name the file, or a folder "
            "whose name does not end in a data file's suffix"
        )
    if p.suffix == ".jsonl":
        if not p.exists():
            if build is None:
                raise FileNotFoundError(f"dataset={dataset!r}: no such file")
            build(p)
        return _read_jsonl(p, text_field, limit)
    if p.suffix in LOCAL_SUFFIXES and not p.exists():
        raise FileNotFoundError(f"dataset={dataset!r}: no such file")
    ds = _load_with_datasets(dataset, config, split)
    if text_field not in ds.column_names:
        raise ValueError(
            f"text_field={text_field!r} is not a column of {dataset!r}; columns: {ds.column_names}"
        )
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    texts = list(ds[text_field])
    for i, t in enumerate(texts):
        _text(t, f"dataset={dataset!r}: row {i} of column {text_field!r}")
    return texts



def config_texts(cfg, build: bool = True) -> list[str]:
    """The texts of a training config's dataset (`dataset`, `text_field`, `dataset_split`,
    `dataset_config`, `max_documents`); a missing local .jsonl is built from its `build`
    settings when `build` is True (else `load_texts`' error)."""

    def make(path: Path) -> None:
        from data.build import build_file

        build_file(path, cfg.build_config())

    return load_texts(
        cfg.dataset,
        cfg.text_field,
        cfg.dataset_split,
        cfg.dataset_config,
        cfg.max_documents,
        build=make if build else None,
    )

def _encode(tokenizer, texts: list[str], chunk: int = 256) -> list[list[int]]:
    out: list[list[int]] = []
    for i in range(0, len(texts), chunk):
        out += tokenizer(texts[i : i + chunk], add_special_tokens=False)["input_ids"]
    return out


def tokenize_blocks(
    tokenizer,
    texts: list[str],
    seq_len: int,
    packing: str = "pack",
    name: str = "the dataset",
    warn: Callable[[str], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)`, both `(num_samples, seq_len)` int64.

    "pack": texts joined with EOS into one stream, cut into blocks of seq_len - 1 tokens, each
    block prefixed with BOS (when the tokenizer has one); the tail shorter than a block is
    dropped. "pad": no block mixes texts: each text fills BOS + seq_len - 1 tokens per block,
    its last block right-padded with the pad id (a tail under seq_len / 4 tokens is dropped
    unless it is the whole text), so a sample that fits one block stays whole. "fill": texts
    (each followed by EOS) placed whole one after another in a block, a text that does not fit
    what is left starting the next block (the rest padded); a text longer than a block fills
    blocks of its own and its tail (dropped under seq_len / 4 tokens) starts the next one: no
    text that fits a block is cut, and blocks are not mostly padding.

    Texts that tokenize to no token are left out (a block of BOS and padding teaches nothing),
    counted in one message to `warn`; when no text has a token, a ValueError names `name`.
    """
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
    prefix = [bos] if bos is not None else []
    body = seq_len - len(prefix)
    ids = [x for x in _encode(tokenizer, texts) if len(x)]
    if not ids:
        raise ValueError(
            f"{name}: none of its {len(texts)} texts has a token (all are empty); nothing to "
            "train on: fill the texts, or check text_field"
        )
    if len(ids) < len(texts) and warn is not None:
        warn(f"{name}: {len(texts) - len(ids)} of {len(texts)} texts have no token; left out")
    if packing == "pack":
        stream = []
        for x in ids:
            stream += x + ([eos] if eos is not None else [])
        n = len(stream) // body
        rows = [prefix + stream[i * body : (i + 1) * body] for i in range(n)]
        mask = [[1] * seq_len for _ in rows]
    elif packing == "fill":
        rows, mask = [], []
        cur: list[int] = []

        def flush() -> None:
            if cur:
                rows.append(prefix + cur + [pad] * (body - len(cur)))
                mask.append([1] * (len(prefix) + len(cur)) + [0] * (body - len(cur)))
                cur.clear()

        for x in ids:
            doc = x + ([eos] if eos is not None else [])
            if len(cur) + len(doc) > body:
                flush()
            while len(doc) > body:  # longer than a block: whole blocks of its own
                cur.extend(doc[:body])
                flush()
                doc = doc[body:]
                if len(prefix) + len(doc) < max(1, seq_len // 4):
                    doc = []  # a short tail alone: too little context to rank
            cur.extend(doc)
        flush()
    elif packing == "pad":
        rows, mask = [], []
        for x in ids:
            for i in range(0, max(len(x), 1), body):
                r = prefix + x[i : i + body]
                if i > 0 and len(r) < max(1, seq_len // 4):
                    continue  # a short tail alone: too little context to rank
                rows.append(r + [pad] * (seq_len - len(r)))
                mask.append([1] * len(r) + [0] * (seq_len - len(r)))
    else:
        raise ValueError(f"packing={packing!r} is not supported; allowed values: pack, pad, fill")
    if not rows:
        raise ValueError(
            f"the dataset yields no sequence of seq_len={seq_len} tokens; use more text or a smaller seq_len"
        )
    return torch.tensor(rows, dtype=torch.long), torch.tensor(mask, dtype=torch.long)


def select_samples(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, n: int | None, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """At most `n` of the `(num_samples, seq_len)` blocks, drawn without replacement with `seed`
    and kept in their original order (all of them when `n` is None or not smaller)."""
    if n is None or n >= input_ids.shape[0]:
        return input_ids, attention_mask
    if n < 1:
        raise ValueError(f"max_samples={n!r} must be an int >= 1")
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(input_ids.shape[0], generator=g)[:n].sort().values
    return input_ids[idx], attention_mask[idx]


@dataclass
class BlockDataset:
    """Token blocks served in a seeded order; sample `position` p is block `perm_{p // n}[p % n]`.

    input_ids, attention_mask: `(num_samples, seq_len)`.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    seed: int = 0
    _perms: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def index(self, position: int) -> int:
        """The block served at global sample `position`."""
        epoch, i = divmod(position, len(self))
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perms = {epoch: torch.randperm(len(self), generator=g)}  # keep one epoch
        return int(self._perms[epoch][i])

    def batch(
        self, position: int, batch_size: int, rank: int = 0, world: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This process's `(batch_size, seq_len)` slice of the global micro-batch at `position`.

        The global micro-batch is samples position .. position + batch_size * world - 1; process
        `rank` takes its contiguous share. The caller advances the position by batch_size * world.
        """
        start = position + rank * batch_size
        idx = torch.tensor([self.index(start + k) for k in range(batch_size)])
        return self.input_ids[idx], self.attention_mask[idx]
