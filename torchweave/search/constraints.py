"""Constraints on the plan search: what an expert (or a preset) allows, as data.

A constraint set says which degrees, schedules, recompute modes and ZeRO stages
the search may use, how much memory a device has, and rules on ops selected
by type, module-path glob or node name. It is written in Python
(:class:`Constraints`) or YAML (:func:`load_constraints`), and a preset is one
YAML file in ``torchweave/search/presets/`` (:func:`preset`):

.. code-block:: yaml

    preset: megatron          # start from a preset; the keys below override it
    tp: [1, 2, 4, 8]          # a list of allowed values,
    pp: {min: 1, max: 16}     # or a range (every divisor of the world inside it),
    dp: any                   # or any divisor of the world (ep too: experts split, MoE only)
    micro: {max: 64}          # micro-batches per step (pipelines)
    virtual: [1, 2, 3, 4]     # stages per pipeline rank (interleaved)
    schedules: [none, 1f1b, interleaved, zb]   # none: no pipeline
    recompute: [none, selective, full]
    coshard: [0, 4]           # the output head in K chunks (0: not co-sharded)
    tied: [copy, send]        # pipelines: a parameter read on several stages copied, or its
                              # lookups run where it is held (plan strings' tied=)
    balance: [flops, seconds] # pipeline cuts: whole blocks by FLOPs (the policy's), or at
                              # block and sub-block modules by each op's seconds (cuts=)
    zero: [0, 1]
    sp: true                  # tensor parallelism may shard the sequence between ops
    split: [rule, solved]     # ops split on tp by Megatron's rules, by the solver, or both
    memory_gib: 70            # per device (default: the device's memory)
    ops:                      # rules on ops, each selecting by type, module or name
      - {module: "blocks.*.attn.*", parts: [1, 2, 4, 8]}
      - {type: "aten.layer_norm.default", replicate: true}
    cuts: ["blocks.*"]        # pipeline stages may start only at these modules
    pin: {"lm_head": last}    # a module on a stage (first, last or an index)
    ties: [["blocks.*.attn.q_proj", "blocks.*.attn.k_proj"]]   # one partition

Files are data: YAML is read with ``yaml.safe_load``'s composer, every key is
checked against the schema, and a mistake names its line, the key and the
keys allowed there.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from torchweave.errors import Problem, TorchweaveError
from torchweave.plan.schedules import BUILTIN
from torchweave.policies.pipeline_policy import TIED
from torchweave.policies.spec import SPLITS

SCHEDULE_NAMES = ("none", *BUILTIN, "interlaced")
"""``none``: no pipeline (pp = 1); the others are the pipeline schedules (``interlaced``:
embeddings and head tensor-parallel over every device, the blocks pipelined one stage
per device; :func:`torchweave.policies.pipeline_policy.interlaced`)."""
RECOMPUTE = ("none", "selective", "full")
BALANCE = ("flops", "seconds")
"""How pipeline stages are cut (:attr:`Constraints.balance`)."""
PRESET_DIR = Path(__file__).with_name("presets")
COSHARD = ("0", "2", "4", "8", "16")
"""Co-shard of the output head: 0 (none) or the chunks each device runs it in
(:mod:`torchweave.policies.coshard`)."""
TOP_KEYS = ("preset", "tp", "pp", "dp", "ep", "micro", "virtual", "schedules", "recompute", "coshard", "zero",
            "tied", "balance", "sp", "split", "memory_gib", "ops", "cuts", "pin", "ties", "description")
OP_KEYS = ("type", "module", "name", "split", "parts", "replicate")
RANGE_KEYS = ("min", "max", "powers_of_two")


@dataclass(frozen=True)
class Degrees:
    """Allowed values of one degree: ``only`` (a list) or ``lo``–``hi`` (None: no bound),
    optionally powers of two only."""

    only: tuple[int, ...] | None = None
    lo: int = 1
    hi: int | None = None
    powers_of_two: bool = False

    def allows(self, n: int) -> bool:
        if self.only is not None:
            return n in self.only
        if n < self.lo or (self.hi is not None and n > self.hi):
            return False
        return not self.powers_of_two or n & (n - 1) == 0

    def __str__(self) -> str:
        if self.only is not None:
            return "[" + ", ".join(map(str, self.only)) + "]"
        text = f"{self.lo}..{self.hi if self.hi is not None else 'any'}"
        return text + (" (powers of two)" if self.powers_of_two else "")


ANY = Degrees()


@dataclass(frozen=True)
class OpRule:
    """Ops selected by ``type`` (an aten target), ``module`` (a glob over module paths) or
    ``name`` (a node name); what a plan may do with them."""

    type: str | None = None
    module: str | None = None
    name: str | None = None
    split: tuple[int | str, ...] | None = None
    """Dims the ops may be split on (None: any)."""
    parts: tuple[int, ...] | None = None
    """How many parts a split may have (None: any)."""
    replicate: bool | None = None
    """False: the ops must be split; True: they may stay whole (None: as the rest allow)."""
    line: int | None = None

    def selects(self, node) -> bool:
        if self.type is not None and node.target != self.type:
            return False
        if self.module is not None and not fnmatch.fnmatchcase(node.module or "", self.module):
            return False
        return self.name is None or node.name == self.name

    def __str__(self) -> str:
        sel = ", ".join(f"{k}={v!r}" for k, v in (("type", self.type), ("module", self.module),
                                                   ("name", self.name)) if v is not None)
        return f"ops rule ({sel})" + (f" at line {self.line}" if self.line else "")


@dataclass(frozen=True)
class Constraints:
    """The space the search may look in (see the module docstring)."""

    tp: Degrees = ANY
    pp: Degrees = ANY
    dp: Degrees = ANY
    ep: Degrees = ANY
    micro: Degrees = Degrees(hi=64)
    virtual: Degrees = Degrees(only=(1, 2, 3, 4))
    schedules: tuple[str, ...] = SCHEDULE_NAMES
    recompute: tuple[str, ...] = RECOMPUTE
    coshard: tuple[int, ...] = (0,)
    """The output head (LM head and loss) in K chunks per device (0: whole)."""
    zero: tuple[int, ...] = (0, 1, 2, 3)
    balance: tuple[str, ...] = ("flops",)
    """How pipeline stages are cut: ``flops`` (the pipeline policy's cut between whole blocks,
    by FLOPs) and/or ``seconds`` (the search's cut at block and sub-block module boundaries
    that ``cuts`` allows, by each op's roofline seconds on the cluster, written into the plan
    string as ``cuts=``; offered for encoder-decoders, whose pipelines the simulator runs
    exactly anyway: :mod:`torchweave.search.cuts`). ``[seconds]`` alone puts each seconds
    cut in place of the whole-block one; where none is offered (the same cut, or not an
    encoder-decoder) the point keeps the policy's cut."""
    tied: tuple[str, ...] = ("copy",)
    """How pipelines hold a parameter that several stages read (``tied=`` in plan strings):
    ``copy`` (a copy a stage, summed once a step) and/or ``send`` (its lookups run on its
    stage: :func:`~torchweave.policies.stage_cuts.send_lookups`)."""
    sp: bool = True
    split: tuple[str, ...] = SPLITS
    memory_gib: float | None = None
    ops: tuple[OpRule, ...] = ()
    cuts: tuple[str, ...] | None = None
    """Module globs a pipeline stage may start at (None: any block boundary)."""
    pin: dict[str, str | int] = field(default_factory=dict)
    ties: tuple[tuple[str, ...], ...] = ()
    name: str = "custom"
    description: str = ""

    def with_(self, **changes: Any) -> Constraints:
        return replace(self, **changes)


# ------------------------------------------------------------------ loading
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


__all__ = ["ANY", "Constraints", "Degrees", "OpRule", "RECOMPUTE", "SCHEDULE_NAMES", "SPLITS",
           "load_constraints", "preset", "preset_names"]
