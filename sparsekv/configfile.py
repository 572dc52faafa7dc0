"""Reading config files and building config dataclasses from mappings: the one YAML reader and
the one unknown-field check of the project (training configs, evaluation grids, eviction, loss,
target and adapter configs).

Errors are ValueErrors that name the file (or the dataclass) and say what to fix: a missing file,
YAML that does not parse (with the line and column), a file that is not a mapping, a field the
dataclass does not have (with the allowed ones). It knows no particular config.
"""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["field_docs", "from_fields", "read_yaml_mapping", "yaml_problem"]

T = TypeVar("T")


def yaml_problem(e: Exception) -> str:
    """A YAML error in one line: what is wrong and where (line:column, 1-based)."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(e, 'problem', None) or type(e).__name__}{where}"


def _unique_keys_loader():
    """yaml.SafeLoader that refuses a key written twice in one mapping (plain YAML keeps the last
    one without a word, so `lr: 0.1` ... `lr: 0.002` would train with the second)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line + 1)
                except TypeError:  # an unhashable key: the base class says so
                    continue
                if first != key_node.start_mark.line + 1:
                    raise yaml.constructor.ConstructorError(
                        None, None,
                        f"duplicate key {key!r} (first at line {first}; YAML would keep only the "
                        "last): write each key once",
                        key_node.start_mark,
                    )
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def read_yaml_mapping(path: str | os.PathLike, label: str = "config file") -> dict[str, Any]:
    """The mapping a YAML file holds (an empty file is `{}`); `label` names the file in errors
    (e.g. "--config")."""
    import yaml

    p = Path(path)
    if not p.is_file():
        what = "is a folder, not a file" if p.is_dir() else "does not exist"
        raise ValueError(f"{label} {str(p)!r} {what}")
    try:
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=_unique_keys_loader()) or {}
    except UnicodeDecodeError as e:
        raise ValueError(f"{label} {str(p)!r} is not UTF-8 text (byte {e.start})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{label} {str(p)!r} is not valid YAML: {yaml_problem(e)}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{label} {str(p)!r} must hold a mapping of fields, got {type(data).__name__}")
    return data


def check_known(cls: type, keys: Any, what: str | None = None, also: tuple[str, ...] = ()) -> None:
    """Every key in `keys` is a field of dataclass `cls` (or one of `also`), else a ValueError
    naming the unknown keys, `what` they were given as, and the allowed ones."""
    known = {f.name for f in fields(cls)} | set(also)
    unknown = sorted(set(keys) - known, key=str)
    if unknown:
        where = f"{what}: " if what else ""
        raise ValueError(
            f"{where}unknown {cls.__name__} field(s) {unknown}; allowed: {', '.join(sorted(known))}"
        )


def from_fields(cls: type[T], d: dict[str, Any]) -> T:
    """`cls(**d)` for a dataclass, after checking that every key of `d` is one of its fields."""
    if not isinstance(d, dict):
        raise ValueError(f"a {cls.__name__} is built from a mapping of fields, got {type(d).__name__}")
    check_known(cls, d)
    return cls(**d)


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of dataclass `cls`, by field name (command-line
    help and config documentation)."""
    import ast
    import inspect
    import itertools

    body = ast.parse(inspect.getsource(cls)).body[0].body
    return {
        a.target.id: " ".join(b.value.value.split())
        for a, b in itertools.pairwise(body)
        if isinstance(a, ast.AnnAssign)
        and isinstance(b, ast.Expr)
        and isinstance(b.value, ast.Constant)
        and isinstance(b.value.value, str)
    }
