"""Constraints as files: the YAML format of :class:`~torchweave.search.constraints.Constraints`
and the presets, one YAML file each in ``torchweave/search/presets/``.

Files are data: the YAML is composed with the safe loader, any tag but plain data's is
refused with its line, and every key is checked against the schema, a mistake naming its
line, the key and the keys allowed there (every problem at once).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from torchweave.errors import Problem, TorchweaveError
from torchweave.policies.pipeline_policy import TIED
from torchweave.search.constraints import (ANY, BALANCE, COSHARD, RECOMPUTE, SCHEDULE_NAMES, SPLITS,
                                         Constraints, Degrees, OpRule)

PRESET_DIR = Path(__file__).with_name("presets")
TOP_KEYS = ("preset", "tp", "pp", "dp", "ep", "micro", "virtual", "schedules", "recompute", "coshard", "zero",
            "tied", "balance", "sp", "split", "memory_gib", "ops", "cuts", "pin", "ties", "description")
OP_KEYS = ("type", "module", "name", "split", "parts", "replicate")
RANGE_KEYS = ("min", "max", "powers_of_two")


def preset(name: str) -> Constraints:
    """The preset ``name`` (``megatron``, ``zero3``, ``dp``, ``nnscaler``, ``alpa``, ``free``)."""
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise TorchweaveError(Problem(obj="preset", value=repr(name),
                                      rule=f"one of {', '.join(preset_names())}",
                                      fix="use a preset name, or --constraints FILE.yaml"))
    return load_constraints(path, _name=name)


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_constraints(source: str | Path, *, _name: str | None = None) -> Constraints:
    """Constraints from a YAML file path or YAML text (checked; errors name the line)."""
    path = Path(source) if isinstance(source, Path) or (
        isinstance(source, str) and source.endswith((".yaml", ".yml")) and "\n" not in source) else None
    where = str(path) if path else "constraints"
    if path is not None and not path.is_file():
        raise TorchweaveError(Problem(obj="--constraints", value=repr(str(path)),
                                      rule="a constraints YAML path must exist",
                                      fix="check the path, or use --preset NAME"))
    text = path.read_text() if path else str(source)
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise TorchweaveError(Problem(
            obj=where, value=f"line {mark.line + 1}" if mark else "the file",
            rule=f"valid YAML ({getattr(exc, 'problem', exc)})", fix="fix the YAML syntax")) from None
    if node is None:
        return Constraints(name=_name or where)
    _plain_tags(node, where)
    return _Reader(where).constraints(node, _name or (path.stem if path else "custom"))


_SAFE_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "seq",
                                                  "map")}


def _plain_tags(node, where: str) -> None:
    """Refuse any YAML tag but plain data's (``!!python/...`` and the like), naming its line."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n.tag not in _SAFE_TAGS:
            raise TorchweaveError(Problem(
                obj=f"{where} line {n.start_mark.line + 1}", value=repr(n.tag),
                rule="constraints are plain data: text, numbers, true/false, lists and mappings",
                fix="remove the tag"))
        if isinstance(n, yaml.SequenceNode):
            stack.extend(n.value)
        elif isinstance(n, yaml.MappingNode):
            stack.extend(x for kv in n.value for x in kv)


