"""Derive the communication between a producer's layout and a consumer's needs.

The search runs in fixed phases, each choosing the cheapest collective that
applies to regular groups of devices: reduce partial sums (reduce-scatter if
each member needs only its chunk, over the whole group or, for a layout split
over two mesh axes, over parts of it in turn; else all-reduce); gather shards over the
narrowest groups that cover what each member needs, one axis at a time (all-to-all when each
member then needs only a chunk along another axis, else all-gather);
cut what is held down to what is needed (a split with an all-gather backward
when replicas keep different chunks, else a local narrow); finally sum the
gradients of a replicated tensor read by different pieces (``R'``). Whatever
fits no regular group falls back to point-to-point transfers. The two sums (the first
phase and the last) are :mod:`torchweave.lower.sums`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Hashable

from torchweave.lower.steps import (
    AllGather, AllReduce, AllToAll, Box, GradAllReduce, Group, Narrow, Split, Step,
)
from torchweave.lower.sums import chunk, gather_chain, reduce_step, sum_groups
from torchweave.lower.transfers import transfers
from torchweave.plan.layout import Piece


@dataclass(frozen=True)
class Need:
    """What one device's consumer piece reads: a box, and who it is."""

    box: Box
    piece_id: Hashable
    """Identity of the consumer piece without its replica index: devices that
    read the same box for different pieces hold partial gradients."""


@dataclass
class Derivation:
    steps: list[Step] = field(default_factory=list)
    grad_groups: tuple[Group, ...] = ()
    """Groups whose gradients still need summing (params: done by grad sync)."""
    result: dict[int, Piece] = field(default_factory=dict)


def derive(shape: tuple[int, ...], src: dict[int, Piece], dst: dict[int, Need], *,
           defer_grad_sum: bool = False, differentiable: bool = True) -> Derivation:
    """Steps that give every device in ``dst`` the box it needs.

    ``differentiable=False`` (integer tensors) skips gradient sums.
    """
    if not differentiable:
        dst = {d: Need(n.box, 0) for d, n in dst.items()}
    held = dict(src)
    steps: list[Step] = []

    def fallback() -> Derivation:
        """Point-to-point from where the regular steps so far have left things."""
        tail = _p2p(shape, held, dst)
        return Derivation(steps + tail.steps, (), tail.result)

    if any(d not in held for d in dst):
        return fallback()
    for _ in range(64):  # a reduce-scatter over part of a group leaves partials (bounded:
        # each step at least halves the terms a device still holds)
        if not any(p.is_partial for p in held.values()):
            break
        step = reduce_step(held, dst)
        if step is None:
            return fallback()
        steps.append(step)
    else:
        return fallback()
    for _ in range(len(shape) + 1):
        if all(held[d].contains(n.box) for d, n in dst.items()):
            break
        step = _gather(held, dst)
        if step is None:
            return fallback()
        steps.append(step)
    else:
        return fallback()
    cut = _cut(dict(held), dst)
    if cut is None:
        return fallback()
    cut_steps, held = cut
    steps.extend(cut_steps)
    groups = sum_groups(dst)
    if groups is None:
        return fallback()
    out = Derivation(steps, (), held)
    if groups:
        last = steps[-1] if steps else None
        if isinstance(last, AllReduce) and set(last.groups) == set(groups):
            steps[-1] = replace(last, bwd="all_reduce")
        elif (k := gather_chain(steps, groups)) is not None:
            steps[-k:] = [replace(g, bwd="reduce_scatter") for g in steps[-k:]]
        elif defer_grad_sum and not steps:
            out.grad_groups = groups
        else:
            steps.append(GradAllReduce(groups))
    return out


# ---------------------------------------------------------------- phases
def _gather(held: dict[int, Piece], dst: dict[int, Need]) -> Step | None:
    """One all-gather (or all-to-all) along the axis that helps most."""
    best: tuple[tuple[int, int], Step, dict[int, Piece]] | None = None
    base: int | None = None  # what is covered before the step, counted once when needed
    for axis in range(len(next(iter(held.values())).box)):
        groups = _narrowest(_tiling_groups(held, axis), held, dst, axis)
        if not groups:
            continue
        new = dict(held)
        for g in groups:
            lo, hi = held[g[0]].box[axis][0], held[g[-1]].box[axis][1]
            for d in g:
                box = held[d].box
                new[d] = Piece(box[:axis] + ((lo, hi),) + box[axis + 1:])
        fixed = sum(1 for d, n in dst.items() if new[d].contains(n.box) and not held[d].contains(n.box))
        gained = 0
        if not fixed:
            # a layout split over two axes gathers one axis at a time: the first gather fixes
            # no one, but covers more of what they need. Only among readers: a holder that
            # reads nothing would get no gradient back through the gathers' slices
            if any(d not in dst for g in groups for d in g):
                continue
            if base is None:
                base = _covered(held, dst)
            gained = _covered(new, dst) - base
            if gained <= 0:
                continue
        step: Step = AllGather(tuple(groups), axis)
        a2a = _all_to_all(groups, held, new, dst, axis)
        if a2a is not None:
            step, new = a2a
        key = (fixed, gained)  # coverage only breaks a tie of fixing no one
        if best is None or key > best[0]:
            best = (key, step, new)
    if best is None:
        return None
    held.update(best[2])
    return best[1]


def _covered(held: dict[int, Piece], dst: dict[int, Need]) -> int:
    """Elements of what each device needs that it holds, summed over devices."""
    total = 0
    for d, n in dst.items():
        v = 1
        for (a, b), (c, e) in zip(held[d].box, n.box):
            v *= max(0, min(b, e) - max(a, c))
        total += v
    return total


