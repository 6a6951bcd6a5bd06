"""Fused projections become one projection per part, each on a slice of the weight.

A model that computes query, key and value with one matmul and then cuts the result
along its last dim (``qkv_proj`` then three slices, GPT-2's ``c_attn`` then ``split``,
a fused ``gate_up_proj`` then ``chunk``) gives the cut an annotation that cannot split:
a piece of ``q`` by heads is not a box of the fused output, whose columns are all the
query heads, then all the key heads, then all the value heads. Under tensor parallelism
the whole attention (or MLP) then ran replicated on every device.

This rewrite turns ``y = x @ W.T (+ b)`` followed by cuts of ``y``'s last dim into
``[s_i, e_i)`` into one projection per cut, ``y_i = x @ W[s_i:e_i].T (+ b[s_i:e_i])``: the
same numbers (each output column is the same dot product), with each part a parameter of
its own. Each then splits by its own heads like a model with separate projections.

A part is a graph parameter whose :attr:`~torchweave.ir.graph.Value.part` names the module
tensor and the slice it is (target ``qkv_proj.weight[0:64]``). Reading a module's state
slices it (:func:`~torchweave.ir.graph.param_tensor`); writing one back joins the parts
(:mod:`torchweave.runtime.statedict`, the trainer's export, verify). Checkpoints and
``state_dict()`` keep the model's own names and shapes.

Rewritten only when it is exact: the weight (and bias) is read by this projection alone
and tied to nothing (and is not its input too), the cuts tile the last dim once, each
part is read (a part nobody reads would get no gradient, where the whole weight's rows
get zeros), and nothing else reads the fused output or any value between it and the cuts.

An optimizer sees each part as a parameter of its own, as it sees each rank's piece under
``tp`` or ZeRO. That changes nothing for optimizers that update each element from its own
gradient and state (SGD, Adam, AdamW, ...); one whose update mixes a tensor's elements
(Adafactor's row and column factors, LAMB's trust ratio) computes those per part. Between the projection and the cuts, a bias add and views that keep the last
dim (GPT-2's ``addmm`` on a flattened batch, viewed back) are carried along.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.utils._pytree as pytree

from torchweave.ir.graph import Graph, Node, Ref, TensorMeta, Value, part_target

_PROJECTIONS = {"aten.linear.default": 0, "aten.mm.default": 1}
"""Op → the weight's dim that indexes output features (``linear``: ``[n, k]``; ``mm``: ``[k, n]``)."""
_VIEWS = {"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default"}
_BIG = 2**62


def unfuse(graph: Graph) -> None:
    """Rewrite every fused projection of ``graph`` in place (see the module's text).

    Matches are disjoint (each owns its weight, bias, chain and cuts, read by it alone), so
    all are found on the graph as captured and rewritten in one pass over it."""
    users = graph.consumers()
    found = [m for m in (_match(graph, node, users) for node in graph.nodes) if m is not None]
    if found:
        _rewrite(graph, found)


@dataclass
class _Fused:
    """One fused projection: the projection then its bias add and views (``chain``), the
    module tensors it reads (the weight, and the bias if added), the weight's
    output-feature dim, and each cut node with its ranges."""

    chain: list[Node]
    params: list[str]
    wdim: int
    cuts: list[tuple[Node, list[tuple[int, int]]]]


def _only_reader(graph: Graph, name: str, node: Node, users: dict[str, list[Node]]) -> bool:
    """Whether ``name`` is a trainable-or-not parameter, untied, read by ``node`` alone."""
    v = graph.values.get(name)
    return (v is not None and v.kind == "param" and not v.aliases and v.part is None
            and [n.name for n in users[name]] == [node.name] and name not in graph.outputs)


