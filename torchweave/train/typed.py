"""Typed frozen dataclasses from plain (YAML) data, every problem collected at once.

:func:`build` checks each field's value against its annotation (``int``,
``float``, ``str``, ``bool``, ``Literal``, unions, tuples (fixed, or ``tuple[X, ...]``), dicts and
nested dataclasses), converts where that is lossless (int → float, list →
tuple), reports unknown fields, and then lets each dataclass's
``__post_init__`` check the rules between fields by raising
:class:`ConfigError`.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any, Literal, Union

from torchweave.errors import Problem, TorchweaveError


class ConfigError(TorchweaveError):
    """A config with an unknown field, a wrong type, or fields that do not fit together."""


def build(cls: type, data: Any, prefix: str, problems: list[Problem]) -> Any:
    where = prefix.rstrip(".") or "config"
    if not isinstance(data, dict):
        problems.append(Problem(obj=where, value=repr(data),
                                rule=f"a mapping of {cls.__name__} fields"))
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            problems.append(Problem(obj=f"{prefix}{key}", value=repr(data[key]),
                                    rule=f"a field of {cls.__name__}: {', '.join(fields)}",
                                    fix="check the spelling"))
    kwargs: dict[str, Any] = {}
    ok = True
    for name in fields:
        if name not in data:
            continue
        value, good = _check(hints[name], data[name], f"{prefix}{name}", problems)
        ok &= good
        kwargs[name] = value
    if not ok or any(k not in fields for k in data):
        return None
    try:
        return cls(**kwargs)
    except ConfigError as e:
        problems.extend(e.problems)
        return None


def _check(tp: Any, value: Any, name: str, problems: list[Problem]) -> tuple[Any, bool]:
    """``value`` converted to ``tp`` where that is lossless (int → float, list → tuple)."""
    if dataclasses.is_dataclass(tp):
        n = len(problems)
        built = build(tp, value, name + ".", problems)
        return built, len(problems) == n and built is not None
    converted = _convert(tp, value)
    if converted is _BAD:
        problems.append(Problem(obj=name, value=repr(value), rule=f"must be {_describe(tp)}"))
        return None, False
    return converted, True


_BAD = object()
_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _convert(tp: Any, value: Any) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin is Literal:
        return value if any(value == a and type(value) is type(a) for a in args) else _BAD
    if origin in (Union, types.UnionType):
        for a in args:
            out = _convert(a, value)
            if out is not _BAD:
                return out
        return _BAD
    if tp is type(None):
        return None if value is None else _BAD
    if tp is bool:
        return value if isinstance(value, bool) else _BAD
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _BAD
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _FLOAT_RE.match(value.strip()):
            return float(value)  # YAML 1.1 reads 3e-4 (no dot) as a string
        return _BAD
    if tp is str:
        return value if isinstance(value, str) else _BAD
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: any length
        if not isinstance(value, (list, tuple)):
            return _BAD
        out = tuple(_convert(args[0], v) for v in value)
        return _BAD if any(o is _BAD for o in out) else out
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            return _BAD
        out = tuple(_convert(a, v) for a, v in zip(args, value))
        return _BAD if any(o is _BAD for o in out) else out
    if origin is dict or tp is dict:
        return dict(value) if isinstance(value, dict) else _BAD
    return _BAD


def _describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if tp is type(None):
        return "null"
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"a list of {_describe(args[0])}s"
    if origin is tuple:
        return f"a list of {len(args)}: [" + ", ".join(_describe(a) for a in args) + "]"
    if origin is dict or tp is dict:
        return "a mapping"
    names = {int: "an int", float: "a number", str: "a string", bool: "true or false"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


__all__ = ["ConfigError", "build"]
