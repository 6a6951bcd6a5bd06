"""A pipeline rank's point-to-point messages: posted, waited for, placed, sent.

Every message is one of the program's (:mod:`torchweave.lower.messages`): before an
action the rank waits for its receives, posted in the order each sender sends
(``irecv``, before the action ahead of it computed, so that they arrive meanwhile),
keeping those meant for later actions; after it, its sends in one fixed order. Sends are
never waited on until the end of the step (:meth:`StageMessages.drop_sent` frees the
buffers of those already done). Messages go over the pipeline's own process groups, one
per direction, apart from the point-to-point exchanges inside a stage; tags are (link,
micro-batch, direction, pass, transfer) when ``tagged``, else 0.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from torchweave.lower.messages import links
from torchweave.lower.program import Exchange, Message
from torchweave.lower.steps import Transfer
from torchweave.runtime.counter import CommKind, Direction

_TAG_TRANSFERS = 4096
"""Room for this many transfers per boundary in a message tag."""


def region(t: torch.Tensor, box) -> torch.Tensor:
    """The part of ``t`` inside ``box`` ((start, stop) per dim)."""
    return t[tuple(slice(a, b) for a, b in box)]


def tagged(mode: str, group_cache) -> bool:
    """``auto``: tags on gloo (a mismatch then waits instead of swapping tensors), none on NCCL."""
    if mode == "auto":
        return group_cache.world_size > 1 and not group_cache.nccl
    return mode == "tagged"


class StageMessages:
    """One rank's messages of one pipelined program, step after step."""

    def __init__(self, program: Any, rank: int, group_cache: Any, mode: str) -> None:
        self.program, self.rank, self.cache = program, rank, group_cache
        self.links = links(program)
        self.dtype = {bd.index: getattr(torch, bd.dtype.removeprefix("torch."))
                      for seg in program.segments for bd in seg.recvs + seg.sends}
        self.tagged = tagged(mode, group_cache)
        """Messages carry tags (a check on gloo); untagged, each is sent with tag 0."""
        self.groups = group_cache.pipeline_groups()
        self.begin({})

    def begin(self, recycled: dict[int, torch.dtype]) -> None:
        """A new step; ``recycled``: the dtype of each recycle link (by link index)."""
        self.recycled = recycled
        self.pending: list[tuple[Any, torch.Tensor]] = []
        self.got: dict[Message, torch.Tensor] = {}
        self.posted: dict[Message, tuple[Any, torch.Tensor]] = {}
        self.wait_s = 0.0
        """Seconds blocked in receives this step: idle, waiting for another stage."""

    def tag(self, x: Message) -> int:
        """``x``'s tag (0 for every message when untagged)."""
        if not self.tagged:
            return 0
        p = self.program
        return ((((x.link * p.micro_batches + x.micro) * 2 + x.grad) * p.passes + x.iteration)
                * _TAG_TRANSFERS + x.transfer)

    def group(self, x: Message):
        """The pipeline's group for ``x``'s direction: one order per ordered pair of ranks."""
        return self.groups[0] if x.src < x.dst else self.groups[1]

    def transfer(self, x: Message) -> Transfer:
        step = self.links[x.link]
        return (step.grad_back if x.grad else step.transfers)[x.transfer]

    def post(self, ex: Exchange) -> None:
        """Post the action's receives not posted yet, in the order their senders send them
        (a rank's posts to one peer keep the order of the schedule's messages)."""
        for x in ex.posts:
            if x in self.posted:
                continue
            box = self.transfer(x).dst_box
            dtype = self.dtype[x.link] if x.link < self.program.boundaries else self.recycled[x.link]
            buf = torch.empty(tuple(b - a for a, b in box), dtype=dtype, device=self.cache.p2p_device)
            self.posted[x] = (dist.irecv(buf, x.src, group=self.group(x), tag=self.tag(x)), buf)

    def receive(self, ex: Exchange, device: torch.device) -> None:
        """The action's receives (posted here, or before the action ahead of it computed);
        some are for later actions: kept until then."""
        self.post(ex)
        for x in ex.posts:
            work, buf = self.posted.pop(x)
            start = time.perf_counter()
            work.wait()
            self.wait_s += time.perf_counter() - start
            self.got[x] = buf.to(device)

    def take(self, needs: tuple[Message, ...], into: dict[int, torch.Tensor]) -> None:
        """Place each received piece in its link's tensor (gradients add up)."""
        for x in needs:
            t, piece = self.transfer(x), self.got.pop(x)
            target = region(into[x.link], t.dst_box)
            target.add_(piece) if x.grad or t.add else target.copy_(piece)

    def send(self, ex: Exchange, values: dict[int, torch.Tensor]) -> None:
        """Post the action's sends (pieces of ``values``, link -> tensor) in the model's order;
        pieces for this rank itself are kept for the action that reads them."""
        for x in ex.local + ex.sends:
            data = region(values[x.link], self.transfer(x).src_box).detach().contiguous()
            if x.dst == self.rank:
                self.got[x] = data
                continue
            direction = Direction.BACKWARD if x.grad else Direction.FORWARD
            self.cache.counter.record(CommKind.P2P, direction, (self.rank, x.dst),
                                      data.numel() * data.element_size())
            data = data.to(self.cache.p2p_device)
            self.pending.append((dist.isend(data, x.dst, group=self.group(x), tag=self.tag(x)), data))

    def drop_sent(self) -> None:
        """Free the buffers of sends that have completed (the rest are waited on at the end)."""
        left = []
        for work, data in self.pending:
            if work.is_completed():
                work.wait()  # raises if the send failed
            else:
                left.append((work, data))
        self.pending = left

    def finish(self) -> None:
        """Wait for every send of the step."""
        for work, _ in self.pending:
            work.wait()
        self.pending = []
