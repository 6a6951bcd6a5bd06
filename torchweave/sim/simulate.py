"""Simulate one training step of a lowered plan on a cluster.

``simulate(graph, plan, cluster)`` lowers the plan (or takes the Programs),
builds each rank's forward, backward, gradient-sync and optimizer tasks
(:mod:`torchweave.sim.tasks`) and runs them on two streams per rank, compute
and communication (:mod:`torchweave.sim.engine`). Collectives start when every
member of their group has reached them.

Memory per rank: parameters, gradients and AdamW state (per ZeRO stage, from
:func:`~torchweave.sim.memory.model_state_memory`), buffers, the activations
saved for backward (the distinct storages that some op's backward needs, by
the rule of :mod:`torchweave.sim.saved`; parameters excluded; recompute groups
keep only their inputs) and temporary buffers (the largest of: a gradient
bucket, twice the largest single activation, two ZeRO-3 units, the full local
gradients that ZeRO-1/2 shard after backward). ZeRO-1/2 as the runtime runs
them also hold an fp32 master copy of each member's parameter shard. Pipelined
plans hold each stage's activations per micro-batch in flight
(:mod:`torchweave.sim.pipelined`). A rank over its device's memory is out of
memory.
"""

from __future__ import annotations

import math
import torch

from torchweave.errors import Problem, SimError
from torchweave.ir.graph import Graph
from torchweave.lower.program import Program
from torchweave.plan.plan import Plan
from torchweave.sim.cluster import Cluster
from torchweave.sim.comm import BUCKET_BYTES
from torchweave.sim.cost import ComputeModel, precision_of
from torchweave.sim.engine import Event, run
from torchweave.sim.memory import model_state_memory
from torchweave.sim.profile import OpProfiles
from torchweave.sim.result import MemoryUse, OutOfMemory, SimResult
from torchweave.sim.symmetry import Replicas
from torchweave.sim.tasks import Builder

GiB = 2**30
FOLD_NODES = 500
"""Graphs this big are simulated by folding their repeated blocks (when they have them)."""
SYMMETRY_RANKS = 16
"""Plans on this many ranks are simulated one data-parallel replica for all (when symmetric)."""


