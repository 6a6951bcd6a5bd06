"""Reading a train config: YAML (safely) and ``--section.field=value`` overrides, into the
typed sections of :mod:`torchweave.train.config`, every problem collected into one error."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from torchweave.errors import Problem
from torchweave.train.config import TrainConfig
from torchweave.train.typed import ConfigError, build


def load_config(path: str | Path | None, overrides: list[str] = (),
                base: dict[str, Any] | None = None) -> TrainConfig:
    """Read ``path`` (YAML, safely), apply ``--section.field=value`` overrides, check it all.

    Override values are parsed as YAML, so ``--optim.lr=3e-4``, ``--steps=10``
    and ``--optim.clip_grad_norm=null`` give a float, an int and ``None``.
    Raises :class:`ConfigError` listing every problem found.
    """
    data: Any = copy.deepcopy(base) if base is not None else {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(Problem(obj="config file", value=str(path),
                                      rule=f"a readable YAML file ({e.strerror})")) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(Problem(obj="config file", value=str(path),
                                      rule=f"valid YAML: {e}")) from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(Problem(obj="config file", value=str(path),
                                      rule=f"a mapping of sections, not {type(data).__name__}"))
    problems: list[Problem] = []
    for item in overrides:
        _apply_override(data, item, problems)
    if problems:
        raise ConfigError(problems, header="invalid overrides")
    return config_from_dict(data)


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    """Build a :class:`TrainConfig` from plain data, collecting every problem."""
    problems: list[Problem] = []
    config = build(TrainConfig, data, "", problems)
    if problems:
        raise ConfigError(problems, header="invalid config")
    return config


def _apply_override(data: dict[str, Any], item: str, problems: list[Problem]) -> None:
    text = item[2:] if item.startswith("--") else item
    key, eq, raw = text.partition("=")
    if not eq or not key:
        problems.append(Problem(obj="override", value=repr(item),
                                rule="--section.field=value", fix="e.g. --optim.lr=3e-4"))
        return
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        value = raw
    *sections, last = key.split(".")
    node = data
    for s in sections:
        nxt = node.setdefault(s, {})
        if not isinstance(nxt, dict):
            problems.append(Problem(obj=key, value=repr(nxt), rule=f"{s!r} is a section"))
            return
        node = nxt
    node[last] = value


__all__ = ["config_from_dict", "load_config"]
