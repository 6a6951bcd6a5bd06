"""Run a step's tasks and say what it cost: the engine over every simulated rank, then
time, memory, FLOPs and price per rank as a :class:`~torchweave.sim.explain.result.SimResult`.

The exact path and both fast paths end here: :func:`run_step` for task lists
run by the engine, :func:`run_pipelined` and :func:`pipelined_result` for
pipelined plans (per-stage costs and the schedule, :mod:`torchweave.sim.step.pipelined`).

Memory per rank: parameters, gradients and AdamW state (per ZeRO stage, from
:func:`~torchweave.sim.hardware.memory.model_state_memory`), buffers, the activations
saved for backward (the distinct storages that some op's backward needs, by
the rule of :mod:`torchweave.sim.step.saved`; parameters excluded; recompute groups
keep only their inputs) and temporary buffers (the largest of: a gradient
bucket, twice the largest single activation, two ZeRO-3 units, the full local
gradients that ZeRO-1/2 shard after backward). ZeRO-1/2 as the runtime runs
them step the member's slice of the fp32 pieces in place (no master copy). Pipelined
plans hold each stage's activations per micro-batch in flight. A rank over its
device's memory is out of memory.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from torchweave.errors import Problem, SimError
from torchweave.ir.graph import Graph
from torchweave.plan.plan import Plan
from torchweave.plan.recycle import resolve_links
from torchweave.sim.explain.result import Event, MemoryUse, OutOfMemory, Replicas, SimResult
from torchweave.sim.hardware.cluster import Cluster
from torchweave.sim.hardware.compute import ComputeModel, precision_of
from torchweave.sim.hardware.memory import model_state_memory
from torchweave.sim.step.accum import accumulate
from torchweave.sim.step.engine import run
from torchweave.sim.step.pipelined import rank_costs, run_pipeline

GiB = 2**30


def run_step(graph: Graph, plan: Plan, cluster: Cluster, tasks, feet, programs, rep, *, dtype,
             model: ComputeModel, strict: bool, timeline: bool, grad_accum: int,
             tokens_per_step: int | None, flops: float, notes: tuple[str, ...] = (),
             folded_blocks: int | None = None) -> SimResult:
    """Run the engine on the simulated ranks' ``tasks`` (one micro-batch's, accumulated
    ``grad_accum`` times) and assemble the result for every rank. ``flops``: one
    micro-batch's."""
    if grad_accum > 1:
        tasks = {r: accumulate(ts, grad_accum, zero=plan.zero) for r, ts in tasks.items()}
    serial = frozenset() if cluster.device.comm_overlaps_compute else frozenset(tasks)
    runs, events = run(tasks, record=timeline, serial=serial)
    step = max((r.end for r in runs.values()), default=0.0)
    if rep:  # every replica runs what replica 0 does
        runs = {r: runs[r % rep.size] for r in range(plan.world_size)}
        feet = {r: feet[r % rep.size] for r in range(plan.world_size)}
        programs = [programs[r % rep.size] for r in range(plan.world_size)]
    ranks = sorted(runs)

    memory = memory_use(plan, programs, feet, ranks, dtype)
    if rep:
        notes += (f"{rep.count} data-parallel replicas of {rep.size} ranks: one lowered and "
                  f"simulated",)
    if grad_accum > 1:
        notes += (f"{grad_accum} micro-batches accumulated per step",)
    return assemble(
        plan, cluster, step=step, compute=tuple(runs[r].compute_busy for r in ranks),
        comm=tuple(runs[r].comm_busy for r in ranks), memory=tuple(memory),
        comm_latency=tuple(runs[r].comm_latency for r in ranks),
        flops=grad_accum * flops,
        tokens=tokens_per_step if tokens_per_step is not None else grad_accum * tokens_of(graph),
        dtype=dtype, model=model, strict=strict, events=events, notes=notes, replicas=rep,
        folded_blocks=folded_blocks)


def memory_use(plan: Plan, programs, feet, ranks, dtype, activations=None) -> tuple[MemoryUse, ...]:
    precision = "bf16-mixed" if dtype in (torch.bfloat16, torch.float16) else "fp32"
    out = []
    for i, r in enumerate(ranks):
        f = feet[r]
        dp = zero_group(plan, r)
        kept = f.kept if plan.zero else 0  # what ZeRO does not own: whole (zero_owns)
        state = model_state_memory(f.params - kept, dp=dp, stage=plan.zero, precision=precision)
        whole = model_state_memory(kept, precision=precision)
        grads, opt, temps = state.grads + whole.grads, state.optimizer + whole.optimizer, f.temporaries
        if plan.zero in (1, 2) and dp > 1:
            # As the runtime runs them (runtime/zero.py): autograd fills full local gradients
            # (a temporary), one all-reduce or reduce-scatter leaves each member its shard,
            # and the optimizer steps the member's slice of the fp32 pieces in place (no
            # master copy: the pieces are views of one flat buffer).
            full = model_state_memory(f.params - kept, precision=precision).grads
            grads, temps = math.ceil(full / dp) + whole.grads, max(temps, full)
        out.append(MemoryUse(params=state.params + whole.params, grads=grads, optimizer=opt,
                             buffers=f.buffers,
                             activations=f.activations if activations is None else activations[r],
                             temporaries=temps))
    return tuple(out)


