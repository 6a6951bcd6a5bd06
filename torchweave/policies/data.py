"""Data parallelism and ZeRO: split every input's batch and follow it through."""

from __future__ import annotations

from torchweave.errors import Problem, TorchweaveError
from torchweave.ir.graph import Graph
from torchweave.plan.layout import Mesh
from torchweave.plan.plan import Plan
from torchweave.plan.propagate import propagate


def batch_inputs(graph: Graph, axis: str, parts: int) -> dict[str, dict[str, int]]:
    """Every user input split along its dim 0 over mesh ``axis``."""
    out = {}
    problems = []
    for name in graph.inputs:
        v = graph.values[name]
        if not v.meta.shape:
            continue
        if v.meta.shape[0] % parts:
            problems.append(Problem(
                obj=f"input {v.target}", value=f"batch {v.meta.shape[0]}",
                rule=f"the batch divides over {axis}: {v.meta.shape[0]} % {parts} != 0",
                fix=f"use a batch that is a multiple of {parts}",
            ))
        out[v.target] = {axis: 0}
    if problems:
        raise TorchweaveError(problems)
    return out


def dp(graph: Graph, world_size: int, *, zero: int = 0) -> Plan:
    """Data parallel: the batch split over all devices; parameters replicated."""
    mesh = Mesh.of(dp=world_size)
    plan = propagate(graph, mesh, inputs=batch_inputs(graph, "dp", world_size),
                     name=f"zero{zero}" if zero else "dp")
    plan.zero, plan.zero_axis = zero, ("dp" if zero else None)
    plan.notes["policy"] = plan.name
    return plan


def zero1(graph: Graph, world_size: int) -> Plan:
    """Data parallel with optimizer state sharded (ZeRO stage 1)."""
    return dp(graph, world_size, zero=1)


def zero2(graph: Graph, world_size: int) -> Plan:
    """Data parallel with optimizer state and gradients sharded (ZeRO stage 2)."""
    return dp(graph, world_size, zero=2)


def zero3(graph: Graph, world_size: int) -> Plan:
    """Data parallel with parameters, gradients and optimizer state sharded (ZeRO-3)."""
    return dp(graph, world_size, zero=3)
