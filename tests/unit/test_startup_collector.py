"""``startup_collector``: the cycle collector skips the objects alive when a rank starts
building its piece, and gets them all back when it is done."""

from __future__ import annotations

import gc
import weakref

import pytest

from torchweave.parallel import startup_collector


class Node:
    """An object that can sit in a reference cycle and be watched by a weak reference."""

    def __init__(self) -> None:
        self.other: Node | None = None


def _cycle() -> weakref.ref:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture(autouse=True)
def _nothing_frozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_objects_alive_before_are_frozen_inside_and_collected_after() -> None:
    holder = [Node()]
    holder[0].other = holder[0]  # a cycle alive when the block starts
    seen = weakref.ref(holder[0])
    with startup_collector():
        assert gc.get_freeze_count() > 0
        del holder[0]  # garbage now, but frozen: a collection does not see it
        gc.collect()
        assert seen() is not None
    assert gc.get_freeze_count() == 0
    gc.collect()  # back under the collector: the cycle goes
    assert seen() is None


def test_garbage_made_inside_is_still_collected_inside() -> None:
    with startup_collector():
        made = _cycle()
        gc.collect()
        assert made() is None


def test_a_process_that_froze_objects_itself_is_left_as_it_is() -> None:
    gc.freeze()
    count = gc.get_freeze_count()
    with startup_collector():
        assert gc.get_freeze_count() == count
    assert gc.get_freeze_count() == count


def test_an_error_inside_still_unfreezes() -> None:
    with pytest.raises(RuntimeError):
        with startup_collector():
            raise RuntimeError("capture failed")
    assert gc.get_freeze_count() == 0
