"""`EvalConfig`: one evaluation grid (model x tasks x lengths x policies x budgets x protocols),
and the policy-spec syntax. Validation only; running lives in `runner.py`.

Policy specs (one string per evaluated method):

    NAME[:ARG][@KEY=VALUE]...

- NAME is a registered policy (`sparsekv.policies.available()`); ARG is its argument, the
  adapter folder or Hub id for `learned` (`learned:checkpoints/run/final`).
- each `@KEY=VALUE` is an `EvictionConfig` field (schedule, rerank_every, sink_tokens,
  recent_window, prefill_chunk, pyramid_slope, evict_slack, quantize) applied to
  this method only, `label` (the name in tables and plots), `budgets` (this method's own
  budgets instead of the grid's, joined with '+': `@budgets=0.3` or `@budgets=0.1+0.3`; an
  ablation then costs one run per prompt, not one per grid budget), `protocols` (the protocols
  this method runs under, joined with '+': `@protocols=aware`; default all of the grid's),
  `lora` (learned only: `@lora=false` runs an adapter that carries a LoRA without it; by default
  its LoRA is applied to the model for the method's whole run, which then prefills live), or
  else a keyword argument of the policy (e.g. `blend` for learned, `window` for snapkv). Values
  are read as YAML scalars.

Labels are unique within a protocol: two methods may share a label when they run under
different protocols (one method, set up per protocol: e.g. `learned` with `blend: 0` under
agnostic, where the observation window holds no question, and `blend: 0.5` under aware).

Examples: `snapkv`, `snapkv@window=64`, `h2o@rerank_every=4@label=h2o-r4`,
`learned:checkpoints/run/final@blend=0.5@schedule=pyramid`.

In YAML, a policy may also be a mapping: `{policy: learned:ckpt/final, blend: 0.5,
schedule: pyramid, label: learned-blend}`. The full cache is always evaluated as the reference
and need not be listed ("full" in the list is accepted and ignored).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from sparsekv.config import TOKENS_PATTERN, TOKENS_SUFFIX, EvictionConfig, Tokens, check_budget
from sparsekv.configfile import read_yaml_mapping
from sparsekv.evaluation.tasks import PROTOCOLS, TASKS, get_task

EVICTION_FIELDS = tuple(f.name for f in fields(EvictionConfig) if f.name != "budget")
REFERENCE = "full"
DEFAULT_TASKS = ("passkey", "multikey", "multivalue", "vartrack", "qa", "ppl", "nexttok", "gen")


@dataclass(frozen=True)
class PolicySpec:
    """One evaluated method: the policy to build, its kwargs, its eviction overrides, its label."""

    spec: str
    name: str
    policy_kwargs: dict[str, Any]
    eviction: dict[str, Any]
    label: str
    budgets: tuple | None = None  # this method's own budgets (None = the grid's)
    protocols: tuple | None = None  # the protocols it runs under (None = the grid's)
    lora: bool = True  # learned: apply the adapter's LoRA (if it carries one) for the whole run

    def runs_under(self, protocol: str) -> bool:
        return self.protocols is None or protocol in self.protocols

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["budgets"] is not None:
            d["budgets"] = tuple(budget_text(b) for b in d["budgets"])
        return d


def _scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def policy_name(head: str) -> str:
    """The policy a spec string builds: `learned` for `learned:DIR@blend=0`."""
    return head.split("@", 1)[0].partition(":")[0]


def parse_policy(spec: str | dict[str, Any]) -> PolicySpec:
    """Parse `NAME[:ARG][@KEY=VALUE]...` (or the YAML mapping form) into a `PolicySpec`."""
    from sparsekv.policies import available

    if isinstance(spec, dict):
        d = dict(spec)
        if "policy" not in d:
            raise ValueError(f"policy mapping {spec!r} needs a 'policy' key (e.g. policy: snapkv)")
        head = str(d.pop("policy"))
        options = d
        text = head + "".join(f"@{k}={v}" for k, v in options.items())
    elif isinstance(spec, str) and spec.strip():
        text = spec.strip()
        head, *opts = text.split("@")
        options = {}
        for o in opts:
            if "=" not in o:
                raise ValueError(f"policy {text!r}: option {o!r} must be KEY=VALUE (e.g. @blend=0.5)")
            k, v = o.split("=", 1)
            if not v.strip():
                raise ValueError(f"policy {text!r}: option @{k.strip()}= has no value; give "
                                 f"@{k.strip()}=VALUE (e.g. @label=NAME, @blend=0.5)")
            if k.strip() in options:
                raise ValueError(f"policy {text!r}: option @{k.strip()} is given twice; give "
                                 "each option once")
            options[k.strip()] = _scalar(v.strip())
    else:
        raise ValueError(f"policy={spec!r} must be a non-empty string like 'snapkv' or 'learned:PATH@blend=0.5'")
    name, arg = policy_name(head), head.partition(":")[2]
    known = available()
    if name not in known:
        raise ValueError(f"unknown policy {name!r} in {text!r}; known policies: {', '.join(known)}")
    if name == "learned" and not arg:
        raise ValueError(f"policy {text!r}: 'learned' needs an adapter, e.g. learned:checkpoints/run/final")
    if arg and name != "learned":
        raise ValueError(f"policy {text!r}: only 'learned' takes an argument after ':'")
    label = options.pop("label", text)
    if label is None or isinstance(label, (dict, list, bool)) or not str(label).strip():
        raise ValueError(f"policy {text!r}: label={label!r}; allowed: a non-empty name (the "
                         "method's name in tables and plots)")
    label = str(label)
    own = options.pop("budgets", options.pop("budget", None))
    budgets = None
    if own is not None:
        budgets = tuple(parse_budget(b) for b in _split_plus(own))
        if not budgets:
            raise ValueError(f"policy {text!r}: @budgets needs at least one budget, e.g. @budgets=0.3")
    own = options.pop("protocols", options.pop("protocol", None))
    protocols = None
    if own is not None:
        protocols = tuple(str(p) for p in _split_plus(own))
        bad = [p for p in protocols if p not in PROTOCOLS]
        if bad or not protocols:
            raise ValueError(f"policy {text!r}: @protocols={own!r}; allowed values: {', '.join(PROTOCOLS)} "
                             "(several joined with '+')")
    if "lora" in options and name != "learned":
        raise ValueError(f"policy {text!r}: only a learned adapter carries a LoRA (@lora=)")
    lora = options.pop("lora", True)
    if not isinstance(lora, bool):
        raise ValueError(f"policy {text!r}: lora={lora!r} must be true or false")
    eviction = {k: options.pop(k) for k in list(options) if k in EVICTION_FIELDS}
    if eviction:
        EvictionConfig(budget=0.5, **eviction)  # raises naming the field
    return PolicySpec(spec=text, name=head, policy_kwargs=options, eviction=eviction, label=label,
                      budgets=budgets, protocols=protocols, lora=lora)


def lora_spec_text(text: str) -> str:
    """The `policy_spec` recorded on the rows of a method that runs its adapter's LoRA."""
    return text if "@lora=" in text else f"{text}@lora=true"


