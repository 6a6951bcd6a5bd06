"""op-order, the third primitive, made real: the order every rank runs the forward's nodes.

Lowering walks the graph in one order on all ranks, so the collectives each rank
issues stay in the same sequence everywhere. Without op-orders that order is the
graph's. With them (``Plan.order(before, after)``) it is the graph's order with
each op-order's ``before`` node (and whatever of its inputs has not run yet)
pulled in just before its ``after`` node; every other node keeps its place. An op-order is realized at node granularity (every piece of ``before``
runs before every piece of ``after``), which implies the piece order it asks
for. What cannot be realized that way is refused before launch:

- op-orders between the same two nodes in both directions (a cycle at node level);
- an op-order that runs against the data flow (``after`` feeds ``before``);
- an op-order between pieces of one node against their row-major order;
- an op-order across pipeline stages (the schedule orders stages:
  ``with_schedule(..., orders=...)``);
- an op-order that would cut a co-sharded region in two, or one inside a region that
  disagrees with its chunk-by-chunk order.

Backward runs in autograd's order, the reverse of the data flow; op-orders order the
forward (and, under recompute, its recomputation).
"""

from __future__ import annotations

from torchweave.errors import Problem
from torchweave.ir.graph import Graph, Node
from torchweave.lower.coshard import coshard_regions
from torchweave.plan.plan import Plan
from torchweave.plan.validate import PlanError


def ordered_nodes(graph: Graph, plan: Plan) -> list[Node]:
    """The graph's nodes in the order every rank lowers and runs them (see the module)."""
    if not plan.orders:
        return list(graph.nodes)
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    producer = {o: n.name for n in graph.nodes for o in n.outputs if o}
    after: dict[str, set[str]] = {n.name: set() for n in graph.nodes}
    for n in graph.nodes:
        for ref in n.input_refs():
            if ref.name in producer:
                after[producer[ref.name]].add(n.name)
    problems = []
    stage_of = plan.pipeline.stage_of if plan.pipeline is not None else {}
    region = coshard_regions(graph, plan)
    for o in plan.orders:
        a, b = o.before.node, o.after.node
        what = f"{a}{list(o.before.piece)} before {b}{list(o.after.piece)}"
        if a != b and region.get(a) is not None and region.get(a) == region.get(b):
            # one co-sharded region runs chunk by chunk: chunk i of every node, then i + 1
            ca, cb = o.before.piece[-1], o.after.piece[-1]
            if not (ca < cb or (ca == cb and index[a] < index[b])):
                problems.append(Problem(
                    obj="op-order", value=what,
                    rule="a co-sharded region runs chunk by chunk (every node's chunk i, in graph "
                         "order, then chunk i + 1): an op-order inside it must agree",
                    fix="drop it, or order the region as a whole against nodes outside it"))
            continue
        if a == b:
            if plan.flat(a, o.before.piece) > plan.flat(a, o.after.piece):
                problems.append(Problem(
                    obj="op-order", value=what,
                    rule="the pieces of one node run in row-major order",
                    fix="order pieces of different nodes, or split the node the other way"))
            continue
        if stage_of.get(a) != stage_of.get(b):
            problems.append(Problem(
                obj="op-order", value=what,
                rule=f"op-orders relate nodes of one pipeline stage (here stages "
                     f"{stage_of.get(a)} and {stage_of.get(b)})",
                fix="order stages and micro-batches with with_schedule(plan, schedule, orders=...)"))
            continue
        after[a].add(b)
    before: dict[str, list[str]] = {n.name: [] for n in graph.nodes}
    for n, outs in after.items():
        for m in outs:
            before[m].append(n)
    out, stuck = _pull(graph, before, index)
    if stuck:
        problems.append(Problem(
            obj="op-order", value=" → ".join(stuck),
            rule="op-orders and the data flow form no cycle at node level: an op-order may "
                 "not run a node before one it reads from, nor order two nodes both ways",
            fix="drop the op-order that runs against the data flow or its opposite"))
    if not problems:
        problems += _regions_whole(out, region)
    if problems:
        raise PlanError(problems)
    return out


def _pull(graph: Graph, before: dict[str, list[str]], index: dict[str, int]
          ) -> tuple[list[Node], list[str]]:
    """Walk the graph in its order; before each node, pull in what must precede it (its
    producers and the ``before`` side of its op-orders) that has not run yet, each in
    turn the same way. So a node moves only when an op-order needs it earlier, and then
    to just before the node that needs it. Returns the order, or a cycle of node names."""
    state: dict[str, int] = {}  # 1: being placed, 2: placed
    out: list[Node] = []
    for root in graph.nodes:
        if state.get(root.name) == 2:
            continue
        stack = [(root.name, iter(sorted(before[root.name], key=index.get)))]
        state[root.name] = 1
        while stack:
            name, deps = stack[-1]
            dep = next((d for d in deps if state.get(d) != 2), None)
            if dep is None:
                stack.pop()
                state[name] = 2
                out.append(graph.nodes[index[name]])
            elif state.get(dep) == 1:
                cycle = [n for n, _ in stack]
                return out, cycle[cycle.index(dep):] + [dep]
            else:
                state[dep] = 1
                stack.append((dep, iter(sorted(before[dep], key=index.get))))
    return out, []


def _regions_whole(nodes: list[Node], region: dict[str, int]) -> list[Problem]:
    """Each co-sharded region stays one run of consecutive nodes (lowering runs a region as
    one: :func:`~torchweave.lower.coshard.coshard_regions`)."""
    problems, done, prev = [], set(), None
    for n in nodes:
        cur = region.get(n.name)
        if cur is not None and cur != prev and cur in done:
            problems.append(Problem(
                obj="op-order", value=f"node {n.name}",
                rule="a co-sharded region runs as one: an op-order may not place other "
                     "nodes inside it",
                fix="order the region as a whole (its first and last nodes)"))
        if cur is not None:
            done.add(cur)
        prev = cur
    return problems


__all__ = ["ordered_nodes"]
