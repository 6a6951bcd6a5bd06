"""Build a plan over a device mesh by propagating splits through the graph.

For each mesh axis on its own, every tensor is sharded along one of its axes,
replicated, or a partial sum. A node is split along the dimension that its
sharded inputs already agree on (so no communication is needed), unless a
*rule* decides otherwise; with no sharded input it is replicated. The result
is an ordinary :class:`Plan`: op-trans per node and mesh axis, and op-assign of
each piece to the mesh coordinate it came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torchweave.ir.graph import Graph, Node
from torchweave.ops import OpInfo, info
from torchweave.plan.layout import Mesh
from torchweave.plan.plan import Plan

Placement = tuple  # ("S", axis) | ("R",) | ("P",)
R: Placement = ("R",)
P: Placement = ("P",)


@dataclass(frozen=True)
class Context:
    """What a rule sees for one node on one mesh axis."""

    graph: Graph
    node: Node
    op: OpInfo
    axis: str
    parts: int
    inputs: list[Placement]
    """Placement of each tensor input on this mesh axis."""
    taken: dict[str, int]
    """Dim → parts already split by earlier mesh axes."""

    def can_split(self, dim: str) -> bool:
        b = self.op.bound
        return (dim in b.splittable()
                and b.sizes[dim] % (self.taken.get(dim, 1) * self.parts) == 0)

    def lead_dim(self, tensor: int, axis: int) -> str | None:
        spec = self.op.bound.annotation.inputs[tensor]
        if spec.opaque or axis >= len(spec.axes) or not spec.axes[axis].dims:
            return None
        return spec.axes[axis].dims[0].name


Rule = Callable[[Context], "str | None | Default"]


class Default:
    """A rule's answer meaning "no opinion: follow the inputs"."""


DEFAULT = Default()


def follow_inputs(ctx: Context) -> str | None:
    """The dim that most sharded input bytes already agree on."""
    votes: dict[str, int] = {}
    metas = ctx.graph.input_metas(ctx.node)
    for k, place in enumerate(ctx.inputs):
        if place[0] == "S":
            dim = ctx.lead_dim(k, place[1])
            if dim is not None and ctx.can_split(dim):
                votes[dim] = votes.get(dim, 0) + metas[k].numel
    return max(votes, key=votes.get) if votes else None


def propagate(
    graph: Graph, mesh: Mesh, *, inputs: dict[str, dict[str, int]] | None = None,
    rule: Rule | None = None, name: str = "plan", pull: bool = False,
) -> Plan:
    """A plan from input shardings (``{input: {mesh_axis: tensor_axis}}``) and a rule.

    ``pull``: a value made from parameters and constants alone that every reader splits
    alike is made split the same way (:func:`_pull`)."""
    inputs = inputs or {}
    choice: dict[str, dict[str, str | None]] = {n.name: {} for n in graph.nodes}
    infos = {n.name: info(graph, n) for n in graph.nodes}
    for axis, parts in mesh.axes:
        if parts == 1:
            continue
        place: dict[str, Placement] = {}
        for v in graph.values.values():
            if v.kind == "input" and axis in inputs.get(v.target, {}):
                place[v.name] = ("S", inputs[v.target][axis])
            elif v.kind != "activation":
                place[v.name] = R
        for node in graph.nodes:
            op = infos[node.name]
            taken: dict[str, int] = {}
            for prev_axis, dim in choice[node.name].items():
                if dim:
                    taken[dim] = taken.get(dim, 1) * mesh.dim(prev_axis)
            ctx = Context(graph, node, op, axis, parts,
                          [place.get(r.name, R) for r in node.input_refs()], taken)
            dim = rule(ctx) if rule else DEFAULT
            if isinstance(dim, Default):
                dim = follow_inputs(ctx)
            if dim is not None and not ctx.can_split(dim):
                dim = None
            choice[node.name][axis] = dim
            for j, out in enumerate(node.outputs):
                if out:
                    place[out] = _output_placement(op, j, dim)
        if pull:
            _pull(graph, infos, choice, axis, parts)
    plan = Plan(world_size=mesh.size, name=name, mesh=mesh)
    everyone = list(range(mesh.size))  # one list for all nodes (Plan.assign copies before writing)
    for node in graph.nodes:
        for axis, parts in mesh.axes:
            if parts == 1:
                continue
            dim = choice[node.name][axis]
            if dim is None:
                plan.replicate(node.name, parts)
            else:
                plan.split(node.name, dim, parts)
        plan.assignment[node.name] = everyone
    return plan


