"""Co-shard: each device runs its share of a chain of ops in ``k`` chunks.

Built from the primitives only: op-trans (each node of the chain split ``k``
more ways, along the dimension that carries one tensor axis through the
chain) and op-assign (the ``k`` new pieces on the device that ran the node's
share). It composes with any plan that runs each node's pieces on distinct
devices: whole on one device, data or tensor parallel, a pipeline stage.
Lowering runs the chunks one after another and recomputes each in backward
(see :mod:`torchweave.lower.coshard`), so only one chunk's activations exist
at a time: the region's activations fall by about ``(k-1)/k``, for one more
forward of the region in backward.

Reachable as the plan strings' ``coshard=`` option (:func:`with_coshard_spec`):

- ``coshard=K``: the output head, from the op that makes the largest tensor
  after the last numbered block (an LM head's logits) to the loss;
- ``coshard=NAME+NAME:K``: every instance of each named module (``attn``,
  ``mlp``), one chain each.
"""

from __future__ import annotations

import re

from torchweave.errors import Problem, TorchweaveError
from torchweave.ir.graph import Graph, Node
from torchweave.ops import info
from torchweave.plan.plan import Plan
from torchweave.policies.recompute import block_of

_VALUE = re.compile(r"(?:(?P<names>[A-Za-z_][A-Za-z0-9_]*(?:\+[A-Za-z_][A-Za-z0-9_]*)*):)?(?P<k>[0-9]+)")


def parse_coshard(value: str) -> tuple[tuple[str, ...], int] | None:
    """``"4"`` → ((), 4); ``"attn+mlp:2"`` → (("attn", "mlp"), 2); None if malformed."""
    m = _VALUE.fullmatch(value)
    if m is None or int(m["k"]) < 2:
        return None
    return tuple(m["names"].split("+")) if m["names"] else (), int(m["k"])


def with_coshard(plan: Plan, graph: Graph, nodes: list[str], k: int, dim: str | None = None,
                 *, trim: bool = False) -> Plan:
    """Co-shard ``nodes`` (consecutive in the graph) ``k`` ways, the first along ``dim``
    (None: the first of its spatial dims that carries through the whole chain).

    ``trim``: end the chain before the first node the split does not reach (a loss's
    final division, or a sum of tensor-parallel partials) instead of refusing it."""
    if not nodes:
        raise TorchweaveError(Problem(obj="co-shard", value="no nodes", rule="a chain has a node"))
    first = info(graph, graph.node(nodes[0])).bound
    kinds = first.annotation.dims()
    tried = [dim] if dim is not None else [d for d in first.splittable() if kinds[d].kind == "spatial"]
    best: tuple[dict[str, str], list[str]] | None = None
    for d in tried:
        dims = _carry(plan, graph, nodes, d, k)
        chain = list(nodes)
        if trim:  # up to the first node the split does not reach
            chain = chain[:next((i for i, n in enumerate(chain) if n not in dims), len(chain))]
        if all(n in dims for n in chain) and chain:
            best = dims, chain
            break
    problems = [] if best is not None else _problems(plan, graph, nodes, tried, k)
    if best is None:
        raise TorchweaveError(problems or [Problem(
            obj=f"node {nodes[0]}", value=f"dims {tried}", rule=f"a spatial dim that divides by {k}")],
            header=f"cannot co-shard {nodes[0]}..{nodes[-1]} {k} ways")
    dims, chain = best
    for name in chain:
        devices = plan.assignment[name]
        plan.split(name, dims[name], k).assign_all(name, [d for d in devices for _ in range(k)])
    note = f"{chain[0]}..{chain[-1]} x{k}" if len(chain) > 1 else f"{chain[0]} x{k}"
    plan.notes["coshard"] = "; ".join(filter(None, (plan.notes.get("coshard"), note)))
    return plan


