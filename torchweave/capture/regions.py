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
    """Inline every grad-mode and disabled-autocast region of ``ep`` in place; return how many.
    The program's signature follows: a user output that was a region's result is renamed."""
    return _inline_all(ep.graph_module, ep.graph_signature)


def _rename_outputs(gm: torch.fx.GraphModule, signature) -> None:
    """Point each output spec at the node now in its place (the region's getitem is gone)."""
    if signature is None:
        return
    out = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    for spec, node in zip(signature.output_specs, leaves):
        if isinstance(node, torch.fx.Node) and hasattr(spec.arg, "name") and spec.arg.name != node.name:
            spec.arg = type(spec.arg)(name=node.name)


def _inline_all(gm: torch.fx.GraphModule, signature=None) -> int:
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
        if kind == _GRAD and not enabled:
            _refuse_input_mutation(node, body)
        _inline(graph, node, body, args, detach=(kind == _GRAD and not enabled))
        if not sub.users:
            graph.erase_node(sub)
        count += 1
    if count:
        _rename_outputs(gm, signature)
        gm.delete_all_unused_submodules()
        graph.lint()
        gm.recompile()
    return count


def _mutated_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The region input an in-place op (or a chain of them) writes to, if any."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        alias = schema.arguments[0].alias_info if schema is not None and schema.arguments else None
        if alias is None or not alias.is_write or not node.args:
            return None
        node = node.args[0]
    return node if isinstance(node, torch.fx.Node) and node.op == "placeholder" else None


def _refuse_input_mutation(call: torch.fx.Node, sub: torch.fx.GraphModule) -> None:
    """An in-place change of a tensor from outside a no-grad region (``w.clamp_()`` on a
    parameter, ``h.mul_()`` on an activation) keeps that tensor's gradient history in eager
    mode; inlined, its result would be detached and a parameter's change lost. Refused."""
    for n in sub.graph.nodes:
        if n.op == "call_function" and _mutated_input(n) is not None:
            loc = location_from_stack_trace(n.meta.get("stack_trace")) or _location(call, sub)
            raise CaptureError(Problem(
                obj=str(loc or call.name), value=f"{n.target} inside torch.no_grad() changes "
                f"{_mutated_input(n).name} in place",
                rule="a no-grad block in forward may compute new tensors, not change tensors "
                     "from outside it in place (their gradients and a parameter's new value "
                     "would be lost in the captured graph)",
                fix="compute a new tensor (h = h.clamp(...)) or change parameters outside "
                    "forward (after optimizer.step(), or in a hook)"))


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
    if call.users:  # used whole: only a region with one result is
        if len(outs) != 1:
            raise CaptureError(Problem(obj=call.name, value=f"{len(outs)} results used whole",
                                       rule="a region's results are read one by one"))
        call.replace_all_uses_with(outs[0])
    graph.erase_node(call)
