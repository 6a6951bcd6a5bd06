"""Co-shard: split a chain of ops ``k`` ways on the one device that runs it.

Built from the primitives only: op-trans (each node split ``k`` ways along the
dimension that carries the first node's split through the chain), op-assign
(every piece on the device that ran the whole node). Lowering runs the pieces
one after another and recomputes each in backward (see
:mod:`torchweave.lower.coshard`), so only one piece's activations exist at
a time.
"""

from __future__ import annotations

from torchweave.errors import Problem, TorchweaveError
from torchweave.ir.graph import Graph
from torchweave.ops import info
from torchweave.plan.plan import Plan


def with_coshard(plan: Plan, graph: Graph, nodes: list[str], k: int, dim: str) -> Plan:
    """Co-shard ``nodes`` (consecutive in the graph) ``k`` ways; the first along ``dim``."""
    problems = []
    split_axis: dict[str, int] = {}  # value made in the chain → its split tensor axis
    for i, name in enumerate(nodes):
        node = graph.node(name)
        bound = info(graph, node).bound
        devices = plan.assignment.get(name, [])
        if plan.num_pieces(name) != 1 or len(devices) != 1:
            problems.append(Problem(obj=f"node {name}", value=f"{plan.num_pieces(name)} pieces",
                                    rule="co-shard splits a node that runs whole on one device"))
            continue
        if i == 0:
            d = dim
        else:
            d = None
            for ref, spec in zip(node.input_refs(), bound.annotation.inputs):
                axis = split_axis.get(ref.name)
                if axis is not None and not spec.opaque and spec.axes[axis].dims:
                    d = spec.axes[axis].dims[0].name
                    break
        if d is None or d not in bound.splittable() or bound.sizes[d] % k:
            problems.append(Problem(obj=f"node {name}", value=f"split {d!r} into {k}",
                                    rule=f"'{bound}' splits that dimension evenly"))
            continue
        out = bound.annotation.outputs[0] if bound.annotation.outputs else None
        if out is not None and not out.opaque:
            for axis, ax in enumerate(out.axes):
                if ax.dims and ax.dims[0].name == d:
                    split_axis[node.outputs[0]] = axis
        plan.split(name, d, k).assign_all(name, devices * k)
    if problems:
        raise TorchweaveError(problems, header=f"cannot co-shard {nodes} {k} ways")
    plan.notes["coshard"] = f"{','.join(nodes)} x{k}"
    return plan