def run_pipelined(graph, plan, cluster, programs, builder, tasks, feet, *, dtype, model, strict,
               tokens_per_step, timeline) -> SimResult:
    """A pipelined plan: per-stage costs, the schedule, then sync and optimizer."""
    overlaps = cluster.device.comm_overlaps_compute
    costs = {r: rank_costs(tasks[r], feet[r], overlaps) for r in sorted(tasks)}
    step, finish = run_pipeline(plan, cluster, costs, recycled_bytes(graph, plan))
    ranks = sorted(tasks)
    memory = memory_use(plan, programs, feet, ranks, dtype, pipeline_activations(plan, step, costs))
    return pipelined_result(plan, cluster, step, finish, costs, memory, ranks,
                            flops=sum(c.model_flops for c in builder.costs.values()),
                            tokens=tokens_per_step if tokens_per_step is not None else tokens_of(graph),
                            dtype=dtype, model=model, strict=strict, timeline=timeline)


def recycled_bytes(graph: Graph, plan: Plan) -> int:
    """Multi-forward: bytes the last stage sends back to stage 0 after each pass."""
    if plan.pipeline.recycle is None:
        return 0

    return sum(graph.values[link.output].meta.nbytes
               for link in resolve_links(graph, plan.pipeline.recycle)[0])


def pipeline_activations(plan: Plan, step, costs) -> dict[int, int]:
    """Per rank of ``costs``: the schedule's activation peak plus its activations of no stage."""
    pipe = plan.pipeline
    group_of = {d: k for k, g in enumerate(pipe.groups) for d in g}
    return {r: step.activation_peak[group_of[r]] + max(0, c.extra_activations) // pipe.micro_batches
            for r, c in costs.items()}


def pipelined_result(plan: Plan, cluster: Cluster, step, finish, costs, memory, ranks, *,
                     flops: float, tokens: int, dtype, model, strict: bool, timeline: bool,
                     notes: tuple[str, ...] = (), folded_blocks: int | None = None,
                     shown=None) -> SimResult:
    """The :class:`SimResult` of a pipelined step: ``costs``, ``finish`` and ``memory`` for
    each of ``ranks`` (in that order); the timeline has the devices in ``shown`` (default: all)."""
    pipe = plan.pipeline
    group_of = {d: k for k, g in enumerate(pipe.groups) for d in g}
    total = max([step.step_time, *finish.values()])
    # The timeline: each pipeline rank's actions on every device of its group.
    events = [Event(d, "compute", str(a), t0, t1) for k_, t0, t1, a in step.events
              for d in pipe.groups[k_] if shown is None or d in shown] if timeline else []
    passes = f", {pipe.passes} forward passes each" if pipe.passes > 1 else ""
    notes = (f"{pipe.kind} schedule, {pipe.stages} stages, {pipe.micro_batches} micro-batches{passes}: "
             f"bubble {step.bubble_fraction:.1%}, micro-batches in flight per pipeline rank "
             f"{[step.in_flight[i] for i in sorted(step.in_flight)]}",) + notes
    busy = tuple(step.busy[group_of[r]] + costs[r].tail for r in ranks)
    if shared_cores(cluster, plan.world_size) and step.events:
        spans = np.array([[t0, t1, len(pipe.groups[k]) / cluster.devices_per_node]
                          for k, t0, t1, _ in step.events])
        end = float(spans[:, 1].max())  # the schedule's; what follows (sums, AdamW) as it is
        shared = float(shared_cores_step(spans[:, :1], spans[:, 1:2], spans[:, 2:3],
                                         cluster.share)[0]) + (total - end)
    else:
        shared = total
    if shared != total:
        notes += (f"{cluster.devices_per_node} ranks share a node's cores: {total * 1e3:.4g} ms "
                  f"with each at its share, {shared * 1e3:.4g} ms as ranks waiting in the "
                  f"bubble leave their share to the others",)
        total = shared
    return assemble(
        plan, cluster, step=total,
        compute=busy,
        comm=tuple(costs[r].comm for r in ranks), memory=memory, flops=flops, tokens=tokens,
        dtype=dtype, model=model, strict=strict, events=events, notes=notes,
        bubble=step.bubble_fraction, folded_blocks=folded_blocks)


def shared_cores(cluster: Cluster, world: int) -> bool:
    """Whether a pipeline of ``world`` ranks runs on one node whose ranks outnumber its
    cores (``cluster.share < 1``): then :func:`shared_cores_step` times its schedule."""
    return cluster.share < 1 and world <= cluster.devices_per_node