def _fits(plan: Plan, graph: Graph, name: str, d: str, k: int) -> bool:
    """Whether ``name`` (its pieces on distinct devices) splits ``k`` more ways on ``d``."""
    bound = info(graph, graph.node(name)).bound
    devices = plan.assignment.get(name, [])
    if len(devices) != plan.num_pieces(name) or len(set(devices)) != len(devices):
        return False
    parts = 1
    for t in plan.transforms(name):
        parts *= t.parts if t.dim == d else 1
    return d in bound.splittable() and bound.sizes[d] % (parts * k) == 0


def _carry(plan: Plan, graph: Graph, nodes: list[str], dim: str, k: int) -> dict[str, str]:
    """Node → the dim it splits on so that one tensor axis is split through the chain:
    from producers to consumers and back, until nothing changes."""
    members = set(nodes)
    dims: dict[str, str] = {}
    if _fits(plan, graph, nodes[0], dim, k):
        dims[nodes[0]] = dim
    axis_of: dict[str, int] = {}  # value made in the chain → its split axis

    def lead_axis(spec, d: str) -> int | None:
        if spec.opaque or spec.meta_only:
            return None
        return next((i for i, ax in enumerate(spec.axes) if ax.dims and ax.dims[0].name == d), None)

    def partial(node: Node, d: str, out: str) -> bool:
        """Whether ``node`` split on ``d`` (and its plan's splits) makes ``out`` a partial sum."""
        bound = info(graph, node).bound
        spec = bound.annotation.outputs[node.outputs.index(out)]
        names = set() if spec.opaque else set(spec.names())
        split = {t.dim for t in plan.transforms(node.name) if t.dim} | {d}
        return any(bound.dim(x).kind == "reduce" and x not in names for x in split)

    def settle(node: Node, d: str) -> None:
        dims[node.name] = d
        bound = info(graph, node).bound
        for out, spec in zip(node.outputs, bound.annotation.outputs):
            a = lead_axis(spec, d) if out else None
            if a is not None:
                axis_of[out] = a

    if nodes[0] in dims:
        settle(graph.node(nodes[0]), dim)
    users = graph.consumers()
    made_by = {o: graph.node(n) for n in nodes for o in graph.node(n).outputs if o}
    changed = bool(dims)
    while changed:
        changed = False
        for name in nodes:
            if name in dims:
                continue
            node = graph.node(name)
            bound = info(graph, node).bound
            found = None
            inner = [ref.name for ref, spec in zip(node.input_refs(), bound.annotation.inputs)
                     if ref.name in made_by and not spec.meta_only]
            if any(partial(made_by[v], dims[made_by[v].name], v) for v in inner
                   if made_by[v].name in dims):
                continue  # a partial sum is summed outside the region: the chain ends before
            for ref, spec in zip(node.input_refs(), bound.annotation.inputs):  # from a producer
                a = axis_of.get(ref.name)
                if a is not None and not spec.opaque and not spec.meta_only and spec.axes[a].dims:
                    found = spec.axes[a].dims[0].name
                    break
            for out, spec in zip(node.outputs, bound.annotation.outputs):  # from a consumer
                if found or not out or spec.opaque or spec.meta_only:
                    continue
                for user in users.get(out, []):
                    if user.name not in members or user.name not in dims:
                        continue
                    ub = info(graph, user).bound
                    for ref, us in zip(user.input_refs(), ub.annotation.inputs):
                        a = lead_axis(us, dims[user.name]) if ref.name == out else None
                        if a is not None and a < len(spec.axes) and spec.axes[a].dims:
                            found = spec.axes[a].dims[0].name
                            break
            if found and any(partial(node, found, o) and any(u.name in dims for u in users.get(o, []))
                             for o in node.outputs if o):
                found = None  # its consumer in the chain would read a partial sum
            if found and _fits(plan, graph, name, found, k):
                settle(node, found)
                changed = True
    return dims


