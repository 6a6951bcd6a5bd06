"""Constraint-guided plan search: ``plan="auto"`` (docs/search.md).

- :mod:`~torchweave.search.constraints`: what the search may do, in Python or YAML; presets;
- :mod:`~torchweave.search.space`: the points a constraint set leaves;
- :mod:`~torchweave.search.estimate`: the search's own cost model;
- :mod:`~torchweave.search.search`: estimate every point, simulate the best, rank.

:func:`resolve` is :func:`torchweave.policies.resolve` that also takes ``auto`` and
``auto:preset=NAME``.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from torchweave.ir.graph import Graph
from torchweave.plan.plan import Plan
from torchweave.policies import PlanLike
from torchweave.policies import resolve as resolve_policy
from torchweave.search.constraints import Constraints, Degrees, OpRule, load_constraints, preset, preset_names
from torchweave.search.search import Ranked, SearchResult, search
from torchweave.sim.cluster import Cluster, cluster_of
from torchweave.sim.devices import lookup


def is_auto(plan: object) -> bool:
    return isinstance(plan, str) and (plan.strip() == "auto" or plan.strip().startswith("auto:"))


def local_cluster(world_size: int) -> Cluster:
    """This machine as ``world_size`` ranks: its GPU model if it has one, else its CPU cores."""
    dev = lookup("H100-80GB-SXM" if torch.cuda.is_available() else "CPU-2core")
    if dev.cores is not None:
        dev = dataclasses.replace(dev, cores=os.cpu_count() or dev.cores)
    return cluster_of(dev, world_size, world_size)


def resolve(plan: PlanLike, graph: Graph, world_size: int, *, cluster: Cluster | None = None,
            constraints: Constraints | str | None = None) -> Plan:
    """A Plan from anything :func:`torchweave.policies.resolve` takes, or ``auto``
    (``auto:preset=megatron``): the search's best plan on ``cluster`` (default: this
    machine as ``world_size`` ranks)."""
    if not is_auto(plan):
        return resolve_policy(plan, graph, world_size)
    from torchweave.policies.spec import PlanSpec

    spec = PlanSpec.parse(plan)
    chosen = constraints or spec.options.get("preset") or "free"
    result = search(graph, cluster or local_cluster(world_size), chosen, world_size=world_size,
                    top=1)
    best = result.best.plan
    best.notes["search"] = (f"auto ({result.constraints.name}): best of {len(result.ranked)} "
                            f"simulated among {result.considered} points on {result.cluster}")
    return best


__all__ = ["Constraints", "Degrees", "OpRule", "Ranked", "SearchResult", "is_auto", "load_constraints",
           "local_cluster", "preset", "preset_names", "resolve", "search"]
