"""One step of a pipelined plan: per-stage costs from the Programs, then the schedule.

A pipelined plan (``Plan.pipeline``) lowers to Programs for the whole batch,
each instruction belonging to a stage (:class:`~torchweave.sim.tasks.Builder`
tags its tasks). Per stage, on the ranks of its group (the slowest of them):

- forward and backward seconds of one micro-batch: the stage's compute and
  intra-group communication tasks over ``micro_batches``;
- activation bytes of one micro-batch (what the stage's ops save, over
  ``micro_batches``; recompute groups already keep only their inputs and pay
  their forward again in backward);
- the bytes it receives from the previous stage per micro-batch (its input).

:func:`~torchweave.sim.pipeline.simulate_schedule` runs the plan's schedule
with those costs, a point-to-point transfer between stage groups for each
boundary (and, multi-forward, from the last stage back to stage 0 after each
no-gradient pass). Activations per rank are the schedule's peak:
micro-batches in flight times their bytes.

After the schedule, each rank runs the tasks of no stage (:func:`finish_times`).
As in the runtime (:mod:`torchweave.runtime.pipeline`), a bucket of replicated
gradients is summed as soon as every stage of the rank that produces one of
them has run its last ``B`` or ``W``, on the comm stream while the rank goes
on with its other actions (where ``Device.comm_overlaps_compute``; elsewhere,
as on this CPU, after the rank's last action); ZeRO-1/2 sum theirs after the
rank's last action. The optimizer and everything else of no stage follow both.
"""

from __future__ import annotations

from collections import defaultdict

from torchweave.plan.plan import Plan
from torchweave.plan.schedules import Kind
from torchweave.sim.cluster import Cluster
from torchweave.sim.comm import Collective, collective_time
from torchweave.sim.engine import COMM, COMPUTE, LOCAL, Task
from torchweave.sim.pipeline import PipelineStep, StageCost, simulate_schedule
from torchweave.sim.tasks import Footprint


def stage_costs(plan: Plan, tasks: dict[int, list[Task]], feet: dict[int, Footprint],
                recycled: int = 0) -> list[StageCost]:
    """One :class:`StageCost` per stage: the slowest rank of the stage's group; the last
    stage sends ``recycled`` bytes per step back to stage 0 after each no-gradient pass."""
    pipe = plan.pipeline
    m = pipe.micro_batches
    out = []
    for s in range(pipe.stages):
        group = pipe.devices_of_stage(s)
        fwd = bwd = 0.0
        act = inp = 0.0
        for r in group:
            f = feet[r]
            mine = [(i < f.n_fwd, t) for i, t in enumerate(tasks[r]) if t.stage == s and t.kind != LOCAL]
            fwd = max(fwd, sum(t.dur for is_fwd, t in mine if is_fwd))
            bwd = max(bwd, sum(t.dur for is_fwd, t in mine if not is_fwd))
            act = max(act, f.stage_activations.get(s, 0))
            inp = max(inp, f.boundary.get(s, 0.0))
        nxt = 0.0
        if s + 1 < pipe.stages:
            nxt = max(feet[r].boundary.get(s + 1, 0.0) for r in pipe.devices_of_stage(s + 1))
        out.append(StageCost(fwd=fwd / m, bwd=bwd / m, activations=int(act / m),
                             inputs=int(inp / m), boundary=int(nxt / m),
                             recycled=int(recycled / m) if s == pipe.stages - 1 else 0))
    return out


def run_pipeline(plan: Plan, cluster: Cluster, tasks: dict[int, list[Task]],
                 feet: dict[int, Footprint], recycled: int = 0
                 ) -> tuple[PipelineStep, dict[int, float], dict[int, float], dict[int, float]]:
    """The schedule's step; per rank the seconds of the tasks of no stage (gradient sync,
    optimizer), when the rank's step ends (:func:`finish_times`), and the communication
    seconds of the whole step."""
    pipe = plan.pipeline
    costs = stage_costs(plan, tasks, feet, recycled)
    a = pipe.groups[0][0]
    b = pipe.groups[1][0] if len(pipe.groups) > 1 else a

    def transfer(nbytes: int) -> float:
        return collective_time(cluster, Collective.P2P, nbytes, (a, b)).seconds if a != b else 0.0

    step = simulate_schedule(pipe.schedule, costs, transfer=transfer)
    tail: dict[int, float] = defaultdict(float)
    comm: dict[int, float] = defaultdict(float)
    for r, ts in tasks.items():
        for t in ts:
            if t.stage == -1 and t.kind in (COMPUTE, COMM):
                tail[r] += t.dur
            if t.kind == COMM and t.stage != -2:
                comm[r] += t.dur
    finish = finish_times(plan, step, tasks, overlap=cluster.device.comm_overlaps_compute)
    return step, dict(tail), finish, dict(comm)


def finish_times(plan: Plan, step: PipelineStep, tasks: dict[int, list[Task]], *,
                 overlap: bool = True) -> dict[int, float]:
    """Per rank, when its step ends: its gradient sums from the moment their stages are
    done, then the optimizer and the rest of no stage after the sums and the schedule."""
    pipe = plan.pipeline
    last: dict[tuple[int, int], float] = {}  # (pipeline rank, stage) -> end of its last B or W
    ends: dict[int, float] = defaultdict(float)  # pipeline rank -> end of its last action
    for q, _, t1, a in step.events:
        ends[q] = max(ends[q], t1)
        if a.kind in (Kind.B, Kind.W):
            last[(q, a.stage)] = max(last.get((q, a.stage), 0.0), t1)
    out: dict[int, float] = {}
    for r, ts in tasks.items():
        q = pipe.rank_of_device(r)
        made_in: dict[str, set[int]] = defaultdict(set)  # gradient signal -> stages producing it
        for t in ts:
            if t.stage >= 0:
                for g in t.sets:
                    made_in[g].add(t.stage)
        syncs = [t for t in ts if t.stage == -1 and t.kind == COMM and t.key and t.key[0] == "g"]
        ready = []
        for t in syncs:
            stages = set().union(*(made_in[w] for w in t.waits)) if t.waits else set()
            early = overlap and plan.zero == 0 and stages and all((q, s) in last for s in stages)
            ready.append(max(last[(q, s)] for s in stages) if early else ends[q])
        clock = 0.0
        for t0, t in sorted(zip(ready, syncs), key=lambda x: x[0]):
            clock = max(clock, t0) + t.dur
        mine = {id(t) for t in syncs}
        rest = sum(t.dur for t in ts if t.stage == -1 and t.kind in (COMPUTE, COMM) and id(t) not in mine)
        out[r] = max(clock, ends[q]) + rest
    return out


__all__ = ["finish_times", "run_pipeline", "stage_costs"]
