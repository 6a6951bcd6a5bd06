"""Multi-forward schedules: no-gradient passes (``R``) placed in a schedule's bubbles.

A recycling model (AlphaFold 2's recycling is the known case) runs each
micro-batch forward ``passes`` times: ``passes - 1`` times without gradients,
each pass fed the last stage's output of the one before, then once with
gradients (``F``) and backward. The ``R`` passes keep nothing for backward,
so they can run whenever a rank would otherwise wait.

:func:`in_bubbles` is op-order over a base schedule: it keeps each rank's
``F``/``B``/``I``/``W`` in their order and inserts the ``R`` actions by
running the pipeline in time (costs as in
:func:`~torchweave.plan.schedules.check.timeline`): a free rank runs its next
base action if its inputs are there, else the most urgent ``R`` whose input is
there (by ``priority``: lowest micro-batch then pass, or lowest pass then
micro-batch), else waits for the next action to finish. :func:`up_front` is
the plain order, every ``R`` pass before the base schedule.

Neither wins everywhere: with unit costs, filling the bubbles is 1.3-2.5x
faster under interleaved 1F1B, whose virtual stages leave the ring of ``R``
passes waiting, while up front is up to 15% faster for 1F1B when the
micro-batches do not fill the pipeline evenly. :func:`multi_forward` times
every candidate (:func:`~torchweave.plan.schedules.check.timeline`, with the
given costs) and keeps the fastest.
"""

from __future__ import annotations

from torchweave.errors import Problem
from torchweave.plan.schedules.actions import Action, Kind, Schedule, ScheduleError, StageToRank
from torchweave.plan.schedules.check import _key, dependencies, timeline


def _no_grad_passes(stage_to_rank: StageToRank, micro: int, passes: int) -> dict[int, list[Action]]:
    if passes < 1 or micro < 1:
        raise ScheduleError(Problem(obj="multi-forward schedule", value=f"passes={passes}, micro={micro}",
                                    rule="at least one pass and one micro-batch"))
    out: dict[int, list[Action]] = {r: [] for r in set(stage_to_rank.values())}
    for k in range(passes - 1):
        for m in range(micro):
            for s, r in sorted(stage_to_rank.items()):
                out[r].append(Action(s, Kind.R, m, k))
    return out


def up_front(base: Schedule, stage_to_rank: StageToRank, micro: int, passes: int) -> Schedule:
    """Every rank runs all its ``R`` passes (pass by pass, micro-batch by micro-batch), then ``base``."""
    extra = _no_grad_passes(stage_to_rank, micro, passes)
    return {r: extra.get(r, []) + list(acts) for r, acts in base.items()}


def multi_forward(base: Schedule, stage_to_rank: StageToRank, micro: int, passes: int,
                  **costs: float) -> Schedule:
    """``base`` with ``passes - 1`` no-gradient passes per micro-batch, placed by whichever of
    :func:`in_bubbles` (both priorities) and :func:`up_front` finishes first under ``costs``
    (``cost_f``, ``cost_b``, ``cost_r``, ``cost_i``, ``cost_w`` as in ``timeline``)."""
    if passes == 1:
        _no_grad_passes(stage_to_rank, micro, passes)
        return {r: list(acts) for r, acts in base.items()}
    candidates = [in_bubbles(base, stage_to_rank, micro, passes, priority=p, **costs)
                  for p in ("micro", "pass")] + [up_front(base, stage_to_rank, micro, passes)]
    return min(candidates, key=lambda c: makespan(c, **costs))


def makespan(schedule: Schedule, **costs: float) -> float:
    """When the last action of ``schedule`` ends in :func:`timeline`'s simulation."""
    times = timeline(schedule, **costs)
    return max((t[-1][1] for t in times.values() if t), default=0.0)


def in_bubbles(base: Schedule, stage_to_rank: StageToRank, micro: int, passes: int, *,
               priority: str = "micro", cost_f: float = 1.0, cost_b: float = 2.0,
               cost_r: float | None = None, cost_i: float | None = None,
               cost_w: float | None = None) -> Schedule:
    """``base`` with ``passes - 1`` no-gradient passes per micro-batch placed where ranks idle."""
    pool = _no_grad_passes(stage_to_rank, micro, passes)
    if passes == 1:
        return {r: list(acts) for r, acts in base.items()}
    if priority not in ("micro", "pass"):
        raise ScheduleError(Problem(obj="in_bubbles priority", value=repr(priority),
                                    rule="'micro' (micro-batch, then pass) or 'pass'"))
    cost = {Kind.F: cost_f, Kind.B: cost_b, Kind.R: cost_f if cost_r is None else cost_r,
            Kind.I: cost_b / 2 if cost_i is None else cost_i,
            Kind.W: cost_b / 2 if cost_w is None else cost_w}
    present = {_key(a) for acts in base.values() for a in acts} | {
        _key(a) for acts in pool.values() for a in acts}
    deps = dependencies(present, max(stage_to_rank, default=0))
    end: dict[tuple, float] = {}
    queue = {r: list(acts) for r, acts in base.items()}
    order = (lambda a: (a.micro, a.iteration)) if priority == "micro" else (lambda a: (a.iteration, a.micro))
    waiting = {r: sorted(pool.get(r, []), key=order) for r in base}
    free = {r: 0.0 for r in base}
    out: Schedule = {r: [] for r in base}

    def ready(a: Action, t: float) -> bool:
        return all(end.get(k, float("inf")) <= t for k in deps(a))

    now = 0.0
    while any(queue.values()) or any(waiting.values()):
        for r in sorted(base):
            if free[r] > now or not (queue[r] or waiting[r]):
                continue
            if queue[r] and ready(queue[r][0], now):
                a = queue[r].pop(0)
            else:
                a = next((x for x in waiting[r] if ready(x, now)), None)
                if a is None:
                    continue
                waiting[r].remove(a)
            free[r] = end[_key(a)] = now + cost[a.kind]
            out[r].append(a)
        later = [t for t in list(free.values()) + list(end.values()) if t > now]
        if not later:
            stuck = {r: str(queue[r][0] if queue[r] else waiting[r][0]) for r in base
                     if queue[r] or waiting[r]}
            raise ScheduleError(Problem(
                obj="multi-forward schedule", value=f"stuck at {stuck}",
                rule="the base schedule runs to the end (check it with dry_run first)"))
        now = min(later)
    return out
