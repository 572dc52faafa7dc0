"""Compress once, ask many: a context prefilled once through a `SparseKVCache`, then asked any
number of questions, each from its own copy of the compressed cache.

This is the query-agnostic use (the evaluation's "agnostic" protocol as an API): the cache
compresses the document before any question is known, and every question (and its answer)
then goes through a fresh copy of that compressed cache under the same eviction config, so
one question never changes what the next one sees and the context is never prefilled again.

    ctx = sparsekv.compress(model, context_ids, EvictionConfig(budget=0.3), adapter)
    out = ctx.generate(question_ids, max_new_tokens=32)   # (1, question + new) token ids
    ctx.save("doc.ctx"); ctx = CompressedContext.load("doc.ctx", model, policy=adapter)

    doc = sparsekv.compress_text(model, tokenizer, text, EvictionConfig(budget=0.3), "snapkv")
    doc.ask("Who wrote it?"); doc.ask_many(["When?", "Where?"])

A policy is a name (`policies.available()`, "learned:DIR"), a `Policy`, or a `ScorerAdapter`:
an adapter (or "learned:DIR") scores with its recorded "agnostic" use settings, since
compressing before the question is that use.

What a compressed context holds (batch 1): the context ids `(1, n)` and, per cache layer, the
state a cache layer carries between steps: for budgeted layers `keys`/`values`
`(1, kv_heads, kept, head_dim)` (int8 plus `key_scale`/`value_scale` `(1, kv_heads, kept, 1)`
under `quantize="int8"`), `positions`, `scores` and `observed` `(1, kv_heads, kept)`, and the
counters `seen`, `decode_steps`, `evicted`; for the other layers (sliding windows) their keys
and values. `save` writes them as `context.safetensors` plus `context.json` (eviction config,
policy spec, model shape and a fingerprint of its weights, token counts, kept entries per
layer, a digest of the tensors) into a folder, atomically; `load` refuses another model, dtype
or policy, tensors that do not match the digest, and keys or values that are not finite.

It owns the compressed context and its file format; the snapshot and restore of a cache's
state live in `sparsekv.cache.state`, the cache's own rules (what is kept, positions, masks) in
`sparsekv.cache`.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from sparsekv.cache import SparseKVCache
from sparsekv.cache.state import model_dtype, model_fingerprint, restore, snapshot
from sparsekv.config import EvictionConfig
from sparsekv.io import fsync_path, pid_alive
from sparsekv.models.families import model_shape
from sparsekv.policies import Policy, available
from sparsekv.policies import get as get_policy

__all__ = ["CompressedContext", "TextContext", "compress", "compress_text"]

FORMAT_VERSION = 1
TENSORS_FILE = "context.safetensors"
META_FILE = "context.json"
DIGEST_KEY = "tensors_sha256"
"""The `context.json` field holding the digest of every tensor of `context.safetensors`."""
KV_SUFFIXES = (".keys", ".values", ".key_scale", ".value_scale")


# ---------------------------------------------------------------------- policy resolution


def _resolve_policy(policy: Any) -> tuple[Policy, dict[str, Any]]:
    """`policy` -> (the Policy the cache scores with, a JSON spec of it for `save`).

    Spec kinds: "name" (rebuilt from the name on load), "adapter" (a `ScorerAdapter` or
    "learned:DIR" under its agnostic use; its fingerprint is checked on load) and "policy"
    (an instance: `load` needs it passed again)."""
    if isinstance(policy, str):
        if policy.startswith("learned:"):
            built, spec = _resolve_policy(get_policy(policy).adapter)  # loads the folder / Hub repo
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


def _policy_for_load(spec: dict[str, Any], policy: Any, path: Path) -> Policy:
    """The policy a loaded context continues with: `policy` when given (checked against the
    recorded spec), else rebuilt from the spec when it names one."""
    if policy is None:
        if spec["kind"] == "name":
            return get_policy(spec["spec"])
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
    built, given = _resolve_policy(policy)
    want, got = spec.get("adapter_fingerprint"), given.get("adapter_fingerprint")
    if want is not None and got != want:
        raise ValueError(
            f"{path}: the context was compressed with an adapter of fingerprint {want[:12]}…, "
            f"but policy= has {str(got)[:12]}…: another adapter would score its questions "
            "differently"
        )
    if spec.get("lora") and _adapter_lora(built) is None:
        raise ValueError(
            f"{path}: the context was compressed with its adapter's LoRA applied, but policy= "
            "carries no LoRA; pass the same adapter (with its lora/)"
        )
    if given["name"] != spec["name"]:
        raise ValueError(
            f"{path}: the context was compressed with {spec['repr']}, not {given['repr']}"
        )
    return built


def _adapter_lora(policy: Policy):
    """The LoRA of the model that the policy's adapter carries (`ScorerAdapter.lora`), or None."""
    return getattr(getattr(policy, "adapter", None), "lora", None)