def _tiling_groups(held: dict[int, Piece], axis: int) -> list[Group]:
    """Groups of devices whose boxes tile a range along ``axis`` in rank order."""
    buckets: dict[tuple, dict[tuple[int, int], list[int]]] = {}
    for d in sorted(held):
        p = held[d]
        key = (p.box[:axis] + p.box[axis + 1:], p.partial)
        buckets.setdefault(key, {}).setdefault(p.box[axis], []).append(d)
    groups: list[Group] = []
    for ranges in buckets.values():
        if len(ranges) < 2:
            continue
        order = sorted(ranges)
        sizes = {b - a for a, b in order}
        contiguous = all(order[i][1] == order[i + 1][0] for i in range(len(order) - 1))
        counts = {len(v) for v in ranges.values()}
        if len(sizes) != 1 or not contiguous or len(counts) != 1:
            return []
        for j in range(counts.pop()):
            g = tuple(ranges[r][j] for r in order)
            if list(g) != sorted(g):
                return []
            groups.append(g)
    return groups


def _narrowest(groups: list[Group], held: dict[int, Piece], dst: dict[int, Need], axis: int
               ) -> list[Group]:
    """Each tiling group cut into the shortest runs of consecutive members whose gathered
    range still covers what every member needs along ``axis``. A batch split again on a
    tensor-parallel axis tiles the batch over the whole stage; a consumer that needs its
    data-parallel share gathers over its tp group, not over every replica."""
    out: list[Group] = []
    for g in groups:
        n = len(g)
        for size in [s for s in range(2, n + 1) if n % s == 0]:
            runs = [g[i:i + size] for i in range(0, n, size)]
            if all(held[r[0]].box[axis][0] <= dst[d].box[axis][0]
                   and dst[d].box[axis][1] <= held[r[-1]].box[axis][1]
                   for r in runs for d in r if d in dst):
                out.extend(runs)
                break
        else:
            out.append(g)
    return out


def _all_to_all(groups, held, gathered, dst, axis):
    """S(axis) → S(b): each member then keeps chunk k along ``b``."""
    for b in range(len(held[groups[0][0]].box)):
        if b == axis:
            continue
        new = dict(gathered)
        ok = True
        for g in groups:
            for k, d in enumerate(g):
                box = gathered[d].box
                lo, hi = box[b]
                if (hi - lo) % len(g) or d not in dst:
                    ok = False
                    break
                new[d] = Piece(chunk(box, b, k, len(g)))
                if not new[d].contains(dst[d].box):
                    ok = False
                    break
            if not ok:
                break
        if ok:
            return AllToAll(tuple(groups), b, axis), new
    return None


def _cut(held: dict[int, Piece], dst: dict[int, Need]
         ) -> tuple[list[Step], dict[int, Piece]] | None:
    """Slice held pieces (a copy) down to the needed boxes; the steps and the result."""
    need_cut = {d for d, n in dst.items() if held[d].box != n.box}
    if not need_cut:
        return [], held
    steps: list[Step] = []
    while need_cut:
        split = _split_groups(held, dst, need_cut)
        if split is None:
            break
        axis, groups = split
        steps.append(Split(tuple(groups), axis))
        for g in groups:
            for k, d in enumerate(g):
                held[d] = Piece(chunk(held[d].box, axis, k, len(g)))
        need_cut = {d for d in need_cut if held[d].box != dst[d].box}
    if need_cut:
        for d in need_cut:
            same = [e for e in dst if held[e] == held[d]]
            if any(dst[e].box != dst[d].box for e in same) or any(e not in dst for e in held
                                                                    if held[e] == held[d]):
                return None
        boxes = []
        for d in sorted(need_cut):
            origin = held[d].box
            local = tuple((a - o[0], b - o[0]) for (a, b), o in zip(dst[d].box, origin))
            boxes.append((d, local))
            held[d] = Piece(dst[d].box)
        steps.append(Narrow(tuple(boxes)))
    return steps, held


def _split_groups(held, dst, need_cut) -> tuple[int, list[Group]] | None:
    """Replicas of one held box whose members need consecutive chunks of it."""
    by_box: dict[Box, list[int]] = {}
    for d in sorted(need_cut):
        by_box.setdefault(held[d].box, []).append(d)
    ndim = len(next(iter(by_box)))
    for axis in range(ndim):
        groups: list[Group] = []
        for box, devs in by_box.items():
            found = _split_along(box, devs, dst, axis)
            if found is None:
                break
            groups.extend(found)
        else:
            return axis, groups
    return None


def _split_along(box: Box, devs: list[int], dst: dict[int, Need], axis: int) -> list[Group] | None:
    a, b = box[axis]
    ranges = sorted({dst[d].box[axis] for d in devs})
    n = len(ranges)
    if n < 2 or (b - a) % n:
        return None
    chunks: dict[int, list[int]] = {}
    for d in devs:
        k = ranges.index(dst[d].box[axis])
        if dst[d].box[axis] != chunk(box, axis, k, n)[axis]:
            return None
        chunks.setdefault(k, []).append(d)
    if len({len(v) for v in chunks.values()}) != 1:
        return None
    groups = [tuple(chunks[k][j] for k in range(n)) for j in range(len(chunks[0]))]
    return groups if all(list(g) == sorted(g) for g in groups) else None


# ---------------------------------------------------------------- fallback
def point_to_point(shape: tuple[int, ...], src: dict[int, Piece], dst: dict[int, Need]) -> Derivation:
    """Transfers from where ``src`` holds the tensor to what ``dst`` needs, with no
    collectives (pipeline boundaries: each message is sent when the schedule says)."""
    return _p2p(shape, src, dst)


def _p2p(shape: tuple[int, ...], src: dict[int, Piece], dst: dict[int, Need]) -> Derivation:
    return Derivation([transfers(shape, src, dst)], (), {d: Piece(dst[d].box) for d in dst})
