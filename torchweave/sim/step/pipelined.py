"""One step of a pipelined plan: per-stage costs from the Programs, then the schedule.

A pipelined plan (``Plan.pipeline``) lowers to Programs for the whole batch,
each instruction belonging to a stage (:class:`~torchweave.sim.step.build.Builder`
tags its tasks). Per stage, on the ranks of its group (the slowest of them):

- forward and backward seconds of one micro-batch: the stage's compute and
  intra-group communication tasks over ``micro_batches``;
- activation bytes of one micro-batch (what the stage's ops save, over
  ``micro_batches``; recompute groups already keep only their inputs and pay
  their forward again in backward);
- the bytes it receives from the previous stage per micro-batch (its input).

:func:`~torchweave.sim.step.schedule.simulate_schedule` runs the plan's schedule
with those costs, a point-to-point transfer between stage groups for each
boundary (and, multi-forward, from the last stage back to stage 0 after each
no-gradient pass). Activations per rank are the schedule's peak:
micro-batches in flight times their bytes.

After the schedule, each rank runs the tasks of no stage (:func:`finish_times`).
As in the runtime (:mod:`torchweave.runtime.schedule_runner`), a bucket of replicated
gradients is summed as soon as every stage of the rank that produces one of
them has run its last ``B`` or ``W``, on the comm stream while the rank goes
on with its other actions (where ``Device.comm_overlaps_compute``; elsewhere,
as on this CPU, after the rank's last action); ZeRO-1/2 sum theirs after the
rank's last action. The optimizer and everything else of no stage follow both.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from torchweave.plan.plan import Plan
from torchweave.plan.schedules import Kind
from torchweave.sim.hardware.cluster import Cluster
from torchweave.sim.hardware.collective_cost import Collective, collective_time
from torchweave.sim.step.engine import COMM, COMPUTE, LOCAL, Task
from torchweave.sim.step.schedule import PipelineStep, StageCost, simulate_schedule
from torchweave.sim.step.signals import Meet, Of, Signal
from torchweave.sim.step.state import Footprint


@dataclass(frozen=True)
class Sums:
    """Collectives of one kind after the backward, on one rank: how many, bytes, seconds."""

    count: int
    nbytes: float
    seconds: float
    group: tuple[int, ...]
    """Their group (the first one's, where sums of several groups are added)."""

    def __add__(self, other: "Sums") -> "Sums":
        return Sums(self.count + other.count, self.nbytes + other.nbytes,
                    self.seconds + other.seconds, self.group or other.group)


@dataclass(kw_only=True)
class RankCosts:
    """What the schedule needs of one rank's tasks, for the whole batch (seconds, bytes).

    The exact path reads it off every rank's tasks (:func:`rank_costs`); the
    fast path for large pipelines (:mod:`torchweave.sim.fast.stagefold`) extrapolates
    it from cut-down models."""

    fwd: dict[int, float] = field(default_factory=dict)
    """Stage → forward seconds (compute and communication inside the stage group)."""
    bwd: dict[int, float] = field(default_factory=dict)
    activations: dict[int, int] = field(default_factory=dict)
    """Stage → bytes its ops save for backward."""
    boundary: dict[int, float] = field(default_factory=dict)
    """Stage → bytes it receives from other stage groups."""
    syncs: dict[tuple[frozenset[int], tuple[int, ...]], Sums] = field(default_factory=dict)
    """Gradient sums after the schedule, by the stages whose gradients they wait on and
    their group (sums over different groups cost differently: never one entry)."""
    gathers: dict[tuple[int, ...], Sums] = field(default_factory=dict)
    """ZeRO-1/2: the all-gathers of the updated parameter shards after the optimizer, by
    group."""
    rest: float = 0.0
    """Seconds of the other tasks of no stage (the optimizer), after the sums."""
    stage_comm: float = 0.0
    """Communication seconds inside the stages (transfers between stage groups excluded)."""
    extra_activations: int = 0
    """Activation bytes of no stage (held for the whole step)."""

    @property
    def after(self) -> float:
        """Seconds after the sums: the optimizer and the rest, and the ZeRO-1/2 gather."""
        return self.rest + sum(s.seconds for s in self.gathers.values())

    @property
    def tail(self) -> float:
        """Seconds of the tasks of no stage."""
        return sum(s.seconds for s in self.syncs.values()) + self.after

    @property
    def comm(self) -> float:
        """Communication seconds of the whole step, transfers between stage groups excluded."""
        return (self.stage_comm + sum(s.seconds for s in self.syncs.values())
                + sum(s.seconds for s in self.gathers.values()))


def hidden(t: Task, overlaps: bool) -> bool:
    """A regathered activation's gather started while the one before it is read
    (runtime/regather.py): it overlaps the stage's compute, where the device overlaps
    communication with compute. A stage's first one meets the backward's first collective
    on its group, so it is charged."""
    return (overlaps and t.key is not None and t.key.meet is Meet.REGATHER
            and any(isinstance(w, Signal) and w.of is Of.REGATHERED for w in t.waits))


def rank_costs(tasks: list[Task], foot: Footprint, overlaps: bool = True) -> RankCosts:
    """One rank's :class:`RankCosts` from its tasks (:mod:`torchweave.sim.step.build`);
    ``overlaps``: the device's ``comm_overlaps_compute``."""
    out = RankCosts(activations=dict(foot.stage_activations), boundary=dict(foot.boundary),
                    extra_activations=foot.activations - sum(foot.stage_activations.values()))
    made_in: dict = defaultdict(set)  # gradient signal -> stages producing it
    for i, t in enumerate(tasks):
        if t.stage is not None:
            for g in t.sets:
                made_in[g].add(t.stage)
            if t.kind != LOCAL and not hidden(t, overlaps):
                side = out.fwd if i < foot.n_fwd else out.bwd
                side[t.stage] = side.get(t.stage, 0.0) + t.dur
    for t in tasks:
        if t.kind == COMM and t.stage is not None:
            out.stage_comm += t.dur
        if t.stage is not None or t.crossing or t.kind not in (COMPUTE, COMM):
            continue
        meet = t.key.meet if t.kind == COMM and t.key else None
        one = Sums(1, t.nbytes, t.dur,
                   tuple(t.key.group) if meet in (Meet.GRAD_SUM, Meet.PARAM_GATHER) else ())
        if meet is Meet.GRAD_SUM:
            stages = frozenset().union(*(made_in[w] for w in t.waits)) if t.waits else frozenset()
            key = (stages, one.group)
            out.syncs[key] = out.syncs[key] + one if key in out.syncs else one
        elif meet is Meet.PARAM_GATHER:
            g = out.gathers
            g[one.group] = g[one.group] + one if one.group in g else one
        else:
            out.rest += t.dur
            if t.kind == COMM:
                out.stage_comm += t.dur
    return out


def stage_costs(plan: Plan, costs: dict[int, RankCosts], recycled: int = 0) -> list[StageCost]:
    """One :class:`StageCost` per stage: the slowest rank of the stage's group (of the ranks
    in ``costs``); the last stage sends ``recycled`` bytes per step back to stage 0 after
    each no-gradient pass."""
    pipe = plan.pipeline
    m = pipe.micro_batches

    def ranks(s: int) -> list[RankCosts]:
        return [costs[r] for r in pipe.devices_of_stage(s) if r in costs]

    out = []
    for s in range(pipe.stages):
        mine = ranks(s)
        fwd = max((c.fwd.get(s, 0.0) for c in mine), default=0.0)
        bwd = max((c.bwd.get(s, 0.0) for c in mine), default=0.0)
        act = max((c.activations.get(s, 0) for c in mine), default=0)
        inp = max((c.boundary.get(s, 0.0) for c in mine), default=0.0)
        nxt = 0.0
        if s + 1 < pipe.stages:
            nxt = max((c.boundary.get(s + 1, 0.0) for c in ranks(s + 1)), default=0.0)
        out.append(StageCost(fwd=fwd / m, bwd=bwd / m, activations=int(act / m),
                             inputs=int(inp / m), boundary=int(nxt / m),
                             recycled=int(recycled / m) if s == pipe.stages - 1 else 0))
    return out


def run_pipeline(plan: Plan, cluster: Cluster, costs: dict[int, RankCosts], recycled: int = 0
                 ) -> tuple[PipelineStep, dict[int, float]]:
    """The schedule's step, and per rank of ``costs`` when its step ends (:func:`finish_times`)."""
    pipe = plan.pipeline
    a = pipe.groups[0][0]
    b = pipe.groups[1][0] if len(pipe.groups) > 1 else a

    def transfer(nbytes: int) -> float:
        return collective_time(cluster, Collective.P2P, nbytes, (a, b)).seconds if a != b else 0.0

    step = simulate_schedule(pipe.schedule, stage_costs(plan, costs, recycled), transfer=transfer)
    finish = finish_times(plan, step, costs, overlap=cluster.device.comm_overlaps_compute)
    return step, finish


def finish_times(plan: Plan, step: PipelineStep, costs: dict[int, RankCosts], *,
                 overlap: bool = True) -> dict[int, float]:
    """Per rank, when its step ends: its gradient sums from the moment their stages are
    done (a tied weight's copies' once the schedule is), then the optimizer and the rest of
    no stage after the sums and the schedule."""
    pipe = plan.pipeline
    last: dict[tuple[int, int], float] = {}  # (pipeline rank, stage) -> end of its last B or W
    ends: dict[int, float] = defaultdict(float)  # pipeline rank -> end of its last action
    for q, _, t1, a in step.events:
        ends[q] = max(ends[q], t1)
        if a.kind in (Kind.B, Kind.W):
            last[(q, a.stage)] = max(last.get((q, a.stage), 0.0), t1)
    group_of = {d: k for k, g in enumerate(pipe.groups) for d in g}
    out: dict[int, float] = {}
    for r, c in costs.items():
        q = group_of[r]
        ready = []
        for (stages, grp), sums in c.syncs.items():
            # a tied weight's copies (a group across stage groups) are summed once the
            # schedule is done, after the rank's sends (runtime/schedule_runner.py)
            early = (overlap and plan.zero == 0 and stages and all((q, s) in last for s in stages)
                     and len({group_of.get(d) for d in grp}) <= 1)
            ready.append((max(last[(q, s)] for s in stages) if early else ends[q], sums.seconds))
        clock = 0.0
        for t0, dur in sorted(ready, key=lambda x: x[0]):
            clock = max(clock, t0) + dur
        out[r] = max(clock, ends[q]) + c.after
    return out


__all__ = ["RankCosts", "Sums", "finish_times", "rank_costs", "run_pipeline", "stage_costs"]
