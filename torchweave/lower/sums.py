"""Sums in lowering: partial sums reduced to what each device needs (derive's first phase),
and the gradient sums of a replicated tensor read by different pieces (``R'``).

A partial sum over a group is reduce-scattered when each member needs only its chunk
along one axis; for a layout split over two mesh axes, in parts of the group in turn,
each part labelled by the terms it holds; else all-reduced. A gradient sum fuses into
the forward collective's backward where that collective spans the summing group (an
all-reduce, or a chain of all-gathers whose backwards reduce-scatter in turn).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Hashable

from torchweave.lower.steps import AllGather, AllReduce, Box, Group, ReduceScatter, Step
from torchweave.plan.layout import Piece

if TYPE_CHECKING:
    from torchweave.lower.derive import Need


def reduce_step(held: dict[int, Piece], dst: dict[int, Need]) -> Step | None:
    by_box: dict[Box, list[int]] = {}
    for d in sorted(held):
        by_box.setdefault(held[d].box, []).append(d)
    groups: list[Group] = []
    for box, devs in by_box.items():
        count = held[devs[0]].partial[1]
        slots: list[dict[int, int]] = []
        for d in devs:
            idx = held[d].partial[0]
            if held[d].partial[1] != count:
                return None
            slot = next((s for s in slots if idx not in s), None)
            if slot is None:
                slot = {}
                slots.append(slot)
            slot[idx] = d
        for s in slots:
            if len(s) != count:
                return None
            groups.append(tuple(sorted(s.values())))
    op = next(iter(held.values())).reduce
    if any(p.reduce != op for p in held.values()):
        return None
    axis = _scatter_axis(groups, held, dst) if op == "sum" else None
    if axis is not None:
        for g in groups:
            for k, d in enumerate(g):
                held[d] = Piece(chunk(held[d].box, axis, k, len(g)))
        return ReduceScatter(tuple(groups), axis)
    part = _part_scatter(groups, held, dst) if op == "sum" else None
    if part is not None:
        return part
    for g in groups:
        for d in g:
            held[d] = Piece(held[d].box)
    return AllReduce(tuple(groups), op=op)


def _part_scatter(groups: list[Group], held: dict[int, Piece], dst: dict[int, Need]
                  ) -> ReduceScatter | None:
    """A reduce-scatter over equal parts of each group (consecutive members, or every
    ``n/s``-th), when each member needs only its chunk along some axis but no one axis
    serves the whole group: what a layout split over two mesh axes needs (experts on
    ``ep``, their tokens' slots on ``dp``). Each part sums its own terms; the parts' results
    stay partial across parts, and the next reduce step sums them (another reduce-scatter
    along another axis, or an all-reduce), in ``_reduce``'s loop."""
    n = len(groups[0])
    if any(len(g) != n for g in groups):
        return None
    # parts by the terms they hold, not by device position: part j of every group then
    # holds the same terms, so the next step, which pairs equal boxes by part, adds each
    # term once (members in term order; each part's devices in rank order for the step)
    by_term = [sorted(g, key=lambda d: held[d].partial[0]) for g in groups]
    for size in [s for s in range(2, n) if n % s == 0]:
        for strided in (False, True):
            parts = [[tuple(sorted(t[j::n // size] if strided else t[j * size:(j + 1) * size]))
                      for j in range(n // size)] for t in by_term]
            flat = [p for ps in parts for p in ps]
            axis = _scatter_axis(flat, held, dst)
            if axis is None:
                continue
            for ps in parts:
                for j, part in enumerate(ps):
                    for k, d in enumerate(part):
                        held[d] = Piece(chunk(held[d].box, axis, k, size), (j, len(ps)))
            return ReduceScatter(tuple(flat), axis)
    return None


def gather_chain(steps: list[Step], groups: tuple[Group, ...]) -> int | None:
    """How many trailing all-gathers together span exactly ``groups`` (each a connected
    component of their groups, as large as the product of their sizes): their backwards,
    reduce-scatters in turn, then do the gradient sum. ``None`` if no such chain ends ``steps``."""
    want = {frozenset(g) for g in groups}
    for k in range(1, len(steps) + 1):
        tail = steps[-k:]
        if not all(isinstance(t, AllGather) for t in tail):
            return None
        comp: dict[int, set[int]] = {}
        for t in tail:
            for g in t.groups:
                merged = set(g).union(*(comp.get(d, set()) for d in g))
                for d in merged:
                    comp[d] = merged
        if any(len({len(g) for g in t.groups}) != 1 for t in tail):
            return None
        size = 1
        for t in tail:
            size *= len(t.groups[0])
        found = {frozenset(c) for c in comp.values()}
        if found == want and all(len(c) == size for c in found):
            return k
    return None


def chunk(box: Box, axis: int, k: int, n: int) -> Box:
    a, b = box[axis]
    step = (b - a) // n
    return box[:axis] + ((a + k * step, a + (k + 1) * step),) + box[axis + 1:]


def _scatter_axis(groups: list[Group], held: dict[int, Piece], dst: dict[int, Need]) -> int | None:
    """An axis along which each member needs only its own chunk."""
    box0 = held[groups[0][0]].box
    for axis in range(len(box0)):
        ok = True
        for g in groups:
            box = held[g[0]].box
            a, b = box[axis]
            if (b - a) % len(g) or any(d not in dst for d in g):
                ok = False
                break
            for k, d in enumerate(g):
                if not Piece(chunk(box, axis, k, len(g))).contains(dst[d].box):
                    ok = False
                    break
            if not ok:
                break
        if ok:
            return axis
    return None


def sum_groups(dst: dict[int, Need]) -> tuple[Group, ...] | None:
    """Devices reading the same box for different pieces: their grads add up."""
    by_box: dict[Box, dict[Hashable, list[int]]] = {}
    for d in sorted(dst):
        by_box.setdefault(dst[d].box, {}).setdefault(dst[d].piece_id, []).append(d)
    groups: list[Group] = []
    for ids in by_box.values():
        if len(ids) < 2:
            continue
        counts = {len(v) for v in ids.values()}
        if len(counts) != 1:
            return None
        for j in range(counts.pop()):
            groups.append(tuple(sorted(v[j] for v in ids.values())))
    return tuple(groups)


__all__ = ["chunk", "gather_chain", "reduce_step", "sum_groups"]
