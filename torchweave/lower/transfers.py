"""Point-to-point transfers: the pieces each device needs, from the devices that hold them.

What :mod:`torchweave.lower.derive` falls back to when no regular group of devices fits,
and what carries a tensor across pipeline stages (each message sent when the schedule
says). Each needed region comes from one holder per partial term (the device itself
first); in backward each gradient piece goes back to every holder, scaled where
replicas of one consumer piece would otherwise add it twice.
"""

from __future__ import annotations

from typing import Any

from torchweave.errors import Problem, TorchweaveError
from torchweave.lower.steps import P2P, Box, Transfer
from torchweave.plan.layout import Piece


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def _local(box: Box, origin: Box) -> Box:
    return tuple((a - o[0], b - o[0]) for (a, b), o in zip(box, origin))


def transfers(shape: tuple[int, ...], src: dict[int, Piece], dst: dict[int, Any]) -> P2P:
    """The step that gives every device in ``dst`` (each a ``Need``: ``box`` and
    ``piece_id``) its box from the pieces ``src`` holds; boxes in a transfer are local to
    the sender's and the receiver's pieces."""
    if any(p.reduce != "sum" for p in src.values()):
        raise TorchweaveError(Problem(
            obj="partial log-sum-exp", value=f"held as {sorted(src.items())[:2]}...",
            rule="log-sum-exp terms are combined over regular groups only",
            fix="split the log-sum-exp's input the same way on every device of a group",
        ))
    sent: list[Transfer] = []
    back: list[Transfer] = []
    for d in sorted(dst):
        need = dst[d].box
        count = max(p.partial[1] for p in src.values())
        for term in range(count):
            sources = [s for s in sorted(src, key=lambda s: (s != d, s))
                       if count == 1 or src[s].partial == (term, count)]
            covered: list[Box] = []
            for s in sources:
                region = _intersect(src[s].box, need)
                if region is None or any(_intersect(region, c) == region for c in covered):
                    continue
                covered.append(region)
                sent.append(Transfer(s, d, _local(region, src[s].box), _local(region, need),
                                     add=count > 1))
        for s in sorted(src):
            region = _intersect(src[s].box, need)
            if region is not None:
                back.append(Transfer(d, s, _local(region, need), _local(region, src[s].box), add=True))
    replicas: dict[tuple, int] = {}
    for n in dst.values():
        replicas[(n.box, n.piece_id)] = replicas.get((n.box, n.piece_id), 0) + 1
    scale = tuple((d, 1.0 / replicas[(n.box, n.piece_id)]) for d, n in sorted(dst.items())
                  if replicas[(n.box, n.piece_id)] > 1)
    shapes = tuple((d, tuple(b - a for a, b in dst[d].box)) for d in sorted(dst))
    return P2P(tuple(sent), shapes, tuple(back), scale)


__all__ = ["transfers"]
