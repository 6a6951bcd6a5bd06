"""The search's independent work (proxies of one degree, the candidates it simulates) on the
machine's cores.

A search of a large model spends nearly all its time in proxies and simulations
that do not depend on one another, in a single Python process. :class:`Runner`
hands them to worker processes (``spawn``: nothing of the parent is inherited
but what is pickled), each of which receives the graph once, at start, and
answers in the order asked, so a search gives the same result with any number of
workers. Errors come back as the problems they name (an exception object does
not always survive pickling). Small searches run here, where starting workers
would cost more than they save.

Workers are started where the entry point is known to allow it: ``torchweave
plan`` and the benches (:func:`default_workers`), or a caller that asks
(``search(..., workers=2)``, ``TORCHWEAVE_SEARCH_WORKERS``). A spawned worker
imports the caller's main module again, so a script that asks needs the usual
``if __name__ == "__main__":`` guard; the library's own default is one process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable

from torchweave.errors import Problem, TorchweaveError

LARGE = 1_000_000
"""Graph nodes × ranks from which a search starts workers (GPT-3 175B on 1,024 GPUs is
about 10 million; the test models are far below)."""

_STATE: dict[str, Any] = {}


def env_workers() -> int | None:
    """``TORCHWEAVE_SEARCH_WORKERS``, checked (None: unset)."""
    env = os.environ.get("TORCHWEAVE_SEARCH_WORKERS")
    if not env:
        return None
    if not env.isdigit() or int(env) < 1:
        raise TorchweaveError(Problem(obj="TORCHWEAVE_SEARCH_WORKERS", value=repr(env),
                                      rule="a whole number of worker processes, at least 1",
                                      fix="unset it, or set it to 1 (no workers) or more"))
    return int(env)


def default_workers(graph_nodes: int, world: int) -> int:
    """Workers for a search of this size, as ``torchweave plan`` and the benches start them:
    the cores (at most 4) for a large one, else 1; ``TORCHWEAVE_SEARCH_WORKERS`` overrides."""
    env = env_workers()
    if env is not None:
        return env
    if graph_nodes * world < LARGE:
        return 1
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1))


def _init(path: str) -> None:
    import torch

    torch.set_num_threads(1)  # the workers share the cores; each is one search thread
    with open(path, "rb") as f:  # the parent's own state, in its private folder (below)
        state = pickle.load(f)
    _STATE.clear()
    _STATE.update(state)


def _run(fn: Callable[..., Any], state: dict[str, Any], args: tuple) -> Any:
    try:
        return fn(state, *args)
    except TorchweaveError as exc:
        return Failed(list(exc.problems))


def _call(job: tuple[Callable[..., Any], tuple]) -> Any:
    """One job on a worker, on the state it received at start."""
    return _run(job[0], _STATE, job[1])


class Failed:
    """A job's error, as the problems it names."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems


class Runner:
    """Runs ``fn(state, *args)`` for each job, here or on ``workers`` processes; the answers
    in the jobs' order, a :class:`Failed` in place of a job that raised a TorchweaveError."""

    def __init__(self, workers: int, **state: Any) -> None:
        self.state = state
        self.pool: ProcessPoolExecutor | None = None
        self._dir: str | None = None
        if workers > 1:
            # The state (the graph, ~1 MB) goes by a file, not with each worker's start: a
            # spawned worker reads its start message while importing what unpickling needs
            # (torch, seconds), and the parent's write of a message larger than a pipe holds
            # waits for that, worker after worker. By a file the workers start together.
            # The folder is the parent's own (mode 0700) and removed on close; only this
            # process writes the file, and only its workers read it.
            self._dir = tempfile.mkdtemp(prefix="torchweave-search-")
            path = os.path.join(self._dir, "state.pickle")
            try:
                with open(path, "wb") as f:
                    pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
                self.pool = ProcessPoolExecutor(max_workers=workers,
                                                mp_context=mp.get_context("spawn"),
                                                initializer=_init, initargs=(path,))
            except BaseException:
                self.close()
                raise

    def map(self, fn: Callable[..., Any], jobs: list[tuple]) -> list[Any]:
        if self.pool is None or len(jobs) < 2:
            return [_run(fn, self.state, args) for args in jobs]
        return list(self.pool.map(_call, [(fn, args) for args in jobs]))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
            self.pool = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Failed", "LARGE", "Runner", "default_workers", "env_workers"]
