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
GradAllReduce       R → R'                 all-reduce
Narrow              a local slice          zero-padded gradient
P2P                 any → any              sends back, summed at the source
==================  =====================  ===============================

``R'`` marks a replicated tensor read by *different* pieces of a split op: their
gradients are partial and are summed by the step's backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

Group = tuple[int, ...]
Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class AllReduce:
    groups: tuple[Group, ...]
    bwd: Literal["identity", "all_reduce"] = "identity"
    op: Literal["sum", "lse"] = "sum"
    """``lse``: the terms are partial log-sum-exps (backward scales by their softmax)."""


@dataclass(frozen=True)
class ReduceScatter:
    groups: tuple[Group, ...]
    axis: int


@dataclass(frozen=True)
class AllGather:
    groups: tuple[Group, ...]
    axis: int
    bwd: Literal["slice", "reduce_scatter"] = "slice"


@dataclass(frozen=True)
class Split:
    groups: tuple[Group, ...]
    axis: int


@dataclass(frozen=True)
class AllToAll:
    groups: tuple[Group, ...]
    split_axis: int
    cat_axis: int


@dataclass(frozen=True)
class GradAllReduce:
    groups: tuple[Group, ...]


@dataclass(frozen=True)
class Narrow:
    """Each listed device keeps ``box`` (in its held piece's local coordinates)."""

    boxes: tuple[tuple[int, Box], ...]


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


Step = Union[AllReduce, ReduceScatter, AllGather, Split, AllToAll, GradAllReduce, Narrow, P2P]


def devices_of(step: Step) -> set[int]:
    """Devices that take part in ``step``."""
    if isinstance(step, Narrow):
        return {d for d, _ in step.boxes}
    if isinstance(step, P2P):
        return {t.src for t in step.transfers} | {t.dst for t in step.transfers} | {
            d for d, _ in step.shapes} | {t.src for t in step.grad_back} | {t.dst for t in step.grad_back}
    return {d for g in step.groups for d in g}


def name_of(step: Step) -> str:
    return {
        AllReduce: "all_reduce", ReduceScatter: "reduce_scatter", AllGather: "all_gather",
        Split: "split", AllToAll: "all_to_all", GradAllReduce: "grad_all_reduce",
        Narrow: "narrow", P2P: "p2p",
    }[type(step)]
