"""A random legal plan from the primitive space, seeded: for testing equivalence."""

from __future__ import annotations

import random as _random

from torchweave.ir.graph import Graph
from torchweave.plan.layout import Mesh
from torchweave.plan.plan import Plan
from torchweave.plan.propagate import Context, propagate


def _factorizations(n: int) -> list[list[int]]:
    out = [[n]]
    for a in range(2, n):
        if n % a == 0:
            out += [[a] + rest for rest in _factorizations(n // a)]
    return out


def random_plan(graph: Graph, world_size: int, *, seed: int = 0, permute: float = 0.3) -> Plan:
    """Random mesh, a random legal split (or replication) of every node on every
    mesh axis, and with probability ``permute`` a random device order."""
    rng = _random.Random(seed)
    sizes = rng.choice(_factorizations(world_size)) if world_size > 1 else [1]
    mesh = Mesh(tuple((f"m{i}", n) for i, n in enumerate(sizes)))

    def rule(ctx: Context):
        options = [None] + [d for d in ctx.op.bound.splittable() if ctx.can_split(d)]
        return rng.choice(options)

    plan = propagate(graph, mesh, rule=rule, name=f"random{seed}")
    if rng.random() < permute:
        perm = list(range(world_size))
        rng.shuffle(perm)
        for node in plan.assignment:
            plan.assignment[node] = [perm[d] for d in plan.assignment[node]]
        plan.notes["permutation"] = str(perm)
    plan.notes["policy"] = f"random(seed={seed})"
    return plan
