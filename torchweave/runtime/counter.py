"""Counting communication calls, per kind, direction and group.

Tests assert on these counts (in the spirit of DTensor's ``CommDebugMode``):
"exactly one all-reduce forward and one backward per block".
"""

from __future__ import annotations

import collections
import contextlib
import enum
from collections.abc import Iterator


class CommKind(enum.Enum):
    """A kind of communication call."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    P2P = "p2p"


class Direction(enum.Enum):
    """Whether a call ran in the forward or the backward pass."""

    FORWARD = "fwd"
    BACKWARD = "bwd"


Key = tuple[CommKind, Direction, tuple[int, ...]]


class CommCounter:
    """Counts calls and bytes sent per (kind, direction, group).

    It always records. ``window()`` yields a fresh counter that sees only the
    calls made while the ``with`` block is open; windows nest.
    """

    def __init__(self) -> None:
        self._calls: collections.Counter[Key] = collections.Counter()
        self._bytes: collections.Counter[Key] = collections.Counter()
        self._windows: list[CommCounter] = []

    def record(self, kind: CommKind, direction: Direction, group: tuple[int, ...],
               nbytes: int) -> None:
        key = (kind, direction, group)
        self._calls[key] += 1
        self._bytes[key] += nbytes
        for w in self._windows:
            w.record(kind, direction, group, nbytes)

    def count(self, kind: CommKind | None = None, direction: Direction | None = None,
              group: tuple[int, ...] | None = None) -> int:
        """Number of calls that match; ``None`` matches anything."""
        return sum(n for key, n in self._calls.items() if _matches(key, kind, direction, group))

    def nbytes(self, kind: CommKind | None = None, direction: Direction | None = None,
               group: tuple[int, ...] | None = None) -> int:
        """Bytes of this rank's input to the matching calls."""
        return sum(n for key, n in self._bytes.items() if _matches(key, kind, direction, group))

    def wire_bytes(self, kind: CommKind | None = None, direction: Direction | None = None) -> float:
        """Bytes this rank sends for the matching calls under ring algorithms, from each
        call's input and its group's size ``p``: an all-reduce sends ``2(p-1)/p`` of its
        input, a reduce-scatter and an all-to-all ``(p-1)/p``, an all-gather ``p-1`` times
        its shard, point-to-point what it sends."""
        factor = {CommKind.ALL_REDUCE: lambda p: 2 * (p - 1) / p,
                  CommKind.REDUCE_SCATTER: lambda p: (p - 1) / p,
                  CommKind.ALL_TO_ALL: lambda p: (p - 1) / p,
                  CommKind.ALL_GATHER: lambda p: p - 1,
                  CommKind.P2P: lambda p: 1}
        return sum(n * factor[key[0]](len(key[2])) for key, n in self._bytes.items()
                   if _matches(key, kind, direction, None))

    def counts(self) -> dict[tuple[CommKind, Direction], int]:
        """Calls per (kind, direction), summed over groups."""
        out: collections.Counter[tuple[CommKind, Direction]] = collections.Counter()
        for (kind, direction, _), n in self._calls.items():
            out[kind, direction] += n
        return dict(out)

    def reset(self) -> None:
        self._calls.clear()
        self._bytes.clear()

    @contextlib.contextmanager
    def window(self) -> Iterator[CommCounter]:
        """A counter of the calls made inside the ``with`` block."""
        inner = CommCounter()
        self._windows.append(inner)
        try:
            yield inner
        finally:
            self._windows.remove(inner)

    def __str__(self) -> str:
        items = sorted(self.counts().items(), key=lambda kv: (kv[0][0].value, kv[0][1].value))
        body = " ".join(f"{k.value}.{d.value}={n}" for (k, d), n in items)
        return f"CommCounter({body})"


def _matches(key: Key, kind: CommKind | None, direction: Direction | None,
             group: tuple[int, ...] | None) -> bool:
    k, d, g = key
    return ((kind is None or k == kind) and (direction is None or d == direction)
            and (group is None or g == tuple(sorted(group))))
