"""``plan: auto`` in a train config: the search's best plan for the config's batch sizes on this machine.

:func:`search_plan` runs :func:`torchweave.search.search` with the data-parallel
degree the config's batch sizes give (``global_batch / (micro_batch · grad_accum)``)
and, with gradient accumulation, no pipelines (a pipeline takes its
micro-batches from the plan). :func:`choose_plan` is the older, narrower choice
among ``dp`` and ZeRO 1–3, kept for callers that want only those.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchweave.api import capture
from torchweave.ir.graph import Graph
from torchweave.search import local_device, resolve
from torchweave.sim.hardware.cluster import cluster_of
from torchweave.sim.hardware.devices import lookup
from torchweave.sim.simulate import simulate

CANDIDATES = ("dp", "zero1", "zero2", "zero3")
"""Policies ``auto`` chooses from: they share the batch arithmetic (dp = world size),
so the config's batch sizes hold whichever is chosen."""


@dataclass(frozen=True)
class Choice:
    plan: str
    predicted_s: dict[str, float]
    """Predicted step time of every candidate that fits, in seconds."""
    reason: str
    cluster: str = ""
    """The cluster the candidates were simulated on (``4xCPU-2core@4``)."""


def choose_plan(graph: Graph, world_size: int, *, device: str | None = None) -> Choice:
    """Simulate every candidate on ``world_size`` ranks of ``device`` (this machine by default)."""
    dev = lookup(device) if device else local_device()  # this machine's GPU, or its cores
    cluster = cluster_of(dev, world_size, world_size)
    times: dict[str, float] = {}
    oom: list[str] = []
    for name in CANDIDATES:
        result = simulate(graph, resolve(name, graph, world_size), cluster, timeline=False)
        if result.oom:
            oom.append(name)
        else:
            times[name] = result.step_time
    if not times:
        return Choice("zero3", {}, f"every candidate is predicted out of memory on {cluster}; "
                                   "zero3 shards the most", str(cluster))
    best = min(times, key=times.__getitem__)
    ranked = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in sorted(times.items(), key=lambda kv: kv[1]))
    why = f"fastest predicted on {cluster}: {ranked}"
    if oom:
        why += f" (out of memory: {', '.join(oom)})"
    return Choice(best, times, why, str(cluster))


def search_plan(graph: Graph, plan: str, parallel) -> Choice:
    """``plan`` (``auto``, ``auto:preset=NAME,exhaustive=1``) searched for ``parallel`` (a
    ``ParallelConfig``) on this machine as ``parallel.world_size`` ranks."""
    from torchweave.policies.spec import PlanSpec
    from torchweave.search import Degrees, local_cluster, preset, search

    spec = PlanSpec.parse(plan)
    c = preset(spec.options.get("preset", "free"))
    c = c.with_(dp=Degrees(only=(parallel.dp,)),
                schedules=("none",) if parallel.grad_accum > 1 else c.schedules)
    cluster = local_cluster(parallel.world_size)
    result = search(graph, cluster, c, world_size=parallel.world_size, top=5,
                    exhaustive=spec.options.get("exhaustive", False))
    ranked = ", ".join(f"{r.spec} {r.result.step_time * 1e3:.1f} ms" for r in result.ranked)
    why = (f"fastest predicted on {cluster} in {c.name} with dp={parallel.dp}: {ranked}")
    return Choice(result.best.spec, {r.spec: r.result.step_time for r in result.ranked}, why,
                  str(cluster))


def auto_plan(model: torch.nn.Module, example: tuple[torch.Tensor, ...], world_size: int) -> Choice:
    return choose_plan(capture(model, example), world_size)


__all__ = ["CANDIDATES", "Choice", "auto_plan", "choose_plan", "search_plan"]
