"""Megatron-style tensor parallelism (and sequence parallelism) as split rules.

Only four decisions are made by hand; propagation makes the rest:

- a linear layer whose input is sharded on its contraction dim is row-parallel
  (split ``k``: partial outputs, summed where a later op needs them whole);
- any other linear layer is column-parallel (split ``n``), so attention heads
  and MLP hidden units shard, and the ops between follow;
- an embedding of the model's input tokens is vocabulary-parallel (split ``v``);
- a mixture's experts op (``torchweave.moe_experts``: transformers' experts) splits its
  experts (``e``): each device computes the routed pairs of its share of them, and the
  partial outputs are summed as a row-parallel layer's are.

``sp`` adds one rule: an op that would run replicated over the tensor-parallel
group and has a sequence axis (axis 1 of a ``[batch, seq, …]`` output) is split
along it instead, so norms, dropout and residual adds hold 1/tp of the
sequence; lowering then uses all-gather and reduce-scatter at the boundaries.
"""

from __future__ import annotations

from torchweave.errors import Problem, TorchweaveError
from torchweave.ir.graph import Graph
from torchweave.plan.layout import Mesh
from torchweave.plan.plan import Plan
from torchweave.plan.propagate import DEFAULT, Context, follow_inputs, propagate
from torchweave.policies.data import batch_inputs


def megatron(ctx: Context):
    if ctx.axis != "tp":
        return DEFAULT
    if ctx.node.target in ("aten.linear.default", "aten.mm.default") and _weight(ctx):
        x = ctx.inputs[0]
        if x[0] == "S" and ctx.lead_dim(0, x[1]) == "k" and ctx.can_split("k"):
            return "k"
        return "n" if ctx.can_split("n") else None
    if ctx.node.target == "aten.embedding.default" and ctx.can_split("v") and _reads_tokens(ctx):
        return "v"
    if ctx.node.target == "torchweave.moe_experts.default" and ctx.can_split("e"):
        return "e"
    return DEFAULT


def _weight(ctx: Context) -> bool:
    """A layer: its second input is a parameter."""
    refs = ctx.node.input_refs()
    return len(refs) > 1 and ctx.graph.values[refs[1].name].kind == "param"


def _reads_tokens(ctx: Context) -> bool:
    """Token embeddings read a model input; position tables read computed indices."""
    refs = ctx.node.input_refs()
    return len(refs) > 1 and ctx.graph.values[refs[1].name].kind == "input"


def sequence(ctx: Context):
    choice = megatron(ctx)
    if ctx.axis != "tp" or choice is not DEFAULT:
        return choice
    dim = follow_inputs(ctx)
    if dim is not None:
        return dim
    outs = ctx.graph.output_metas(ctx.node)
    spec = ctx.op.bound.annotation.outputs[0] if ctx.op.bound.annotation.outputs else None
    if ctx.node.outputs and ctx.node.outputs[0] not in _batched(ctx.graph):
        return None  # parameters alone (a [T, T, heads] bias table lookup): no sequence axis
    if outs and spec is not None and not spec.opaque and len(outs[0].shape) >= 3:
        axis = spec.axes[1]
        if axis.dims and ctx.can_split(axis.dims[0].name):
            return axis.dims[0].name
    return None


def _batched(graph: Graph) -> frozenset[str]:
    """``graph.batched_values()``, kept on the graph (as its ``_``-named caches are: not
    pickled) for the rule's calls on each node; made again if the nodes change."""
    key = (id(graph.nodes), len(graph.nodes))
    got = graph.__dict__.get("_batched")
    if got is None or got[0] != key:
        got = graph.__dict__["_batched"] = (key, graph.batched_values())
    return got[1]


def _mesh(world_size: int, tp_size: int | None) -> Mesh:
    tp_size = tp_size or world_size
    if world_size % tp_size:
        raise TorchweaveError(Problem(
            obj="tp policy", value=f"tp={tp_size}",
            rule=f"tp divides the world: {world_size} % {tp_size} != 0"))
    return Mesh.of(dp=world_size // tp_size, tp=tp_size)


def given(dims: dict[str, str | None]):
    """A rule that splits each node on ``tp`` along ``dims[node]`` (None: whole): a partition
    decided elsewhere (the search's solver, :mod:`torchweave.search.intra`)."""

    def rule(ctx: Context):
        return dims.get(ctx.node.name) if ctx.axis == "tp" else DEFAULT

    return rule


def tp(graph: Graph, world_size: int, *, tp_size: int | None = None,
       dims: dict[str, str | None] | None = None) -> Plan:
    """Megatron tensor parallelism over ``tp_size`` devices (default: all), data parallel
    over the rest; with ``dims``, each node split on ``tp`` as ``dims`` says instead."""
    mesh = _mesh(world_size, tp_size)
    plan = propagate(graph, mesh, inputs=batch_inputs(graph, "dp", mesh.dim("dp")),
                     rule=megatron if dims is None else given(dims),
                     name="tp" if dims is None else "tp-solved", pull=dims is None)
    plan.notes["policy"] = f"tp(tp_size={mesh.dim('tp')}{'' if dims is None else ', solved'})"
    return plan


def sp(graph: Graph, world_size: int, *, tp_size: int | None = None) -> Plan:
    """Tensor parallelism plus sequence parallelism in norms, dropout and residuals."""
    mesh = _mesh(world_size, tp_size)
    plan = propagate(graph, mesh, inputs=batch_inputs(graph, "dp", mesh.dim("dp")),
                     rule=sequence, name="sp", pull=True)
    plan.notes["policy"] = f"sp(tp_size={mesh.dim('tp')})"
    return plan
