"""The pieces of a node under a plan: their boxes, partial terms and local arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchweave.ops.bind import Bound
from torchweave.ops.grammar import TensorSpec
from torchweave.ops.registry import OpSpec
from torchweave.plan.layout import Box, Piece, full_box
from torchweave.plan.plan import PieceIndex, Plan


@dataclass(frozen=True)
class PieceInfo:
    """One piece of one node."""

    index: PieceIndex
    chunks: dict[str, tuple[int, int]]
    """Split dim → (chunk index, number of chunks)."""
    replica: int
    device: int

    @property
    def piece_id(self) -> tuple:
        """Identity without the replica index."""
        return tuple(sorted(self.chunks.items()))


def node_pieces(plan: Plan, node: str) -> list[PieceInfo]:
    trans = plan.transforms(node)
    return [piece_info(trans, index, plan.device_of(node, index)) for index in plan.pieces(node)]


def piece_info(trans, index: PieceIndex, device: int) -> PieceInfo:
    """The piece ``index`` of a node transformed by ``trans`` (a prefix of them gives the
    piece those transforms alone would make: co-shard's share of a device)."""
    chunks: dict[str, tuple[int, int]] = {}
    replica = 0
    for t, i in zip(trans, index):
        if t.dim is None:
            replica = replica * t.parts + i
        else:
            k, n = chunks.get(t.dim, (0, 1))
            chunks[t.dim] = (k * t.parts + i, n * t.parts)
    return PieceInfo(tuple(index), chunks, replica, device)


def tensor_box(bound: Bound, spec: TensorSpec, shape: tuple[int, ...], piece: PieceInfo) -> Box:
    """The box of a tensor (annotated ``spec``) that ``piece`` reads or writes."""
    if spec.opaque:
        return full_box(shape)
    box = []
    for axis, size in zip(spec.axes, shape):
        lead = axis.dims[0].name if axis.dims else None
        if lead in piece.chunks:
            k, n = piece.chunks[lead]
            step = size // n
            box.append((k * step, (k + 1) * step))
        else:
            box.append((0, size))
    return tuple(box)


def output_piece(bound: Bound, spec: TensorSpec, shape: tuple[int, ...], piece: PieceInfo,
                 reduce: str = "sum") -> Piece:
    """The output piece: its box, which partial term it is, and how terms combine."""
    names = set(spec.names()) if not spec.opaque else set()
    index, count = 0, 1
    for dim, (k, n) in sorted(piece.chunks.items()):
        if bound.dim(dim).kind == "reduce" and dim not in names:
            index, count = index * n + k, count * n
    return Piece(tensor_box(bound, spec, shape, piece), (index, count),
                 reduce if count > 1 else "sum")


def local_shape(box: Box) -> list[int]:
    return [b - a for a, b in box]


def local_call(spec: OpSpec | None, target: str, args: tuple[Any, ...], kwargs: dict[str, Any],
               bound: Bound, out_box: Box, piece: PieceInfo) -> tuple[str, tuple, dict]:
    """The function (by import path) and constant arguments one piece calls."""
    fn = target
    if spec is None:
        return fn, args, kwargs
    if spec.shape_arg is not None and piece.chunks:
        pos, name = spec.shape_arg
        shape = local_shape(out_box)
        if pos < len(args):
            args = args[:pos] + (shape,) + args[pos + 1:]
        else:
            kwargs = {**kwargs, name: shape}
    if spec.local is not None:  # a whole piece asks too (split None): an op may run its own
        for dim, (k, n) in piece.chunks.items() or [(None, (0, 1))]:  # function whole as well
            custom = spec.local(args, kwargs, _SplitView(dim, n), k, bound.sizes)
            if custom is not None:
                f, args, kwargs = custom
                fn = f"{f.__module__}.{f.__qualname__}"
    return fn, args, kwargs


@dataclass(frozen=True)
class _SplitView:
    dim: str | None
    parts: int