def shared_cores_step(starts: np.ndarray, ends: np.ndarray, weight: np.ndarray,
                      share: float) -> np.ndarray:
    """A pipeline schedule's seconds on one node whose ranks outnumber its cores, from its
    actions' ``starts`` and ``ends`` (``[actions, K]``, for ``K`` sets of costs at once),
    simulated with every rank at its ``share`` of a core, and each action's ``weight``
    (``[actions, 1]`` or ``[actions, K]``): the fraction of the node's ranks that run it
    (its pipeline rank's group over the node's devices).

    A pipeline rank waiting in the bubble leaves its cores to the ranks that have work, and
    the operating system runs those faster than their share, up to a whole core each: while
    a fraction ``b`` of the ranks compute, each runs at ``min(1, share / b)`` of a core
    instead of ``share``, so that moment of the schedule lasts ``max(share, b)`` of itself
    (``docs/simulator.md``, "Ranks sharing cores", has it against measured steps). Moments
    where all compute stay as they are; the schedule's ramps and waits shrink (a wait for
    a transfer alone, too, to ``share`` of itself: gloo's copies take the cores). The
    moments are the schedule's as simulated at shares: shrinking each where it is keeps
    every action's order, which is what the dependencies fix."""
    times = np.concatenate([starts, ends])
    order = np.argsort(times, axis=0, kind="stable")
    moments = np.take_along_axis(times, order, axis=0)
    delta = np.broadcast_to(np.concatenate([weight, -weight]), times.shape)
    busy = np.minimum(1.0, np.cumsum(np.take_along_axis(delta, order, axis=0), axis=0))
    lasts = np.maximum(share, busy[:-1]) * np.diff(moments, axis=0)
    return lasts.sum(axis=0) + share * moments[0]


def assemble(plan: Plan, cluster: Cluster, *, step: float, compute: tuple[float, ...],
             comm: tuple[float, ...], memory: tuple[MemoryUse, ...], flops: float, tokens: int,
             dtype: torch.dtype | None, model: ComputeModel, strict: bool,
             events: list[Event], notes: tuple[str, ...] = (),
             bubble: float | None = None, replicas: Replicas | None = None,
             folded_blocks: int | None = None, comm_latency: tuple[float, ...] = ()) -> SimResult:
    """The :class:`SimResult` of per-rank busy times and memory: OOM, MFU, throughput, $."""
    tops: dict[int, tuple] = {}  # ranks that share a MemoryUse (a fast path's) share its ranking
    oom = tuple(
        OutOfMemory(rank=r, device=cluster.device.name, peak=m.peak,
                    capacity=cluster.device.memory_bytes,
                    contributors=tops.setdefault(id(m), tuple(m.contributors())))
        for r, m in enumerate(memory) if m.peak > cluster.device.memory_bytes)
    if strict and oom:
        raise SimError([Problem(obj=f"rank {o.rank} on {o.device}",
                                value=f"{o.peak / GiB:.3g} GiB ({o.peak} bytes)",
                                rule=f"must fit the device's {o.capacity / GiB:.3g} GiB; biggest: "
                                     + ", ".join(f"{w} {n / GiB:.3g} GiB" for w, n in o.contributors[:3]),
                                fix="shard more (zero, tp), use more devices, or a bigger device")
                        for o in oom[:4]], header=f"plan {plan.name!r} is out of memory")
    peak = cluster.device.peak.of(precision_of(dtype or torch.float32, cluster.device, matmul=True,
                                               tf32=model.tf32))
    tps = tokens / step if step > 0 else 0.0
    usd = cluster.price_per_hour / 3600 * step / tokens * 1e6 if tokens else 0.0
    return SimResult(
        plan_name=plan.name, cluster=str(cluster), world_size=len(memory), step_time=step,
        compute_time=compute, comm_time=comm,
        idle=tuple(max(0.0, 1 - c / step) if step else 0.0 for c in compute),
        memory=memory, model_flops=flops,
        mfu=flops / (step * cluster.size * peak) if step else 0.0,
        tokens_per_step=tokens, tokens_per_s=tps, usd_per_million_tokens=usd, oom=oom,
        timeline=events, notes=notes, pipeline_bubble=bubble, replicas=replicas,
        folded_blocks=folded_blocks, comm_latency=comm_latency)


def zero_group(plan: Plan, rank: int) -> int:
    """How many ranks ZeRO shards ``rank``'s state over (1 without ZeRO)."""
    return max(1, len(plan.zero_group(rank)))


def tokens_of(graph: Graph) -> int:
    metas = [graph.values[i].meta for i in graph.inputs]
    for m in metas:
        if not m.dtype.is_floating_point and len(m.shape) >= 2:
            return m.numel
    return metas[0].shape[0] if metas and metas[0].shape else 1


__all__ = ["assemble", "memory_use", "pipeline_activations", "pipelined_result", "recycled_bytes",
           "run_pipelined", "run_step", "tokens_of", "zero_group"]
