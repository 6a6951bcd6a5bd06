"""Expert parallelism as a split rule: experts split across devices, tokens split as in
data parallelism, and the communication between them derived by lowering.

The mesh is ``dp × ep``. Every op splits its batch over both axes, as under ``dp``,
except an op fed by an *expert parameter* (a parameter of rank 3 or more whose first
axis is a dim the op keeps and shares with its activation: ``w_in[e, d, f]`` in
``einsum("ecd,edf->ecf")``): on ``ep`` it splits along that expert dim, so each device
holds and runs ``E / ep`` experts, and on ``dp`` along its tokens' slots (``c``), so
the replicas of one expert share its work. Nothing else is decided by hand: where the tokens' layout
meets the experts' (the dispatch ``einsum("tec,td->ecd")`` sums over each device's own
tokens), lowering turns the partial sums into a reduce-scatter along the experts (with
``dp`` too, one within each ep group and one across dp, since each rank's block spans both
axes), and the combine gathers the experts' outputs back to each device's tokens (one
all-gather per axis). Expert
gradients are summed over ``dp`` only: each ``ep`` rank owns its experts.

transformers' experts sort the tokens by expert into groups whose row offsets come from a
histogram; traced op by op, their experts could not split (a split would cut the rows at
offsets known only at run time). Capture records each such experts module as one op,
``torchweave.moe_experts`` (:mod:`torchweave.ops.moe`), whose output is a sum over its
experts: on ``ep`` it splits the experts (each device computes only the pairs routed to
its own, dropless), on ``dp`` the tokens; lowering gathers the tokens within each ep group
and reduce-scatters the partial outputs back. A model with no expert op at all runs
``ep`` as data parallelism, and the plan's note says so.
"""

from __future__ import annotations

from torchweave.errors import Problem, TorchweaveError
from torchweave.ir.graph import Graph
from torchweave.ops import info
from torchweave.plan.layout import Mesh
from torchweave.plan.plan import Plan
from torchweave.plan.propagate import DEFAULT, Context, propagate
from torchweave.policies.data import batch_inputs
from torchweave.policies.tensor import megatron


def _lead_dims(graph: Graph, node, op, *, params: bool) -> list[tuple[object, list[str]]]:
    """(input, the lead name of each of its axes, None for a size-one axis) of each parameter
    input (``params``) or activation input, in order; opaque inputs left out."""
    spec = op.bound.annotation
    return [(ref, [a.dims[0].name if a.dims else None for a in spec.inputs[k].axes])
            for k, ref in enumerate(node.input_refs())
            if k < len(spec.inputs) and not spec.inputs[k].opaque
            and (graph.values[ref.name].kind == "param") == params]


def expert_axis(graph: Graph, node, op) -> str | None:
    """The dim of ``node`` that indexes the experts of one of its parameter inputs: the
    weight's first axis, either kept by the op and shared with its activation input, as in
    a batched matmul over experts (not a convolution's output channels), or summed over and
    absent from the activations, as in ``torchweave.moe_experts`` (the output is a sum over
    experts). Ops that compute only: a transposed view of the experts' weights is not one."""
    if op.flops <= 0:
        return None
    batched = {d for _, dims in _lead_dims(graph, node, op, params=False) for d in dims}
    for ref, dims in _lead_dims(graph, node, op, params=True):
        dim = dims[0] if dims and len(graph.values[ref.name].meta.shape) >= 3 else None
        if dim is None or dim not in op.bound.splittable():
            continue
        if (dim in batched) != (op.bound.dim(dim).kind == "reduce"):
            return dim  # experts kept beside their tokens' slots, or summed over (moe_experts)
    return None


def expert_dim(ctx: Context) -> str | None:
    """:func:`expert_axis` of the context's op, where this mesh axis can split it."""
    dim = expert_axis(ctx.graph, ctx.node, ctx.op)
    return dim if dim is not None and ctx.can_split(dim) else None


def expert_count(graph: Graph) -> int:
    """How many experts ``graph``'s expert ops index (0: no expert op)."""
    if not any(v.kind == "param" and len(v.meta.shape) >= 3 for v in graph.values.values()):
        return 0
    for node in graph.nodes:
        op = info(graph, node)
        dim = expert_axis(graph, node, op)
        if dim is not None:
            return op.bound.sizes[dim]
    return 0


def slot_dim(ctx: Context, expert: str) -> str | None:
    """A dim of the op's activation input that the op keeps, other than the experts': the
    expert's token slots (``c`` of ``ecd``), which ``dp`` splits among its replicas."""
    for _, dims in _lead_dims(ctx.graph, ctx.node, ctx.op, params=False):
        for dim in dims:
            if dim and dim != expert and ctx.op.bound.dim(dim).kind != "reduce" and ctx.can_split(dim):
                return dim
    return None


