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
no-gradient pass). Gradient sync and the optimizer run after the pipeline flushes (the
tasks of no stage), on each rank. Activations per rank are the schedule's
peak: micro-batches in flight times their bytes.
"""

from __future__ import annotations

from collections import defaultdict

from torchweave.plan.plan import Plan
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
                 ) -> tuple[PipelineStep, dict[int, float], dict[int, float]]:
    """The schedule's step, and per rank the seconds after it (gradient sync, optimizer)
    and the communication seconds of the whole step."""
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
    return step, dict(tail), dict(comm)


__all__ = ["run_pipeline", "stage_costs"]