class _Reader:
    """YAML nodes → :class:`Constraints`, collecting every problem with its line."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.problems: list[Problem] = []

    def bad(self, node, what: str, value: Any, rule: str, fix: str = "") -> None:
        self.problems.append(Problem(obj=f"{self.where} line {node.start_mark.line + 1}: {what}",
                                     value=repr(value), rule=rule, fix=fix))

    def constraints(self, node, name: str) -> Constraints:
        if not isinstance(node, yaml.MappingNode):
            self.bad(node, "constraints", _plain(node), "a mapping of KEY: VALUE",
                     f"keys: {', '.join(TOP_KEYS)}")
            raise TorchweaveError(self.problems)
        base = Constraints()
        items = {}
        for k, v in node.value:
            key = k.value
            if key not in TOP_KEYS:
                self.bad(k, "key", key, f"allowed keys: {', '.join(TOP_KEYS)}",
                         "remove it or correct its spelling")
            elif key in items:
                self.bad(k, "key", key, "each key is given once")
            else:
                items[key] = v
        if "preset" in items:
            try:
                base = preset(_plain(items["preset"]))
            except TorchweaveError as exc:
                self.problems += [replace(p, obj=f"{self.where} line "
                                          f"{items['preset'].start_mark.line + 1}: preset")
                                  for p in exc.problems]
        out: dict[str, Any] = {}
        for key in ("tp", "pp", "dp", "ep", "micro", "virtual"):
            if key in items:
                out[key] = self.degrees(items[key], key)
        if "schedules" in items:
            out["schedules"] = tuple(self.choices(items["schedules"], "schedules", SCHEDULE_NAMES))
        if "recompute" in items:
            out["recompute"] = tuple(self.choices(items["recompute"], "recompute", RECOMPUTE))
        if "coshard" in items:
            out["coshard"] = tuple(int(x) for x in self.choices(items["coshard"], "coshard", COSHARD))
        if "zero" in items:
            out["zero"] = tuple(int(x) for x in self.choices(items["zero"], "zero",
                                                             ("0", "1", "2", "3")))
        if "tied" in items:
            out["tied"] = tuple(self.choices(items["tied"], "tied", TIED))
        if "balance" in items:
            out["balance"] = tuple(self.choices(items["balance"], "balance", BALANCE))
        if "sp" in items:
            out["sp"] = self.boolean(items["sp"], "sp")
        if "split" in items:
            out["split"] = tuple(self.choices(items["split"], "split", SPLITS))
        if "memory_gib" in items:
            v = _plain(items["memory_gib"])
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                self.bad(items["memory_gib"], "memory_gib", v, "a positive number of GiB",
                         "e.g. memory_gib: 70")
            else:
                out["memory_gib"] = float(v)
        if "ops" in items:
            out["ops"] = tuple(self.op_rules(items["ops"]))
        if "cuts" in items:
            out["cuts"] = tuple(self.strings(items["cuts"], "cuts"))
        if "ties" in items:
            out["ties"] = tuple(tuple(self.strings(t, "ties entry")) for t in
                                self.sequence(items["ties"], "ties"))
        if "pin" in items:
            out["pin"] = self.pins(items["pin"])
        if "description" in items:
            out["description"] = str(_plain(items["description"]))
        if self.problems:
            raise TorchweaveError(self.problems)
        return replace(base, name=name, **out)

    def degrees(self, node, key: str) -> Degrees:
        v = _plain(node)
        if v == "any":
            return ANY
        if isinstance(node, yaml.SequenceNode):
            vals = [x for x in v if isinstance(x, int) and not isinstance(x, bool) and x >= 1]
            if len(vals) != len(v) or not vals:
                self.bad(node, key, v, f"{key} is a list of whole numbers ≥ 1, a range or 'any'",
                         f"e.g. {key}: [1, 2, 4] or {key}: {{min: 1, max: 8}}")
                return ANY
            return Degrees(only=tuple(sorted(set(vals))))
        if isinstance(node, yaml.MappingNode):
            d: dict[str, Any] = {}
            for k, x in node.value:
                if k.value not in RANGE_KEYS:
                    self.bad(k, f"{key} key", k.value, f"allowed keys: {', '.join(RANGE_KEYS)}",
                             "remove it or correct its spelling")
                    continue
                d[k.value] = _plain(x)
            lo, hi, p2 = d.get("min", 1), d.get("max"), d.get("powers_of_two", False)
            if not isinstance(lo, int) or lo < 1 or (hi is not None and (not isinstance(hi, int)
                                                                         or hi < lo)):
                self.bad(node, key, v, "min and max are whole numbers with 1 ≤ min ≤ max",
                         f"e.g. {key}: {{min: 1, max: 8}}")
                return ANY
            return Degrees(lo=lo, hi=hi, powers_of_two=bool(p2))
        if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
            return Degrees(only=(v,))
        self.bad(node, key, v, f"{key} is a list of whole numbers, a range {{min, max}} or 'any'",
                 f"e.g. {key}: [1, 2, 4]")
        return ANY

    def sequence(self, node, key: str) -> list:
        if isinstance(node, yaml.SequenceNode):
            return list(node.value)
        self.bad(node, key, _plain(node), f"{key} is a list", f"e.g. {key}: [...]")
        return []

    def choices(self, node, key: str, allowed: tuple[str, ...]) -> list[str]:
        out = []
        for x in self.sequence(node, key):
            v = str(_plain(x))
            if v not in allowed:
                self.bad(x, key, _plain(x), f"{key} are among {', '.join(allowed)}")
            elif v not in out:
                out.append(v)
        if not out and not self.problems:
            self.bad(node, key, [], f"at least one of {', '.join(allowed)}")
        return out

    def strings(self, node, key: str) -> list[str]:
        out = []
        for x in self.sequence(node, key):
            v = _plain(x)
            if not isinstance(v, str) or not v:
                self.bad(x, key, v, f"{key} are module-path globs (text)", "e.g. 'blocks.*'")
            else:
                out.append(v)
        return out

    def boolean(self, node, key: str) -> bool:
        v = _plain(node)
        if not isinstance(v, bool):
            self.bad(node, key, v, f"{key} is true or false")
            return True
        return v

    def pins(self, node) -> dict[str, str | int]:
        out: dict[str, str | int] = {}
        if not isinstance(node, yaml.MappingNode):
            self.bad(node, "pin", _plain(node), "pin maps a module glob to a stage",
                     "e.g. pin: {lm_head: last}")
            return out
        for k, x in node.value:
            v = _plain(x)
            if v not in ("first", "last") and not (isinstance(v, int) and v >= 0):
                self.bad(x, f"pin {k.value!r}", v, "a stage is first, last or an index ≥ 0")
            else:
                out[str(k.value)] = v
        return out

    def op_rules(self, node) -> list[OpRule]:
        out = []
        for item in self.sequence(node, "ops"):
            if not isinstance(item, yaml.MappingNode):
                self.bad(item, "ops entry", _plain(item), "a mapping such as "
                         "{module: 'blocks.*.attn.*', parts: [1, 2, 4]}")
                continue
            d: dict[str, Any] = {}
            for k, x in item.value:
                if k.value not in OP_KEYS:
                    self.bad(k, "ops key", k.value, f"allowed keys: {', '.join(OP_KEYS)}",
                             "remove it or correct its spelling")
                else:
                    d[k.value] = (x, _plain(x))
            if not any(s in d for s in ("type", "module", "name")):
                self.bad(item, "ops entry", _plain(item),
                         "an ops rule selects by type, module or name")
                continue
            rule: dict[str, Any] = {"line": item.start_mark.line + 1}
            for s in ("type", "module", "name"):
                if s in d:
                    rule[s] = str(d[s][1])
            if "parts" in d:
                rule["parts"] = self.degrees(d["parts"][0], "parts").only
            if "split" in d:
                rule["split"] = tuple(_plain(y) for y in self.sequence(d["split"][0], "split"))
            if "replicate" in d:
                rule["replicate"] = self.boolean(d["replicate"][0], "replicate")
            out.append(OpRule(**rule))
        return out


def _plain(node) -> Any:
    """A YAML node as plain data (safe: scalars, lists and mappings only)."""
    return yaml.safe_load(yaml.serialize(node)) if node is not None else None


__all__ = ["PRESET_DIR", "load_constraints", "preset", "preset_names"]
