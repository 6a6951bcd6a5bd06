"""Constraint-guided plan search: ``plan="auto"`` (docs/search.md).

- :mod:`~torchweave.search.constraints`: what the search may do, in Python or YAML; presets;
- :mod:`~torchweave.search.space`: the points a constraint set leaves;
- :mod:`~torchweave.search.intra`: each op's split within a stage, by an ILP (``split=solved``);
- :mod:`~torchweave.search.estimate`: the search's own cost model;
- :mod:`~torchweave.search.search`: estimate every point, simulate the best, rank.

:func:`resolve` is :func:`torchweave.policies.resolve` that also takes ``auto``,
``auto:preset=NAME`` and plan strings with ``split=solved``.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import torch

from torchweave.ir.graph import Graph
from torchweave.plan.plan import Plan
from torchweave.policies import PlanLike
from torchweave.policies import resolve as resolve_policy
from torchweave.policies.spec import is_auto, needs_search
from torchweave.search.constraints import Constraints, Degrees, OpRule
from torchweave.search.constraints_file import load_constraints, preset, preset_names
from torchweave.search.intra import Partition, solve, tp_dims
from torchweave.search.search import Ranked, SearchResult, search
from torchweave.sim.hardware.cluster import Cluster, cluster_of
from torchweave.sim.hardware.devices import DEFAULT_GPU, Device, gpu_entry, lookup


def local_device() -> Device:
    """This machine's device: its first GPU's catalog entry (by the name torch reports; a GPU
    the catalog lacks is priced as an H100 with its own memory, with a warning saying how to
    describe it), else the CPU entry with this machine's core count."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        total = torch.cuda.get_device_properties(0).total_memory
        entry = gpu_entry(name, total)
        if entry is None:
            warnings.warn(f"GPU {name!r} is not in the device catalog: plans are priced as on "
                          f"{DEFAULT_GPU}, with this GPU's memory. Give its figures in a cluster "
                          "YAML (--cluster) for predictions of this GPU", stacklevel=2)
            entry = DEFAULT_GPU
        dev = lookup(entry)  # never more memory than the GPU has (a catalog entry's may be more)
        return dataclasses.replace(dev, memory_bytes=min(dev.memory_bytes, total))
    dev = lookup("CPU-2core")
    return dataclasses.replace(dev, cores=os.cpu_count() or dev.cores)


def local_cluster(world_size: int) -> Cluster:
    """This machine as ``world_size`` ranks of :func:`local_device`."""
    return cluster_of(local_device(), world_size, world_size)


def resolve(plan: PlanLike, graph: Graph, world_size: int, *, cluster: Cluster | None = None,
            constraints: Constraints | str | None = None, like: Plan | None = None) -> Plan:
    """A Plan from anything :func:`torchweave.policies.resolve` takes, or ``auto``
    (``auto:preset=megatron``): the search's best plan on ``cluster`` (default: this
    machine as ``world_size`` ranks); or a plan string with ``split=solved``, its ops'
    splits solved for ``cluster`` (or taken from ``like``, the same plan on another
    capture of the model: a pipeline's micro-batch)."""
    if not needs_search(plan):
        return resolve_policy(plan, graph, world_size)
    from torchweave.policies.spec import PlanSpec

    spec = PlanSpec.parse(plan)
    if spec.policy != "auto":
        if like is not None:
            dims = tp_dims(like, graph)
        else:
            tp = spec.options.get("tp", 1)
            rules = (constraints if isinstance(constraints, Constraints) else
                     preset(constraints) if constraints else Constraints()).ops
            part = solve(graph, cluster or local_cluster(world_size), tp=tp, world=world_size,
                         rules=rules)
            dims = part.dims
        built = spec.build(graph, world_size, dims=dims)
        built.notes["spec"] = spec.text
        return built
    chosen = constraints or spec.options.get("preset") or "free"
    every = spec.options.get("exhaustive", False)
    result = search(graph, cluster or local_cluster(world_size), chosen, world_size=world_size,
                    top=1, exhaustive=every)
    best = result.best.plan
    best.notes["search"] = (f"auto ({result.constraints.name}{', exhaustive' if every else ''}): "
                            f"best of {len(result.ranked)} simulated among {result.considered} "
                            f"points on {result.cluster}")
    return best


__all__ = ["Constraints", "Degrees", "OpRule", "Partition", "Ranked", "SearchResult", "is_auto", "load_constraints",
           "local_cluster", "local_device", "needs_search", "preset", "preset_names", "resolve", "search", "solve"]
