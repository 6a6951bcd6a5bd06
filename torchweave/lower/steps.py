"""Communication steps: what turns one layout into another, forward and backward.

Gradient convention ("R-grad"): every device holding a replica of a piece holds
the full gradient of that piece; each term of a partial sum receives the full
gradient of the sum. The backward of each step keeps that true:

==================  =====================  ===============================
step                forward                backward
==================  =====================  ===============================
AllReduce           P → R                  identity, or all-reduce (``R'``)
ReduceScatter       P → S(a)               all-gather
AllGather           S(a) → R               slice, or reduce-scatter (``R'``)
Split               R → S(a)               all-gather
AllToAll            S(a) → S(b)            all-to-all back
Route               S(t) → routed rows     none (an index)
Dispatch            S(t) → routed rows     routed all-to-all back, summed per row
Combine             routed P → S(t)        routed all-to-all
GradAllReduce       R → R'                 all-reduce
Narrow              a local slice          zero-padded gradient
P2P                 any → any              sends back, summed at the source
==================  =====================  ===============================

``R'`` marks a replicated tensor read by *different* pieces of a split op: their
gradients are partial and are summed by the step's backward.

Each step type is the one place its semantics are written: its printed name
(``NAME``), the collective its forward runs and the one its backward runs
(:meth:`forward_collective`, :meth:`backward_collective`), the local bytes it
produces and moves (:meth:`out_bytes`, :meth:`forward_bytes`,
``BACKWARD_BYTES``) and the :mod:`torchweave.runtime.collectives` function the
generated code calls (:meth:`runtime_call`). Codegen, the simulator and the
runtime read these; a new collective is one class here and its runtime function.
Collectives are named by :class:`torchweave.sim.hardware.collective_cost.Collective`'s
values (``"all_reduce"``, ...), strings here since the simulator sits beside this layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Union

Group = tuple[int, ...]
Box = tuple[tuple[int, int], ...]


class _Collective:
    """What every step over ``groups`` shares (the defaults: a collective that keeps the
    local size, whose backward is local)."""

    NAME: ClassVar[str]
    FORWARD: ClassVar[str | None] = None
    BACKWARD: ClassVar[str | None] = None
    BACKWARD_BYTES: ClassVar[Literal["src", "dst"]] = "dst"
    """Whose local bytes the backward collective moves: the step's source or its result."""
    SPANS_REPLICAS: ClassVar[bool] = False
    """Whether its groups may grow over data-parallel replicas without moving data between
    them (a sum, or a local split): the simulator's symmetry folding lifts such steps."""

    def forward_collective(self) -> str | None:
        """The collective the forward runs; ``None``: local (a slice, or nothing)."""
        return self.FORWARD

    def backward_collective(self) -> str | None:
        """The collective the backward runs; ``None``: local."""
        return self.BACKWARD

    def out_bytes(self, nbytes: float, size: int) -> float:
        """Local bytes of the result, from the source's local bytes and the group's size."""
        return nbytes

    def forward_bytes(self, nbytes: float, out: float) -> float:
        """Bytes the forward collective is sized by (the source's, or the result's)."""
        return nbytes

    def backward_bytes(self, src: float, dst: float) -> float:
        """Bytes the backward collective is sized by, from the source's and the result's."""
        return src if self.BACKWARD_BYTES == "src" else dst

    def runtime_call(self) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
        """``(function in runtime.collectives, arguments after the group, keyword arguments)``."""
        return self.NAME, (), {}


@dataclass(frozen=True)
class AllReduce(_Collective):
    groups: tuple[Group, ...]
    bwd: Literal["identity", "all_reduce"] = "identity"
    op: Literal["sum", "lse"] = "sum"
    """``lse``: the terms are partial log-sum-exps (backward scales by their softmax)."""
    NAME: ClassVar[str] = "all_reduce"
    SPANS_REPLICAS: ClassVar[bool] = True
    FORWARD: ClassVar[str | None] = "all_reduce"

    def backward_collective(self) -> str | None:
        return "all_reduce" if self.bwd == "all_reduce" else None

    def runtime_call(self) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
        return ("all_reduce" if self.op == "sum" else "all_reduce_lse"), (), {"bwd": self.bwd}


class _Scatter(_Collective):
    """A step that leaves each member one slice along ``axis`` (a reduce-scatter, or a
    local split): its backward gathers the source-sized gradient back."""

    axis: int
    BACKWARD: ClassVar[str | None] = "all_gather"
    BACKWARD_BYTES: ClassVar[Literal["src", "dst"]] = "src"

    def out_bytes(self, nbytes: float, size: int) -> float:
        return nbytes / size

    def runtime_call(self) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
        return self.NAME, (self.axis,), {}


@dataclass(frozen=True)
class ReduceScatter(_Scatter):
    groups: tuple[Group, ...]
    axis: int
    NAME: ClassVar[str] = "reduce_scatter"
    FORWARD: ClassVar[str | None] = "reduce_scatter"


@dataclass(frozen=True)
class AllGather(_Collective):
    groups: tuple[Group, ...]
    axis: int
    bwd: Literal["slice", "reduce_scatter"] = "slice"
    regather: bool = False
    """Saved for backward as the shard and gathered again there (a second all-gather in
    backward, ``1/size`` of the bytes kept): :mod:`torchweave.runtime.regather`."""
    NAME: ClassVar[str] = "all_gather"
    FORWARD: ClassVar[str | None] = "all_gather"

    def backward_collective(self) -> str | None:
        return "reduce_scatter" if self.bwd == "reduce_scatter" else None

    def out_bytes(self, nbytes: float, size: int) -> float:
        return nbytes * size

    def forward_bytes(self, nbytes: float, out: float) -> float:
        return out

    def runtime_call(self) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
        return self.NAME, (self.axis,), {"bwd": self.bwd, **({"regather": True} if self.regather else {})}