def _split_plus(value: Any) -> list:
    """A per-method list option: 'a+b' in the string form, a YAML list (or one value) in a mapping."""
    return value.split("+") if isinstance(value, str) else _split(value)


def _split(value: Any, what: str = "list") -> list:
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",")]
        if len(items) > 1 and not all(items[:-1]):  # "a,,b" or ",a" (a trailing comma is fine)
            raise ValueError(f"{what}={value!r} has an empty item between commas")
        return [v for v in items if v]
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def budget_text(b: Any) -> Any:
    """A budget as `config.yaml` writes it: an explicit token count (`Tokens`) as "Ntok", so
    that it reads back as one (a bare 1 would be refused); other budgets as they are."""
    return f"{int(b)}{TOKENS_SUFFIX}" if isinstance(b, Tokens) else b


def is_token_budget(b: Any) -> bool:
    """True for a budget that is a token count: an int (as rows record `Tokens` too), or its
    text ("512", "512tok"); False for a fraction (a float, "0.3", "1.0")."""
    if isinstance(b, str):
        s = b.strip()
        return s.isdigit() or TOKENS_PATTERN.fullmatch(s) is not None
    return isinstance(b, int) and not isinstance(b, bool)


def budget_label(b: Any) -> str:
    """A budget as reports name it: a token count with its unit ("512 tokens", "1 token"), a
    fraction as it is ("0.3")."""
    if not is_token_budget(b):
        return str(b)
    m = TOKENS_PATTERN.fullmatch(b.strip()) if isinstance(b, str) else None
    n = int(m.group(1)) if m else int(b)
    return f"{n} token" if n == 1 else f"{n} tokens"


def parse_budget(v: Any) -> float | int:
    """'0.3' -> 0.3 (fraction), '512' -> 512 (tokens per layer), '1tok' -> `Tokens(1)`: the rule
    of the API (`sparsekv.config.check_budget`), so '2.0' is refused as it is there (a float is a
    fraction) and '1' as ambiguous (write 1.0 for the whole context, 1tok for one token)."""
    if isinstance(v, str):
        s = v.strip()
        if not TOKENS_PATTERN.fullmatch(s):
            try:
                v = int(s) if s.isdigit() else float(s)
            except ValueError:
                raise ValueError(
                    f"budget {s!r} is not a number; use fractions in (0, 1], token counts >= 2 "
                    "or token counts spelled like 512tok"
                ) from None
    try:
        return check_budget(v)
    except ValueError as e:
        raise ValueError(f"bad budget: {e}") from None