@contextmanager
def _lora_applied(model, lora) -> Iterator[None]:
    """Run the block with `lora` injected into `model` (and removed after), or as is for None."""
    if lora is None:
        yield
        return
    from sparsekv.scoring.lora import apply_lora

    with apply_lora(model, lora):
        yield


# ---------------------------------------------------------------------- integrity


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of every tensor (name, dtype, shape, bytes; sorted by name), as adapters hash
    theirs (`sparsekv.scoring.files.tensors_digest`)."""
    from sparsekv.scoring.files import tensors_digest

    return tensors_digest(tensors)


def _check_tensors(tensors: dict[str, torch.Tensor], recorded: Any, path: Path) -> None:
    """Refuse tensors that are not those `context.json` was written with (the digest it records:
    damaged bytes, another context's file beside it) or keys / values that are not finite.
    Contexts written before the digest existed are checked for finiteness only."""
    if recorded is not None and recorded != _digest(tensors):
        raise ValueError(
            f"{path} does not match {path.parent / META_FILE}: its tensors' digest differs from "
            f"the {DIGEST_KEY} recorded there (damaged bytes, or another context's tensors); "
            "compress and save the context again"
        )
    for name, t in sorted(tensors.items()):
        if name.endswith(KV_SUFFIXES) and t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(
                f"{path}: tensor {name} holds non-finite values (NaN or inf); a context's keys "
                "and values are finite: compress and save the context again"
            )


# ---------------------------------------------------------------------- the compressed context


def _as_ids(ids: Any, name: str, device: torch.device) -> torch.Tensor:
    """A list of ints, a 1-D tensor or a `(1, n)` tensor -> `(1, n)` long tensor on `device`."""
    if isinstance(ids, str):
        raise TypeError(f"{name} must be token ids, got a string (compress_text takes text)")
    t = ids if isinstance(ids, torch.Tensor) else torch.tensor(list(ids), dtype=torch.long)
    if t.ndim == 1:
        t = t[None]
    if t.ndim != 2 or t.shape[0] != 1:
        raise ValueError(
            f"{name} must be token ids of one sequence: a list, a 1-D tensor or shape (1, n); got "
            f"shape {tuple(t.shape)} (ask several questions one after the other)"
        )
    if t.shape[1] == 0:
        raise ValueError(f"{name} is empty: at least one token is needed")
    if t.dtype not in (torch.long, torch.int, torch.int32):
        raise ValueError(f"{name} must hold integer token ids, got dtype {t.dtype}")
    if int(t.min()) < 0:
        raise ValueError(f"{name} holds a negative token id ({int(t.min())})")
    return t.to(device, torch.long)


# ---------------------------------------------------------------------- atomic folders

_IN_PROGRESS: set[str] = set()
"""Names of the temporary and aside folders of this process's saves now running."""


def _exchange(a: Path, b: Path) -> bool:
    """Swap the folders `a` and `b` in one atomic step (Linux `renameat2(RENAME_EXCHANGE)`);
    False when this system or file system cannot (the caller then renames twice)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, f"cannot exchange {a} and {b}: {os.strerror(err)}")


def _leftover(name: str, base: str) -> str | None:
    """"tmp" or "old" when `name` is a temporary or aside folder of a save of `base` whose
    process is gone (or, in this process, is no longer running); else None."""
    for kind in ("tmp", "old"):
        prefix = f".{base}.{kind}-"
        if name.startswith(prefix):
            pid = name[len(prefix) :].split("-", 1)[0]
            if not pid.isdigit() or name in _IN_PROGRESS:
                return None
            if int(pid) != os.getpid() and pid_alive(int(pid)):
                return None
            return kind
    return None


def recover(path: str | os.PathLike) -> None:
    """Undo what a killed `save` of the context folder `path` left beside it: when `path` is
    missing and the old folder is aside (`.NAME.old-PID-...`, a kill between the two renames),
    it is moved back; the temporary and aside folders of saves whose process is gone are then
    removed. `save` and `load` call it; saves still running are left alone."""
    final = Path(path).expanduser()
    parent = final.parent
    if not parent.is_dir():
        return
    found = {"tmp": [], "old": []}
    for p in parent.iterdir():
        kind = _leftover(p.name, final.name)
        if kind is not None and p.is_dir() and not p.is_symlink():
            found[kind].append(p)
    if not final.exists():
        complete = [
            p for p in found["old"] if (p / META_FILE).is_file() and (p / TENSORS_FILE).is_file()
        ]
        if complete:
            back = max(complete, key=lambda p: p.stat().st_mtime)
            os.rename(back, final)
            fsync_path(parent)
            found["old"].remove(back)
    for p in found["tmp"] + found["old"]:
        shutil.rmtree(p, ignore_errors=True)


class CompressedContext:
    """A context compressed once through a `SparseKVCache`; `generate` answers questions from
    copies of it. Build it with `compress` or `CompressedContext.load`."""

    def __init__(
        self,
        model,
        config: EvictionConfig,
        policy: Policy,
        policy_spec: dict[str, Any],
        context_ids: torch.Tensor,
        tensors: dict[str, torch.Tensor],
        meta: dict[str, Any],
    ):
        self.model = model
        self.config = config
        self.policy = policy
        self.policy_spec = policy_spec
        self.context_ids = context_ids  # (1, n)
        self._tensors = tensors
        self._meta = meta
        self._dtype = model_dtype(model)
        # the adapter's LoRA of the model, when the context was compressed with it applied
        self.lora = _adapter_lora(policy) if policy_spec.get("lora") else None

    # ---- what it holds ------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Tokens of the context (seen by the cache), not the entries kept."""
        return int(self.context_ids.shape[1])

    def kept(self) -> list[int]:
        """Entries stored per cache layer (budgeted and sliding layers alike)."""
        return [0 if m["empty"] else m["kept"] for m in self._meta["layers"]]

    def kv_bytes(self) -> int:
        """Bytes of the compressed keys and values (int8 scales included)."""
        return sum(
            t.nbytes
            for k, t in self._tensors.items()
            if k.endswith((".keys", ".values", ".key_scale", ".value_scale"))
        )

    def state(self) -> dict[str, torch.Tensor]:
        """The compressed state by name (read-only view for inspection and tests)."""
        return dict(self._tensors)

    def cache(self) -> SparseKVCache:
        """A fresh `SparseKVCache` holding a copy of the compressed context: pass it as `cache=`
        with `input_ids` = context + new tokens (`generate` does this). Close it when done."""
        return restore(
            SparseKVCache(self.model, self.config, self.policy), self._tensors, self._meta, self._dtype
        )

    # ---- asking -------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, question_ids: Any, **generate_kwargs: Any):
        """Answer one question: `model.generate` on context + question over a fresh copy of the
        compressed cache (the question's tokens and the answer's go through it under the same
        eviction config and policy). `question_ids`: `(1, q)`, a 1-D tensor or a list of ints.

        Returns what `model.generate` returns with the context cut off: `(1, q + new)` token ids
        (or its output object with `.sequences` so cut, under `return_dict_in_generate=True`).
        """
        for key in ("input_ids", "attention_mask", "cache", "past_key_values"):
            if key in generate_kwargs:
                raise ValueError(
                    f"generate(..., {key}=...) is set by the compressed context; leave it out"
                )
        device = self.context_ids.device
        q = _as_ids(question_ids, "question_ids", device)
        ids = torch.cat([self.context_ids, q], dim=1)
        mask = torch.ones_like(ids)
        with _lora_applied(self.model, self.lora):
            cache = self.cache()
            try:
                out = self.model.generate(
                    input_ids=ids, attention_mask=mask, cache=cache, **generate_kwargs
                )
            finally:
                cache.close()
        n = self.num_tokens
        if isinstance(out, torch.Tensor):
            return out[:, n:]
        out.sequences = out.sequences[:, n:]
        return out

    # ---- persistence --------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write the context into folder `path` (`context.safetensors` + `context.json`),
        atomically: a complete folder or the previous one, never half of each. The files are
        written and fsynced into a temporary sibling, which takes the old folder's place in one
        atomic exchange (Linux `renameat2`; elsewhere two renames, the old folder kept aside
        as `.NAME.old-PID-...` between them). A save or load after a killed save puts that old
        folder back and removes the temporary folders of saves whose process is gone
        (`recover`)."""
        from safetensors.torch import save_file

        final = Path(path).expanduser()
        recover(final)  # what a killed save left: the old folder back at `final`, temporaries gone
        if final.exists() and not (final / META_FILE).is_file():
            raise ValueError(
                f"path={str(final)!r} exists and is not a saved compressed context; "
                "choose a new folder"
            )
        meta = {
            "format_version": FORMAT_VERSION,
            "config": self.config.to_dict(),
            "policy": self.policy_spec,
            "model_shape": model_shape(self.model).to_dict(),
            "model_fingerprint": model_fingerprint(self.model),
            "dtype": str(self._dtype).removeprefix("torch."),
            "num_tokens": self.num_tokens,
            "kept": self.kept(),
            **self._meta,
        }
        tensors = {k: v.detach().cpu().contiguous() for k, v in self._tensors.items()}
        tensors["context_ids"] = self.context_ids.cpu().contiguous()
        meta[DIGEST_KEY] = _digest(tensors)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent))
        _IN_PROGRESS.add(tmp.name)
        try:
            os.chmod(tmp, 0o755)
            save_file(tensors, str(tmp / TENSORS_FILE), metadata={"format": "sparsekv-context"})
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
            for name in (TENSORS_FILE, META_FILE):
                fsync_path(tmp / name)
            fsync_path(tmp)
            if not final.exists():
                os.rename(tmp, final)  # atomic: no folder, then the complete one
            elif not _exchange(tmp, final):
                # no atomic exchange here: `final` moves aside to `.NAME.old-PID-...` for the
                # instant between the two renames; `recover` moves it back after a kill
                suffix = tmp.name.rsplit("-", 1)[-1]
                old = final.parent / f".{final.name}.old-{os.getpid()}-{suffix}"
                _IN_PROGRESS.add(old.name)
                try:
                    os.rename(final, old)
                    os.rename(tmp, final)
                    fsync_path(final.parent)
                    shutil.rmtree(old, ignore_errors=True)
                finally:
                    _IN_PROGRESS.discard(old.name)
            fsync_path(final.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # after an exchange it holds the old context
            _IN_PROGRESS.discard(tmp.name)
        return final

    @classmethod
    def load(cls, path: str | os.PathLike, model, policy: Any = None) -> CompressedContext:
        """A context written by `save`, for `model` (the same model: shape, weights and dtype are
        checked). `policy`: needed again when the context was compressed with a `ScorerAdapter`
        or a `Policy` instance (a name or "learned:DIR" is rebuilt from the record)."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        folder = Path(path).expanduser()
        try:
            recover(folder)  # what a killed save left (a read-only folder is read as it is)
        except OSError:
            pass
        meta_path, tensors_path = folder / META_FILE, folder / TENSORS_FILE
        if not meta_path.is_file() or not tensors_path.is_file():
            raise FileNotFoundError(
                f"path={str(folder)!r} is not a saved compressed context "
                f"(needs {META_FILE} and {TENSORS_FILE})"
            )
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{meta_path}: not valid JSON ({e})") from None
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{meta_path}: format_version={meta.get('format_version')!r}; this "
                f"sparsekv reads compressed contexts of format {FORMAT_VERSION}"
            )
        shape = model_shape(model).to_dict()
        if meta["model_shape"] != shape:
            diff = sorted(k for k in shape if meta["model_shape"].get(k) != shape[k])
            raise ValueError(
                f"{folder}: the context was compressed by another model "
                f"({meta['model_shape']['model_type']}, differing in {', '.join(diff)}); load it "
                "onto the model that compressed it"
            )
        dtype = str(model_dtype(model)).removeprefix("torch.")
        if meta["dtype"] != dtype:
            raise ValueError(
                f"{folder}: the context holds {meta['dtype']} keys and values but the "
                f"model runs in {dtype}; load the model in {meta['dtype']}"
            )
        if meta["model_fingerprint"] != model_fingerprint(model):
            raise ValueError(
                f"{folder}: the context was compressed by another model of the same shape (its "
                "key/value projection weights differ); load it onto the model that compressed it"
            )
        try:
            tensors = load_file(str(tensors_path))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{tensors_path}: unreadable safetensors file ({e})") from None
        _check_tensors(tensors, meta.get(DIGEST_KEY), tensors_path)
        config = EvictionConfig.from_dict(meta["config"])
        built = _policy_for_load(meta["policy"], policy, folder)
        device = next(model.parameters()).device
        ids = tensors.pop("context_ids").to(device)
        if ids.shape != (1, meta["num_tokens"]):
            raise ValueError(
                f"{tensors_path}: context_ids of shape {tuple(ids.shape)}, expected "
                f"(1, {meta['num_tokens']})"
            )
        tensors = {k: v.to(device) for k, v in tensors.items()}
        return cls(model, config, built, meta["policy"], ids, tensors, {"layers": meta["layers"]})

    def __repr__(self) -> str:
        return (
            f"CompressedContext(tokens={self.num_tokens}, kept={self.kept()}, "
            f"policy={self.policy!r}, budget={self.config.budget})"
        )


