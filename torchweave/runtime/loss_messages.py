"""A pipeline's loss on every rank by messages from the ranks that hold it (gloo).

``train_step`` gives every rank the loss, which only the last stage computes. Summed by
an all-reduce after the step, every rank's step ends when every rank has reached it: on
gloo over ranks that share cores, the slowest rank's last action and then a ring of hops,
each a process to wake (about 3% of a zero-bubble step on 8 ranks here). The last
stage's loss is final long before the first stage's last action, so here the lowest rank
holding each loss term sends it to every other rank as soon as its last micro-batch's
forward has run, and every rank posts those receives when its step begins: the message
is there when the loss is read. Which rank holds which term is learned once, by an
all-gather every rank makes when the pipeline module is built.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from torchweave.lower.program import Program
from torchweave.runtime.groups import GroupCache

LOSS_TAG = 0x1055
"""The tag of the loss's messages on the world group (its exchanges use tag 0)."""

MOST_MESSAGES = 4096
"""Most loss messages a step (senders x ranks) sent point to point; more: one all-reduce."""


def _wait_all(works: list[tuple[Any, torch.Tensor]]) -> None:
    """Wait on each posted send and drop it: a gloo send waited on twice waits for a second
    send that never comes."""
    while works:
        works.pop()[0].wait()


class LossMessages:
    """One rank's loss messages: :meth:`begin` each step, :meth:`send` once its term is
    final, :meth:`reader` for the step's loss."""

    def __init__(self, senders: dict[int, int], rank: int, world: int, device: torch.device) -> None:
        self.senders = senders
        """Each loss term's index -> the rank that sends it."""
        self.rank, self.world, self.device = rank, world, device
        self._sent: list[tuple[Any, torch.Tensor]] = []
        self._incoming: dict[int, tuple[Any, torch.Tensor]] = {}
        self._out = False

    @staticmethod
    def build(program: Program, cache: GroupCache) -> "LossMessages | None":
        """For a rank on gloo; None where the terms are summed by one all-reduce after the
        step (NCCL, where an early receive holds a kernel and the ring is microseconds; one
        rank; more than ``MOST_MESSAGES`` messages). Every rank calls this at one point."""
        if program.world_size == 1 or cache.nccl:
            return None
        mine = torch.tensor([program.loss_partial[0] if program.loss is not None else -1],
                            dtype=torch.int64, device=cache.p2p_device)
        every = [torch.empty_like(mine) for _ in range(program.world_size)]
        dist.all_gather(every, mine)
        senders: dict[int, int] = {}
        for rank, t in enumerate(every):
            if int(t) >= 0:
                senders.setdefault(int(t), rank)
        if not senders or len(senders) * program.world_size > MOST_MESSAGES:
            return None
        return LossMessages(dict(sorted(senders.items())), program.rank, program.world_size,
                            cache.p2p_device)

    def begin(self) -> None:
        """This step's receives posted; the last step's sends, long completed, waited on."""
        _wait_all(self._sent)
        self._sent, self._out = [], False
        self._incoming = {}
        for index, src in self.senders.items():
            if src != self.rank:
                buf = torch.zeros(1, dtype=torch.float64, device=self.device)
                self._incoming[index] = (dist.irecv(buf, src, tag=LOSS_TAG), buf)

    def send(self, term: torch.Tensor | float) -> None:
        """This rank's loss term, final, to every other rank (if it sends one), once a step."""
        if self._out or self.rank not in self.senders.values():
            return
        self._out = True
        data = torch.as_tensor(term, dtype=torch.float64).detach().reshape(1).to(self.device)
        for dst in range(self.world):
            if dst != self.rank:
                self._sent.append((dist.isend(data, dst, tag=LOSS_TAG), data))

    def reader(self, own: torch.Tensor | float) -> Callable[[], float]:
        """The step's loss: the senders' terms in index order (``own`` for this rank's)."""
        incoming, sent, senders, me = self._incoming, self._sent, self.senders, self.rank

        def value() -> float:
            _wait_all(sent)  # done once every rank has posted this step's receives
            total = torch.zeros((), dtype=torch.float64)
            for index, src in senders.items():
                if src == me:
                    total = total + torch.as_tensor(own, dtype=torch.float64).cpu()
                else:
                    work, buf = incoming[index]
                    work.wait()
                    total = total + buf.cpu()[0]
            return float(total)
        return value
