"""Grad-mode and autocast regions in an exported program, inlined into its graph.

``torch.export`` keeps a ``with torch.no_grad():`` block (or a method decorated with
``@torch.no_grad()``, as transformers' rotary embeddings are in some releases) and a
``with torch.autocast(..., enabled=False):`` block as a higher-order op that calls a
submodule: ``wrap_with_set_grad_enabled(False, submod, *args)``. The rest of capture reads
one flat graph of ATen ops, so each such call is replaced by the submodule's ops:

- ``set_grad_enabled(False)``: the ops, then ``aten.detach`` on each result, so that no
  gradient flows back through the region, as in eager mode;
- ``set_grad_enabled(True)``: the ops as they are (capture traces with gradients on);
- ``autocast(enabled=False)``: the ops as they are (the traced ops already carry the
  dtypes the region computes in, and torchweave applies precision by its own casts);
- ``autocast(enabled=True)``: refused with a :class:`CaptureError`. Its casts happen at
  dispatch, after this graph, so inlining it would silently drop them.
"""

from __future__ import annotations

import operator

import torch

from torchweave.capture.source import location_from_stack_trace
from torchweave.errors import CaptureError, Problem

_GRAD = "wrap_with_set_grad_enabled"
_AUTOCAST = "wrap_with_autocast"


def inline_regions(ep: torch.export.ExportedProgram) -> int:
    """Inline every grad-mode and disabled-autocast region of ``ep`` in place; return how many."""
    return _inline_all(ep.graph_module)


def _inline_all(gm: torch.fx.GraphModule) -> int:
    """Regions of ``gm``, nested ones first (transformers' rotary embedding on CUDA is a
    disabled autocast inside a no_grad method)."""
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        kind = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
        if kind == _GRAD:
            enabled, sub, args = node.args[0], node.args[1], node.args[2:]
        elif kind == _AUTOCAST:
            enabled, sub, args = node.args[2], node.args[4], node.args[5:]
            if enabled:
                loc = _location(node, getattr(gm, sub.target))
                raise CaptureError(Problem(
                    obj=str(loc or node.name), value=f"torch.autocast({node.args[0]!r}, "
                    f"dtype={node.args[1]}, enabled=True) inside forward",
                    rule="capture keeps the model's own dtypes; an autocast region's casts "
                         "happen after the traced graph and would be lost",
                    fix="remove the autocast block from forward and ask for the precision "
                        "in the plan (precision='bf16' or --precision bf16)"))
        else:
            continue
        body = getattr(gm, sub.target)
        count += _inline_all(body)
        _inline(graph, node, body, args, detach=(kind == _GRAD and not enabled))
        if not sub.users:
            graph.erase_node(sub)
        count += 1
    if count:
        gm.delete_all_unused_submodules()
        graph.lint()
        gm.recompile()
    return count


def _location(call: torch.fx.Node, sub: torch.fx.GraphModule):
    """Where in the user's source a region is: the call's own trace or its first op's."""
    traces = [call.meta.get("stack_trace")] + [n.meta.get("stack_trace") for n in sub.graph.nodes]
    return next((loc for loc in map(location_from_stack_trace, traces) if loc), None)


def _inline(graph: torch.fx.Graph, call: torch.fx.Node, sub: torch.fx.GraphModule,
            args: tuple, *, detach: bool) -> None:
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, args))
    results: list = []
    with graph.inserting_before(call):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                results = list(n.args[0]) if isinstance(n.args[0], (tuple, list)) else [n.args[0]]
                break
            if n.op == "get_attr":  # a region inside reads its own submodule; none is left here
                raise CaptureError(Problem(
                    obj=call.name, value=f"region reads attribute {n.target}",
                    rule="a no_grad/autocast region reads only its inputs",
                    fix="pass the tensor into the region as an argument"))
            env[n] = graph.node_copy(n, lambda x: env[x])
            if call.meta.get("nn_module_stack") and not env[n].meta.get("nn_module_stack"):
                env[n].meta["nn_module_stack"] = call.meta["nn_module_stack"]
        outs = []
        for r in results:
            out = env[r] if isinstance(r, torch.fx.Node) else r
            if detach and isinstance(out, torch.fx.Node):
                d = graph.call_function(torch.ops.aten.detach.default, (out,))
                d.meta = dict(out.meta)
                out = d
            outs.append(out)
    for user in list(call.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(outs[user.args[1]])
            graph.erase_node(user)
    if call.users:  # used whole (a single result)
        call.replace_all_uses_with(outs[0])
    graph.erase_node(call)