def _cuts(node: Node, rank: int, n: int) -> list[tuple[int, int]] | None:
    """The ``[start, stop)`` ranges of the last dim that ``node``'s outputs are, in order."""
    args = list(node.args)
    dim_at = {"aten.slice.Tensor": 1, "aten.split.Tensor": 2, "aten.split_with_sizes.default": 2,
              "aten.chunk.default": 2, "aten.narrow.default": 1}.get(node.target)
    if dim_at is None:
        return None
    dim = node.kwargs.get("dim", args[dim_at] if len(args) > dim_at else 0)
    if not isinstance(dim, int) or dim % rank != rank - 1:
        return None
    if node.target == "aten.slice.Tensor":
        start = args[2] if len(args) > 2 else node.kwargs.get("start")
        stop = args[3] if len(args) > 3 else node.kwargs.get("end")
        step = args[4] if len(args) > 4 else node.kwargs.get("step", 1)
        start = 0 if start is None else start
        stop = _BIG if stop is None else stop
        if step != 1 or not isinstance(start, int) or not isinstance(stop, int):
            return None
        start, stop = (max(0, min(n, x + n if x < 0 else x)) for x in (start, stop))
        return [(start, max(start, stop))]
    if node.target == "aten.narrow.default":
        start, length = args[2], args[3]
        if not isinstance(start, int) or not isinstance(length, int):
            return None
        start = start + n if start < 0 else start
        return [(start, start + length)]
    if node.target == "aten.chunk.default":
        size = -(-n // args[1]) if isinstance(args[1], int) and args[1] > 0 else 0
        sizes = [min(size, n - s) for s in range(0, n, size)] if size else []
    elif node.target == "aten.split.Tensor":
        size = args[1]
        if not isinstance(size, int) or size <= 0:
            return None
        sizes = [min(size, n - s) for s in range(0, n, size)]
    else:
        sizes = list(args[1])
    if not sizes or not all(isinstance(s, int) and s >= 0 for s in sizes) or \
            len(sizes) != len(node.outputs) or sum(sizes) != n:
        return None
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(s, s + k) for s, k in zip(starts, sizes)]


def _match(graph: Graph, node: Node, users: dict[str, list[Node]]) -> _Fused | None:
    """The fused projection that starts at ``node``; None where the rewrite is not exact."""
    wdim = _PROJECTIONS.get(node.target)
    if wdim is None or len(node.args) != 2 or node.kwargs or not isinstance(node.args[1], Ref) \
            or node.args[0] == node.args[1]:
        return None
    w = node.args[1].name
    if not _only_reader(graph, w, node, users) or len(graph.values[w].meta.shape) != 2:
        return None
    n = graph.values[w].meta.shape[wdim]
    chain: list[Node] = [node]
    tail = node.outputs[0]
    bias = None
    readers = users[tail]
    if len(readers) == 1 and readers[0].target == "aten.add.Tensor" and len(readers[0].args) == 2 \
            and readers[0].args[0] == Ref(tail) and isinstance(readers[0].args[1], Ref) \
            and _only_reader(graph, readers[0].args[1].name, readers[0], users) \
            and graph.values[readers[0].args[1].name].meta.shape == (n,):
        bias = readers[0]
        chain.append(bias)
        tail = bias.outputs[0]
    while len(users[tail]) == 1 and users[tail][0].target in _VIEWS:
        view = users[tail][0]
        shape = graph.values[view.outputs[0]].meta.shape
        if not shape or shape[-1] != n or graph.values[tail].meta.shape[-1] != n:
            break
        chain.append(view)
        tail = view.outputs[0]
    rank = len(graph.values[tail].meta.shape)
    if any(step.outputs[0] in graph.outputs for step in chain) or not users[tail] or rank == 0:
        return None
    cuts = []
    for reader in users[tail]:
        if reader.args[0] != Ref(tail) or any(Ref(tail) == r for r in reader.input_refs()[1:]):
            return None
        ranges = _cuts(reader, rank, n)
        if ranges is None or len(ranges) != len(reader.outputs) or \
                any(not users[o] and o not in graph.outputs for o in reader.outputs):
            return None  # a part nobody reads would get no gradient, unlike its rows of the whole
        cuts.append((reader, ranges))
    edges = sorted(r for _, ranges in cuts for r in ranges)
    if len(edges) < 2 or edges[0][0] != 0 or edges[-1][1] != n or \
            any(a[1] != b[0] for a, b in zip(edges, edges[1:])) or any(a == b for a, b in edges):
        return None  # the parts must tile the last dim once, each part non-empty
    return _Fused(chain, [w] + ([bias.args[1].name] if bias is not None else []), wdim, cuts)