def _problems(plan: Plan, graph: Graph, nodes: list[str], tried: list[str], k: int) -> list[Problem]:
    out = []
    for d in tried[:1]:
        dims = _carry(plan, graph, nodes, d, k)
        for name in nodes:
            if name not in dims:
                bound = info(graph, graph.node(name)).bound
                out.append(Problem(
                    obj=f"node {name}", value=f"'{bound}' on {plan.num_pieces(name)} pieces",
                    rule=f"every node of a co-shard chain splits {k} more ways along the axis the chain "
                         f"splits (from {nodes[0]}'s {d!r}), evenly, one share per device",
                    fix="co-shard a shorter chain, another k, or another region"))
    return out


# ---------------------------------------------------------------- regions by name
def head_chain(graph: Graph) -> list[str]:
    """The output head: from the op making the largest tensor after the last numbered
    block to the graph's end (the loss)."""
    nodes = graph.nodes
    last = max((i for i, n in enumerate(nodes) if block_of(n.module)), default=-1)
    tail = nodes[last + 1:]
    if not tail:
        return []
    sizes = [max((graph.values[o].meta.numel for o in n.outputs if o), default=0) for n in tail]
    start = sizes.index(max(sizes))
    return [n.name for n in tail[start:]]


def module_chains(graph: Graph, names: tuple[str, ...]) -> list[list[str]]:
    """One chain per instance of each module named (the last part of its path)."""
    chains: dict[str, list[str]] = {}
    for node in graph.nodes:
        parts = node.module.split(".")
        for j in range(len(parts), 0, -1):
            if parts[j - 1] in names:
                chains.setdefault(".".join(parts[:j]), []).append(node.name)
                break
    return list(chains.values())


def with_coshard_spec(plan: Plan, graph: Graph, value: str) -> Plan:
    """The plan strings' ``coshard=`` option (see the module docstring)."""
    parsed = parse_coshard(value)
    if parsed is None:
        raise TorchweaveError(Problem(obj="coshard", value=value,
                                      rule="coshard is K (the output head) or NAME+NAME:K, K ≥ 2",
                                      fix="e.g. coshard=4 or coshard=attn:2"))
    names, k = parsed
    pipe = plan.pipeline
    if not names:
        chains = [head_chain(graph)]
    else:
        chains = module_chains(graph, names)
        if not chains:
            have = sorted({p for n in graph.nodes for p in n.module.split(".") if p and not p.isdigit()})
            raise TorchweaveError(Problem(
                obj="coshard", value=value, rule="each name is the last part of a module path",
                fix=f"the model's modules: {', '.join(have[:12])}{', ...' if len(have) > 12 else ''}"))
    for chain in chains:
        if pipe is not None:  # a chain never crosses a stage
            stage = pipe.stage_of.get(chain[0])
            chain = [n for n in chain if pipe.stage_of.get(n) == stage]
        if not chain:
            raise TorchweaveError(Problem(obj="coshard", value=value, rule="the region has ops",
                                          fix="name a module, or drop coshard"))
        with_coshard(plan, graph, chain, k, trim=True)
        if not names:
            _head_stays_chunked(plan, graph, chain[0], k, value)
    return plan


def _head_stays_chunked(plan: Plan, graph: Graph, first: str, k: int, value: str) -> None:
    """The head's largest tensor (its first node's output) must be read only inside the
    region: joined whole again, the co-shard would save nothing and cost a forward."""
    users = graph.consumers()
    node = graph.node(first)
    inside = {n for n, tr in plan.trans.items() if tr and tr[-1].parts == k and len(
        set(plan.assignment.get(n, []))) < len(plan.assignment.get(n, []))}
    out = node.outputs[0]
    if any(u.name not in inside for u in users.get(out, [])):
        bound = info(graph, node).bound
        raise TorchweaveError(Problem(
            obj="coshard", value=value,
            rule=f"the output head's {out} ('{bound}') stays in {k} chunks through the loss: its "
                 f"split must carry to the loss, so each device's share of the batch splits {k} ways",
            fix="a K that divides each device's samples (per micro-batch), or no coshard"))


__all__ = ["head_chain", "module_chains", "parse_coshard", "with_coshard", "with_coshard_spec"]
