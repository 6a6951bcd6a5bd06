"""``plan: auto``: the data-parallel policy the simulator predicts fastest, among those that fit."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from torchweave.api import capture
from torchweave.ir.graph import Graph
from torchweave.policies import resolve
from torchweave.sim.cluster import cluster_of
from torchweave.sim.devices import lookup
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
    dev = lookup(device or ("H100-80GB-SXM" if torch.cuda.is_available() else "CPU-2core"))
    if device is None and dev.cores is not None:
        dev = dataclasses.replace(dev, cores=os.cpu_count() or dev.cores)  # this machine's cores
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


def auto_plan(model: torch.nn.Module, example: tuple[torch.Tensor, ...], world_size: int) -> Choice:
    return choose_plan(capture(model, example), world_size)


__all__ = ["CANDIDATES", "Choice", "auto_plan", "choose_plan"]