@torch.no_grad()
def compress(
    model, context_ids: Any, config: EvictionConfig, policy: Any = "snapkv", lora: bool = True
) -> CompressedContext:
    """Prefill `context_ids` (`(1, n)`, a 1-D tensor or a list of ints) through a
    `SparseKVCache(model, config, policy)` and keep what it kept: a `CompressedContext` whose
    `generate` answers questions without compressing again. `policy`: a name, a `Policy`, or a
    `ScorerAdapter` (scoring with its recorded "agnostic" use settings). An adapter that carries
    a LoRA of the model (co-adaptation) has it applied to the prefill and to every question, as
    `ScorerAdapter.attach` does, unless `lora=False`."""
    if not isinstance(config, EvictionConfig):
        raise ValueError(f"config must be an EvictionConfig, got {type(config).__name__}")
    if not isinstance(lora, bool):
        raise ValueError(f"lora={lora!r} must be True (apply the adapter's LoRA, if any) or False")
    built, spec = _resolve_policy(policy)
    spec["lora"] = lora and _adapter_lora(built) is not None
    device = next(model.parameters()).device
    ids = _as_ids(context_ids, "context_ids", device)
    if int(ids.max()) >= (vocab := model.get_input_embeddings().num_embeddings):
        raise ValueError(f"context_ids holds token id {int(ids.max())}, beyond the vocabulary "
                         f"({vocab})")
    with _lora_applied(model, _adapter_lora(built) if spec["lora"] else None):
        with SparseKVCache(model, config, built) as cache:
            model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            tensors, meta = snapshot(cache)
    return CompressedContext(model, config, built, spec, ids, tensors, meta)


