"""Check a plan against its graph before anything runs; report every problem."""

from __future__ import annotations

from torchweave.errors import Problem, TorchweaveError
from torchweave.ir.graph import Graph
from torchweave.ops import info
from torchweave.plan.names import string_problems
from torchweave.plan.stage_plan import check_pipeline, check_schedule
from torchweave.plan.plan import Plan
from torchweave.plan.recycle import check_recycle


class PlanError(TorchweaveError):
    """An invalid plan."""


def validate(plan: Plan, graph: Graph, *, world_size: int | None = None) -> None:
    """Raise :class:`PlanError` with every problem of ``plan`` on ``graph``.

    Its strings are checked first (:mod:`torchweave.plan.names`); a plan with
    a string outside its alphabet is not checked further.
    """
    problems = string_problems(plan)
    if problems:
        raise PlanError(problems, header="the plan holds strings outside their alphabets")
    if world_size is not None and world_size != plan.world_size:
        problems.append(Problem(
            obj=f"plan {plan.name!r}", value=f"world_size {plan.world_size}",
            rule=f"the plan's world size equals the devices launched: {plan.world_size} != {world_size}",
            fix=f"build the plan for {world_size} devices, or launch {plan.world_size}",
        ))
    if plan.mesh is not None and plan.mesh.size != plan.world_size:
        dims = " * ".join(f"{a}({n})" for a, n in plan.mesh.axes)
        problems.append(Problem(
            obj=f"plan {plan.name!r} mesh", value=str(plan.mesh),
            rule=f"the mesh covers the world: {dims} = {plan.mesh.size} != world_size({plan.world_size})",
        ))
    if not isinstance(plan.accum, int) or plan.accum < 1:
        problems.append(Problem(obj=f"plan {plan.name!r}", value=f"accum={plan.accum!r}",
                                rule="gradient accumulation runs a whole number >= 1 of "
                                     "micro-batches"))
    elif plan.accum > 1 and plan.pipeline is not None:
        problems.append(Problem(
            obj=f"plan {plan.name!r}", value=f"accum={plan.accum}",
            rule="a pipelined plan takes its micro-batches from its pipeline",
            fix=f"drop accum, or set the pipeline's micro-batches (micro={plan.accum})"))
    if not 0 <= plan.zero <= 3:
        problems.append(Problem(obj=f"plan {plan.name!r}", value=f"zero={plan.zero}",
                                rule="ZeRO stage is 0, 1, 2 or 3"))
    if plan.zero and (plan.mesh is None or plan.zero_axis not in plan.mesh.names()):
        problems.append(Problem(obj=f"plan {plan.name!r}", value=f"zero_axis={plan.zero_axis!r}",
                                rule="ZeRO shards over a named mesh axis",
                                fix="set mesh and zero_axis='dp'"))
    names = {n.name: n for n in graph.nodes}
    for node_name in list(plan.trans) + list(plan.assignment):
        if node_name not in names:
            problems.append(Problem(obj=f"plan {plan.name!r}", value=f"node {node_name!r}",
                                    rule="plans name nodes of the graph",
                                    fix="see `torchweave inspect` for node names"))
    for node in graph.nodes:
        problems.extend(_check_node(plan, graph, node))
    problems.extend(_check_orders(plan, names))
    problems.extend(_check_recompute(plan, names))
    if plan.pipeline is not None:
        devices = {n: set(ds) for n, ds in plan.assignment.items()}
        producer = graph.producers()
        edges = [(producer[r.name].name, n.name) for n in graph.nodes for r in n.input_refs()
                 if r.name in producer]
        problems.extend(check_pipeline(plan.pipeline, world_size=plan.world_size, nodes=names,
                                       devices_of=devices, edges=edges))
        pipe = plan.pipeline
        if pipe.recycle is not None:
            problems.extend(check_recycle(pipe.recycle, graph, pipe.stage_of, pipe.stages, pipe.shared))
        if plan.zero == 3:
            problems.append(Problem(obj=f"plan {plan.name!r}", value="zero=3 with a pipeline",
                                    rule="pipelined plans shard optimizer state and gradients "
                                         "(ZeRO 1-2), not parameters",
                                    fix="use zero=1 or zero=2"))
    if problems:
        raise PlanError(problems, header=f"plan {plan.name!r} is invalid for {graph.model_name!r}")
    if plan.pipeline is not None:
        check_schedule(plan.pipeline)


