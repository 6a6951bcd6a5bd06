"""Sum the gradients of replicated parameter pieces, bucketed and overlapped.

Each parameter piece whose gradient is partial over a group (the plan says
which) joins a bucket of pieces with the same group. Buckets are filled in
reverse order of first use (the order backward produces gradients); when a
bucket's last gradient arrives, its all-reduce starts asynchronously while
backward goes on, as DDP does. Buckets always start in the same order on every
rank, so collectives match. Each gradient is reduced exactly once per step.

A caller that runs several backward passes per step (micro-batches, pipeline
actions) says which gradients are final in the pass it is about to run
(``enabled`` and ``allow``), and may mark gradients final that no hook sees
(``mark_ready``: ones accumulated by hand, or never produced).
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
    work: object | None = None


class GradSync:
    """Bucketed all-reduce of parameter gradients over their plan-given groups."""

    def __init__(self, group_cache: GroupCache, params: list[tuple[torch.Tensor, tuple[int, ...]]],
                 *, bucket_bytes: int, overlap: bool) -> None:
        self.group_cache, self.overlap = group_cache, overlap
        self.buckets: list[Bucket] = []
        self.enabled = True
        self.allow: set[int] | None = None
        """When set, hooks count only the parameters (by ``id``) in it as final."""
        open_: dict[tuple[int, ...], Bucket] = {}
        for p, group in reversed(params):
            b = open_.get(group)
            size = sum(q.numel() * q.element_size() for q in b.params) if b else 0
            if b is None or size + p.numel() * p.element_size() > bucket_bytes:
                b = Bucket(group, [])
                self.buckets.append(b)
                open_[group] = b
            b.params.append(p)
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
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
        b.flat = torch.cat([g.reshape(-1) for g in grads])
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
            offset = 0
            for p in b.params:
                n = p.numel()
                piece = b.flat[offset:offset + n].view_as(p)
                if p.grad is None:
                    p.grad = piece.clone()
                else:
                    p.grad.copy_(piece)
                offset += n
            b.ready.clear()
            b.flat = b.work = None
        self._next = 0
