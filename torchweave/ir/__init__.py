"""The captured forward graph: values, nodes, checker, interpreter, printer."""

from torchweave.ir.checker import check_graph
from torchweave.ir.graph import Graph, Node, Ref, TensorMeta, Value, resolve_target
from torchweave.ir.interp import run_graph, run_node

__all__ = [
    "Graph", "Node", "Ref", "TensorMeta", "Value", "check_graph", "resolve_target",
    "run_graph", "run_node",
]