def _check_recompute(plan: Plan, names) -> list[Problem]:
    out = []
    seen: dict[str, int] = {}
    for i, group in enumerate(plan.recompute):
        for n in group:
            if n not in names:
                out.append(Problem(obj=f"recompute group {i}", value=f"node {n!r}",
                                   rule="recompute groups name nodes of the graph"))
            elif n in seen:
                out.append(Problem(obj=f"recompute group {i}", value=f"node {n!r}",
                                   rule=f"a node is in one recompute group; also in group {seen[n]}"))
            seen[n] = i
    return out


def _check_node(plan: Plan, graph: Graph, node) -> list[Problem]:
    out = []
    where = f"node {node.name} ({node.target} at {node.source or '?'})"
    bound = info(graph, node).bound
    splittable = set(bound.splittable())
    per_dim: dict[str, int] = {}
    for t in plan.transforms(node.name):
        if t.parts < 1:
            out.append(Problem(obj=where, value=f"{t}", rule="a transform makes 1 or more parts"))
            continue
        if t.dim is None:
            continue
        if t.dim not in bound.sizes:
            out.append(Problem(obj=where, value=f"split {t.dim!r}",
                               rule=f"split a dimension of the annotation '{bound}'"))
            continue
        if t.dim not in splittable:
            out.append(Problem(obj=where, value=f"split {t.dim!r}",
                               rule=f"'{bound}' does not allow splitting {t.dim!r}",
                               fix=f"split one of: {' '.join(sorted(splittable)) or '(none: replicate it)'}"))
            continue
        per_dim[t.dim] = per_dim.get(t.dim, 1) * t.parts
        size = bound.sizes[t.dim]
        if size % per_dim[t.dim]:
            out.append(Problem(obj=where, value=f"split {t.dim}={size} into {per_dim[t.dim]}",
                               rule=f"the parts divide the dimension: {size} % {per_dim[t.dim]} != 0"))
    devices = plan.assignment.get(node.name)
    n = plan.num_pieces(node.name)
    if devices is None:
        out.append(Problem(obj=where, value="no op-assign", rule="every piece is assigned",
                           fix="assign each piece to a device"))
    elif len(devices) != n:
        out.append(Problem(obj=where, value=f"{len(devices)} devices for {n} pieces",
                           rule="one device per piece"))
    else:
        for i, d in enumerate(devices):
            if d == -1:
                out.append(Problem(obj=where, value=f"piece {i}", rule="every piece is assigned"))
            elif not 0 <= d < plan.world_size:
                out.append(Problem(obj=where, value=f"device {d}",
                                   rule=f"devices are 0..{plan.world_size - 1}"))
    return out


def _check_orders(plan: Plan, names) -> list[Problem]:
    out = []
    edges: dict[tuple, list[tuple]] = {}
    for o in plan.orders:
        for ref in (o.before, o.after):
            if ref.node not in names or ref.piece not in set(plan.pieces(ref.node)):
                out.append(Problem(obj="op-order", value=str(ref), rule="orders name existing pieces"))
        if out:
            continue
        if plan.device_of(o.before.node, o.before.piece) != plan.device_of(o.after.node, o.after.piece):
            out.append(Problem(obj="op-order", value=f"{o.before} before {o.after}",
                               rule="op-order relates pieces on the same device"))
        edges.setdefault((o.before.node, o.before.piece), []).append((o.after.node, o.after.piece))
    cycle = _find_cycle(edges)
    if cycle:
        out.append(Problem(obj="op-order", value=" → ".join(f"{n}{list(p)}" for n, p in cycle),
                           rule="order constraints form no cycle"))
    return out


def _find_cycle(edges: dict[tuple, list[tuple]]) -> list[tuple] | None:
    state: dict[tuple, int] = {}
    stack: list[tuple] = []

    def visit(v: tuple) -> list[tuple] | None:
        state[v] = 1
        stack.append(v)
        for w in edges.get(v, []):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        state[v] = 2
        stack.pop()
        return None

    for v in list(edges):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None
