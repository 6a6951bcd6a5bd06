"""CommCounter.wire_bytes: what a rank sends for each recorded call under ring algorithms."""

from __future__ import annotations

import pytest

from torchweave.runtime.counter import CommCounter, CommKind, Direction

FWD, BWD = Direction.FORWARD, Direction.BACKWARD


def test_wire_bytes_follow_the_ring_algorithms() -> None:
    c = CommCounter()
    c.record(CommKind.ALL_REDUCE, FWD, (0, 1, 2, 3), 1000)  # 2·3/4 of it
    c.record(CommKind.REDUCE_SCATTER, FWD, (0, 1), 1000)  # 1/2 of it
    c.record(CommKind.ALL_GATHER, BWD, (0, 1, 2, 3), 250)  # its shard to 3 others
    c.record(CommKind.ALL_TO_ALL, BWD, (0, 1), 400)  # half of it leaves
    c.record(CommKind.P2P, FWD, (0, 1, 2, 3), 300)  # what it sent
    assert c.wire_bytes(CommKind.ALL_REDUCE) == pytest.approx(1500)
    assert c.wire_bytes(CommKind.REDUCE_SCATTER) == pytest.approx(500)
    assert c.wire_bytes(CommKind.ALL_GATHER) == pytest.approx(750)
    assert c.wire_bytes(direction=BWD) == pytest.approx(750 + 200)
    assert c.wire_bytes() == pytest.approx(1500 + 500 + 750 + 200 + 300)
    assert c.nbytes() == 1000 + 1000 + 250 + 400 + 300  # the inputs, as before
