"""Which ops of a model force replication, and what that costs under each policy.

An op with no annotation (or one whose annotation no split reaches) runs whole on
every device it is on. Under data parallelism that means its inputs, split by
batch upstream, are all-gathered onto every rank first, and its work is repeated
on each. ``torchweave inspect MODEL --coverage`` lists such ops, grouped by op
kind, with what they cost under each policy: FLOPs repeated (the work beyond one
copy, summed over devices) and bytes gathered (the whole of each input that
arrives split, less the piece a device already holds, summed over devices).

:func:`registry_markdown` is the table of every annotated op that
``docs/coverage.md`` publishes (a test keeps the file equal to it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torchweave.ir.graph import Graph
from torchweave.ops import BUILT_IN, REGISTRY, info
from torchweave.plan.plan import Plan

POLICIES = ("dp", "tp", "sp")
"""The policies the coverage table prices (zero1–3 lay out activations as dp does)."""


@dataclass
class Cost:
    """One op kind under one policy."""

    nodes: int = 0
    """Nodes of this kind that run replicated."""
    flops_repeated: float = 0.0
    bytes_gathered: float = 0.0


@dataclass
class Row:
    op: str
    annotated: bool
    """Whether the registry annotates the op (False: it can only run whole)."""
    example: str
    """One node's source location."""
    nodes: int = 0
    costs: dict[str, Cost] = field(default_factory=dict)


def _replicas(plan: Plan, node: str) -> int:
    return math.prod(t.parts for t in plan.transforms(node) if t.dim is None)


def _splits(plan: Plan, node: str) -> int:
    return math.prod(t.parts for t in plan.transforms(node) if t.dim is not None)


def coverage(graph: Graph, world_size: int = 2, policies: tuple[str, ...] = POLICIES) -> list[Row]:
    """Op kinds that run replicated under at least one policy, or have no annotation."""
    from torchweave.policies import resolve

    plans = {}
    for name in policies:
        try:
            plans[name] = resolve(name, graph, world_size)
        except Exception:  # noqa: BLE001 - a policy this model cannot take is left out
            continue
    producer = {out: n for n in graph.nodes for out in n.outputs}
    rows: dict[str, Row] = {}
    for node in graph.nodes:
        op = node.target.rsplit(".", 1)[0] if node.target.count(".") > 1 else node.target
        annotated = REGISTRY.lookup(node.target) is not None
        inf = info(graph, node)
        for name, plan in plans.items():
            r = _replicas(plan, node.name)
            if r <= 1:
                continue
            row = rows.setdefault(op, Row(op, annotated, node.source or node.name))
            cost = row.costs.setdefault(name, Cost())
            cost.nodes += 1
            cost.flops_repeated += inf.flops / max(_splits(plan, node.name), 1) * (r - 1)
            if _splits(plan, node.name) == 1:  # whole: split inputs are gathered onto each device
                for ref in node.input_refs():
                    src = producer.get(ref.name)
                    parts = _splits(plan, src.name) if src is not None else 1
                    if parts > 1:
                        nbytes = graph.values[ref.name].meta.nbytes
                        cost.bytes_gathered += nbytes * (parts - 1) / parts * r
        if not annotated:
            rows.setdefault(op, Row(op, False, node.source or node.name))
    for row in rows.values():
        row.nodes = sum(1 for n in graph.nodes if n.target.startswith(row.op))
    return sorted(rows.values(), key=lambda r: (-max((c.flops_repeated for c in r.costs.values()),
                                                     default=0.0), r.op))


def registry_markdown() -> str:
    """The ops torchweave annotates (not a user's own), as the table of ``docs/coverage.md``."""
    lines = ["| op | annotation, or the rule that writes it from the call's arguments | "
             "backward FLOPs / forward |", "|---|---|---|"]
    for name in sorted(BUILT_IN):
        spec = BUILT_IN[name]
        ann = (f"`{spec.annotation}`" if isinstance(spec.annotation, str) else
               f"rule `{getattr(spec.annotation, '__name__', type(spec.annotation).__name__)}`")
        lines.append(f"| `{name}` | {ann} | {spec.bwd_factor:g} |")
    return "\n".join(lines) + "\n"