# ---------------------------------------------------------------------- text convenience


class TextContext:
    """A `CompressedContext` with its tokenizer: questions and answers as text."""

    def __init__(self, context: CompressedContext, tokenizer):
        self.context = context
        self.tokenizer = tokenizer

    def ask(self, question: str, max_new_tokens: int = 64, **generate_kwargs: Any) -> str:
        """The answer to `question` (greedy unless `do_sample=True` is passed), special tokens
        dropped. The question's text is appended to the context's as is: include the separator
        (a newline or a space) the prompt needs."""
        if not isinstance(question, str) or not question:
            raise ValueError(f"question={question!r} must be a non-empty string")
        ids = self.tokenizer(question, add_special_tokens=False)["input_ids"]
        generate_kwargs.setdefault("do_sample", False)
        out = self.context.generate(ids, max_new_tokens=max_new_tokens, **generate_kwargs)
        return self.tokenizer.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)

    def ask_many(self, questions: Sequence[str], **kwargs: Any) -> list[str]:
        """`ask` for each question, each from its own copy of the compressed context."""
        if isinstance(questions, str):
            raise ValueError("questions must be a list of strings (got one string); use ask()")
        return [self.ask(q, **kwargs) for q in questions]

    def save(self, path: str | os.PathLike) -> Path:
        return self.context.save(path)

    def __repr__(self) -> str:
        return f"TextContext({self.context!r})"


def compress_text(
    model,
    tokenizer,
    context: str,
    config: EvictionConfig,
    policy: Any = "snapkv",
    add_special_tokens: bool = True,
) -> TextContext:
    """`compress` for text: `context` is tokenized (with the tokenizer's special tokens, e.g.
    BOS, unless `add_special_tokens=False`) and compressed; ask it with `.ask` / `.ask_many`."""
    if not isinstance(context, str) or not context:
        raise ValueError(f"context={context!r} must be a non-empty string")
    if not callable(tokenizer):
        raise TypeError(f"tokenizer={tokenizer!r} must be a Hugging Face tokenizer (text -> ids)")
    ids = tokenizer(context, add_special_tokens=add_special_tokens)["input_ids"]
    return TextContext(compress(model, ids, config, policy), tokenizer)
