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
    # The freeze count itself is not compared: frozen objects freed by reference counting
    # elsewhere (another test's leftovers) lower it at any moment. What is checked is what
    # the count stands for: what the process froze stays frozen, and nothing else is.
    kept = [Node()]
    kept[0].other = kept[0]
    frozen_by_user = weakref.ref(kept[0])
    gc.freeze()
    made_after = _cycle()  # not frozen by the process: the block must not freeze it either
    with startup_collector():
        gc.collect()
        assert made_after() is None
        assert gc.get_freeze_count() > 0
    del kept[0]
    gc.collect()
    assert frozen_by_user() is not None  # still frozen: the block did not unfreeze it
    gc.unfreeze()
    gc.collect()
    assert frozen_by_user() is None


def test_an_error_inside_still_unfreezes() -> None:
    with pytest.raises(RuntimeError):
        with startup_collector():
            raise RuntimeError("capture failed")
    assert gc.get_freeze_count() == 0
