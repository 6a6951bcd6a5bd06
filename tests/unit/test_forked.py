"""``runtime/forked.py``: work done in a forked child comes back whole, or not at all."""

from __future__ import annotations

import sys

import pytest
import torch

from torchweave.runtime import forked

pytestmark = pytest.mark.skipif(not forked.can_fork(), reason="no fork here")


def test_the_childs_parts_come_back_and_its_imports_stay_there() -> None:
    name = "tests.unit._forked_probe"
    assert name not in sys.modules

    def work() -> list[bytes]:
        sys.modules[name] = type(sys)(name)  # stands for an import the parent should not keep
        return [b"header", b"", bytes(range(256)) * 1000]

    got = forked.in_child(work)
    assert [bytes(p) for p in got] == [b"header", b"", bytes(range(256)) * 1000]
    assert name not in sys.modules


def test_a_failing_child_gives_none_so_the_caller_does_the_work_itself() -> None:
    def fails() -> list[bytes]:
        raise ValueError("capture refused")

    assert forked.in_child(fails) is None


def test_a_child_after_parallel_work_here_does_not_hang() -> None:
    """A child forked after OpenMP ran here hangs in its first parallel region unless it runs
    one thread; ``in_child`` makes it so."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = torch.randn(512, 512)
        for _ in range(3):
            a @ a  # parallel regions in this process

        def child_work() -> list[bytes]:
            b = torch.randn(512, 512)
            return [str(float((b @ b).sum().isfinite())).encode(), str(torch.get_num_threads()).encode()]

        assert [bytes(p) for p in forked.in_child(child_work)] == [b"1.0", b"1"]
    finally:
        torch.set_num_threads(threads)


def test_a_stuck_child_is_killed_after_the_timeout() -> None:
    """A child that never answers (a lock another thread held at the fork) is killed and
    reaped; the caller then does the work itself."""
    import time

    def stuck() -> list[bytes]:
        time.sleep(600)
        return [b"late"]

    t0 = time.monotonic()
    assert forked.in_child(stuck, timeout=1.0) is None
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("data", [b"", b"\x00\x00\x00\x00\x00\x00\x00\x00", b"\x01\x00\x00\x00\x00\x00\x00\x00",
                                  b"\x01\x00\x00\x00\x00\x00\x00\x00\x09\x00\x00\x00\x00\x00\x00\x00abc",
                                  b"\x00\x00\x00\x00\x00\x00\x00\x00trailing"])
def test_a_short_padded_or_empty_message_is_refused(data: bytes) -> None:
    assert forked._parts(bytearray(data)) is None


def test_the_env_switch_keeps_the_work_here(monkeypatch) -> None:
    monkeypatch.setenv(forked.ENV, "1")
    assert not forked.can_fork()
    assert forked.in_child(lambda: [b"x"]) is None


def test_the_parts_are_views_torch_can_read_without_a_copy() -> None:
    data = torch.arange(6, dtype=torch.float32)
    got = forked.in_child(lambda: [b"h", bytearray(data.numpy())])
    back = torch.frombuffer(got[1], dtype=torch.uint8).view(torch.float32)
    assert torch.equal(back, data)
