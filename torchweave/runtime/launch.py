"""Starting ranks: local processes (``spawn``) or under torchrun (``init_from_env``).

``spawn`` starts one process per rank and returns each rank's return value.
A local launch listens on no network address: the ranks meet through a
``FileStore`` in the launch's private temporary folder (mode 0700), and gloo's
pair connections listen on 127.0.0.1 only (:func:`_loopback_gloo`). Each rank
writes its result, or its traceback, to a file in that folder before it tears
down; so a rank that crashes during teardown, after its result is written,
does not fail the run (gloo aborts one rank in about twenty at exit; see
PLATFORM.md). Multi-node jobs are torchrun's (:func:`init_from_env`).
"""

from __future__ import annotations

import math
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchweave.errors import Problem, TorchweaveError
from torchweave.runtime.groups import GroupCache

_POLL_S = 0.02


class LaunchError(TorchweaveError):
    """A launch that cannot start, or a rank that failed."""


class RankFailedError(LaunchError):
    """A rank raised or died; the other ranks were terminated."""

    def __init__(self, failures: dict[int, tuple[str, str]]):
        self.failures = {r: text for r, (_, text) in failures.items()}
        """Traceback text (or exit description) per failed rank, first failure first."""
        self.rank = next(iter(failures))
        """The rank that failed first."""
        self.traceback = self.failures[self.rank]
        problems = [Problem(obj=f"rank {r}", value=summary,
                            rule="a rank raised or died, so every rank was stopped",
                            fix="see the traceback of the first failing rank above")
                    for r, (summary, _) in failures.items()]
        super().__init__(problems, header=f"rank {self.rank} failed first:\n{self.traceback}")


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """How to start the ranks of one job."""

    world_size: int
    """Number of ranks."""
    backend: Literal["gloo", "nccl", "auto"] = "auto"
    """Process-group backend; ``auto`` is nccl when CUDA is available, else gloo."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where each rank's tensors live. ``auto``: ``cuda:local_rank`` under nccl, else cpu.
    ``cuda`` under gloo: CUDA tensors through gloo, the ranks sharing the visible GPUs
    round-robin (``cuda:local_rank % device_count``; several ranks may share one)."""
    timeout_s: float = 60.0
    """Time-out of every collective and of the rendezvous, in seconds."""
    threads_per_rank: int | None = None
    """torch threads per rank; ``None`` shares the CPU cores evenly (at least 1)."""
    teardown_grace_s: float = 10.0
    """Seconds ranks get to exit after all results are in; stragglers are killed."""

    def __post_init__(self) -> None:
        problems = []

        def bad(name: str, rule: str, fix: str = "") -> None:
            value = getattr(self, name)
            problems.append(Problem(obj=f"LaunchConfig.{name}", value=repr(value), rule=rule,
                                    fix=fix))

        if not _is_int(self.world_size) or self.world_size < 1:
            bad("world_size", "must be an int >= 1")
        if self.backend not in ("gloo", "nccl", "auto"):
            bad("backend", "must be 'gloo', 'nccl' or 'auto'", "use 'auto' to pick by device")
        if self.device not in ("auto", "cpu", "cuda"):
            bad("device", "must be 'auto', 'cpu' or 'cuda'")
        elif self.device == "cpu" and self.backend == "nccl":
            bad("device", "nccl communicates CUDA tensors only", "use device='cuda' or 'auto'")
        if not _is_positive(self.timeout_s):
            bad("timeout_s", "must be a finite number > 0", "use e.g. 60.0; tests use about 5.0")
        if self.threads_per_rank is not None and (
                not _is_int(self.threads_per_rank) or self.threads_per_rank < 1):
            bad("threads_per_rank", "must be None or an int >= 1")
        if not _is_positive(self.teardown_grace_s, allow_zero=True):
            bad("teardown_grace_s", "must be a finite number >= 0")
        if problems:
            raise LaunchError(problems, header="invalid LaunchConfig")

    def resolved_backend(self) -> Literal["gloo", "nccl"]:
        if self.backend == "auto":
            return "nccl" if torch.cuda.is_available() and self.device != "cpu" else "gloo"
        return self.backend

    def resolved_device(self, local_rank: int) -> torch.device:
        """This rank's device (see ``device``)."""
        if self.resolved_backend() == "nccl":
            return torch.device("cuda", local_rank)
        if self.device == "cuda":
            return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        return torch.device("cpu")

    def resolved_threads(self) -> int:
        if self.threads_per_rank is not None:
            return self.threads_per_rank
        return max(1, (os.cpu_count() or 1) // self.world_size)


@dataclass(kw_only=True)
class RankContext:
    """What a rank's program knows about where it runs."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    """cpu for gloo, cuda:local_rank for nccl."""
    timeout_s: float
    groups: GroupCache

    def close(self) -> None:
        """Wait for every rank, then destroy the process group."""
        if not dist.is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], config: LaunchConfig, *args: Any) -> list[Any]:
    """Run ``fn(rank_context, *args)`` on ``config.world_size`` local processes.

    ``fn`` and ``args`` must be picklable (``fn`` defined at module level).
    Returns the ranks' return values, indexed by rank. If a rank raises or
    dies, every other rank is terminated and :class:`RankFailedError` names
    the rank and carries its traceback.
    """
    backend = config.resolved_backend()
    if backend == "nccl" and torch.cuda.device_count() < config.world_size:
        raise LaunchError(Problem(
            obj="LaunchConfig.world_size", value=str(config.world_size),
            rule=f"nccl needs one GPU per local rank; {torch.cuda.device_count()} visible",
            fix="lower world_size, or use backend='gloo'"))
    if config.device == "cuda" and not torch.cuda.is_available():
        raise LaunchError(Problem(obj="LaunchConfig.device", value="'cuda'",
                                  rule="CUDA tensors need a visible GPU; none is",
                                  fix="use device='auto' or 'cpu'"))
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="torchweave-spawn-") as tmp:
        out_dir = Path(tmp)
        os.chmod(out_dir, 0o700)  # mkdtemp's mode already; results and the store live here
        procs = [ctx.Process(target=_run_rank, name=f"torchweave-rank{r}",
                             args=(r, fn, config, backend, out_dir, args))
                 for r in range(config.world_size)]
        try:
            for p in procs:
                p.start()
            return _collect(procs, out_dir, config)
        finally:
            _stop(procs)


def init_from_env(config: LaunchConfig) -> RankContext:
    """Join the process group of a job started by torchrun.

    This is the one place torchweave reads environment variables: torchrun
    sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for each
    rank (``env://`` reads the last two).
    """
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    missing = [k for k, v in env.items() if v is None]
    if missing:
        raise LaunchError(Problem(obj="environment", value=f"{', '.join(missing)} not set",
                                  rule="init_from_env runs only under torchrun",
                                  fix="start with `torchrun --nproc-per-node N ...`, "
                                      "or use spawn()"))
    world_size = int(env["WORLD_SIZE"])
    if world_size != config.world_size:
        raise LaunchError(Problem(obj="LaunchConfig.world_size", value=str(config.world_size),
                                  rule=f"must equal torchrun's WORLD_SIZE ({world_size})",
                                  fix=f"set world_size={world_size}"))
    rank = int(env["RANK"])
    return _init_rank(rank=rank, local_rank=int(env["LOCAL_RANK"]), config=config,
                      backend=config.resolved_backend(), store=_attempt_store(rank, world_size,
                                                                              config))


def _attempt_store(rank: int, world_size: int, config: LaunchConfig) -> dist.Store | None:
    """After a torchrun restart, a store whose keys belong to this attempt only.

    Without it, a restarted group could read the previous attempt's addresses
    (seen here as gloo's ``connectFullMesh ... Connection refused`` right after
    a rank was killed and the job restarted).
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None  # plain env:// rendezvous
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun hosts it
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=not agent and rank == 0,
                          timeout=timedelta(seconds=config.timeout_s))
    return dist.PrefixStore(f"torchweave/attempt{restart}", store)


def _init_rank(*, rank: int, local_rank: int, config: LaunchConfig, backend: str,
               store: dist.Store | None) -> RankContext:
    torch.set_num_threads(config.resolved_threads())
    device = config.resolved_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=config.timeout_s)
    if store is None:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=rank,
                                world_size=config.world_size, timeout=timeout)
    groups = GroupCache(rank=rank, world_size=config.world_size, timeout_s=config.timeout_s,
                        device=device)
    return RankContext(rank=rank, world_size=config.world_size, local_rank=local_rank,
                       device=device, timeout_s=config.timeout_s, groups=groups)


