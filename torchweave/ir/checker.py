"""Structural checks of a :class:`Graph` (the IR's spec, tinygrad style)."""

from __future__ import annotations

from torchweave.errors import Problem, TorchweaveError
from torchweave.ir.graph import Graph


def check_graph(graph: Graph) -> None:
    """Raise :class:`TorchweaveError` listing every broken IR invariant."""
    problems: list[Problem] = []
    defined = {n for n, v in graph.values.items() if v.kind != "activation"}
    names: set[str] = set()
    for node in graph.nodes:
        where = f"node {node.name} ({node.target})"
        if node.name in names:
            problems.append(Problem(obj=where, value=node.name, rule="node names are unique"))
        names.add(node.name)
        for ref in node.input_refs():
            if ref.name not in graph.values:
                problems.append(Problem(obj=where, value=ref.name, rule="inputs are graph values"))
            elif ref.name not in defined:
                problems.append(
                    Problem(obj=where, value=ref.name, rule="inputs are defined before use")
                )
        for out in node.outputs:
            if not out:
                continue
            v = graph.values.get(out)
            if v is None or v.kind != "activation":
                problems.append(Problem(obj=where, value=out, rule="outputs are activations"))
            if out in defined:
                problems.append(Problem(obj=where, value=out, rule="each value is defined once"))
            defined.add(out)
    for out in graph.outputs:
        if out not in defined:
            problems.append(Problem(obj="graph outputs", value=out, rule="outputs are defined"))
    if graph.loss is not None:
        loss = graph.values[graph.loss].meta
        if loss.shape != () or not loss.dtype.is_floating_point:
            problems.append(
                Problem(obj="graph loss", value=str(loss), rule="the loss is a float scalar")
            )
    if problems:
        raise TorchweaveError(problems, header=f"graph {graph.model_name!r} is malformed")
