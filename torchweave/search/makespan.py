"""A pipeline schedule run on many sets of stage costs at once, by the simulator's rules.

:func:`compile_schedule` orders a schedule's compute actions once (each after what it
waits for, with the boundary a transfer crosses); :func:`makespans` then runs that order
on ``K`` sets of per-stage forward, backward and transfer seconds as numpy arrays, so that
every split of a block sharing ``(schedule, pp, virtual, micro)`` costs one pass
(:mod:`torchweave.search.timed`). :func:`exposed_sums` adds the gradient sums each stage
starts once its gradients are made.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from torchweave.plan.schedules import Kind, Schedule
from torchweave.plan.schedules.check import dependencies, timeline

WEIGHT_SHARE = 0.5
"""A split backward's weight-gradient share (``StageCost.weight_share``'s default)."""


@dataclass(frozen=True)
class Compiled:
    """A schedule's compute actions in an order where each comes after what it waits
    for: per action its rank, stage, kind, and (action, boundary or -1) it waits on."""

    rank: tuple[int, ...]
    stage: tuple[int, ...]
    kind: tuple[Kind, ...]
    deps: tuple[tuple[tuple[int, int], ...], ...]
    ranks: int


def compile_schedule(schedule: Schedule) -> Compiled:
    """``schedule`` ordered for :func:`makespans`, by the rules of ``simulate_schedule``:
    a forward's input from another rank crosses the boundary after the stage that made
    it; a backward's output gradient crosses the boundary after its own stage. The order
    is :func:`~torchweave.plan.schedules.check.timeline`'s start times (every cost
    positive, so an action starts after all it waits for)."""
    def key(a):  # as plan.schedules.check keys an action
        return (a.kind, a.stage, a.micro, a.iteration)

    seen = [key(a) for acts in schedule.values() for a in acts if a.kind.is_compute]
    if len(set(seen)) < len(seen) or any(k[0] is Kind.R for k in seen):
        raise ValueError("compile_schedule times plain pipelines: no shared stage (interlaced) "
                         "and no no-gradient pass (multi-forward)")
    times = timeline(schedule)
    order = sorted((start, r, i, a) for r, acts in times.items()
                   for i, (start, _end, a) in enumerate(acts))
    rank_of = {a.stage: r for _s, r, _i, a in order}
    deps_of = dependencies({key(a) for *_, a in order}, max(rank_of, default=0))
    index: dict[tuple, int] = {}
    rank, stage, kind, deps = [], [], [], []
    for _start, r, _i, a in order:
        edges = []
        for d in deps_of(a):
            src, apart = d[1], rank_of[d[1]] != r
            if apart and d[0] is Kind.F and a.kind is Kind.F:  # the input, sent forward
                edges.append((index[d], src))
            elif apart and d[0] in (Kind.B, Kind.I) and src != a.stage:  # a gradient, back
                edges.append((index[d], a.stage))
            else:
                edges.append((index[d], -1))
        index[key(a)] = len(rank)
        rank.append(r)
        stage.append(a.stage)
        kind.append(a.kind)
        deps.append(tuple(edges))
    return Compiled(tuple(rank), tuple(stage), tuple(kind), tuple(deps), len(times))


@dataclass(frozen=True)
class Run:
    """A schedule run on ``K`` sets of stage costs (arrays of ``K``)."""

    step: np.ndarray
    busy: np.ndarray
    """The busiest rank's compute seconds."""
    ends: list[np.ndarray]
    """Per rank, when its last action ends."""
    grads: dict[int, list[tuple[int, np.ndarray]]]
    """Per rank, its stages with the end of the last action that makes their gradients
    (B or W), in the order the rank runs those actions (the same for every ``K``)."""
    starts: np.ndarray
    """``[actions, K]``: when each action starts."""
    finishes: np.ndarray
    """``[actions, K]``: when each action ends."""


def makespans(c: Compiled, fwd: np.ndarray, bwd: np.ndarray, hop: np.ndarray) -> Run:
    """``c`` run for ``K`` sets of stage costs: ``fwd``, ``bwd`` and ``hop`` (the transfer
    after each boundary) are ``[stages, K]``."""
    costs = {Kind.F: fwd, Kind.R: fwd, Kind.B: bwd, Kind.I: bwd * (1 - WEIGHT_SHARE),
             Kind.W: bwd * WEIGHT_SHARE}
    zero = np.zeros(fwd.shape[1])
    clock = [zero] * c.ranks
    busy = [zero] * c.ranks
    end: list[np.ndarray] = []
    start: list[np.ndarray] = []
    last: dict[int, tuple[int, int]] = {}  # stage -> (its last B or W action, its rank)
    for r, s, k, deps in zip(c.rank, c.stage, c.kind, c.deps):
        t = clock[r]
        for d, b in deps:
            t = np.maximum(t, end[d] if b < 0 else end[d] + hop[b])
        cost = costs[k][s]
        if k in (Kind.B, Kind.W):
            last[s] = (len(end), r)
        start.append(t)
        end.append(t + cost)
        clock[r] = end[-1]
        busy[r] = busy[r] + cost
    grads: dict[int, list[tuple[int, np.ndarray]]] = defaultdict(list)
    for s, (i, r) in sorted(last.items(), key=lambda x: x[1][0]):
        grads[r].append((s, end[i]))
    return Run(np.max(clock, axis=0), np.max(busy, axis=0), clock, dict(grads),
               np.array(start).reshape(len(start), -1), np.array(end).reshape(len(end), -1))


def exposed_sums(run: Run, seconds: np.ndarray, after: np.ndarray | None = None) -> np.ndarray:
    """How much longer than ``run.step`` the step is when each stage's gradient sum
    (``seconds``: ``[stages, K]``) starts once the stage's gradients are made and the sums
    of one rank run one after another (as the simulator's ``finish_times`` has them for a
    pipeline without ZeRO); ``after`` (``[stages, K]``): sums of the stage's rank that
    start only once its schedule is done, after the others (a tied weight's copies)."""
    finish = run.step * 0
    for r, stages in run.grads.items():
        clock = run.step * 0
        for s, ready in stages:
            clock = np.maximum(clock, ready) + seconds[s]
        clock = np.maximum(clock, run.ends[r])
        if after is not None:
            clock = clock + sum(after[s] for s, _ in stages)
        finish = np.maximum(finish, clock)
    return finish - run.step


__all__ = ["WEIGHT_SHARE", "Compiled", "Run", "compile_schedule", "exposed_sums", "makespans"]
