"""Explain a plan per op: its partition, devices, the communication lowering inserts before
it, its simulated time and memory (``torchweave explain`` prints this; the library call is
:func:`explain_plan`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from torchweave.errors import Problem, TorchweaveError
from torchweave.ir.graph import Graph
from torchweave.lower import steps
from torchweave.plan.plan import Plan
from torchweave.sim.explain.result import SimResult
from torchweave.sim.fast.symmetry import lower_programs
from torchweave.sim.hardware.cluster import Cluster
from torchweave.lower.buckets import BUCKET_BYTES
from torchweave.sim.hardware.compute import ComputeModel
from torchweave.sim.simulate import simulate
from torchweave.sim.step.build import Builder
from torchweave.sim.step.engine import COMM


@dataclass
class OpRow:
    node: str
    op: str
    partition: str
    devices: str
    comm: list[str]
    comm_time: float
    time: float
    memory: int
    stage: int | None = None
    """Pipelined plans: the node's stage."""


@dataclass
class Explained:
    result: SimResult
    rows: list[OpRow]
    collectives: dict[str, float]
    """Collective event name → seconds (max over ranks)."""


def _devices(devs: list[int]) -> str:
    if not devs:
        return "-"
    uniq = sorted(set(devs))
    if uniq == list(range(uniq[0], uniq[-1] + 1)) and len(uniq) > 2:
        text = f"{uniq[0]}-{uniq[-1]}"
    else:
        text = ",".join(map(str, uniq))
    return text if len(uniq) == len(devs) else f"{text} (x{len(devs) // len(uniq)})"


def explain_plan(graph: Graph, plan: Plan, cluster: Cluster, *, dtype: torch.dtype | None = None,
                 grad_accum: int = 1) -> Explained:
    """Per-op partition, devices, communication, time and memory of one plan on ``cluster``
    (``graph`` is one micro-batch's, ``grad_accum`` of them a step)."""
    if plan.world_size > cluster.size:  # before lowering: the plan must fit the cluster
        raise TorchweaveError(Problem(
            obj=f"plan {plan.name!r} world_size", value=str(plan.world_size),
            rule=f"a plan must fit the cluster: {cluster} has {cluster.size} devices",
            fix=f"use a cluster of at least {plan.world_size} devices, or a plan for {cluster.size}"))
    # One data-parallel replica lowered for all when the plan allows (sim/fast/symmetry.py);
    # the communication each node gets is the same on every replica.
    programs, _ = lower_programs(graph, plan, None)  # a pipeline's are never lifted (pp outermost)
    result = simulate(graph, plan, cluster, dtype=dtype, grad_accum=grad_accum)
    model = ComputeModel.for_device(cluster.device)
    builder = Builder(graph, plan, cluster, dtype, model, BUCKET_BYTES)
    costs = builder.costs
    # Collective time per event name: sum on each rank, max over ranks.
    if plan.pipeline is not None:  # its timeline has stage actions, not their collectives
        per_rank = _pipeline_collectives(programs, plan, builder)
    else:
        per_rank = defaultdict(float)
        for e in result.timeline:
            if e.stream == "comm":
                per_rank[(e.rank, e.name)] += e.end - e.start
    coll: dict[str, float] = {}
    for (_, name), t in per_rank.items():
        coll[name] = max(coll.get(name, 0.0), t)
    inserted: dict[str, dict[str, None]] = defaultdict(dict)  # consumer → names, ordered
    for prog in programs:
        for c in prog.comms():
            if c.consumer:
                inserted[c.consumer][f"{steps.name_of(c.step)} {c.value}"] = None
    stand_in = _folded_values(graph, plan, result)

    def seconds(name: str) -> float:
        """A collective's time; in a folded model, blocks past the 4th read block 3's."""
        kind, _, value = name.partition(" ")
        alt = f"{kind} {stand_in.get(value, value)}"
        return coll.get(name, coll.get(alt, 0.0)) + coll.get(name + " bwd", coll.get(alt + " bwd", 0.0))

    rows = []
    for node in graph.nodes:
        cost = costs[node.name]
        names = list(inserted.get(node.name, {}))
        rows.append(OpRow(
            node=node.name, op=node.target.rsplit(".", 1)[0].removeprefix("aten."),
            partition=" ".join(map(str, plan.transforms(node.name))) or "whole",
            devices=_devices(plan.assignment.get(node.name, [])),
            comm=names,
            comm_time=sum(seconds(n) for n in names),
            time=cost.fwd + cost.bwd, memory=sum(cost.out_bytes),
            stage=plan.pipeline.stage_of.get(node.name) if plan.pipeline else None))
    return Explained(result, rows, coll)


def _pipeline_collectives(programs: list, plan: Plan, builder: Builder) -> dict[tuple[int, str], float]:
    """A pipelined plan's collectives, per rank and name, from the tasks its simulation costs
    each stage by (:mod:`torchweave.sim.step.pipelined`): one rank of each set of stages
    (the ranks of a stage's group run the same collectives), the step's micro-batches
    together."""
    assert plan.pipeline is not None
    seen: set[int | None] = set()
    out: dict[tuple[int, str], float] = defaultdict(float)
    for prog in programs:
        held = plan.pipeline.rank_of_device(prog.rank)  # the same stages: the same collectives
        if held in seen:
            continue
        seen.add(held)
        tasks, _ = builder.tasks(prog)
        for t in tasks:
            if t.kind == COMM and not t.crossing:
                out[(prog.rank, t.name)] += t.dur
    return out


def _folded_values(graph: Graph, plan: Plan, result: SimResult) -> dict[str, str]:
    """When the simulation folded the model's blocks (sim/fast/fold.py): each value made in
    a block past the 4th → the same value of block 3, the last one simulated."""
    if not result.folded_blocks:
        return {}
    from torchweave.sim.fast.fold import find_blocks, made_in

    blocks = find_blocks(graph, plan)
    if blocks is None or len(blocks) < 5:
        return {}
    start = blocks.spans[3][0]
    return {v: graph.nodes[start + q].outputs[j]
            for v, (b, q, j) in made_in(blocks, graph).items() if b >= 4}


__all__ = ["Explained", "OpRow", "explain_plan"]
