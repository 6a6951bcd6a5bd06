"""Layouts: which piece of a logical tensor each device holds.

A :class:`Piece` is an index box plus which part of a partial sum it is. A
:class:`Layout` maps each device to the piece it holds. Layouts are frozen
values; they never run communication. Regular layouts print in the style of
DTensor placements over named mesh axes: ``S(0)@dp S(2)@tp``, ``R``, ``P@tp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping

Range = tuple[int, int]
Box = tuple[Range, ...]


@dataclass(frozen=True)
class Piece:
    """A box of a tensor, and its partial-sum index (0 of 1 when complete)."""

    box: tuple[Range, ...]
    partial: tuple[int, int] = (0, 1)
    """(index, count): this piece is one of ``count`` terms that make the value."""
    reduce: str = "sum"
    """How the terms combine: ``sum``, or ``lse`` (log-sum-exp)."""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.box)

    @property
    def is_partial(self) -> bool:
        return self.partial[1] > 1

    def contains(self, box: tuple[Range, ...]) -> bool:
        return all(a <= c and d <= b for (a, b), (c, d) in zip(self.box, box))

    def __str__(self) -> str:
        box = ",".join(f"{a}:{b}" for a, b in self.box)
        kind = "" if self.reduce == "sum" else f"({self.reduce})"
        part = f" P{kind}{self.partial[0]}/{self.partial[1]}" if self.is_partial else ""
        return f"[{box}]{part}"


def full_box(shape: tuple[int, ...]) -> tuple[Range, ...]:
    return tuple((0, s) for s in shape)


def hull(boxes: list[Box]) -> Box:
    """The smallest box holding every box of ``boxes`` (all of one rank)."""
    return tuple((min(b[i][0] for b in boxes), max(b[i][1] for b in boxes))
                 for i in range(len(boxes[0])))


@dataclass(frozen=True)
class Layout:
    """Device → the piece it holds, for one logical tensor of ``shape``."""

    shape: tuple[int, ...]
    pieces: tuple[tuple[int, Piece], ...]
    """(device, piece) pairs, sorted by device."""

    @staticmethod
    def of(shape: tuple[int, ...], pieces: Mapping[int, Piece]) -> "Layout":
        return Layout(tuple(shape), tuple(sorted(pieces.items())))

    def as_dict(self) -> dict[int, Piece]:
        return dict(self.pieces)

    def devices(self) -> list[int]:
        return [d for d, _ in self.pieces]

    def __iter__(self) -> Iterator[tuple[int, Piece]]:
        return iter(self.pieces)

    def describe(self, mesh: "Mesh | None" = None) -> str:
        """Short placement form when regular over ``mesh``, else the boxes."""
        if mesh is not None:
            regular = mesh.placements(self)
            if regular is not None:
                return regular
        return " ".join(f"{d}:{p}" for d, p in self.pieces)


@dataclass(frozen=True)
class Mesh:
    """Named device axes, row-major over ranks ``0 … size-1``."""

    axes: tuple[tuple[str, int], ...]

    @staticmethod
    def of(**axes: int) -> "Mesh":
        return Mesh(tuple(axes.items()))

    @property
    def size(self) -> int:
        out = 1
        for _, n in self.axes:
            out *= n
        return out

    def names(self) -> list[str]:
        return [a for a, _ in self.axes]

    def dim(self, name: str) -> int:
        return dict(self.axes)[name]

    def coord(self, rank: int) -> dict[str, int]:
        out = {}
        for name, n in reversed(self.axes):
            out[name] = rank % n
            rank //= n
        return dict(reversed(list(out.items())))

    def rank(self, coord: Mapping[str, int]) -> int:
        r = 0
        for name, n in self.axes:
            r = r * n + coord.get(name, 0)
        return r

    def groups(self, axis: str) -> list[tuple[int, ...]]:
        """The device groups along ``axis``: ranks that differ only in it."""
        out: dict[tuple, list[int]] = {}
        for r in range(self.size):
            c = self.coord(r)
            key = tuple(v for k, v in c.items() if k != axis)
            out.setdefault(key, []).append(r)
        return [tuple(g) for g in out.values()]

    def placements(self, layout: Layout) -> str | None:
        """``S(0)@dp S(2)@tp`` if each axis shards, replicates or sums evenly."""
        held = layout.as_dict()
        if sorted(held) != list(range(self.size)):
            return None
        parts = []
        for name, n in self.axes:
            if n == 1:
                continue
            place = None
            for group in self.groups(name):
                ps = [held[r] for r in group]
                p = _axis_placement(ps, layout.shape)
                if p is None or (place is not None and p != place):
                    return None
                place = p
            if place != "R":
                parts.append(f"{place}@{name}")
        return " ".join(parts) or "R"

    def __str__(self) -> str:
        return "×".join(f"{a}={n}" for a, n in self.axes)


def _axis_placement(ps: list[Piece], shape: tuple[int, ...]) -> str | None:
    if all(p == ps[0] for p in ps):
        return "R"
    if all(p.box == ps[0].box for p in ps) and sorted(p.partial[0] for p in ps) == list(range(len(ps))):
        return "P"
    diff = [a for a in range(len(shape)) if len({p.box[a] for p in ps}) > 1]
    if len(diff) == 1 and all(p.partial == ps[0].partial for p in ps):
        a = diff[0]
        starts = [p.box[a][0] for p in ps]
        if starts == sorted(starts):
            return f"S({a})"
    return None
