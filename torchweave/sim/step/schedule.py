"""Pipeline schedules in time and memory: per-stage costs plus a schedule's action lists.

:func:`simulate_schedule` runs the compute actions of a
:data:`~torchweave.plan.schedules.Schedule` (``F``, ``B``, ``I``, ``W`` per
stage and micro-batch, in each rank's order) with per-stage costs
(:class:`StageCost`), as early as their inputs allow. Which actions an action
waits for is the schedule's own rule
(:func:`torchweave.plan.schedules.check.dependencies`, which the checks and the
timeline of ``plan/schedules`` use too); this module adds the time of what
crosses between ranks:

- ``F(s, m)`` after ``F(s-1, m)`` and the transfer of its output when stage
  ``s-1`` is on another rank;
- ``B(s, m)`` / ``I(s, m)`` after ``F(s, m)`` and the input gradient of stage
  ``s+1`` (``B`` or ``I``), transferred back when on another rank;
- ``W(s, m)`` after ``I(s, m)``;
- ``R(s, m, k)`` (a no-gradient pass, multi-forward) like ``F``; stage 0's
  pass ``k`` (``R``, or ``F`` after the last ``R``) after the last stage's
  pass ``k - 1`` and the transfer of its recycled outputs.

An action that appears in several ranks' lists (a *shared* stage, run by
every rank on its piece, as in interlaced pipelines) starts on all of them
when the last one reaches it. ``B`` costs the stage's backward; split into ``I`` and ``W`` it costs
``1 - weight_share`` and ``weight_share`` of it. With ``recompute`` a stage
keeps only its input per micro-batch and its backward (``B`` or ``I``) first
reruns the forward.

Memory: ``R`` keeps nothing. A micro-batch's activations of a stage are held
from the start of its ``F`` to the end of its ``B`` (or of its ``W`` when split, since the weight
gradient still reads the layer inputs). The result gives, per rank, the peak
number of micro-batches held and the peak activation bytes, so schedules with
the same stages compare by bubble and by memory.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

from torchweave.errors import Problem, SimError
from torchweave.plan.schedules import Action, Kind, Schedule
from torchweave.plan.schedules.check import dependencies


@dataclass(frozen=True, kw_only=True)
class StageCost:
    """One stage, one micro-batch."""

    fwd: float
    """Seconds of the forward."""
    bwd: float
    """Seconds of the whole backward (input and weight gradients)."""
    activations: int = 0
    """Bytes kept from forward to backward."""
    boundary: int = 0
    """Bytes of the stage's output, sent to the next stage (its gradient comes back)."""
    inputs: int = 0
    """Bytes of the stage's input (all a recomputing stage keeps)."""
    weight_share: float = 0.5
    """Fraction of ``bwd`` that is the weight gradient (``W``) when split."""
    recompute: bool = False
    recycled: int = 0
    """Multi-forward, last stage: bytes of the outputs sent back to stage 0 after each pass."""


@dataclass(frozen=True)
class PipelineStep:
    """What one step of the schedule does on each rank."""

    step_time: float
    busy: dict[int, float]
    bubble: dict[int, float]
    """Idle fraction of the step per rank."""
    in_flight: dict[int, int]
    """Peak micro-batches whose activations a rank holds at once."""
    activation_peak: dict[int, int]
    """Peak activation bytes per rank."""
    events: list[tuple[int, float, float, Action]] = field(repr=False, default_factory=list)

    @property
    def bubble_fraction(self) -> float:
        """Mean idle fraction over ranks."""
        return sum(self.bubble.values()) / len(self.bubble) if self.bubble else 0.0


def _cost(a: Action, c: StageCost) -> float:
    rerun = c.fwd if c.recompute else 0.0
    if a.kind in (Kind.F, Kind.R):
        return c.fwd
    if a.kind is Kind.B:
        return c.bwd + rerun
    if a.kind is Kind.I:
        return c.bwd * (1 - c.weight_share) + rerun
    return c.bwd * c.weight_share


