"""Gradient accumulation: one rank's task list for ``k`` micro-batches per optimizer step.

The runtime (``RankModule.backward_step``) runs forward and backward ``k`` times
on a micro-batch, with the gradient sync enabled only in the last, then the
optimizer once. So the task list of one micro-step (built on the micro-batch's
graph) runs ``k`` times: the first ``k - 1`` copies without the gradient sums
and without the optimizer and what follows it, the last as built, its sums
overlapping its backward as usual. ZeRO-3 is the exception: it gathers and
reduce-scatters by unit on every micro-batch (``runtime/zero3.py``), so its
copies keep their unit collectives.

Copies rename the names they wait for and set (:class:`~torchweave.sim.step.signals.Renamed`)
and their collectives' keys (``Rendezvous.micro``), so that each copy meets only
itself; a value nobody sets (parameters, inputs) is ready at the start in every copy.
"""

from __future__ import annotations

from dataclasses import replace

from torchweave.sim.step.engine import Task
from torchweave.sim.step.signals import OPTIMIZER, Copying, Meet, Renamed


def _after_backward(t: Task, zero: int) -> bool:
    """Runs once per optimizer step: the optimizer, what follows it, and (but for ZeRO-3)
    the gradient sums."""
    if OPTIMIZER in t.sets or OPTIMIZER in t.waits:
        return True
    return zero < 3 and t.key is not None and t.key.meet is Meet.GRAD_SUM


def accumulate(tasks: list[Task], k: int, *, zero: int) -> list[Task]:
    """``tasks`` (one micro-step and the optimizer step) for ``k`` micro-batches."""
    if k <= 1:
        return tasks
    body = [t for t in tasks if not _after_backward(t, zero)]
    out: list[Task] = []
    for i in range(k - 1):
        def tag(name, i: int = i) -> Renamed:
            return Renamed(name, Copying.MICRO, i)
        out.extend(replace(t, name=f"{t.name} (micro-batch {i})", waits=tuple(map(tag, t.waits)),
                           sets=tuple(map(tag, t.sets)),
                           key=None if t.key is None else t.key._replace(micro=i))
                   for t in body)
    return out + tasks


__all__ = ["accumulate"]
