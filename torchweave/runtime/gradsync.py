"""Sum the gradients of replicated parameter pieces, bucketed and overlapped.

Each parameter piece whose gradient is partial over a group (the plan says
which) joins a bucket of pieces with the same group. Buckets are filled in
reverse order of first use (the order backward produces gradients); when a
bucket's last gradient arrives, its all-reduce starts asynchronously while
backward goes on, as DDP does. Buckets always start in the same order on every
rank, so collectives match. Each gradient is reduced exactly once per step.

Each bucket owns one flat buffer for the whole run. When its sum starts, each
gradient is copied into its place there and the parameter's ``.grad`` becomes
that place (a view), so the sum lands in the gradients with no copy back; a
gradient that already is its view (not set to None since) is not copied at
all. By default the first bucket of each group is small (``FIRST_BUCKET_BYTES`` of
:mod:`torchweave.lower.buckets`),
so the first sum starts early in backward; a bucket size the user gives applies to
every bucket. Both as DDP (its ``bucket_cap_mb`` left out, or given).

A caller that runs several backward passes per step (micro-batches, pipeline
actions) says which gradients are final in the pass it is about to run
(``enabled`` and ``allow``), and may mark gradients final that no hook sees
(``mark_ready``: ones accumulated by hand, or never produced).

The step's loss may ride in a bucket too (``rider``: its group and a number of
slots): the last bucket over that group gets that many elements after its
gradients, which the caller fills before the bucket's sum starts and reads
after :meth:`GradSync.finish`. The loss is then summed with the gradients, not
by a collective of its own (DDP's step sums no loss at all).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from torchweave.runtime.counter import CommKind, Direction
from torchweave.runtime.groups import GroupCache


@dataclass
class Bucket:
    group: tuple[int, ...]
    params: list[torch.Tensor]
    ready: set[int] = field(default_factory=set)
    flat: torch.Tensor | None = None
    """The bucket's gradients, one after another (made when the bucket is full)."""
    views: list[torch.Tensor] = field(default_factory=list)
    work: object | None = None
    extra: int = 0
    """Elements after the gradients that belong to no parameter (the loss's slots)."""
    tail: torch.Tensor | None = None
    """Those elements, a view of ``flat``."""

    def nbytes(self) -> int:
        return sum(q.numel() * q.element_size() for q in self.params)

    def build(self) -> None:
        p0 = self.params[0]
        offsets = [0]
        for p in self.params:
            offsets.append(offsets[-1] + p.numel())
        self.flat = torch.zeros(offsets[-1] + self.extra, dtype=p0.dtype, device=p0.device)
        self.views = [self.flat[a:b].view_as(p) for a, b, p in zip(offsets, offsets[1:], self.params)]
        self.tail = self.flat[offsets[-1]:] if self.extra else None

    def gather(self) -> None:
        """Every gradient into its place in ``flat``, and ``.grad`` made that place."""
        for p, view in zip(self.params, self.views):
            g = p.grad
            if g is None:
                view.zero_()
            elif g.data_ptr() != view.data_ptr():
                view.copy_(g)
            else:
                continue
            p.grad = view


class GradSync:
    """Bucketed all-reduce of parameter gradients over their plan-given groups."""

    def __init__(self, group_cache: GroupCache, params: list[tuple[torch.Tensor, tuple[int, ...]]],
                 *, bucket_bytes: int, overlap: bool, first_bucket_bytes: int | None = None,
                 rider: tuple[tuple[int, ...], int] | None = None) -> None:
        self.group_cache, self.overlap = group_cache, overlap
        self.buckets: list[Bucket] = []
        self.enabled = True
        self.allow: set[int] | None = None
        """When set, hooks count only the parameters (by ``id``) in it as final."""
        open_: dict[tuple, Bucket] = {}
        started: set[tuple] = set()
        for p, group in reversed(params):
            key = (group, p.dtype, p.device)
            b = open_.get(key)
            cap = bucket_bytes if key in started or first_bucket_bytes is None \
                else min(bucket_bytes, first_bucket_bytes)
            if b is None or b.nbytes() + p.numel() * p.element_size() > cap:
                if b is not None:
                    started.add(key)
                b = Bucket(group, [])
                self.buckets.append(b)
                open_[key] = b
            b.params.append(p)
        self.rider: Bucket | None = None
        """The bucket that carries ``rider``'s slots (None: no bucket over its group holds
        floating-point gradients of at least float32, and the caller sums by itself)."""
        if rider is not None:
            fits = [b for b in self.buckets if b.group == tuple(rider[0])
                    and b.params[0].dtype in (torch.float32, torch.float64)]
            if fits:
                self.rider = fits[-1]
                self.rider.extra = rider[1]
        for b in self.buckets:
            b.build()
        self._where = {id(p): (i, b) for i, b in enumerate(self.buckets) for p in b.params}
        self._next = 0
        if overlap:
            for b in self.buckets:
                for p in b.params:
                    p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p: torch.Tensor) -> None:
        if not self.enabled or (self.allow is not None and id(p) not in self.allow):
            return
        i, b = self._where[id(p)]
        b.ready.add(id(p))
        self._launch_ready()

    def mark_ready(self, params: list[torch.Tensor]) -> None:
        """These gradients are final for this step: start every bucket that is now complete."""
        if not self.overlap:
            return
        for p in params:
            if id(p) in self._where:
                self._where[id(p)][1].ready.add(id(p))
        self._launch_ready()

    @property
    def started(self) -> int:
        """Buckets of this step whose sum has started."""
        return self._next

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if len(b.ready) < len(b.params):
                return
            self._launch(b)
            self._next += 1

    def _launch(self, b: Bucket) -> None:
        b.gather()
        self.group_cache.counter.record(CommKind.ALL_REDUCE, Direction.BACKWARD, b.group,
                               b.flat.numel() * b.flat.element_size())
        pg = self.group_cache.get(b.group)
        b.work = dist.all_reduce(b.flat, group=pg, async_op=self.overlap)

    def finish(self) -> None:
        """Launch what is left (in order), wait for all, and write the sums back."""
        for b in self.buckets[self._next:]:
            self._launch(b)
        for b in self.buckets:
            if self.overlap and b.work is not None:
                b.work.wait()
            b.ready.clear()
            b.work = None
        self._next = 0