def _rewrite(graph: Graph, found: list[_Fused]) -> None:
    taken = set(graph.values) | {n.name for n in graph.nodes}

    def fresh(name: str) -> str:  # a name no value or node has yet
        out, k = name, 1
        while out in taken:
            out, k = f"{name}_{k}", k + 1
        taken.add(out)
        return out

    rename: dict[str, str] = {}
    made: dict[str, list[Value]] = {}
    at: dict[str, list[Node]] = {}  # the chain's last node → the nodes that replace it
    dropped: set[str] = set()
    for fused in found:
        new = at[fused.chain[-1].name] = []
        dropped |= {n.name for n in fused.chain} | {r.name for r, _ in fused.cuts}
        for p in fused.params:
            made[p] = []
        for reader, ranges in fused.cuts:
            for j, (start, stop) in enumerate(ranges):
                tag = f"part{start}"
                parts = {}
                for i, p in enumerate(fused.params):
                    made[p].append(_part(graph.values[p], fused.wdim if i == 0 else 0, start,
                                         stop, fresh(f"{p}_{tag}")))
                    parts[p] = made[p][-1].name
                prev = None
                for step in fused.chain:
                    name = fresh(f"{step.name}_{tag}")
                    meta = graph.values[step.outputs[0]].meta
                    shape = meta.shape[:-1] + (stop - start,)
                    graph.values[name] = Value(name, TensorMeta(shape, meta.dtype), "activation")
                    args = list(pytree.tree_map(lambda a: Ref(parts[a.name]) if isinstance(a, Ref)
                                                and a.name in parts else a, list(step.args)))
                    if prev is not None:
                        args[0] = Ref(prev)
                    if step.target in _VIEWS:
                        args[1] = list(args[1])[:-1] + [stop - start if args[1][-1] != -1 else -1]
                    new.append(Node(name, step.target, tuple(args), dict(step.kwargs), (name,),
                                    step.source, step.source_line, step.module))
                    prev = name
                rename[reader.outputs[j]] = prev
        for name in [o for r, _ in fused.cuts for o in r.outputs] + \
                [n.outputs[0] for n in fused.chain]:
            graph.values.pop(name, None)
    values: dict[str, Value] = {}
    for name, v in graph.values.items():  # each part where its module tensor was
        for part in sorted(made.get(name, [v]), key=lambda x: x.part[2] if x.part else 0):
            values[part.name] = part
    graph.values = values
    out: list[Node] = []
    for node in graph.nodes:  # a part's reader may be another fused projection's new node
        if node.name in at:
            out.extend(at[node.name])
        elif node.name not in dropped:
            out.append(node)
    for node in out:
        node.args = _renamed(node.args, rename)
        node.kwargs = _renamed(node.kwargs, rename)
    graph.nodes = out
    graph.outputs = [rename.get(o, o) for o in graph.outputs]
    if graph.loss in rename:
        graph.loss = rename[graph.loss]


def _part(v: Value, dim: int, start: int, stop: int, name: str) -> Value:
    shape = list(v.meta.shape)
    shape[dim] = stop - start
    return Value(name, TensorMeta(tuple(shape), v.meta.dtype), "param",
                 part_target(v.target, dim, start, stop), (), v.requires_grad, (v.target, dim, start))


def _renamed(tree: Any, rename: dict[str, str]) -> Any:
    return pytree.tree_map(lambda a: Ref(rename[a.name]) if isinstance(a, Ref) and a.name in rename
                           else a, tree)