_LOOPBACK_GLOO = "gloo_loopback"


def _loopback_gloo(store: dist.Store, rank: int, size: int,
                   timeout: timedelta) -> dist.ProcessGroupGloo:
    """Gloo whose pair connections listen on 127.0.0.1, not on the host name's address
    (gloo's default; the device is passed explicitly rather than through the
    ``GLOO_SOCKET_IFNAME`` environment variable)."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    pg = dist.ProcessGroupGloo(store, rank, size, options)
    pg._set_sequence_number_for_group()  # as init_process_group does for its own gloo
    return pg


def _run_rank(rank: int, fn: Callable[..., Any], config: LaunchConfig, backend: str,
              out_dir: Path, args: tuple) -> None:
    """Body of one spawned rank: result file first, teardown after."""
    try:
        store = dist.FileStore(str(out_dir / "store"), config.world_size)
        store.set_timeout(timedelta(seconds=config.timeout_s))
        if backend == "gloo":
            # gloo reduces CUDA tensors too (LaunchConfig(device="cuda")): both device types
            dist.Backend.register_backend(_LOOPBACK_GLOO, _loopback_gloo, devices=["cpu", "cuda"])
            backend = _LOOPBACK_GLOO
        ctx = _init_rank(rank=rank, local_rank=rank, config=config, backend=backend, store=store)
        payload = pickle.dumps(("ok", fn(ctx, *args), time.time()))
    except BaseException as e:  # noqa: BLE001 - every failure goes to the parent
        summary = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
        _write(out_dir, rank, pickle.dumps(("err", (summary, traceback.format_exc()), time.time())))
        os._exit(1)  # skip teardown: the parent stops the other ranks
    _write(out_dir, rank, payload)
    ctx.close()


def _write(out_dir: Path, rank: int, payload: bytes) -> None:
    tmp = out_dir / f"{rank}.tmp"
    tmp.write_bytes(payload)
    os.replace(tmp, out_dir / f"{rank}.pkl")  # atomic: the parent never sees half a file


def _collect(procs: list, out_dir: Path, config: LaunchConfig) -> list[Any]:
    results: dict[int, Any] = {}
    failures: dict[int, tuple[float, tuple[str, str]]] = {}
    while True:
        for r, p in enumerate(procs):
            if r in results or r in failures:
                continue
            path = out_dir / f"{r}.pkl"
            if path.exists():
                status, value, when = pickle.loads(path.read_bytes())
                if status == "ok":
                    results[r] = value
                else:
                    failures[r] = (when, value)
            elif not p.is_alive() and not path.exists():
                text = f"exited with code {p.exitcode} before returning a result"
                failures[r] = (time.time(), (text, text))
        if failures:
            # A failure makes peers fail a moment later ("connection closed");
            # sorting by time puts the cause first.
            first = sorted(failures.items(), key=lambda kv: kv[1][0])
            raise RankFailedError({r: info for r, (_, info) in first})
        if len(results) == len(procs):
            deadline = time.monotonic() + config.teardown_grace_s
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            return [results[r] for r in range(len(procs))]
        time.sleep(_POLL_S)


def _stop(procs: list) -> None:
    """Terminate ranks still running, then kill any that ignore it (some may never have started)."""
    procs = [p for p in procs if p.pid is not None]
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join()


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_positive(v: object, *, allow_zero: bool = False) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return False
    return v >= 0 if allow_zero else v > 0

