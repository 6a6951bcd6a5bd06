"""Process groups, created once up front and then looked up by rank tuple.

torch requires every rank to call ``dist.new_group`` for every group, in the
same order, even ranks that are not in it. So all ranks call
:meth:`GroupCache.create_all` with the same list before the first collective;
:meth:`GroupCache.get` only looks groups up.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from torchweave.errors import Problem, TorchweaveError
from torchweave.runtime.counter import CommCounter


class GroupError(TorchweaveError):
    """A bad group, or one used before it was created."""


class GroupCache:
    """This rank's process groups, keyed by the sorted tuple of global ranks."""

    def __init__(self, *, rank: int, world_size: int, timeout_s: float,
                 device: torch.device) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.device = device
        """Where this rank's tensors live; receive buffers of ``exchange`` go here."""
        self.counter = CommCounter()
        """Every communication call made through ``comm`` on this rank."""
        self._groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self._pipeline: tuple[dist.ProcessGroup, ...] = ()
        self._p2p_device: torch.device | None = None

    @property
    def nccl(self) -> bool:
        """The default process group runs NCCL (the one place the runtime asks which backend)."""
        return dist.is_initialized() and "nccl" in str(dist.get_backend())

    @property
    def p2p_device(self) -> torch.device:
        """Where point-to-point messages are sent from and received into: this rank's device,
        except CUDA tensors under gloo, whose send and receive take host memory only
        (PyTorch's backend table; seen on an H200 as the pipelines' only failure)."""
        if self._p2p_device is None:
            on_gloo = self.device.type == "cuda" and dist.is_initialized() and not self.nccl
            self._p2p_device = torch.device("cpu") if on_gloo else self.device
        return self._p2p_device

    @property
    def world(self) -> tuple[int, ...]:
        return tuple(range(self.world_size))

    def normalize(self, ranks: Sequence[int]) -> tuple[int, ...]:
        """The group as a sorted tuple; raises if a rank is out of range or repeated."""
        problems = []
        if len(ranks) == 0:
            problems.append(Problem(obj="group ()", value="empty",
                                    rule="a group needs at least one rank"))
        bad = [r for r in ranks if not isinstance(r, int) or isinstance(r, bool)
               or not 0 <= r < self.world_size]
        if bad:
            problems.append(Problem(
                obj=f"group {tuple(ranks)}", value=f"ranks {bad}",
                rule=f"ranks are ints in [0, world_size={self.world_size})"))
        if len(set(ranks)) != len(ranks):
            problems.append(Problem(obj=f"group {tuple(ranks)}", value="repeated rank",
                                    rule="each rank appears once in a group"))
        if problems:
            raise GroupError(problems)
        return tuple(sorted(ranks))

    def create_all(self, groups: Iterable[Sequence[int]]) -> None:
        """Create every group in ``groups``; all ranks call this with the same list."""
        wanted = [self.normalize(g) for g in groups]
        timeout = timedelta(seconds=self.timeout_s)
        for ranks in wanted:
            if ranks == self.world or ranks in self._groups:
                continue
            pg = dist.new_group(list(ranks), timeout=timeout)
            self._groups[ranks] = pg if self.rank in ranks else None

    def pipeline_groups(self) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
        """Two groups of all ranks, for pipeline messages only: to a higher rank, then to a
        lower one. Their order is then independent of every other point-to-point message and
        of the other direction's (NCCL, and gloo without tags, match by order per group; an
        NCCL send waits for its receive, so one stream for both directions of a pair could
        wait in a cycle). Created on first use, which every rank reaches together; ``None``
        on one rank."""
        if self.world_size > 1 and not self._pipeline:
            timeout = timedelta(seconds=self.timeout_s)
            self._pipeline = tuple(dist.new_group(list(self.world), timeout=timeout) for _ in range(2))
        return self._pipeline or (None, None)

    def get(self, ranks: Sequence[int]) -> dist.ProcessGroup | None:
        """The group of ``ranks``; ``None`` if this rank is not in it."""
        key = self.normalize(ranks)
        if key == self.world:
            return dist.group.WORLD
        if key not in self._groups:
            known = ", ".join(str(g) for g in self._groups) or "none"
            raise GroupError(Problem(
                obj=f"group {key}", value="not created",
                rule=f"groups are created up front by create_all on every rank (created: {known})",
                fix=f"add {key} to the list every rank passes to GroupCache.create_all"))
        return self._groups[key]

    def __repr__(self) -> str:
        return (f"GroupCache(rank={self.rank}, world_size={self.world_size}, "
                f"groups={list(self._groups)})")