@dataclass(frozen=True)
class Split(_Scatter):
    groups: tuple[Group, ...]
    axis: int
    NAME: ClassVar[str] = "split"
    SPANS_REPLICAS: ClassVar[bool] = True


@dataclass(frozen=True)
class AllToAll(_Collective):
    groups: tuple[Group, ...]
    split_axis: int
    cat_axis: int
    NAME: ClassVar[str] = "all_to_all"
    FORWARD: ClassVar[str | None] = "all_to_all"
    BACKWARD: ClassVar[str | None] = "all_to_all"

    def runtime_call(self) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
        return self.NAME, (self.split_axis, self.cat_axis), {}


def reach(owners: tuple[tuple[int, int], ...], top_k: int) -> float:
    """Expected members a row reaches when its ``top_k`` distinct coordinates are drawn
    uniformly from ``[0, E)`` and member ``m`` owns ``owners[m]``: ``Σ_m 1 − C(E−E_m, k)/C(E, k)``
    (a balanced router; the simulator's assumption, docs/simulator.md)."""
    e = max(b for _, b in owners)
    k = max(1, min(top_k, e))
    return sum(1.0 - math.comb(e - (b - a), k) / math.comb(e, k) for a, b in owners)


@dataclass(frozen=True)
class Route(_Collective):
    """The routed exchange's index: each member sends each row of its index to every member
    that owns one of the row's coordinates (``owners[m]``: member ``m``'s range along the
    indexed dim, in group order), and receives the rows routed to it. The result carries the
    route, which the exchange's :class:`Dispatch` and :class:`Combine` read (``EXTRA``).
    Derived by :mod:`torchweave.lower.route` from an op's ``route`` declaration."""

    groups: tuple[Group, ...]
    owners: tuple[tuple[int, int], ...]
    top_k: int
    NAME: ClassVar[str] = "route"
    FORWARD: ClassVar[str | None] = "all_to_all"
    EXTRA: ClassVar[tuple[str, ...]] = ()

    def out_bytes(self, nbytes: float, size: int) -> float:
        return nbytes * reach(self.owners, self.top_k)

    def forward_bytes(self, nbytes: float, out: float) -> float:
        return out

    def runtime_call(self) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
        return self.NAME, (), {"owners": self.owners}


@dataclass(frozen=True)
class Dispatch(Route):
    """Rows of a tensor sent as its :class:`Route` sends the index's (the ``route`` read)."""

    NAME: ClassVar[str] = "dispatch"
    BACKWARD: ClassVar[str | None] = "all_to_all"
    EXTRA: ClassVar[tuple[str, ...]] = ("route",)

    def runtime_call(self) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
        return self.NAME, (), {}


@dataclass(frozen=True)
class Combine(Dispatch):
    """The routed rows' partial results sent back to where each row came from and summed
    there: the :class:`Dispatch` reversed. Its source is sized as lowering sizes the op's
    output, over every row of the group (the piece's box); what moves is the routed rows."""

    NAME: ClassVar[str] = "combine"

    def out_bytes(self, nbytes: float, size: int) -> float:
        return nbytes / size

    def forward_bytes(self, nbytes: float, out: float) -> float:
        return out * reach(self.owners, self.top_k)

    def backward_bytes(self, src: float, dst: float) -> float:
        return dst * reach(self.owners, self.top_k)


@dataclass(frozen=True)
class GradAllReduce(_Collective):
    groups: tuple[Group, ...]
    NAME: ClassVar[str] = "grad_all_reduce"
    SPANS_REPLICAS: ClassVar[bool] = True
    BACKWARD: ClassVar[str | None] = "all_reduce"


@dataclass(frozen=True)
class Narrow:
    """Each listed device keeps ``box`` (in its held piece's local coordinates)."""

    boxes: tuple[tuple[int, Box], ...]
    NAME: ClassVar[str] = "narrow"

    def forward_collective(self) -> str | None:
        return None

    def backward_collective(self) -> str | None:
        return None


@dataclass(frozen=True)
class Transfer:
    """Copy (or add, for partial terms) ``src_box`` of ``src``'s piece into
    ``dst_box`` of ``dst``'s new piece; boxes in each piece's local coordinates."""

    src: int
    dst: int
    src_box: Box
    dst_box: Box
    add: bool


@dataclass(frozen=True)
class P2P:
    """Irregular redistribution by point-to-point transfers."""

    transfers: tuple[Transfer, ...]
    shapes: tuple[tuple[int, tuple[int, ...]], ...]
    """Each receiving device's new local shape."""
    grad_back: tuple[Transfer, ...]
    """Backward: gradient slices sent back to every holder of each source region
    (``add`` is always True); ``grad_scale`` divides replicated readers."""
    grad_scale: tuple[tuple[int, float], ...] = ()
    NAME: ClassVar[str] = "p2p"

    def forward_collective(self) -> str | None:
        return "p2p"

    def backward_collective(self) -> str | None:
        return "p2p"


Step = Union[AllReduce, ReduceScatter, AllGather, Split, AllToAll, Route, Dispatch, Combine,
             GradAllReduce, Narrow, P2P]


def devices_of(step: Step) -> set[int]:
    """Devices that take part in ``step``."""
    if isinstance(step, Narrow):
        return {d for d, _ in step.boxes}
    if isinstance(step, P2P):
        return {t.src for t in step.transfers} | {t.dst for t in step.transfers} | {
            d for d, _ in step.shapes} | {t.src for t in step.grad_back} | {t.dst for t in step.grad_back}
    return {d for g in step.groups for d in g}


def name_of(step: Step) -> str:
    return step.NAME
