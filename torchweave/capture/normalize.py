"""Rewrites that make every op's annotation exact under every split.

- ``linear(x, w, b)`` becomes ``linear(x, w)`` then ``add(·, b)``, so that the
  contraction dimension can be split (row-parallel) without adding the bias
  once per piece.
- ``addmm(b, x, w)`` becomes ``mm(x, w)`` then ``add(·, b)``, likewise.
- ``cross_entropy(x, t)`` (mean or sum, over ``[n, classes]``, ``t`` int64 class indices)
  becomes
  ``logsumexp(x) − x[t]`` per row, kept where ``t != ignore_index``, summed
  (and, for the mean, divided by the number of counted targets). Splitting the
  batch gives partial sums that add up exactly whatever ``ignore_index``
  removes from each piece, and splitting the classes gives a vocabulary-
  parallel cross-entropy: partial log-sum-exps and partial target logits.
"""

from __future__ import annotations

import torch

from torchweave.ir.graph import Graph, Node, Ref, TensorMeta, Value

_MEAN, _SUM = 1, 2


def normalize(graph: Graph) -> None:
    out: list[Node] = []
    for node in graph.nodes:
        if node.target == "aten.linear.default":
            out.extend(_split_linear_bias(graph, node))
        elif node.target == "aten.addmm.default" and not node.kwargs:
            out.extend(_split_addmm(graph, node))
        elif node.target == "aten.cross_entropy_loss.default":
            out.extend(_mean_cross_entropy(graph, node))
        else:
            out.append(node)
    graph.nodes = out


def _derived(graph: Graph, node: Node, suffix: str, target: str, args, kwargs, meta) -> Node:
    name = f"{node.name}_{suffix}"
    graph.values[name] = Value(name, meta, "activation")
    return Node(
        name=name,
        target=target,
        args=args,
        kwargs=kwargs,
        outputs=(name,),
        source=node.source,
        source_line=node.source_line,
        module=node.module,
    )


def _split_linear_bias(graph: Graph, node: Node) -> list[Node]:
    args = list(node.args) + [node.kwargs.get("bias")] * (3 - len(node.args))
    x, w, b = args[:3]
    if b is None:
        node.args, node.kwargs = (x, w), {}
        return [node]
    meta = graph.values[node.outputs[0]].meta
    mm = _derived(graph, node, "nobias", "aten.linear.default", (x, w), {}, meta)
    node.target, node.args, node.kwargs = "aten.add.Tensor", (Ref(mm.name), b), {}
    return [mm, node]


def _split_addmm(graph: Graph, node: Node) -> list[Node]:
    b, x, w = node.args[:3]
    meta = graph.values[node.outputs[0]].meta
    mm = _derived(graph, node, "mm", "aten.mm.default", (x, w), {}, meta)
    node.target, node.args, node.kwargs = "aten.add.Tensor", (Ref(mm.name), b), {}
    return [mm, node]


def _mean_cross_entropy(graph: Graph, node: Node) -> list[Node]:
    names = ["input", "target", "weight", "reduction", "ignore_index", "label_smoothing"]
    defaults = [None, None, None, _MEAN, -100, 0.0]
    a = dict(zip(names, defaults))
    a.update(zip(names, node.args))
    a.update(node.kwargs)
    x, t, ignore = a["input"], a["target"], a["ignore_index"]
    tmeta = graph.values[t.name].meta
    if a["reduction"] not in (_MEAN, _SUM) or a["weight"] is not None \
            or a["label_smoothing"] != 0.0 or len(graph.values[x.name].meta.shape) != 2 \
            or tmeta.dtype != torch.int64 or len(tmeta.shape) != 1:
        return [node]  # class probabilities, or targets of another integer type: as written
    loss = graph.values[node.outputs[0]].meta
    n = tmeta.shape[0]
    row = TensorMeta((n,), loss.dtype)
    lse = _derived(graph, node, "lse", "aten.logsumexp.default", (x, [1], False), {}, row)
    valid = _derived(graph, node, "valid", "aten.ne.Scalar", (t, ignore), {},
                     TensorMeta(tmeta.shape, torch.bool))
    safe = _derived(graph, node, "safe", "aten.mul.Tensor", (t, Ref(valid.name)), {}, tmeta)
    index = _derived(graph, node, "index", "aten.unsqueeze.default", (Ref(safe.name), 1), {},
                     TensorMeta((n, 1), tmeta.dtype))
    picked = _derived(graph, node, "picked", "aten.gather.default", (x, 1, Ref(index.name)), {},
                      TensorMeta((n, 1), loss.dtype))
    flat = _derived(graph, node, "target_logit", "aten.view.default", (Ref(picked.name), [n]), {},
                    row)
    each = _derived(graph, node, "each", "aten.sub.Tensor", (Ref(lse.name), Ref(flat.name)), {}, row)
    kept = _derived(graph, node, "kept", "aten.mul.Tensor", (Ref(each.name), Ref(valid.name)), {}, row)
    nodes = [lse, valid, safe, index, picked, flat, each, kept]
    if a["reduction"] == _SUM:
        node.target, node.args, node.kwargs = "aten.sum.default", (Ref(kept.name),), {}
        return nodes + [node]
    total = _derived(graph, node, "sum", "aten.sum.default", (Ref(kept.name),), {}, loss)
    count = _derived(graph, node, "count", "aten.sum.default", (Ref(valid.name),),
                     {"dtype": loss.dtype}, loss)
    node.target, node.args, node.kwargs = "aten.div.Tensor", (Ref(total.name), Ref(count.name)), {}
    return nodes + [total, count, node]
