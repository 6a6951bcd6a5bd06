"""Run a :class:`Graph` eagerly, node by node, with real tensors.

This is the reference semantics of the IR: capture tests replay a graph here
and compare with the user's eager model.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.utils._pytree as pytree

from torchweave.ir.graph import Graph, Node, Ref, param_tensor


def substitute(tree: Any, env: Mapping[str, torch.Tensor]) -> Any:
    """Replace every :class:`Ref` in ``tree`` with its tensor from ``env``."""
    return pytree.tree_map(lambda x: env[x.name] if isinstance(x, Ref) else x, tree)


def on_device(tree: Any, device: torch.device | None) -> Any:
    """``tree`` with every captured ``torch.device`` constant replaced by ``device`` (None: kept)."""
    if device is None:
        return tree
    return pytree.tree_map(lambda x: device if isinstance(x, torch.device) else x, tree)


def run_node(node: Node, env: dict[str, torch.Tensor], device: torch.device | None = None) -> None:
    """Run one node and bind its outputs in ``env``; ``device``: where ops that make
    tensors (``arange``, ``full``) put them, in place of the device they were captured on."""
    args = on_device(substitute(node.args, env), device)
    kwargs = on_device(substitute(node.kwargs, env), device)
    out = node.op(*args, **kwargs)
    if node.output_structure == "single":
        env[node.outputs[0]] = out
    else:
        for name, t in zip(node.outputs, out):
            if name:
                env[name] = t


def run_graph(
    graph: Graph, state: Mapping[str, torch.Tensor], inputs: tuple[torch.Tensor, ...],
    device: torch.device | None = None,
) -> list[torch.Tensor]:
    """Run the forward pass; ``state`` maps module paths to params and buffers.

    ``device``: the device ``state`` and ``inputs`` are on, for the ops that make
    tensors (see :func:`run_node`); None runs them where they were captured."""
    env: dict[str, torch.Tensor] = {}
    for v in graph.values.values():
        if v.kind in ("param", "buffer"):
            env[v.name] = param_tensor(state, v)
    if len(inputs) != len(graph.inputs):
        raise ValueError(f"graph takes {len(graph.inputs)} inputs, got {len(inputs)}")
    env.update(zip(graph.inputs, inputs))
    for node in graph.nodes:
        run_node(node, env, device)
    return [env[o] for o in graph.outputs]
