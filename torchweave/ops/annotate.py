"""Give every node of a graph its bound annotation, FLOPs and bytes."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch.utils._pytree as pytree

from torchweave.errors import TorchweaveError
from torchweave.ir.graph import Graph, Node, Ref
from torchweave.ops.bind import Bound, Split, bind
from torchweave.ops.registry import REGISTRY, Call, OpSpec, Registry


class UnannotatedOpWarning(UserWarning):
    """An op with no annotation runs whole on every device it is placed on."""


@dataclass(frozen=True)
class OpInfo:
    """What the registry derives for one node."""

    node: Node
    spec: OpSpec | None
    bound: Bound
    flops: float
    """Forward FLOPs."""
    bwd_flops: float
    bytes: int
    """Bytes read and written by the forward call."""

    @property
    def splits(self) -> list[Split]:
        return self.bound.splits()

    @property
    def replicate_only(self) -> bool:
        return self.spec is None or not self.bound.splittable()


def call_of(graph: Graph, node: Node) -> Call:
    """The node as rules see it: tensors replaced by their TensorMeta."""

    def meta(x):
        return graph.values[x.name].meta if isinstance(x, Ref) else x

    return Call(
        target=node.target,
        args=pytree.tree_map(meta, node.args),
        kwargs=pytree.tree_map(meta, node.kwargs),
        inputs=graph.input_metas(node),
        outputs=graph.output_metas(node),
    )


def _opaque(call: Call) -> str:
    return f"{', '.join('?' * len(call.inputs))} -> {', '.join('?' * len(call.outputs))}".strip()


def default_flops(spec: OpSpec | None, call: Call, bound: Bound) -> float:
    if spec is None:
        return 0.0
    if spec.flops is not None:
        return float(spec.flops(call, bound))
    out_names = {n for t in bound.annotation.outputs for n in t.names()}
    contracted = any(n not in out_names for t in bound.annotation.inputs for n in t.names())
    if contracted:
        return spec.flops_per_point * bound.iteration_points()
    return spec.flops_per_point * max((m.numel for m in call.outputs), default=0)


def info(graph: Graph, node: Node, registry: Registry = REGISTRY) -> OpInfo:
    """Annotation, FLOPs and bytes of one node (annotating it if needed).

    Kept on the graph per node: a captured graph's nodes and tensor metadata do not
    change, and every plan build, lowering and simulation asks again (a search asks
    hundreds of thousands of times). The answer is recomputed when the node object, its
    annotation or the op's registered spec is not the one it was computed for."""
    spec = registry.lookup(node.target)
    cache = graph.__dict__.setdefault("_op_infos", {})
    hit = cache.get(node.name)
    if hit is not None and hit[0] is node and hit[1] == node.annotation and hit[2] is spec:
        return hit[3]
    call = call_of(graph, node)
    text = node.annotation or (spec.annotate(call) if spec else _opaque(call))
    return _info(graph, node, spec, call, bind(text, call.inputs, call.outputs, op=node.target))


def _info(graph: Graph, node: Node, spec: OpSpec | None, call: Call, bound: Bound) -> OpInfo:
    """The node's :class:`OpInfo` from its bound annotation, kept on the graph (see :func:`info`)."""
    flops = default_flops(spec, call, bound)
    nbytes = sum(m.nbytes for m in call.inputs) + sum(m.nbytes for m in call.outputs)
    out = OpInfo(node, spec, bound, flops, flops * (spec.bwd_factor if spec else 2.0), nbytes)
    graph.__dict__.setdefault("_op_infos", {})[node.name] = (node, node.annotation, spec, out)
    return out


def annotate(graph: Graph, registry: Registry = REGISTRY) -> list[OpInfo]:
    """Bind every node's annotation; warn once per op that has none."""
    infos = []
    missing: dict[str, Node] = {}
    broken: dict[str, str] = {}
    for node in graph.nodes:
        call = call_of(graph, node)
        spec = registry.lookup(node.target)
        bound = None
        if spec is None:
            missing.setdefault(node.target, node)
            node.annotation = _opaque(call)
        else:
            try:
                bound = bind(spec.annotate(call), call.inputs, call.outputs, op=node.target)
                node.annotation = str(bound.annotation)
            except (TorchweaveError, ValueError, KeyError, IndexError, TypeError) as exc:
                broken.setdefault(node.target, f"{node.source or node.name}: {exc}")
                node.annotation = _opaque(call)
        if bound is None:  # the opaque annotation, bound as info would bind it
            bound = bind(node.annotation, call.inputs, call.outputs, op=node.target)
        infos.append(_info(graph, node, spec, call, bound))
    for target, node in missing.items():
        warnings.warn(
            f"op {target} at {node.source or node.name} has no annotation; it will run whole "
            f"(replicated) on each device. Register one with "
            f"torchweave.register_annotation('{target}', '<annotation>')",
            UnannotatedOpWarning, stacklevel=2,
        )
    for target, why in broken.items():
        warnings.warn(f"op {target}: its annotation rule failed ({why}); it will run replicated",
                      UnannotatedOpWarning, stacklevel=2)
    return infos