def simulate(graph: Graph, plan: Plan, cluster: Cluster, *, programs: list[Program] | None = None,
             dtype: torch.dtype | None = None, tokens_per_step: int | None = None,
             model: ComputeModel | None = None, bucket_bytes: int = BUCKET_BYTES,
             strict: bool = False, timeline: bool = True,
             symmetry: bool | None = None, fold: bool | None = None,
             profiles: OpProfiles | None = None, grad_accum: int = 1) -> SimResult:
    """Simulate one training step of ``plan`` on ``cluster``.

    ``dtype`` overrides the floating dtype ops compute in (``torch.bfloat16``
    for mixed precision; ``None``: the graph's). ``tokens_per_step`` defaults
    to the elements of the first integer input (``idx [batch, seq]``), else its
    batch size. ``strict``: raise :class:`SimError` when a rank is out of memory.
    ``symmetry``: lower and simulate one data-parallel replica for all
    (:mod:`torchweave.sim.symmetry`); None: when the plan has more than two
    replicas on ``SYMMETRY_RANKS`` ranks or more and no ``programs`` are
    given. Per-rank results are the same for every replica; the timeline has
    replica 0's ranks only. ``fold``: lower 4 of the model's identical blocks
    and copy their tasks to all (:mod:`torchweave.sim.folded`); None: for
    graphs of ``FOLD_NODES`` nodes or more, when no ``programs`` are given.
    Pipelined plans (``plan.pipeline``) use neither, and are simulated by
    their schedule (:mod:`torchweave.sim.pipelined`). ``profiles``: measured op times
    (:mod:`torchweave.sim.profile`) used in place of the roofline where present.
    ``grad_accum``: micro-batches per optimizer step, ``graph`` being one
    micro-batch's (:mod:`torchweave.sim.accum`); tokens and FLOPs are the step's.
    Default: the plan's ``accum``. A pipelined plan takes its micro-batches from its
    pipeline instead.
    """
    if grad_accum == 1:
        grad_accum = plan.accum
    elif plan.accum not in (1, grad_accum):
        raise SimError(Problem(obj="grad_accum", value=str(grad_accum),
                               rule=f"one number of micro-batches per step: the plan says "
                                    f"accum={plan.accum}", fix="give it once, or make them equal"))
    if plan.world_size > cluster.size:
        raise SimError(Problem(obj=f"plan {plan.name!r} world_size", value=str(plan.world_size),
                               rule=f"a plan must fit the cluster: {cluster} has {cluster.size} devices",
                               fix=f"use a cluster of at least {plan.world_size} devices"))
    if grad_accum < 1 or (grad_accum > 1 and plan.pipeline is not None):
        raise SimError(Problem(
            obj="grad_accum", value=str(grad_accum),
            rule="at least 1; a pipelined plan runs the micro-batches its plan says" if grad_accum >= 1
            else "at least 1",
            fix=f"give the plan its micro-batches (e.g. '{plan.pipeline.kind}:micro={grad_accum}')"
            if plan.pipeline is not None else "use 1 for no accumulation"))
    if plan.pipeline is not None and programs is None and fold is not False and (
            fold or len(graph.nodes) >= FOLD_NODES or plan.world_size >= SYMMETRY_RANKS):
        from torchweave.sim.stagefold import find_stage_shape, simulate_stagefold

        shape = find_stage_shape(graph, plan, symmetry=symmetry is not False)
        if shape is not None:
            res = simulate_stagefold(
                graph, plan, cluster, shape, dtype=dtype,
                tokens=tokens_per_step if tokens_per_step is not None else _tokens(graph),
                model=model or ComputeModel.for_device(cluster.device), bucket_bytes=bucket_bytes,
                strict=strict, timeline=timeline, profiles=profiles)
            if res is not None:
                return res
    if plan.pipeline is not None:  # the exact path: every rank lowered and simulated
        fold, symmetry = False, False
    if programs is None and fold is not False:
        from torchweave.sim.fold import find_blocks

        blocks = find_blocks(graph, plan) if fold or len(graph.nodes) >= FOLD_NODES else None
        if blocks is not None:
            from torchweave.sim.folded import simulate_folded

            res = simulate_folded(graph, plan, cluster, blocks, dtype=dtype,
                                  tokens_per_step=tokens_per_step, model=model,
                                  bucket_bytes=bucket_bytes, strict=strict, timeline=timeline,
                                  symmetry=symmetry, profiles=profiles, grad_accum=grad_accum)
            if res is not None:
                return res
    rep = None
    if programs is None:
        programs, rep = lower_programs(graph, plan, symmetry)
    model = model or ComputeModel.for_device(cluster.device)
    meet = frozenset(range(rep.size)) if rep else None
    builder = Builder(graph, plan, cluster, dtype, model, bucket_bytes, profiles=profiles, meet=meet)
    tasks, feet = {}, {}
    for prog in programs:
        tasks[prog.rank], feet[prog.rank] = builder.tasks(prog)
    if plan.pipeline is not None:
        return _pipelined(graph, plan, cluster, programs, builder, tasks, feet, dtype=dtype,
                          model=model, strict=strict, tokens_per_step=tokens_per_step,
                          timeline=timeline)
    return run_step(graph, plan, cluster, tasks, feet, programs, rep, dtype=dtype, model=model,
                    strict=strict, timeline=timeline, grad_accum=grad_accum,
                    tokens_per_step=tokens_per_step,
                    flops=sum(c.model_flops for c in builder.costs.values()))


def run_step(graph: Graph, plan: Plan, cluster: Cluster, tasks, feet, programs, rep, *, dtype,
             model: ComputeModel, strict: bool, timeline: bool, grad_accum: int,
             tokens_per_step: int | None, flops: float, notes: tuple[str, ...] = (),
             folded_blocks: int | None = None) -> SimResult:
    """Run the engine on the simulated ranks' ``tasks`` (one micro-batch's, accumulated
    ``grad_accum`` times) and assemble the result for every rank. ``flops``: one
    micro-batch's."""
    if grad_accum > 1:
        from torchweave.sim.accum import accumulate

        tasks = {r: accumulate(ts, grad_accum, zero=plan.zero) for r, ts in tasks.items()}
    serial = frozenset() if cluster.device.comm_overlaps_compute else frozenset(tasks)
    runs, events = run(tasks, record=timeline, serial=serial)
    step = max((r.end for r in runs.values()), default=0.0)
    if rep:  # every replica runs what replica 0 does
        runs = {r: runs[r % rep.size] for r in range(plan.world_size)}
        feet = {r: feet[r % rep.size] for r in range(plan.world_size)}
        programs = [programs[r % rep.size] for r in range(plan.world_size)]
    ranks = sorted(runs)

    memory = _memory(plan, programs, feet, ranks, dtype)
    if rep:
        notes += (f"{rep.count} data-parallel replicas of {rep.size} ranks: one lowered and "
                  f"simulated",)
    if grad_accum > 1:
        notes += (f"{grad_accum} micro-batches accumulated per step",)
    return assemble(
        plan, cluster, step=step, compute=tuple(runs[r].compute_busy for r in ranks),
        comm=tuple(runs[r].comm_busy for r in ranks), memory=tuple(memory),
        flops=grad_accum * flops,
        tokens=tokens_per_step if tokens_per_step is not None else grad_accum * _tokens(graph),
        dtype=dtype, model=model, strict=strict, events=events, notes=notes, replicas=rep,
        folded_blocks=folded_blocks)