@dataclass
class EvalConfig:
    """One evaluation grid. Every list field also accepts a comma-separated string."""

    out: str | None = None
    """Output folder: results.jsonl, summary.csv, summary.md, plots, config.yaml, prompts.jsonl."""
    model: str = "default"
    """'default' (gemma-3-270m, offline), 'tiny:<family>' (random test model) or a local folder."""
    dtype: str = "float32"
    """Model dtype: float32, bfloat16 or float16."""
    attn_implementation: str = "sdpa"
    """sdpa or eager."""
    device: str = "cpu"
    """Where the model runs: "cpu", "cuda" or "cuda:<index>". Rows of two devices never share a
    folder (a resume with another device is refused)."""
    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_TASKS))
    """Task names (see `sparsekv.evaluation.tasks.TASKS`)."""
    lengths: list[int] = field(default_factory=lambda: [1024])
    """Prompt lengths in tokens of the model's tokenizer."""
    policies: list[Any] = field(default_factory=lambda: ["snapkv", "h2o"])
    """Policy specs (see the module docstring); the full cache always runs as the reference."""
    budgets: list[Any] = field(default_factory=lambda: [0.3])
    """Fractions in (0, 1] of the tokens seen, or token counts >= 1, per budgeted layer."""
    protocols: list[str] = field(default_factory=lambda: list(PROTOCOLS))
    """'agnostic' (compress the context, then feed the question) and/or 'aware' (both together).
    Tasks without a question (ppl, nexttok, gen) run under 'agnostic' only."""
    samples: int = 5
    """Samples per task and length."""
    seed: int = 0
    """Seed of the sample generators (same seed -> same prompts)."""
    eviction: dict[str, Any] = field(default_factory=dict)
    """EvictionConfig fields (not budget) for every policy, e.g. {schedule: pyramid, rerank_every: 16}."""
    task_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per task: generator options (e.g. multikey: {num_keys: 8}) and max_new_tokens."""
    threads: int | None = None
    """torch.set_num_threads for the run (None = torch's default)."""
    workers: int = 1
    """Processes sharing the grid (each loads its own model and runs whole sample x protocol
    groups; `threads` each, default cores / workers). 2 on a 2-core machine halves the wall time."""
    shared_prefill: bool = True
    """Prefill each prompt once and let every policy and budget start from a fork of it
    (`SparseKVCache.fork`: the same kept entries as its own prefill, without repeating the
    forward). False prefills every run live, so `prefill_s` and `kv_bytes_peak` are each
    method's own (about as many times slower as there are methods x budgets)."""

    def __post_init__(self) -> None:
        from sparsekv.evaluation.running.models import validate_model_spec

        if self.out is not None and not isinstance(self.out, (str, Path)):
            raise ValueError(f"out={self.out!r} must be a folder path")
        if self.out is not None and not str(self.out).strip():
            raise ValueError(f"out={str(self.out)!r} is empty; give the output folder's path (an "
                             "empty path would write into the current directory)")
        self.out = None if self.out is None else str(self.out)
        validate_model_spec(self.model)
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r}; allowed values: float32, bfloat16, float16")
        if self.attn_implementation not in ("sdpa", "eager"):
            raise ValueError(f"attn_implementation={self.attn_implementation!r}; allowed values: sdpa, eager")
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device={self.device!r}; allowed values: cpu, cuda, cuda:<index>")
        self.tasks = [str(t) for t in _split(self.tasks, "tasks")]
        if not self.tasks:
            raise ValueError(f"tasks is empty; known tasks: {', '.join(TASKS)}")
        for t in self.tasks:
            get_task(t)  # raises listing the known tasks
        self.lengths = [self._length(x) for x in _split(self.lengths, "lengths")]
        if not self.lengths:
            raise ValueError("lengths is empty; give prompt lengths in tokens, e.g. 1024,4096")
        if self.policies in ("", []) or (isinstance(self.policies, str) and not self.policies.strip()):
            raise ValueError("policies is empty; give at least one policy (the full cache always runs "
                             "as the reference; `sparsekv eval --list` shows them)")
        pols = [p for p in _split(self.policies, "policies") if p != REFERENCE]
        self.policies = pols
        self._parsed = [parse_policy(p) for p in pols]
        self.budgets = [parse_budget(b) for b in _split(self.budgets, "budgets")]
        if not self.budgets and any(p.budgets is None for p in self._parsed):
            raise ValueError("budgets is empty; give fractions in (0, 1] such as 0.1,0.3")
        self.protocols = [str(p) for p in _split(self.protocols, "protocols")]
        bad = [p for p in self.protocols if p not in PROTOCOLS]
        if bad or not self.protocols:
            raise ValueError(f"protocols={self.protocols!r}; allowed values: {', '.join(PROTOCOLS)}")
        for spec in self._parsed:
            if not any(spec.runs_under(proto) for proto in self.protocols):
                raise ValueError(f"policy {spec.spec!r} runs under none of the grid's protocols "
                                 f"({', '.join(self.protocols)}); fix its @protocols= or the grid's protocols")
        for proto in self.protocols:
            labels = [p.label for p in self._parsed if p.runs_under(proto)]
            dup = sorted({x for x in labels if labels.count(x) > 1} | ({REFERENCE} & set(labels)))
            if dup:
                raise ValueError(f"policy labels must be unique within a protocol and not {REFERENCE!r}: "
                                 f"{dup} under {proto}; add @label=NAME or split them with @protocols=")
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise ValueError(f"samples={self.samples!r} must be an int >= 1")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an int")
        if not isinstance(self.eviction, dict):
            raise ValueError(f"eviction={self.eviction!r} must be a mapping of EvictionConfig fields")
        bad = sorted(set(self.eviction) - set(EVICTION_FIELDS))
        if bad:
            raise ValueError(f"eviction has unknown field(s) {bad}; allowed: {', '.join(EVICTION_FIELDS)}")
        EvictionConfig(budget=0.5, **self.eviction)
        if not isinstance(self.task_options, dict):
            raise ValueError(f"task_options={self.task_options!r} must map task names to option mappings")
        for t, opts in self.task_options.items():
            spec = get_task(t)
            if self.tasks and t not in self.tasks:
                warnings.warn(
                    f"task_options[{t!r}] is for a task this grid does not run (tasks: "
                    f"{', '.join(self.tasks)}); it is not used",
                    UserWarning,
                    stacklevel=3,
                )
            if not isinstance(opts, dict):
                raise ValueError(f"task_options[{t!r}] must be a mapping, got {opts!r}")
            bad = sorted(set(opts) - set(spec.defaults) - {"max_new_tokens"})
            if bad:
                allowed = ", ".join([*spec.defaults, "max_new_tokens"])
                raise ValueError(f"task_options[{t!r}] has unknown option(s) {bad}; allowed: {allowed}")
        if not isinstance(self.shared_prefill, bool):
            raise ValueError(f"shared_prefill={self.shared_prefill!r} must be true or false")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers={self.workers!r} must be an int >= 1")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads={self.threads!r} must be None or an int >= 1")

    @staticmethod
    def _length(x: Any) -> int:
        try:
            n = int(str(x).strip())
        except ValueError:
            raise ValueError(f"length {x!r} is not an integer number of tokens") from None
        if n < 64:
            raise ValueError(f"length {n} is too short; lengths are >= 64 tokens")
        return n

    @property
    def policy_specs(self) -> list[PolicySpec]:
        return list(self._parsed)

    def budgets_of(self, spec: PolicySpec, protocol: str | None = None) -> list:
        """The budgets `spec` runs at: its own (`@budgets=`) or the grid's; none under a
        `protocol` it does not run under (`@protocols=`)."""
        if protocol is not None and not spec.runs_under(protocol):
            return []
        return list(spec.budgets) if spec.budgets is not None else list(self.budgets)

    def protocols_for(self, task: str) -> list[str]:
        """The protocols a task runs under: the requested ones it supports, else agnostic."""
        supported = get_task(task).protocols
        chosen = [p for p in self.protocols if p in supported]
        return chosen or ["agnostic"]

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["budgets"] = [budget_text(b) for b in d["budgets"]]  # config.yaml reads back the same
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EvalConfig:
        if not isinstance(d, dict):
            raise ValueError(f"an eval config is a YAML mapping of fields, got {type(d).__name__}")
        d = dict(d)
        if "budget" in d and "budgets" not in d:  # singular spellings, as on the command line
            d["budgets"] = d.pop("budget")
        for single, plural in (("policy", "policies"), ("protocol", "protocols"), ("length", "lengths")):
            if single in d and plural not in d:
                d[plural] = d.pop(single)
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ValueError(f"unknown eval config field(s) {unknown}; allowed: {', '.join(known)}")
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> EvalConfig:
        """Read a YAML config; `overrides` (not None) replace its fields."""
        data = read_yaml_mapping(path, "config file")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_dict(data)