def expert_tp(ctx: Context, expert: str) -> str | None:
    """Megatron's choice inside an expert: the contraction when the activation arrives split
    on it (row-parallel: partial sums), else a dim the expert's weight adds (column-parallel:
    ``f`` of ``w_in[e, d, f]``)."""
    for k, ref in enumerate(ctx.node.input_refs()):
        place = ctx.inputs[k] if k < len(ctx.inputs) else ("R",)
        if ctx.graph.values[ref.name].kind != "param" and place[0] == "S":
            dim = ctx.lead_dim(k, place[1])
            if dim is not None and ctx.op.bound.dim(dim).kind == "reduce" and ctx.can_split(dim):
                return dim
    taken = {d for _, dims in _lead_dims(ctx.graph, ctx.node, ctx.op, params=False) for d in dims}
    for _, dims in _lead_dims(ctx.graph, ctx.node, ctx.op, params=True):
        for dim in dims:
            if dim and dim != expert and dim not in taken and ctx.can_split(dim) \
                    and ctx.op.bound.dim(dim).kind != "reduce":
                return dim
    return None


def _after_sum(ctx: Context):
    """An op fed by a partial sum and no split input (the experts' summed output, reshaped
    back to the batch's shape) splits along its output's first axis, as the batch is split,
    so that the sum arrives as a reduce-scatter rather than an all-reduce."""
    if any(p[0] == "S" for p in ctx.inputs) or not any(p[0] == "P" for p in ctx.inputs):
        return DEFAULT
    outs = ctx.op.bound.annotation.outputs
    axes = outs[0].axes if outs and not outs[0].opaque else ()
    dim = axes[0].dims[0].name if axes and axes[0].dims else None
    return dim if dim is not None and ctx.can_split(dim) else DEFAULT


def _experts(found: list[str]):
    def rule(ctx: Context):
        if ctx.axis == "tp":
            dim = expert_dim(ctx)
            if dim is not None and ctx.op.bound.dim(dim).kind == "reduce":
                return dim  # an experts op whose widths stay whole: its experts split on tp too
            return megatron(ctx) if dim is None else (expert_tp(ctx, dim) or DEFAULT)
        dim = expert_dim(ctx)
        if dim is None:
            return _after_sum(ctx)
        if ctx.axis == "ep":
            found.append(ctx.node.name)
            return dim
        return slot_dim(ctx, dim) or DEFAULT  # dp: each replica its share of the slots

    return rule


def ep(graph: Graph, world_size: int, *, ep_size: int | None = None, tp_size: int = 1,
       zero: int = 0) -> Plan:
    """Experts split over ``ep_size`` devices (default: all but ``tp``'s), the batch over
    ``dp × ep``; with ``tp_size`` > 1, Megatron's tensor parallelism inside each
    (:func:`~torchweave.policies.tensor.megatron`); ``zero``: ZeRO over ``dp``."""
    ep_size = ep_size or world_size // tp_size
    if ep_size < 1 or world_size % (ep_size * tp_size):
        raise TorchweaveError(Problem(
            obj="ep policy", value=f"ep={ep_size}, tp={tp_size}",
            rule=f"ep × tp divides the world ({world_size})",
            fix=f"choose ep and tp whose product divides {world_size}"))
    experts = expert_count(graph)
    if experts and experts % ep_size:
        raise TorchweaveError(Problem(
            obj="ep policy", value=f"ep={ep_size}",
            rule=f"ep divides the model's {experts} experts",
            fix=f"choose ep among {', '.join(str(d) for d in range(1, experts + 1) if experts % d == 0)}"))
    mesh = Mesh.of(dp=world_size // (ep_size * tp_size), ep=ep_size, tp=tp_size)
    inputs = batch_inputs(graph, "dp", mesh.dim("dp"))
    both = batch_inputs(graph, "ep", mesh.dim("dp") * ep_size)  # the batch divides over dp × ep
    for name, axes in both.items():
        inputs.setdefault(name, {}).update(axes)
    found: list[str] = []
    plan = propagate(graph, mesh, inputs=inputs, rule=_experts(found), name="ep")
    plan.zero, plan.zero_axis = (zero, "dp") if zero and mesh.dim("dp") > 1 else (0, None)
    plan.notes["policy"] = f"ep(ep_size={ep_size}, dp={mesh.dim('dp')}, tp={tp_size}, zero={plan.zero})"
    plan.notes["experts"] = (f"{len(found)} expert ops split over ep={ep_size}" if found else
                             "no expert op found (a batched matmul over a rank-3 weight's first axis): "
                             "ep runs as data parallelism")
    return plan