def _memory(plan: Plan, programs, feet, ranks, dtype, activations=None) -> tuple[MemoryUse, ...]:
    precision = "bf16-mixed" if dtype in (torch.bfloat16, torch.float16) else "fp32"
    out = []
    for i, r in enumerate(ranks):
        f = feet[r]
        dp = _zero_group(plan, programs[i], r)
        state = model_state_memory(f.params, dp=dp, stage=plan.zero, precision=precision)
        grads, opt, temps = state.grads, state.optimizer, f.temporaries
        if plan.zero in (1, 2) and dp > 1:
            # As the runtime runs them (runtime/zero.py): autograd fills full local gradients
            # (a temporary), one all-reduce or reduce-scatter leaves each member its shard,
            # and the optimizer steps an fp32 master copy of the member's parameter shard.
            full = model_state_memory(f.params, precision=precision).grads
            grads, temps = math.ceil(full / dp), max(temps, full)
            if precision == "fp32":
                opt += math.ceil(4 * f.params / dp)
        out.append(MemoryUse(params=state.params, grads=grads, optimizer=opt, buffers=f.buffers,
                             activations=f.activations if activations is None else activations[r],
                             temporaries=temps))
    return tuple(out)


def _pipelined(graph, plan, cluster, programs, builder, tasks, feet, *, dtype, model, strict,
               tokens_per_step, timeline) -> SimResult:
    """A pipelined plan: per-stage costs, the schedule, then sync and optimizer."""
    from torchweave.sim.pipelined import rank_costs, run_pipeline

    costs = {r: rank_costs(tasks[r], feet[r]) for r in sorted(tasks)}
    step, finish = run_pipeline(plan, cluster, costs, recycled_bytes(graph, plan))
    ranks = sorted(tasks)
    memory = _memory(plan, programs, feet, ranks, dtype, pipeline_activations(plan, step, costs))
    return pipelined_result(plan, cluster, step, finish, costs, memory, ranks,
                            flops=sum(c.model_flops for c in builder.costs.values()),
                            tokens=tokens_per_step if tokens_per_step is not None else _tokens(graph),
                            dtype=dtype, model=model, strict=strict, timeline=timeline)


def recycled_bytes(graph: Graph, plan: Plan) -> int:
    """Multi-forward: bytes the last stage sends back to stage 0 after each pass."""
    if plan.pipeline.recycle is None:
        return 0
    from torchweave.plan.recycle import resolve_links

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
    return assemble(
        plan, cluster, step=total,
        compute=tuple(step.busy[group_of[r]] + costs[r].tail for r in ranks),
        comm=tuple(costs[r].comm for r in ranks), memory=memory, flops=flops, tokens=tokens,
        dtype=dtype, model=model, strict=strict, events=events, notes=notes,
        bubble=step.bubble_fraction, folded_blocks=folded_blocks)


def assemble(plan: Plan, cluster: Cluster, *, step: float, compute: tuple[float, ...],
             comm: tuple[float, ...], memory: tuple[MemoryUse, ...], flops: float, tokens: int,
             dtype: torch.dtype | None, model: ComputeModel, strict: bool,
             events: list[Event], notes: tuple[str, ...] = (),
             bubble: float | None = None, replicas: Replicas | None = None,
             folded_blocks: int | None = None) -> SimResult:
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
        folded_blocks=folded_blocks)


def lower_programs(graph: Graph, plan: Plan, symmetry: bool | None):
    """Programs to simulate, and the replica symmetry used (None: every rank lowered)."""
    from torchweave.lower.lower import lower
    from torchweave.sim.symmetry import find_replicas, lift_programs, reduce_plan

    rep = find_replicas(plan, [n.name for n in graph.nodes]) if symmetry is not False else None
    if rep is not None and (symmetry or (rep.count > 2 and plan.world_size >= SYMMETRY_RANKS)):
        # ``lower`` validates the reduced plan; the full one has its shape (find_replicas).
        lifted = lift_programs(lower(graph, reduce_plan(plan, rep)), rep)
        if lifted is not None:
            return lifted, rep
    return lower(graph, plan), None


def _zero_group(plan: Plan, prog: Program, rank: int) -> int:
    if not plan.zero:
        return 1
    sizes = [len(g) for s in prog.params for g in s.grad_groups if rank in g]
    return max(sizes, default=1)


def _tokens(graph: Graph) -> int:
    metas = [graph.values[i].meta for i in graph.inputs]
    for m in metas:
        if not m.dtype.is_floating_point and len(m.shape) >= 2:
            return m.numel
    return metas[0].shape[0] if metas and metas[0].shape else 1


__all__ = ["Event", "MemoryUse", "OutOfMemory", "SimResult", "simulate"]
