"""The teacher store: compute the frozen model's side of training once, train many heads from it.

A store is a folder of shards, each holding, for `shard_size` token sequences of one length,
everything a head's training step reads from the frozen model:

- `input_ids`, `attention_mask` `(rows, length)` int64 / uint8 (which sequences these are);
- `hidden.<l>` `(rows, length, hidden)`: the self_attn inputs of each of the head's input layers
  `l`, in bfloat16 (default), int8 with one float32 scale per token (`hidden_scale.<l>` `(rows,
  length)`, absmax / 127) or the model's own dtype ("model");
- the raw teacher statistics every recipe combines its target from, per layer, `(rows, kv_heads,
  length)` float32, 0 on padding: `questions.<l>` (attention received from the sequence's own
  later queries, `sparsekv.teacher.statistics.attention_received`), `reconstruction.<l>` (from the
  queries of a teacher-forced repeat of the sequence) and `kvzip_plus.<l>` (KVzap's statistic on
  that pass, before its log; see `sparsekv.teacher.reconstruction`). One pass over
  `sequence + repeat prompt + copy` per row gives all three (and the hidden states, read at
  positions < m, where causal attention makes them exactly a forward over the sequence alone).

What is stored is fixed by the *statistic* settings (`stat`, `normalize`, `exclude_self`,
`min_distance`: they change the per-layer numbers); how layers, heads and signals are mixed
(`decay`, `cross_layer`, `source_layers`, `cross_head`, `signal`, `reconstruction_weight`,
`kind`) is applied when a row is read (`combine_targets`, the formulas of
`training_targets`), so one store serves every mix of targets.

Files. `store.json` (written once, atomically) holds the settings: the model (`model_identity`:
base id, shape, dtype and `sparsekv.cache.state.model_fingerprint`), the text (whatever the
builder passes: dataset, build options, packing, length, and a digest of every token block), the
statistic settings, the layers of each statistic, the repeat prompt's ids, the head's input
layers, the hidden dtype and the shard size; their sha256 is the store's fingerprint. Shard `s`
(`shard-00000.safetensors`, ...) holds rows `s * shard_size ..` of the build order and is written
with `sparsekv.io.atomic_path`, so a kill loses at most the shard being written. Its metadata
carries the store fingerprint, its first row, the sha256 of each row's bytes (all of its tensors'
slices, in name order) and a shard checksum (the sha256 of those). A shard that does not parse,
belongs to another fingerprint or holds fewer rows than it should is incomplete: `build(resume=
True)` rebuilds it, readers skip it with a warning. A row whose bytes do not match its checksum is
refused (`StoreError`) when it is read; `verify()` reads them all.

Opening a store for training (`TeacherStore.check`) compares its settings with the run's (model,
length, statistic settings, layers) and refuses a difference by name (`model.fingerprint`,
`target.stat`, ...). Training from a store (`dataset: store:PATH` in a training config) never
runs the base model: `StoreTeacher` reads each row's tensors and combines its target.

Command line (reads a training config; the text is that config's dataset, built if missing):

    python -m sparsekv.teacher.store build --config configs/train/gemma3-270m-store.yaml \\
        --out stores/gemma3-270m-2k --sequences 2500 --length 2048 --resume
    python -m sparsekv.teacher.store info stores/gemma3-270m-2k
    python -m sparsekv.teacher.store verify stores/gemma3-270m-2k
"""

from __future__ import annotations

from sparsekv.teacher import store_cli
from sparsekv.teacher.reconstruction import repeat_received
from sparsekv.teacher.store_build import build_store, text_blocks
from sparsekv.teacher.store_format import (
    SIGNALS,
    StoreError,
    StoreSpec,
    decode_hidden,
    encode_hidden,
    example_key,
    model_identity,
    needed_settings,
    sha256_of,
    shard_name,
    target_settings,
)
from sparsekv.teacher.store_read import StoreTeacher, TeacherStore, store_dataset_path
from sparsekv.teacher.store_rows import combine_targets, compute_row

__all__ = [
    "SIGNALS",
    "StoreError",
    "StoreSpec",
    "StoreTeacher",
    "TeacherStore",
    "build_store",
    "combine_targets",
    "compute_row",
    "decode_hidden",
    "encode_hidden",
    "example_key",
    "model_identity",
    "needed_settings",
    "repeat_received",
    "sha256_of",
    "shard_name",
    "store_dataset_path",
    "target_settings",
    "text_blocks",
]


# ---------------------------------------------------------------------- building


def main(argv: list[str] | None = None) -> int:
    """The command line (`sparsekv.teacher.store_cli.main`): build, info, verify."""
    return store_cli.main(argv, description=__doc__.split("\n\n", 1)[0])


if __name__ == "__main__":
    raise SystemExit(main())
