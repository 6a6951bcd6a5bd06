"""A cluster: nodes × devices per node, and the links between them.

Three ways to get one:

- ``parse_cluster("64xA100-80GB-SXM")``: N devices of a catalog entry, with
  the device's typical node size; ``@4`` sets the devices per node;
- ``load_cluster_yaml(path)``: a YAML file, for custom devices and links;
- ``Cluster(...)`` directly.

A cluster YAML (every field but ``device`` and ``nodes`` optional)::

    name: my-a100s
    device: A100-80GB-SXM        # a catalog name, or a mapping (below)
    nodes: 8
    devices_per_node: 8          # default: the device's node_size
    intra: {bandwidth: 3.0e+11, latency: 5.0e-6}   # override the device's links
    inter: {bandwidth: 2.5e+10}                    # fields left out keep the device's

A custom device is a mapping of :class:`Device` fields (``peak`` a mapping of
precisions), or ``base: <catalog name>`` plus the fields that differ.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from torchweave.errors import Problem, SimError
from torchweave.sim.hardware.devices import CATALOG, Device, Link, lookup


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Identical devices in identical nodes."""

    device: Device
    """Every device's spec."""
    nodes: int
    """Number of nodes."""
    devices_per_node: int
    """Devices in each node; ranks ``k*devices_per_node ...`` share node ``k``."""
    intra: Link
    """Link between devices of one node."""
    inter: Link
    """Network between nodes."""
    name: str = ""
    """How the user wrote it, e.g. ``64xA100-80GB-SXM``."""
    share: float = 1.0
    """Where a node runs more ranks than its device's ``cores``: the fraction of a core's
    rates each rank's ``device`` figures are, ``cores / ranks × shared_efficiency`` (set
    when the cluster is made); 1 otherwise. A rank that waits leaves its share to the
    others (:func:`~torchweave.sim.step.run.shared_cores_step`)."""

    def __post_init__(self) -> None:
        problems = []
        for field, kind in (("device", Device), ("intra", Link), ("inter", Link)):
            value = getattr(self, field)
            if not isinstance(value, kind):
                problems.append(Problem(obj=f"cluster.{field}", value=repr(value),
                                        rule=f"must be a {kind.__name__}",
                                        fix=f"build one with torchweave.sim.{kind.__name__}(...)"))
        for field in ("nodes", "devices_per_node"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(Problem(obj=f"cluster.{field}", value=repr(value),
                                        rule="must be an integer >= 1", fix=f"set {field} to 1 or more"))
        if problems:
            raise SimError(problems, header=f"bad cluster {self.name!r}" if self.name else "bad cluster")
        cores = self.device.cores
        if cores is not None and self.devices_per_node > cores:
            # more ranks than cores on a node: each runs a share of the time
            share = cores / self.devices_per_node * self.device.shared_efficiency
            peak = dataclasses.replace(self.device.peak, **{
                f.name: getattr(self.device.peak, f.name) * share
                for f in dataclasses.fields(self.device.peak) if getattr(self.device.peak, f.name)})
            object.__setattr__(self, "device", dataclasses.replace(
                self.device, peak=peak, memory_bandwidth=self.device.memory_bandwidth * share,
                collective_wait=self.device.shared_wait, cores=None,
                description=f"{self.device.description}; here {self.devices_per_node} ranks "
                            f"share the node's {cores} cores, each at {share:.3g} of a core's "
                            f"rates"))
            object.__setattr__(self, "intra", dataclasses.replace(
                self.intra, bandwidth=self.intra.bandwidth * share))
            object.__setattr__(self, "share", share)

    @property
    def size(self) -> int:
        """Number of devices: ``nodes * devices_per_node``."""
        return self.nodes * self.devices_per_node

    @property
    def price_per_hour(self) -> float:
        """USD per hour for the whole cluster (an estimate; see :class:`Device`)."""
        return self.size * self.device.price_per_hour

    def node_of(self, rank: int) -> int:
        """The node that holds ``rank``."""
        if not 0 <= rank < self.size:
            raise SimError(Problem(obj="rank", value=str(rank),
                                   rule=f"must be in [0, {self.size}) for cluster {self}",
                                   fix="use a rank of this cluster, or a larger cluster"))
        return rank // self.devices_per_node

    def __str__(self) -> str:
        return self.name or f"{self.size}x{self.device.name}@{self.devices_per_node}"


def cluster_of(device: Device, size: int, devices_per_node: int | None = None, *,
               name: str = "") -> Cluster:
    """``size`` devices; ``devices_per_node`` defaults to the device's node size
    (or to ``size`` when that is smaller)."""
    per = devices_per_node or min(size, device.node_size)
    if size < 1 or per < 1 or size % per:
        raise SimError(Problem(
            obj=f"cluster {name or size}", value=f"{size} devices, {per} per node",
            rule=f"devices must fill whole nodes: {size} % {per} = {size % per if per > 0 else '?'} != 0",
            fix=f"use a multiple of {per} devices, or set devices per node with '@' "
                f"(e.g. {size}x{device.name}@{_divisor_hint(size, per)})"))
    return Cluster(device=device, nodes=size // per, devices_per_node=per,
                   intra=device.intra, inter=device.inter, name=name)


def _divisor_hint(size: int, per: int) -> int:
    divisors = [d for d in range(1, max(size, 1) + 1) if size % d == 0 and d <= max(per, 1)]
    return divisors[-1] if divisors else 1


_SPEC = re.compile(r"^\s*(\d+)\s*[xX×]\s*([A-Za-z0-9_.\-]+?)\s*(?:@\s*(\d+))?\s*$")


def parse_cluster(text: str) -> Cluster:
    """``"64xA100-80GB-SXM"`` or ``"16xH100-80GB-SXM@4"`` → :class:`Cluster`."""
    m = _SPEC.match(text) if isinstance(text, str) else None
    if m is None:
        raise SimError(Problem(
            obj="cluster", value=repr(text),
            rule="a cluster string is N x DEVICE[@DEVICES_PER_NODE]",
            fix=f"e.g. 64xA100-80GB-SXM or 16xH100-80GB-SXM@8; devices: {', '.join(CATALOG)}"))
    size, per = int(m.group(1)), int(m.group(3)) if m.group(3) else None
    return cluster_of(lookup(m.group(2)), size, per, name=text.strip())


# --- YAML -------------------------------------------------------------------

_CLUSTER_FIELDS = ("name", "device", "nodes", "devices_per_node", "intra", "inter")


def load_cluster_yaml(path: str | Path) -> Cluster:
    """Read a cluster YAML (``yaml.safe_load``), checking it against the schema.

    Every problem in the file is reported at once."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise SimError(Problem(obj=str(path), value="not valid YAML", rule=str(exc).replace("\n", " "),
                               fix="fix the YAML syntax at the position shown")) from None
    return cluster_from_dict(data, where=path.name)


def cluster_from_dict(data: Any, *, where: str = "cluster") -> Cluster:
    """A cluster from plain data (a parsed YAML mapping)."""
    problems: list[Problem] = []
    if not isinstance(data, dict):
        raise SimError(Problem(obj=where, value=type(data).__name__, rule="must be a mapping of "
                               f"cluster fields: {', '.join(_CLUSTER_FIELDS)}",
                               fix="write 'device: NAME' and 'nodes: N' at the top level"))
    _unknown(data, _CLUSTER_FIELDS, where, problems)
    for key in ("device", "nodes"):
        if key not in data:
            problems.append(Problem(obj=f"{where}: {key}", value="missing", rule="a required field",
                                    fix=f"add '{key}:'"))
    device = _device(data["device"], f"{where}: device", problems) if "device" in data else None
    nodes = _convert(int, data.get("nodes", 1), f"{where}: nodes", problems)
    name = _convert(str, data.get("name", ""), f"{where}: name", problems)
    per = (_convert(int, data["devices_per_node"], f"{where}: devices_per_node", problems)
           if "devices_per_node" in data else None)
    links = {}
    for key in ("intra", "inter"):
        if device is None:  # no base to fill from: only check the names
            if isinstance(data.get(key), dict):
                _unknown(data[key], [f.name for f in dataclasses.fields(Link)], f"{where}: {key}",
                         problems)
            continue
        base = getattr(device, key)
        links[key] = _build(Link, data[key], f"{where}: {key}", problems, base) if key in data else base
    if problems or device is None:
        raise SimError(problems, header=f"bad cluster spec {where}")
    return Cluster(device=device, nodes=nodes, devices_per_node=per or device.node_size,
                   intra=links["intra"], inter=links["inter"], name=name)


def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    """Plain data that :func:`cluster_from_dict` reads back (device spelled out)."""
    def plain(x: Any) -> Any:
        if dataclasses.is_dataclass(x):
            return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
        return list(x) if isinstance(x, tuple) else x

    out = plain(cluster)
    out["name"] = cluster.name
    out.pop("share")  # the device is written with its shared rates; its cores are not
    return out


def dump_cluster_yaml(cluster: Cluster) -> str:
    return yaml.safe_dump(cluster_to_dict(cluster), sort_keys=False)


def _device(value: Any, where: str, problems: list[Problem]) -> Device | None:
    if isinstance(value, str):
        try:
            return lookup(value)
        except SimError as exc:
            problems.extend(dataclasses.replace(p, obj=where) for p in exc.problems)
            return None
    if not isinstance(value, dict):
        problems.append(Problem(obj=where, value=repr(value),
                                rule="must be a catalog name or a mapping of device fields",
                                fix=f"one of: {', '.join(CATALOG)}"))
        return None
    base = None
    if "base" in value:
        base = _device(value["base"], f"{where}.base", problems)
        if base is None:
            return None
    fields = {k: v for k, v in value.items() if k != "base"}
    return _build(Device, fields, where, problems, base, extra=("base",))


def _unknown(data: dict, allowed: Any, where: str, problems: list[Problem]) -> None:
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), list(allowed), n=1)
            problems.append(Problem(
                obj=f"{where}: {key}", value="unknown field",
                rule=f"allowed fields: {', '.join(allowed)}",
                fix=f"did you mean {close[0]!r}?" if close else "remove it"))


def _build(cls: type, data: Any, where: str, problems: list[Problem], base: Any = None,
           extra: tuple[str, ...] = ()) -> Any:
    """Instance of dataclass ``cls`` from a mapping; fields absent from it come
    from ``base`` (or must have defaults)."""
    if not isinstance(data, dict):
        problems.append(Problem(obj=where, value=repr(data), rule=f"must be a mapping of "
                                f"{cls.__name__} fields", fix="write it as 'key: value' lines"))
        return None
    hints = typing.get_type_hints(cls)
    before = len(problems)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    _unknown(data, list(fields) + list(extra), where, problems)
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name in data:
            sub_base = getattr(base, name) if base is not None else None
            kwargs[name] = _convert(hints[name], data[name], f"{where}.{name}", problems, sub_base)
        elif base is not None:
            kwargs[name] = getattr(base, name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            problems.append(Problem(obj=f"{where}.{name}", value="missing",
                                    rule=f"a required {cls.__name__} field",
                                    fix=f"add '{name}:'" + (" or 'base: <catalog name>'"
                                                             if "base" in extra else "")))
    if len(problems) > before:
        return None
    try:
        return cls(**kwargs)
    except SimError as exc:
        problems.extend(exc.problems)
        return None


def _convert(hint: Any, value: Any, where: str, problems: list[Problem], base: Any = None) -> Any:
    """``value`` checked (and converted) against a type hint."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where, problems, base)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _convert(next(a for a in args if a is not type(None)), value, where, problems)
    if origin is typing.Literal:
        if value in args:
            return value
        return _bad(where, value, f"must be one of: {', '.join(map(str, args))}", problems,
                    "use one of those")
    if origin is tuple:
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        return _bad(where, value, "must be a list of strings", problems, "write [\"a\", \"b\"]")
    if hint is object:
        return value
    if hint is bool:
        return value if isinstance(value, bool) else _bad(where, value, "must be true or false",
                                                          problems, "write true or false")
    if hint is str:
        return value if isinstance(value, str) else _bad(where, value, "must be a string", problems,
                                                         "quote it")
    if hint in (int, float):
        # YAML 1.1 reads 3e11 (no dot) as a string: accept numeric strings.
        number = _number(value)
        if number is None:
            return _bad(where, value, f"must be a number ({hint.__name__})", problems,
                        "write digits, e.g. 8 or 3.0e+11")
        if hint is int:
            if not float(number).is_integer():
                return _bad(where, value, "must be a whole number", problems, "drop the fraction")
            return int(number)
        return float(number)
    raise TypeError(f"no YAML conversion for {hint!r}")  # a new field type: add a branch


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _bad(where: str, value: Any, rule: str, problems: list[Problem], fix: str) -> None:
    problems.append(Problem(obj=where, value=repr(value), rule=rule, fix=fix))
    return None
