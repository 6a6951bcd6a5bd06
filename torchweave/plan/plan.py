"""A parallel plan: op-trans, op-assign and op-order decisions, as plain data.

- **op-trans** ``split(node, dim, parts)`` / ``replicate(node, times)``: a node's
  pieces are the product of its transforms, indexed row-major
  (``piece = (i0, i1, …)``, one index per transform, in order).
- **op-assign** ``assign(node, piece, device)``: where each piece runs. Two
  pieces of a node on one device run one after the other (co-shard).
- **op-order** ``order(a, b)``: piece ``a`` runs before piece ``b`` on their device.
- **pipelines** (``pipeline``): stages on device groups (op-assign of whole
  stages), micro-batches (op-trans of the batch) and a schedule (op-order of
  stage actions); see :mod:`torchweave.plan.stage_plan`.

Built-in policies, user policies and the search all build this one type. It
prints as a table, round-trips through versioned JSON and is validated before
anything runs (:mod:`torchweave.plan.validate`).
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterator

from torchweave.plan.layout import Mesh
from torchweave.plan.names import string_problems
from torchweave.plan.stage_plan import Pipeline

VERSION = 1
PieceIndex = tuple[int, ...]


@dataclass(frozen=True)
class Trans:
    """op-trans: split ``node`` along ``dim`` into ``parts``; ``dim=None`` replicates."""

    node: str
    dim: str | None
    parts: int

    def __str__(self) -> str:
        return f"{self.dim}/{self.parts}" if self.dim else f"R×{self.parts}"


@dataclass(frozen=True)
class PieceRef:
    node: str
    piece: PieceIndex

    def __str__(self) -> str:
        return f"{self.node}{list(self.piece)}"


@dataclass(frozen=True)
class Order:
    """op-order: ``before`` runs before ``after`` on their device."""

    before: PieceRef
    after: PieceRef


@dataclass
class Plan:
    """The decisions for one graph on ``world_size`` devices."""

    world_size: int
    name: str = "plan"
    mesh: Mesh | None = None
    """The named device axes the plan was built over (``dp``, ``tp``, ``pp``, ``ep``), row-major
    over ranks. Not only for printing: validation checks layouts against it, ZeRO's groups
    are ``mesh.groups(zero_axis)``, and the trainer reads the data-parallel degree from its
    ``dp`` and ``ep`` axes (the ranks that see different samples). ``None``: a plan with no
    regular axes (random, interlaced, hand-built)."""
    trans: dict[str, list[Trans]] = field(default_factory=dict)
    assignment: dict[str, list[int]] = field(default_factory=dict)
    """node → device of each piece, in row-major piece order."""
    orders: list[Order] = field(default_factory=list)
    zero: int = 0
    """ZeRO stage 0–3 for parameters replicated over ``zero_axis``."""
    zero_axis: str | None = None
    notes: dict[str, str] = field(default_factory=dict)
    """Free-form provenance: the policy and its arguments, the search's reasons."""
    pipeline: Pipeline | None = None
    """Stages on device groups, micro-batches and the schedule (see :mod:`torchweave.plan.stage_plan`)."""
    recompute: list[tuple[str, ...]] = field(default_factory=list)
    """Groups of nodes whose activations are recomputed in backward instead of kept."""
    accum: int = 1
    """Gradient accumulation, for a plan without a pipeline: forward and backward run on
    each of ``accum`` equal slices of the batch, the gradients summed, then one optimizer
    step (a pipeline's micro-batches are its ``pipeline.micro_batches``)."""

    # ------------------------------------------------------------ primitives
    def split(self, node: str, dim: str, parts: int) -> "Plan":
        """op-trans: split ``node`` along annotated dimension ``dim``."""
        self.trans.setdefault(node, []).append(Trans(node, dim, parts))
        self.assignment.pop(node, None)
        return self

    def replicate(self, node: str, times: int) -> "Plan":
        """op-trans: replicate ``node`` ``times`` times."""
        self.trans.setdefault(node, []).append(Trans(node, None, times))
        self.assignment.pop(node, None)
        return self

    def assign(self, node: str, piece: PieceIndex, device: int) -> "Plan":
        """op-assign: run ``piece`` of ``node`` on ``device``."""
        n = self.num_pieces(node)
        # A copy: policies may give many nodes one list (propagate), never written in place.
        devices = list(self.assignment.get(node) or [-1] * n)
        devices[self.flat(node, piece)] = device
        self.assignment[node] = devices
        return self

    def assign_all(self, node: str, devices: list[int]) -> "Plan":
        """op-assign for every piece of ``node`` at once, in row-major order."""
        self.assignment[node] = list(devices)
        return self

    def order(self, before: PieceRef, after: PieceRef) -> "Plan":
        """op-order: ``before`` runs before ``after``."""
        self.orders.append(Order(before, after))
        return self

    # ------------------------------------------------------------ queries
    def transforms(self, node: str) -> list[Trans]:
        return self.trans.get(node, [])

    def num_pieces(self, node: str) -> int:
        return math.prod(t.parts for t in self.transforms(node))

    def zero_group(self, rank: int) -> tuple[int, ...]:
        """The ranks ZeRO shards ``rank``'s state over: its group along ``zero_axis``
        (``()`` without ZeRO). The runtime builds its sharded optimizer on this group and
        the simulator prices and counts memory by it; what a parameter's gradient is not
        summed over it stays whole (``lower.program.zero_owns``)."""
        if not self.zero or self.zero_axis is None or self.mesh is None:
            return ()
        return next(tuple(g) for g in self.mesh.groups(self.zero_axis) if rank in g)

    def pieces(self, node: str) -> Iterator[PieceIndex]:
        return itertools.product(*(range(t.parts) for t in self.transforms(node)))

    def flat(self, node: str, piece: PieceIndex) -> int:
        i = 0
        for t, k in zip(self.transforms(node), piece):
            i = i * t.parts + k
        return i

    def device_of(self, node: str, piece: PieceIndex) -> int:
        return self.assignment[node][self.flat(node, piece)]

    def pieces_on(self, node: str, device: int) -> list[PieceIndex]:
        return [p for p in self.pieces(node) if self.device_of(node, p) == device]

    # ------------------------------------------------------------ data
    def to_json(self) -> str:
        data: dict[str, Any] = {
            "version": VERSION,
            "name": self.name,
            "world_size": self.world_size,
            "mesh": [list(a) for a in self.mesh.axes] if self.mesh else None,
            "trans": {n: [[t.dim, t.parts] for t in ts] for n, ts in self.trans.items()},
            "assign": self.assignment,
            "order": [[[o.before.node, list(o.before.piece)], [o.after.node, list(o.after.piece)]]
                      for o in self.orders],
            "zero": self.zero,
            "zero_axis": self.zero_axis,
            "notes": self.notes,
        }
        if self.pipeline is not None:
            data["pipeline"] = self.pipeline.to_data()
        if self.recompute:
            data["recompute"] = [list(g) for g in self.recompute]
        if self.accum != 1:
            data["accum"] = self.accum
        return json.dumps(data, indent=1)

    @staticmethod
    def from_json(text: str) -> "Plan":
        from torchweave.errors import Problem, TorchweaveError

        data = json.loads(text)
        if data.get("version") != VERSION:
            raise TorchweaveError(Problem(
                obj="plan JSON", value=f"version {data.get('version')!r}",
                rule=f"this torchweave reads plan version {VERSION}",
                fix="re-create the plan with this version of torchweave",
            ))
        plan = Plan(
            world_size=int(data["world_size"]), name=data.get("name", "plan"),
            mesh=Mesh(tuple((a, int(n)) for a, n in data["mesh"])) if data.get("mesh") else None,
            zero=int(data.get("zero", 0)), zero_axis=data.get("zero_axis"),
            notes=dict(data.get("notes", {})),
            pipeline=Pipeline.from_data(data["pipeline"]) if data.get("pipeline") else None,
            recompute=[tuple(g) for g in data.get("recompute", [])],
            accum=_whole(data.get("accum", 1), "accum"),
        )
        for node, ts in data["trans"].items():
            plan.trans[node] = [Trans(node, d, int(p)) for d, p in ts]
        plan.assignment = {n: [int(d) for d in ds] for n, ds in data["assign"].items()}
        plan.orders = [Order(PieceRef(a[0], tuple(a[1])), PieceRef(b[0], tuple(b[1])))
                       for a, b in data.get("order", [])]
        problems = string_problems(plan)
        if problems:
            from torchweave.plan.validate import PlanError

            raise PlanError(problems, header="plan JSON holds strings outside their alphabets")
        return plan

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plan) and self.to_json() == other.to_json()

    def diff(self, other: "Plan") -> list[str]:
        """Human-readable differences, one line per node that changed."""
        out = []
        for node in sorted(set(self.trans) | set(other.trans) | set(self.assignment)
                           | set(other.assignment)):
            a = (self.transforms(node), self.assignment.get(node))
            b = (other.transforms(node), other.assignment.get(node))
            if a != b:
                out.append(f"{node}: {_fmt(*a)}  →  {_fmt(*b)}")
        if self.pipeline != other.pipeline:
            out.append(f"pipeline: {_pipe(self.pipeline)}  →  {_pipe(other.pipeline)}")
        if self.recompute != other.recompute:
            out.append(f"recompute: {self.recompute}  →  {other.recompute}")
        for attr in ("world_size", "zero", "zero_axis", "accum"):
            if getattr(self, attr) != getattr(other, attr):
                out.append(f"{attr}: {getattr(self, attr)}  →  {getattr(other, attr)}")
        return out


def _whole(value: Any, key: str) -> int:
    """A plan JSON field that is a whole number of at least 1 (data, never code)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        from torchweave.errors import Problem, TorchweaveError

        raise TorchweaveError(Problem(obj=f"plan JSON {key!r}", value=repr(value)[:40],
                                      rule="a whole number of at least 1",
                                      fix=f"write {key} as a number such as 4, or drop it"))
    return value


def _fmt(trans: list[Trans], devices: list[int] | None) -> str:
    t = " ".join(map(str, trans)) or "whole"
    return f"{t} on {devices}"


def _pipe(p: Pipeline | None) -> str:
    if p is None:
        return "none"
    passes = f", {p.passes} passes" if p.passes > 1 else ""
    return f"{p.kind}, {p.stages} stages on {len(p.groups)} groups, {p.micro_batches} micro-batches{passes}"
