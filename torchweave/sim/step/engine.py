"""The event engine: per-rank task lists on two streams, with collectives that meet.

Each rank runs its :class:`Task` list in order. A task waits for ready names
(values and signals, :mod:`~torchweave.sim.step.signals`; ``ready`` times on its
rank) and for its stream:

- ``COMPUTE``: runs on the compute stream after the previous compute task;
- ``COMM``: runs on the communication stream, in FIFO order. A collective
  (``key`` set) starts when every member of its ``group`` has reached the task
  with the same key, each member's arrival being ``max(comm stream free,
  its inputs ready)``; it then occupies every member's comm stream for ``dur``;
- on a rank in ``serial`` (a device whose communication does not overlap
  compute, ``Device.comm_overlaps_compute``), a ``COMM`` task also waits for
  and occupies the compute stream, and the next compute task waits for it;
- ``LOCAL``: takes no time and no stream; it only passes readiness on
  (views, local slices, identity backward steps).

A task's ``sets`` become ready when it ends (the latest writer wins, so a
gradient read by several ops is ready after the last contribution).
Collectives that never meet are a deadlock, reported with the waiting ranks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from torchweave.errors import Problem, SimError
from torchweave.sim.explain.result import Event
from torchweave.sim.step.signals import Kind, Ready, Rendezvous

COMPUTE, COMM, LOCAL = Kind.COMPUTE, Kind.COMM, Kind.LOCAL


@dataclass(slots=True)
class Task:
    kind: Kind
    name: str
    waits: tuple[Ready, ...] = ()
    sets: tuple[Ready, ...] = ()
    dur: float = 0.0
    key: Rendezvous | None = None
    """Rendezvous key of a collective (same on every member); None: this rank alone."""
    group: tuple[int, ...] = ()
    stage: int | None = None
    """Pipeline stage the task belongs to (None: no stage, or after the pipeline); read by
    :mod:`torchweave.sim.step.pipelined`, not by the engine."""
    crossing: bool = False
    """A transfer between stage groups (of no stage: the schedule costs it)."""
    nbytes: int = 0
    """A gradient sum or parameter gather after the backward: the bytes it moves (read by
    :mod:`torchweave.sim.fast.stagefold` to cost it at another size), not by the engine.
    A :data:`~Kind.REACH` marker: the gradient's local bytes."""
    block: int | None = None
    """Which of the model's repeated blocks the task belongs to (None: none, or not
    asked); read by :mod:`torchweave.sim.fast.folded`, not by the engine."""
    closes: bool | None = None
    """A :data:`~Kind.REACH` marker of a ZeRO-3 unit's parameter: whether it completes the
    unit (its gradients then sum together); None: not in a unit."""
    latency: float = 0.0
    """Of the ``dur`` of a collective that moves a value (an activation or its gradient),
    what does not shrink with the batch: its latency, once per collective it stands for,
    or all of it for a batch-free value (:meth:`StepContext.latency`). 0 for gradient
    sums and parameter gathers. Read by the search, which scales the rest with the
    micro-batch (:class:`~torchweave.search.proxies.Proxy`), not by the engine."""


@dataclass
class RankRun:
    """What one rank did."""

    end: float = 0.0
    compute_busy: float = 0.0
    comm_busy: float = 0.0
    comm_latency: float = 0.0
    """Of ``comm_busy``, the collectives' latency (:attr:`Task.latency`)."""


def run(tasks: dict[int, list[Task]], *, record: bool = True,
        serial: frozenset[int] | set[int] = frozenset()) -> tuple[dict[int, RankRun], list[Event]]:
    """Simulate every rank's task list; returns per-rank totals and the timeline.

    ``serial``: ranks whose communication runs on the compute stream too."""
    ranks = sorted(tasks)
    pc = {r: 0 for r in ranks}
    free = {r: {COMPUTE: 0.0, COMM: 0.0} for r in ranks}
    ready: dict[int, dict[Ready, float]] = {r: {} for r in ranks}
    out = {r: RankRun() for r in ranks}
    events: list[Event] = []
    pending: dict[Rendezvous, dict[int, float]] = {}
    blocked: dict[int, Rendezvous] = {}
    queue = deque(ranks)

    def finish(r: int, task: Task, start: float, end: float) -> None:
        rd = ready[r]
        for name in task.sets:
            if rd.get(name, -1.0) < end:
                rd[name] = end
        if task.kind != LOCAL:
            free[r][task.kind] = end
            if task.kind == COMM and r in serial:
                free[r][COMPUTE] = end
            run_ = out[r]
            if task.kind == COMPUTE:
                run_.compute_busy += end - start
            else:
                run_.comm_busy += end - start
                run_.comm_latency += task.latency
            run_.end = max(run_.end, end)
            if record and end > start:
                events.append(Event(r, str(task.kind), task.name, start, end))
        pc[r] += 1

    while queue:
        r = queue.popleft()
        lst, rd = tasks[r], ready[r]
        while pc[r] < len(lst):
            task = lst[pc[r]]
            dep = max((rd.get(w, 0.0) for w in task.waits), default=0.0)
            if task.kind == LOCAL:
                finish(r, task, dep, dep)
                continue
            start = max(free[r][task.kind], dep)
            if task.kind == COMM and r in serial:
                start = max(start, free[r][COMPUTE])
            if task.key is None or len(task.group) <= 1:
                finish(r, task, start, start + task.dur)
                continue
            arrived = pending.setdefault(task.key, {})
            arrived[r] = start
            if len(arrived) < len(task.group):
                blocked[r] = task.key
                break
            del pending[task.key]
            begin = max(arrived.values())
            for m in task.group:
                mtask = tasks[m][pc[m]]
                finish(m, mtask, begin, begin + mtask.dur)
                if m != r and blocked.pop(m, None) is not None:
                    queue.append(m)
    if any(pc[r] < len(tasks[r]) for r in ranks):
        stuck = {r: tasks[r][pc[r]] for r in ranks if pc[r] < len(tasks[r])}
        raise SimError([Problem(obj=f"rank {r}", value=f"waits at {t.name!r} (group {t.group})",
                                rule="every member of a collective's group must reach it",
                                fix="the ranks issue collectives in different orders: check the plan's "
                                    "op-order and the lowered programs")
                        for r, t in sorted(stuck.items())[:8]], header="simulated deadlock")
    return out, events
