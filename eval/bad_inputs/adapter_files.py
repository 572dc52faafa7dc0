"""Bad-input cases of one surface: adapter files (damaged folders on disk)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import sparsekv
from eval.bad_inputs.api import pget
from eval.bad_inputs.framework import adapter_dir, add, cfg, damaged, model

# ---------------------------------------------------------------------------------------------
# surface 2: adapter files
# ---------------------------------------------------------------------------------------------
AF = "adapter files"


def _cfgjson(folder: Path) -> Path:
    return folder / "config.json"


def _weights(folder: Path) -> Path:
    return folder / "model.safetensors"


def _edit_config(change: Callable[[dict], None]):
    def edit(folder: Path) -> None:
        d = json.loads(_cfgjson(folder).read_text())
        change(d)
        _cfgjson(folder).write_text(json.dumps(d))
    return edit


def _edit_state(change: Callable[[dict], None]):
    from safetensors.torch import load_file, save_file

    def edit(folder: Path) -> None:
        state = load_file(str(_weights(folder)))
        change(state)
        save_file(state, str(_weights(folder)))
    return edit


def _load(edit, family="llama"):
    return lambda: sparsekv.ScorerAdapter.from_pretrained(damaged(edit, family))


def _first(state: dict) -> str:
    return min(state)


def _set(d: dict, k: str, v: Any) -> None:
    d[k] = v


def _pop(d: dict, k: str) -> None:
    d.pop(k, None)


W = ("model.safetensors",)
C = ("config.json", "model.safetensors")  # a config change the weights contradict: either file
add(AF, "weights", "truncated safetensors (half)", W,
    _load(lambda f: _weights(f).write_bytes(_weights(f).read_bytes()[: len(_weights(f).read_bytes()) // 2])))
add(AF, "weights", "truncated safetensors (header only)", W,
    _load(lambda f: _weights(f).write_bytes(_weights(f).read_bytes()[:9])))
add(AF, "weights", "empty safetensors", W, _load(lambda f: _weights(f).write_bytes(b"")))
add(AF, "weights", "garbled bytes", W, _load(lambda f: _weights(f).write_bytes(os.urandom(4096))))
add(AF, "weights", "garbled header JSON", W,
    _load(lambda f: _weights(f).write_bytes((64).to_bytes(8, "little") + b"{" * 64)))
add(AF, "weights", "weights file missing", W, _load(lambda f: _weights(f).unlink()))
add(AF, "weights", "NaN weights", W + ("finite", "nan"),
    _load(_edit_state(lambda s: s[_first(s)].fill_(float("nan")))))
add(AF, "weights", "inf weights", W + ("finite", "inf"),
    _load(_edit_state(lambda s: s[_first(s)].fill_(float("inf")))))
add(AF, "weights", "a tensor of the wrong shape", W + ("shape",),
    _load(_edit_state(lambda s: s.__setitem__(_first(s), torch.zeros(3, 5)))))
add(AF, "weights", "a tensor missing", W + ("missing",),
    _load(_edit_state(lambda s: s.pop(_first(s)))))
add(AF, "weights", "an extra tensor", W + ("unexpected", "extra"),
    _load(_edit_state(lambda s: s.__setitem__("extra.weight", torch.zeros(2)))))
add(AF, "weights", "integer tensors", W + ("dtype",),
    _load(_edit_state(lambda s: s.__setitem__(_first(s), s[_first(s)].to(torch.int32)))))
add(AF, "config", "config.json missing", C, _load(lambda f: _cfgjson(f).unlink()))
add(AF, "config", "config.json not JSON", C, _load(lambda f: _cfgjson(f).write_text("{oops")))
add(AF, "config", "config.json a list", C, _load(lambda f: _cfgjson(f).write_text("[1, 2]")))
add(AF, "config", "config.json empty", C, _load(lambda f: _cfgjson(f).write_text("")))
for key in ("hidden_size", "layers", "format_version", "model_type", "num_kv_heads",
            "num_layers", "head_dim", "hidden"):
    add(AF, "config", f"key {key!r} missing", C + (key,),
        _load(_edit_config(lambda d, k=key: _pop(d, k))))
add(AF, "config", "an unknown extra key", C + ("bogus",),
    _load(_edit_config(lambda d: _set(d, "bogus", 1))))
for key, val in [
    ("format_version", 99), ("format_version", "2"), ("format_version", 0),
    ("format_version", None), ("hidden_size", 10 ** 9), ("hidden", 10 ** 8),
    ("num_kv_heads", -2), ("num_kv_heads", 0), ("head_dim", "x"), ("layers", [99]),
    ("layers", [-1]), ("layers", []), ("layers", "all"), ("kind", "transformer"),
    ("hidden", 0), ("recency", -1), ("blend", 5), ("blend_mode", "avg"),
    ("kernel_size", 2), ("head_layer", "last"), ("lora", "lora"), ("target", "x"),
    ("uses", {"agnostic": {"blend": 7}}), ("uses", {"bogus_use": {"recency": -1}}),
    ("uses", "aware"), ("model_type", 12),
]:
    add(AF, "config", f"{key}={val!r}", C + (key,),
        _load(_edit_config(lambda d, k=key, v=val: _set(d, k, v))))


def _set_use(d: dict, use: str, key: str, val: Any) -> None:
    d["uses"][use][key] = val


for use, key, val in [("aware", "blend", 7), ("aware", "recency", -1), ("agnostic", "kernel_size", 4),
                      ("agnostic", "blend_mode", "avg"), ("aware", "bogus", 1)]:
    add(AF, "config", f"uses[{use!r}][{key!r}]={val!r}", C + (key,),
        _load(_edit_config(lambda d, u=use, k=key, v=val: _set_use(d, u, k, v))))


def _config_hidden_size_and_weights_agree_but_model_differs() -> None:
    gem = sparsekv.ScorerAdapter.from_pretrained(adapter_dir("gemma3"))
    sparsekv.SparseKVCache(model("llama"), cfg(), gem.policy())


add(AF, "another model", "gemma3 head into SparseKVCache on llama", ("model", "gemma"),
    _config_hidden_size_and_weights_agree_but_model_differs)
add(AF, "another model", "policies.get('learned:<gemma3 head>') on llama", ("model", "gemma"),
    lambda: sparsekv.SparseKVCache(model("llama"), cfg(),
                                   pget(f"learned:{adapter_dir('gemma3')}")))
add(AF, "another model", "gemma3 head attach() onto llama", ("model", "gemma"),
    lambda: _attach_dir(adapter_dir("gemma3"), model("llama")))
add(AF, "another model", "llama head on a qwen3 model", ("model", "llama", "qwen"),
    lambda: sparsekv.SparseKVCache(model("qwen3"), cfg(),
                                   sparsekv.ScorerAdapter.from_pretrained(adapter_dir()).policy()))


def _attach_dir(folder: Path, m) -> None:
    with sparsekv.ScorerAdapter.from_pretrained(folder).attach(m):
        pass
