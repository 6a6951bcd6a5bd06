"""Run a function in a forked child and get its bytes back: work whose imports and caches
the caller should not keep.

Rank 0 captures the model for every rank (:func:`torchweave.front.shared_front`).
``torch.export`` imports some 400 modules (networkx's among them) and fills caches that
stay, about 30 MiB of resident memory that no other rank and no peer (DDP, FSDP) holds. A
forked child does that work instead and writes its result, the same texts and bytes the
other ranks receive, to a pipe; the child's memory goes when it exits.

A fork copies only the calling thread. The child sets PyTorch's thread count to one (a
child forked after OpenMP ran hangs in its first parallel region otherwise) and never
touches the parent's process groups; a lock another thread held at the fork could still
stop it, so the parent waits at most ``timeout`` seconds, then kills it, and on Linux the
child is killed when its parent ends (a launcher stopping a failed job). ``fork`` is not
used where it is not safe or not there: no ``os.fork`` (Windows), CUDA already
initialized (a forked child cannot use it), or ``TORCHWEAVE_CAPTURE_IN_PROCESS=1`` (to
step through a capture in a debugger). There, and wherever the fork or the child fails,
the caller does the work itself.
"""

from __future__ import annotations

import os
import select
import signal
import struct
import sys
import time
import warnings
from typing import Callable

import torch

ENV = "TORCHWEAVE_CAPTURE_IN_PROCESS"


def can_fork() -> bool:
    """Whether :func:`in_child` may fork here."""
    return (hasattr(os, "fork") and os.environ.get(ENV, "") not in ("1", "true", "yes")
            and not torch.cuda.is_initialized())


def in_child(fn: Callable[[], list[bytes]], timeout: float = 3600.0) -> list[memoryview] | None:
    """``fn()``'s parts (at least one), computed in a forked child. None: not forked (see the
    module), or the child failed, ran past ``timeout`` seconds (it is killed) or exited
    without writing everything; the caller then calls ``fn`` itself. What this process
    imported before is the child's too, without a second import. The parts are views of
    one writable buffer."""
    if not can_fork():
        return None
    for stream in (sys.stdout, sys.stderr):  # what is buffered is printed once, by this process
        stream.flush()
    try:
        r, w = os.pipe()
    except OSError:
        return None
    parent = os.getpid()
    try:
        with warnings.catch_warnings():  # Python 3.12+ warns of forking with threads: see above
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        return None
    if pid == 0:  # the child: never returns into the caller's code
        _child(fn, r, w, parent)
    os.close(w)
    data = bytearray()
    end = time.monotonic() + timeout
    ready = select.poll()  # not select(): a rank of a large job may hold over 1,024 descriptors
    ready.register(r, select.POLLIN | select.POLLHUP)
    try:
        while True:
            left = end - time.monotonic()
            if left <= 0 or not ready.poll(min(left, 86400.0) * 1000):
                os.kill(pid, signal.SIGKILL)
                break
            chunk = os.read(r, 1 << 20)
            if not chunk:  # the child closed its end: done, or dead
                break
            data += chunk
    finally:
        os.close(r)  # a child still writing now fails (broken pipe) instead of waiting
        _, status = os.waitpid(pid, 0)
    return _parts(data) if status == 0 else None


def _child(fn: Callable[[], list[bytes]], r: int, w: int, parent: int) -> None:
    code = 1
    try:
        _die_with_parent(parent)
        os.close(r)
        torch.set_num_threads(1)
        parts = fn()
        with os.fdopen(w, "wb") as out:
            out.write(struct.pack("<q", len(parts)))
            for p in parts:
                out.write(struct.pack("<q", len(p)))
                out.write(p)
        code = 0
    except BaseException:  # noqa: BLE001 - the parent repeats the work and raises it
        code = 1
    finally:
        try:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
        except BaseException:  # noqa: BLE001
            pass
        os._exit(code)


def _die_with_parent(parent: int) -> None:
    """Linux: the child is killed when the process that forked it ends (a launcher that
    stops a job stops its ranks, and a rank's child must not outlive it)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent ended before the request: end now
            os._exit(1)
    except (OSError, AttributeError):
        pass


def _parts(data: bytearray) -> list[memoryview] | None:
    """The parts the child wrote, as views of ``data``; None where they are not all there."""
    if len(data) < 8:
        return None
    view = memoryview(data)
    (n,), at, out = struct.unpack_from("<q", data, 0), 8, []
    if n < 1:
        return None
    for _ in range(n):
        if at + 8 > len(data):
            return None
        (size,) = struct.unpack_from("<q", data, at)
        at += 8
        if size < 0 or at + size > len(data):
            return None
        out.append(view[at:at + size])
        at += size
    return out if at == len(data) else None
