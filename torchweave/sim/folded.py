"""One step of a model with ``L`` identical blocks, from simulations of 3 and 4 (:mod:`torchweave.sim.fold`)."""

from __future__ import annotations

from dataclasses import fields

from torchweave.ir.graph import Graph
from torchweave.plan.plan import Plan
from torchweave.sim.cluster import Cluster
from torchweave.sim.cost import ComputeModel
from torchweave.sim.fold import Blocks, cut, extrapolate
from torchweave.sim.simulate import MemoryUse, SimResult, assemble, simulate


def simulate_folded(graph: Graph, plan: Plan, cluster: Cluster, blocks: Blocks, *, dtype,
                    tokens_per_step: int | None, model: ComputeModel | None, bucket_bytes: int,
                    strict: bool, timeline: bool, symmetry: bool | None,
                    profiles=None, grad_accum: int = 1) -> SimResult:
    n = len(blocks)
    runs = []
    for k in (3, 4):
        g, p = cut(graph, plan, blocks, k)
        runs.append(simulate(g, p, cluster, dtype=dtype, tokens_per_step=tokens_per_step,
                             model=model, bucket_bytes=bucket_bytes, timeline=timeline and k == 4,
                             symmetry=symmetry, fold=False, profiles=profiles,
                             grad_accum=grad_accum))
    two, three = runs  # 3 and 4 blocks

    def ex(a: float, b: float) -> float:
        return max(0.0, extrapolate(a, b, n))

    def temporaries(a: int, b: int) -> int:
        """The largest bucket grows with the blocks until it holds ``bucket_bytes`` (plus
        one block's worth at most); twice the largest activation does not grow."""
        return round(min(ex(a, b), max(b, bucket_bytes + max(0, b - a))))

    memory = tuple(
        MemoryUse(**{f.name: (temporaries(getattr(a, f.name), getattr(b, f.name))
                              if f.name == "temporaries"
                              else round(ex(getattr(a, f.name), getattr(b, f.name))))
                     for f in fields(MemoryUse)})
        for a, b in zip(two.memory, three.memory))
    notes = (f"{n} identical '{blocks.prefix}' blocks: simulated with 3 and 4, extrapolated "
             f"(timeline: 4 blocks)",) + three.notes
    return assemble(
        plan, cluster, step=ex(two.step_time, three.step_time),
        compute=tuple(ex(a, b) for a, b in zip(two.compute_time, three.compute_time)),
        comm=tuple(ex(a, b) for a, b in zip(two.comm_time, three.comm_time)),
        memory=memory, flops=ex(two.model_flops, three.model_flops), tokens=three.tokens_per_step,
        dtype=dtype, model=model or ComputeModel.for_device(cluster.device), strict=strict,
        events=three.timeline, notes=notes, replicas=three.replicas, folded_blocks=n)


__all__ = ["simulate_folded"]
