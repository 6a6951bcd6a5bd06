"""Activation recompute as a plan transform: which nodes run their forward again in backward.

A recompute group keeps only its inputs through the forward and runs its nodes
again just before their backward (``Plan.recompute``). Three ways to choose the
groups, each reachable as the ``recompute=`` option of a plan string:

- ``full``: every numbered block (``blocks.3``, ``model.layers.3``) is a group,
  so each block keeps only its input (Megatron-LM's full recompute);
- ``selective``: in each block, the attention core only: from the first op that
  combines activations by attention (scaled dot-product attention anywhere; a
  softmax or a matmul of two activations inside a module whose name holds
  ``att``) to the next op that reads a parameter (the output projection). That is where the big activations of attention live
  (the scores are batch × heads × seq²), and what Korthikanti et al., "Reducing
  Activation Recomputation in Large Transformer Models" (MLSys 2023) recompute;
- module names (``mlp+attn``): one group per instance of each module whose
  path ends with one of the names.

A group never crosses a pipeline stage: it is cut where the plan's stages are.
"""

from __future__ import annotations

from typing import Iterable

from torchweave.errors import Problem, TorchweaveError
from torchweave.ir.graph import Graph, Node
from torchweave.plan.plan import Plan

MODES = ("none", "full", "selective")
"""The named recompute choices; anything else is a ``+``-separated list of module names."""

_CORE = frozenset({
    "aten.scaled_dot_product_attention.default", "aten._softmax.default", "aten.softmax.int",
    "aten._safe_softmax.default", "aten.matmul.default", "aten.bmm.default", "aten.baddbmm.default",
})


def block_of(module: str) -> str:
    """``blocks.3.attn`` → ``blocks.3``; outside numbered blocks, ``""``."""
    parts = module.split(".")
    for j, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:j + 1])
    return ""


def with_recompute(plan: Plan, graph: Graph, what: str | Iterable[str]) -> Plan:
    """``plan`` recomputing ``what``: ``"full"``, ``"selective"``, ``"none"``, or module
    names (a tuple, or one string joined by ``+``); see the module docstring."""
    if isinstance(what, str):
        what = what if what in MODES else tuple(what.split("+"))
    elif not tuple(what):  # no module names: nothing recomputed
        what = "none"
    if what == "none":
        groups: list[list[str]] = []
    elif what == "full":
        groups = _by_key(graph, plan, lambda n: block_of(n.module))
    elif what == "selective":
        groups = _selective(graph, plan)
    else:
        modules = tuple(what)
        groups = _by_key(graph, plan, lambda n: _instance(n.module, modules))
    if what not in MODES:
        have = sorted({part for n in graph.nodes for part in n.module.split(".")
                       if part and not part.isdigit()})
        missing = [m for m in what if m not in have]
        if missing or not groups:
            raise TorchweaveError(Problem(
                obj="recompute", value="+".join(what),
                rule=f"one of {', '.join(MODES)}, or names of the model's modules joined by '+' "
                     f"(each the last part of a module path): no module {', '.join(map(repr, missing))}",
                fix=f"the model's modules: {', '.join(have[:12])}{', ...' if len(have) > 12 else ''}"))
    plan.recompute = [tuple(g) for g in groups if g]
    return plan


def _instance(module: str, names: tuple[str, ...]) -> str:
    parts = module.split(".")
    for j in range(len(parts), 0, -1):
        if parts[j - 1] in names:
            return ".".join(parts[:j])
    return ""


def _stage(plan: Plan, node: Node) -> int:
    return plan.pipeline.stage_of.get(node.name, 0) if plan.pipeline is not None else 0


def _by_key(graph: Graph, plan: Plan, key) -> list[list[str]]:
    """One group per (non-empty key, stage), nodes in graph order."""
    groups: dict[tuple[str, int], list[str]] = {}
    for node in graph.nodes:
        k = key(node)
        if k:
            groups.setdefault((k, _stage(plan, node)), []).append(node.name)
    return list(groups.values())


def _reads_param(graph: Graph, node: Node) -> bool:
    return any(graph.values[r.name].kind == "param" for r in node.input_refs())


def _is_core(graph: Graph, node: Node) -> bool:
    if node.target not in _CORE or _reads_param(graph, node):
        return False
    return "scaled_dot_product" in node.target or any(
        "att" in part.lower() for part in node.module.split("."))


def _selective(graph: Graph, plan: Plan) -> list[list[str]]:
    """Per block (or per module outside blocks), each run from a core op to the next op that
    reads a parameter, the end of the block, or a stage boundary."""
    groups: list[list[str]] = []
    run: list[str] = []
    where: tuple[str, int] | None = None
    for node in graph.nodes:
        here = (block_of(node.module) or node.module, _stage(plan, node))
        if run and (here != where or _reads_param(graph, node)):
            groups.append(run)
            run = []
        if not run and _is_core(graph, node):
            run, where = [node.name], here
        elif run:
            run.append(node.name)
    if run:
        groups.append(run)
    return groups


__all__ = ["MODES", "block_of", "with_recompute"]
