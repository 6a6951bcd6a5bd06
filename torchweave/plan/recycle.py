"""Multi-forward (recycling) plans: which outputs come back as which inputs, how often.

A model that recycles (AlphaFold 2 is the known case) is written for one
device as a loop: ``passes - 1`` forward passes without gradients, each
feeding some of its outputs back as inputs of the next, then one pass with
gradients and its backward. torchweave captures one forward; a
:class:`Recycle` names the loop's links:

- ``input``: a forward argument of the model (a graph input), zeros or the
  user's initial value on the first pass;
- ``output``: the module whose output replaces it on the next pass (the value
  its last op produces), or a graph value's name.

The schedule places the no-gradient passes (``R`` actions, see
:mod:`torchweave.plan.schedules.recycle`); lowering derives the transfers
that carry each output from the last stage's devices to the first stage's
(:func:`torchweave.lower.lower.recycle_links`). The recycled value carries no
gradient, as in the one-device loop, which detaches it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchweave.errors import Problem
from torchweave.ir.graph import Graph


@dataclass(frozen=True)
class Recycle:
    """``passes`` forward passes per micro-batch, the last with gradients, linked by ``links``."""

    passes: int
    links: tuple[tuple[str, str], ...]
    """(input, output): forward argument ← module path (or graph value) of the previous pass."""

    def to_data(self) -> dict[str, Any]:
        return {"passes": self.passes, "links": [list(link) for link in self.links]}

    @staticmethod
    def from_data(data: dict[str, Any]) -> "Recycle":
        return Recycle(int(data["passes"]), tuple((str(a), str(b)) for a, b in data["links"]))


@dataclass(frozen=True)
class Link:
    """One link resolved against the graph."""

    input: str
    """The graph input (a value name) that receives."""
    index: int
    """Its position among the graph's inputs (and the user's batch)."""
    output: str
    """The graph value recycled."""


def output_value(graph: Graph, output: str) -> str | None:
    """The value ``output`` names: a graph value, else the last op's output in that module."""
    if output in graph.values and graph.values[output].kind == "activation":
        return output
    inside = [n for n in graph.nodes if n.module == output or n.module.startswith(output + ".")]
    outs = [o for o in (inside[-1].outputs if inside else ()) if o]
    return outs[0] if outs else None


def resolve_links(graph: Graph, recycle: Recycle) -> tuple[list[Link], list[Problem]]:
    """Each link as graph values, and every problem (unknown names, shape or dtype mismatch)."""
    links, problems = [], []
    obj = "plan recycle"
    if not isinstance(recycle.passes, int) or recycle.passes < 1:
        problems.append(Problem(obj=f"{obj} passes", value=repr(recycle.passes),
                                rule="a whole number of forward passes >= 1 (the last with gradients)"))
    if not recycle.links:
        problems.append(Problem(obj=f"{obj} links", value="none",
                                rule="a multi-forward plan recycles at least one output",
                                fix="give (input, module) pairs, e.g. {'prev': 'norm'}"))
    inputs = {graph.values[i].target: i for i in graph.inputs}
    seen: set[str] = set()
    for name, output in recycle.links:
        here = f"{obj} link {name!r} <- {output!r}"
        value = inputs.get(name, name if name in graph.inputs else None)
        if value is None:
            problems.append(Problem(obj=here, value=repr(name),
                                    rule=f"the recycled input is a forward argument: {', '.join(inputs)}"))
            continue
        if value in seen:
            problems.append(Problem(obj=here, value=repr(name), rule="each input is recycled once"))
            continue
        seen.add(value)
        out = output_value(graph, output)
        if out is None:
            problems.append(Problem(obj=here, value=repr(output),
                                    rule="the output is a module path with ops in the graph, or a value",
                                    fix="see `torchweave inspect` for module paths and values"))
            continue
        a, b = graph.values[value].meta, graph.values[out].meta
        if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
            problems.append(Problem(
                obj=here, value=f"{out} is {b}, {name} is {a}",
                rule="the recycled output has the input's shape and dtype",
                fix="recycle a module whose output matches the input, or reshape it in the model"))
            continue
        links.append(Link(value, graph.inputs.index(value), out))
    return links, problems


def check_recycle(recycle: Recycle, graph: Graph, stage_of: dict[str, int], stages: int,
                  shared: list[int]) -> list[Problem]:
    """Problems with ``recycle`` in a pipeline of ``stages`` stages (node → stage ``stage_of``)."""
    links, problems = resolve_links(graph, recycle)
    if shared:
        problems.append(Problem(obj="plan recycle", value=f"shared stages {shared}",
                                rule="multi-forward runs on pipelines without shared stages",
                                fix="use gpipe, 1f1b, interleaved or zb"))
        return problems
    producer, consumers = graph.producers(), graph.consumers()
    for link in links:
        s = stage_of.get(producer[link.output].name)
        if s is not None and s != stages - 1:
            problems.append(Problem(
                obj=f"plan recycle output {link.output}", value=f"stage {s}",
                rule=f"the recycled output is made on the last stage ({stages - 1}), "
                     "which sends it back to stage 0",
                fix="cut the stages so that it is on the last one (pipeline cuts=...)"))
        late = sorted({stage_of.get(n.name, 0) for n in consumers.get(link.input, [])} - {0})
        if late:
            problems.append(Problem(
                obj=f"plan recycle input {link.input}", value=f"read on stage(s) {late}",
                rule="the recycled input is read on stage 0 only",
                fix="cut the stages so that its readers are on stage 0"))
    return problems