def _pull(graph: Graph, infos: dict[str, OpInfo], choice: dict[str, dict[str, str | None]],
          axis: str, parts: int) -> None:
    """Splits on ``axis`` pulled back from readers into what parameters alone make.

    Propagation runs forward, so a value made from parameters and constants alone (T5's
    relative-position bias: a table looked up at fixed buckets, then permuted) has no split
    input to follow and is made whole on every device, even where each reader reads only
    its share of it (attention split by heads reads its heads of the bias). Each device
    then makes the whole value, and in backward the readers' shares of its gradient are
    summed over the group: a collective of the whole value per step (per micro-batch in a
    pipeline), where the parameters it comes from are tiny.

    Walking back from the last node, a replicated node whose inputs carry no batch and
    whose every reader is split on ``axis`` along the same tensor axis of its output is
    split there too, when its output has that axis as a dim it may split evenly. Its
    readers then read their share with no step, and the pull goes on to its own inputs.
    Nodes split on another mesh axis, and readers whose dim is split on another axis too,
    are left as they are."""
    batched = graph.batched_values()
    readers: dict[str, list[tuple[Node, int]]] = {}
    for node in graph.nodes:
        for k, ref in enumerate(node.input_refs()):
            readers.setdefault(ref.name, []).append((node, k))
    for node in reversed(graph.nodes):
        mine = choice[node.name]
        if mine.get(axis) is not None or any(d for a, d in mine.items() if a != axis) or \
                len(node.outputs) != 1 or not node.outputs[0] or node.outputs[0] in batched or \
                node.outputs[0] in graph.outputs:
            continue
        users = readers.get(node.outputs[0], [])
        axes = {_read_axis(infos[r.name], k, choice[r.name], axis) for r, k in users}
        if len(axes) != 1 or None in axes:
            continue
        (a,) = axes
        bound = infos[node.name].bound
        spec = bound.annotation.outputs[0] if bound.annotation.outputs else None
        if spec is None or spec.opaque or a >= len(spec.axes) or not spec.axes[a].dims:
            continue
        dim = spec.axes[a].dims[0].name
        if bound.dim(dim).kind != "reduce" and \
                Context(graph, node, infos[node.name], axis, parts, [], {}).can_split(dim):
            mine[axis] = dim


def _read_axis(op: OpInfo, k: int, chosen: dict[str, str | None], axis: str) -> int | None:
    """The axis of input ``k`` a reader split on ``axis`` reads a share of (None: it reads
    it whole, or its dim is split on another mesh axis too)."""
    dim = chosen.get(axis)
    if dim is None or any(d == dim for a, d in chosen.items() if a != axis):
        return None
    spec = op.bound.annotation.inputs[k]
    if spec.opaque:
        return None
    hits = [i for i, ax in enumerate(spec.axes) if ax.dims and ax.dims[0].name == dim]
    return hits[0] if len(hits) == 1 else None


def _output_placement(op: OpInfo, j: int, dim: str | None) -> Placement:
    if dim is None:
        return R
    spec = op.bound.annotation.outputs[j]
    if not spec.opaque:
        for a, ax in enumerate(spec.axes):
            if ax.dims and ax.dims[0].name == dim:
                return ("S", a)
    return P if op.bound.dim(dim).kind == "reduce" else R
