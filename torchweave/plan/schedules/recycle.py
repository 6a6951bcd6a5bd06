"""Multi-forward schedules: no-gradient passes (``R``) placed in a schedule's bubbles.

A recycling model (AlphaFold 2's recycling is the known case) runs each
micro-batch forward ``passes`` times: ``passes - 1`` times without gradients,
each pass fed the last stage's output of the one before, then once with
gradients (``F``) and backward. The ``R`` passes keep nothing for backward,
so they can run whenever a rank would otherwise wait.

:func:`up_front` is op-order over a base schedule: each rank runs its ``R``
actions first, pass by pass, each pass in the order of its own ``F`` actions,
then the base unchanged. Since sends never wait, a rank starts its next pass
(and stage 0 its ``F``) as soon as its inputs are there, so the passes of
different micro-batches overlap and the later stages' warm-up idle time of
each pass is filled by the previous pass's work: only one fill and one
drain for the whole step, against one per pass when each no-gradient pass
runs as its own pipeline pass (``schedule.eval()`` per pass in
``torch.distributed.pipelining``). :func:`in_bubbles` is the greedy
alternative: it runs the pipeline in time (costs as in
:func:`~torchweave.plan.schedules.check.timeline`) and gives a free rank its
next base action if its inputs are there, else the most urgent ``R`` that is
ready. :func:`multi_forward` times every candidate and keeps the fastest,
up front on a tie.

With unit costs (p in 2-8, m in 1-12, 2-4 passes, GPipe, 1F1B, ZB-H1 and
interleaved bases, ``R`` at 0.3-1 of ``F``) up front was never slower than
the greedy, and 1.0-1.34x faster than a fill and drain per pass; the greedy is
kept as a candidate for user schedules whose own forward order is a poor one.
With ``m >= p`` on 1F1B the ``R`` passes add work but no idle time.
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
    """Every rank runs all its ``R`` passes, then ``base``: pass by pass, each pass in the
    order of the base's ``F`` actions on that rank (so stages hand over as its forwards do)."""
    _no_grad_passes(stage_to_rank, micro, passes)
    return {r: [Action(a.stage, Kind.R, a.micro, k) for k in range(passes - 1)
                for a in acts if a.kind is Kind.F] + list(acts) for r, acts in base.items()}


def multi_forward(base: Schedule, stage_to_rank: StageToRank, micro: int, passes: int,
                  **costs: float) -> Schedule:
    """``base`` with ``passes - 1`` no-gradient passes per micro-batch, placed by whichever of
    :func:`in_bubbles` (both priorities) and :func:`up_front` finishes first under ``costs``
    (``cost_f``, ``cost_b``, ``cost_r``, ``cost_i``, ``cost_w`` as in ``timeline``)."""
    if passes == 1:
        _no_grad_passes(stage_to_rank, micro, passes)
        return {r: list(acts) for r, acts in base.items()}
    candidates = [up_front(base, stage_to_rank, micro, passes)] + [
        in_bubbles(base, stage_to_rank, micro, passes, priority=p, **costs) for p in ("micro", "pass")]
    return min(candidates, key=lambda c: makespan(c, **costs))  # ties: up front (fewer switches)


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
