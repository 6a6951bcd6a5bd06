"""Run a function in a forked child and get its bytes back: work whose imports and caches
the caller should not keep.

Rank 0 captures the model for every rank (:func:`torchweave.front.shared_front`).
``torch.export`` imports some 400 modules (networkx's among them) and fills caches that
stay, about 30 MiB of resident memory that no other rank and no peer (DDP, FSDP) holds. A
forked child does that work instead and writes its result, the same texts and bytes the
other ranks receive, to a pipe; the child's memory goes when it exits.

The child runs one thread (a child forked after OpenMP ran can hang in its first parallel
region otherwise) and never touches the parent's process groups. ``fork`` is not used where
it is not safe or not there: no ``os.fork`` (Windows), CUDA already initialized (a forked
child cannot use it), or ``TORCHWEAVE_CAPTURE_IN_PROCESS=1`` (to step through a capture in
a debugger). There, and wherever the child fails, the caller does the work itself.
"""

from __future__ import annotations

import os
import struct
import sys
from typing import Callable

import torch

ENV = "TORCHWEAVE_CAPTURE_IN_PROCESS"


def can_fork() -> bool:
    """Whether :func:`in_child` may fork here."""
    return (hasattr(os, "fork") and os.environ.get(ENV, "") not in ("1", "true", "yes")
            and not torch.cuda.is_initialized())


def in_child(fn: Callable[[], list[bytes]]) -> list[bytes] | None:
    """``fn()``'s parts, computed in a forked child. None: not forked (see the module), or
    the child failed or exited without writing everything (the caller then calls ``fn``
    itself, which raises what the child met). What this process imported before is the
    child's too, without a second import."""
    if not can_fork():
        return None
    for stream in (sys.stdout, sys.stderr):  # what is buffered is printed once, by this process
        stream.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        code = 1
        try:
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
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001
                    pass
            os._exit(code)
    os.close(w)
    src = os.fdopen(r, "rb")
    try:
        data = src.read()  # until the child closes its end: never blocks it on a full pipe
    finally:
        src.close()  # a child still writing now fails (broken pipe) instead of waiting
        _, status = os.waitpid(pid, 0)
    if status != 0:
        return None
    return _parts(data)


def _parts(data: bytes) -> list[bytes] | None:
    """The parts the child wrote; None where they are not all there."""
    if len(data) < 8:
        return None
    (n,), at, out = struct.unpack_from("<q", data, 0), 8, []
    for _ in range(n):
        if at + 8 > len(data):
            return None
        (size,) = struct.unpack_from("<q", data, at)
        at += 8
        if size < 0 or at + size > len(data):
            return None
        out.append(data[at:at + size])
        at += size
    return out if at == len(data) else None
