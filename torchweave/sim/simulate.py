"""Simulate one training step of a lowered plan on a cluster.

``simulate(graph, plan, cluster)`` lowers the plan (or takes the Programs),
builds each rank's forward, backward, gradient-sync and optimizer tasks
(:mod:`torchweave.sim.step.build`) and runs them on two streams per rank, compute
and communication (:mod:`torchweave.sim.step.engine`). Collectives start when every
member of their group has reached them.

Large plans take a fast path (:mod:`torchweave.sim.fast`) where one applies:
one data-parallel replica for all, repeated blocks folded, or a pipeline's
stages of identical blocks simulated once. Time, memory per rank (see
:mod:`torchweave.sim.step.run`), FLOPs and price come back as a
:class:`~torchweave.sim.explain.result.SimResult`.
"""

from __future__ import annotations

import functools
import gc

import torch

from torchweave.errors import Problem, SimError
from torchweave.ir.graph import Graph
from torchweave.lower.program import Program
from torchweave.plan.plan import Plan
from torchweave.sim.explain.result import MemoryUse, OutOfMemory, SimResult
from torchweave.sim.fast.fold import find_blocks
from torchweave.sim.fast.folded import simulate_folded
from torchweave.sim.fast.stagefold import find_stage_shape, simulate_stagefold
from torchweave.sim.fast.symmetry import SYMMETRY_RANKS, lower_programs
from torchweave.sim.hardware.cluster import Cluster
from torchweave.lower.buckets import BUCKET_BYTES
from torchweave.sim.hardware.compute import ComputeModel
from torchweave.sim.hardware.profile import OpProfiles
from torchweave.sim.step.build import Builder
from torchweave.sim.step.run import run_pipelined, run_step, tokens_of

FOLD_NODES = 500
"""Graphs this big are simulated by folding their repeated blocks (when they have them)."""


def without_cyclic_gc(fn):
    """Run ``fn`` with Python's cyclic garbage collector paused: a simulation makes
    millions of small tuples and no cycles, and full collections in the middle of it
    cost as much as the simulation (seen as every other call taking twice as long)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()
    return run


@without_cyclic_gc
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
    (:mod:`torchweave.sim.fast.symmetry`); None: when the plan has more than two
    replicas on ``SYMMETRY_RANKS`` ranks or more and no ``programs`` are
    given. Per-rank results are the same for every replica; the timeline has
    replica 0's ranks only. ``fold``: lower 4 of the model's identical blocks
    and copy their tasks to all (:mod:`torchweave.sim.fast.folded`); None: for
    graphs of ``FOLD_NODES`` nodes or more, when no ``programs`` are given.
    Pipelined plans (``plan.pipeline``) use neither, and are simulated by
    their schedule (:mod:`torchweave.sim.step.pipelined`). ``profiles``: measured op times
    (:mod:`torchweave.sim.hardware.profile`) used in place of the roofline where present.
    ``grad_accum``: micro-batches per optimizer step, ``graph`` being one
    micro-batch's (:mod:`torchweave.sim.step.accum`); tokens and FLOPs are the step's.
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
        shape = find_stage_shape(graph, plan, symmetry=symmetry is not False)
        if shape is not None:
            res = simulate_stagefold(
                graph, plan, cluster, shape, dtype=dtype,
                tokens=tokens_per_step if tokens_per_step is not None else tokens_of(graph),
                model=model or ComputeModel.for_device(cluster.device), bucket_bytes=bucket_bytes,
                strict=strict, timeline=timeline, profiles=profiles)
            if res is not None:
                return res
    if plan.pipeline is not None:  # the exact path: every rank lowered and simulated
        fold, symmetry = False, False
    if programs is None and fold is not False:
        blocks = find_blocks(graph, plan) if fold or len(graph.nodes) >= FOLD_NODES else None
        if blocks is not None:
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
        return run_pipelined(graph, plan, cluster, programs, builder, tasks, feet, dtype=dtype,
                          model=model, strict=strict, tokens_per_step=tokens_per_step,
                          timeline=timeline)
    return run_step(graph, plan, cluster, tasks, feet, programs, rep, dtype=dtype, model=model,
                    strict=strict, timeline=timeline, grad_accum=grad_accum,
                    tokens_per_step=tokens_per_step,
                    flops=sum(c.model_flops for c in builder.costs.values()))


__all__ = ["FOLD_NODES", "without_cyclic_gc", "MemoryUse", "OutOfMemory", "SYMMETRY_RANKS", "SimResult", "simulate"]