def simulate_schedule(schedule: Schedule, costs: Sequence[StageCost], *,
                      transfer: Callable[[int], float] | float = 0.0) -> PipelineStep:
    """Time and memory of ``schedule`` with ``costs[stage]``; ``transfer(bytes)`` (or a
    constant) is the time of one point-to-point message between ranks."""
    send = transfer if callable(transfer) else (lambda _n, t=float(transfer): t)
    compute = {r: [a for a in acts if a.kind.is_compute] for r, acts in schedule.items()}
    owners = Counter(_key(a) for acts in compute.values() for a in acts)
    rank_of: dict[int, int | None] = {}
    for r, acts in compute.items():
        for a in acts:  # a stage on several ranks (shared) has no single rank: None
            rank_of[a.stage] = r if rank_of.get(a.stage, r) == r else None
    stages = max(rank_of, default=-1) + 1
    if len(costs) < stages:
        raise SimError(Problem(obj="pipeline costs", value=f"{len(costs)} stages",
                               rule=f"one StageCost per stage: the schedule has {stages}",
                               fix="give a cost for every stage"))
    present = {_key(a) for acts in compute.values() for a in acts}
    last = stages - 1
    deps = dependencies(present, last)  # the schedule's own rules (plan/schedules/check.py)
    end: dict[tuple, float] = {}

    def apart(src: int, dst: int) -> bool:
        return rank_of[src] != rank_of[dst] or rank_of[dst] is None

    def ready(a: Action) -> float | None:
        """When every input of ``a`` is on its rank: each action it depends on has ended,
        and what crosses between ranks has been sent (a forward's input, stage 0's
        recycled input, a backward's output gradient)."""
        t = 0.0
        for d in deps(a):
            done = end.get(d)
            if done is None:
                return None
            kind, src = d[0], d[1]
            if kind in (Kind.F, Kind.R) and a.kind in (Kind.F, Kind.R) and apart(src, a.stage):
                done += send(costs[src].boundary if src < a.stage else costs[src].recycled)
            elif kind in (Kind.B, Kind.I) and src != a.stage and apart(src, a.stage):
                done += send(costs[a.stage].boundary)
            t = max(t, done)
        return t

    clock = {r: 0.0 for r in compute}
    busy = {r: 0.0 for r in compute}
    done = {r: 0 for r in compute}
    events: list[tuple[int, float, float, Action]] = []
    arrived: dict[tuple, dict[int, float]] = {}

    def run_on(ranks: list[int], a: Action, start: float) -> None:
        dur = _cost(a, costs[a.stage])
        end[_key(a)] = start + dur
        for q in ranks:
            clock[q] = start + dur
            busy[q] += dur
            events.append((q, start, start + dur, a))
            done[q] += 1

    progress = True
    while progress:
        progress = False
        for r, acts in compute.items():
            while done[r] < len(acts):
                a = acts[done[r]]
                key = _key(a)
                t = ready(a)
                if t is None:
                    break
                if owners[key] == 1:
                    run_on([r], a, max(clock[r], t))
                    progress = True
                    continue
                # A shared action runs on all its ranks at once, when the last one arrives.
                waiting = arrived.setdefault(key, {})
                if r not in waiting:
                    waiting[r] = max(clock[r], t)
                    progress = True
                if len(waiting) < owners[key]:
                    break
                run_on(sorted(waiting), a, max(waiting.values()))
                del arrived[key]
    if any(done[r] < len(acts) for r, acts in compute.items()):
        stuck = {r: str(acts[done[r]]) for r, acts in compute.items() if done[r] < len(acts)}
        raise SimError(Problem(obj="pipeline schedule", value=f"stuck at {stuck}",
                               rule="every action's inputs are produced by an earlier action",
                               fix="check the schedule with plan.schedules.dry_run"))
    step = max(clock.values(), default=0.0)
    in_flight, peak = _memory(compute, costs)
    return PipelineStep(step, busy, {r: 1 - busy[r] / step if step else 0.0 for r in compute},
                        in_flight, peak, events)


def _memory(compute: dict[int, list[Action]], costs: Sequence[StageCost]
            ) -> tuple[dict[int, int], dict[int, int]]:
    """Peak micro-batches held and peak activation bytes, in each rank's action order."""
    in_flight, peak = {}, {}
    for r, acts in compute.items():
        split = {(a.stage, a.micro) for a in acts if a.kind is Kind.W}
        live: dict[tuple[int, int], int] = {}
        most = top = 0
        for a in acts:
            key = (a.stage, a.micro)
            c = costs[a.stage]
            if a.kind is Kind.F:
                live[key] = c.inputs if c.recompute else c.activations
                most = max(most, len(live))
                top = max(top, sum(live.values()))
            elif a.kind is Kind.W or (a.kind is Kind.B and key not in split):
                live.pop(key, None)
        in_flight[r], peak[r] = most, top
    return in_flight, peak


def _key(a: Action) -> tuple[Kind, int, int, int]:
    return (a.kind, a.stage, a.micro, a.iteration)


__all__ = ["PipelineStep", "StageCost", "simulate_schedule"]
