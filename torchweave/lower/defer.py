"""Gradient sums of replicated parameter-only computations, deferred to the parameters.

A value that every rank of a group computes alike from parameters alone (a
position embedding looked up at ``arange``, a relative-position bias table, a
class token) and that a batch-split op reads has a partial gradient on each
rank. Lowering sums it where it is read (a ``grad_all_reduce``: nothing
forward, an all-reduce in backward, blocking, on an activation). Backward is
linear in the incoming gradient, so the same sum can be taken at the
parameters instead, where the bucketed, overlapped gradient sync takes it
with every other gradient, as DDP does; and a ZeRO plan then shards those
parameters like the rest, since their gradients are summed over its group.

The move is exact only when nothing else mixes into those gradients. For a
value ``v`` whose only step is ``grad_all_reduce`` over groups ``G``, its
*cone* is every node ``v`` depends on through non-parameter values. The sum
moves to the cone's parameters when:

- no graph input feeds the cone (it is parameters, buffers and constants only);
- every node of the cone reads its inputs with no communication, so each rank
  of ``G`` computes the whole cone alike;
- every floating value of the cone is read outside it only through a lone
  ``grad_all_reduce`` over the same ``G`` (inside it, with no step);
- every trainable parameter of the cone is read only inside it, is held by exactly
  the ranks of ``G``, each group of ``G`` holding one piece of it (whole, or its
  share of a split the readers pulled back: ``plan/propagate.py``), and has no
  gradient sum of its own, or, as a pipeline stage's copy (``lower/copies.py``),
  copies' sums that link with ``G`` into grids (:func:`_grid`): the parameter is
  then summed over the linked sets;
- the cone has no co-sharded node.

Cones that share a trainable parameter (a table each block looks up for itself)
are taken together: their sums move together or not at all, and must agree on
every device. In a pipeline a value read on another stage crosses by a transfer,
not a lone ``grad_all_reduce``, so its cone stays as it is.

Then the ``grad_all_reduce`` steps of every value of the cone go (an inner
value read by a split op too: a step kept there would sum its part twice),
their readers read the values themselves, and the cone's parameters are
summed over ``G`` by the gradient sync.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch.utils._pytree as pytree

from torchweave.lower.coshard import coshard_key
from torchweave.lower.program import Comm, Compute, LocalRef
from torchweave.lower.steps import GradAllReduce, Group, Step

if TYPE_CHECKING:
    from torchweave.lower.lower import Lowering

NONE = "none"
OTHER = "other"


def read_kind(steps: list[Step]) -> Any:
    """How a reader got a value: with no step, through a lone grad_all_reduce (its groups), or else."""
    if not steps:
        return NONE
    if len(steps) == 1 and isinstance(steps[0], GradAllReduce):
        return frozenset(steps[0].groups)
    return OTHER


def _cone(low: "Lowering", value: str) -> tuple[set[str], set[str]] | None:
    """(nodes, parameters) ``value`` depends on through non-parameter values; None if an input does."""
    nodes: set[str] = set()
    params: set[str] = set()
    todo = [value]
    while todo:
        v = todo.pop()
        kind = low.graph.values[v].kind
        if kind in ("param", "buffer"):
            params.add(v)
            continue
        if kind == "input":
            return None
        node = low.producer.get(v)
        if node is None or node in nodes:
            continue
        nodes.add(node)
        todo += [r.name for r in low.nodes[node].input_refs()]
    return nodes, params


def _trainable(low: "Lowering", params: set[str]) -> set[str]:
    return {p for p in params if low.graph.values[p].kind == "param"
            and low.graph.values[p].requires_grad}


def _movable(low: "Lowering", values: list[str], groups: dict[str, frozenset[Group]],
             cones: dict) -> tuple[dict[str, tuple[Group, ...]], set[str]] | None:
    """(each cone parameter's gradient groups, the cone's values) if the sums of ``values``
    (whose cones share trainable parameters; ``groups[v]``: ``v``'s sum; ``cones[v]``: its
    cone) may move to the parameters (module docstring), else None."""
    nodes: set[str] = set()
    params: set[str] = set()
    for value in values:
        cone = cones[value]
        if cone is None:
            return None
        nodes |= cone[0]
        params |= cone[1]
    if any(coshard_key(low.plan, n) is not None for n in nodes):
        return None
    every = frozenset().union(*groups.values())
    members = set().union(*every)
    summed: dict[int, Group] = {}
    for g in every:  # the values' sums must agree on every device (one per stage's devices
        for d in g:  # in a pipeline): where one is summed over dp and another over dp x tp,
            if summed.setdefault(d, g) != g:  # no one sum at the parameters is right
                return None
    trainable = _trainable(low, params)
    outputs = {o for n in nodes for o in low.nodes[n].outputs if o}
    for v, reader, kind in low.reads:
        inside = reader in nodes
        if v in params:
            if kind != NONE or (not inside and v in trainable):
                return None
        elif v in outputs:
            if inside and kind != NONE:
                return None
            if not inside and v in low.grad_values and not (
                    isinstance(kind, frozenset) and kind <= every):
                return None
    out: dict[str, tuple[Group, ...]] = {}
    for p in trainable:
        held = low.held.get(p, {})
        if set(held) != members or any(q.is_partial for q in held.values()):
            return None
        if p not in low.copied and low.param_grad.get(p, ()):
            return None
        # the sum: over the holders that the groups and, for a pipeline stage's copy
        # (lower/copies.py), its copies' sums link, each set holding one piece
        copies = low.param_grad.get(p, ())
        sums = _linked(list(every) + list(copies))
        if any(len({held[d].box for d in g}) != 1 for g in sums) or \
                not all(_grid(j, every, copies) for j in sums):
            return None
        out[p] = sums
    return out, outputs


def _grid(linked: Group, groups: frozenset[Group], copies: tuple[Group, ...]) -> bool:
    """Whether ``linked`` is a grid of the groups and the copies' sums in it: each group (a
    stage's devices summed over dp) meets each copies' sum (one device per stage) in exactly
    one device. Then it holds one device of every stage and dp rank, none twice; two groups
    of one stage linked together (tensor-parallel replicas, which hold the same
    contribution) would count a contribution twice."""
    inner = [set(g) for g in groups if set(g) <= set(linked)]
    across = [set(c) for c in copies if set(c) <= set(linked)]
    return not across or all(len(g & c) == 1 for g in inner for c in across)


def _linked(groups: list[Group]) -> tuple[Group, ...]:
    """The groups merged where they share a device: the sets of devices they link."""
    merged: list[set[int]] = []
    for g in groups:
        touch = [m for m in merged if m & set(g)]
        new = set(g).union(*touch)
        merged = [m for m in merged if not m & set(g)] + [new]
    return tuple(sorted(tuple(sorted(m)) for m in merged))


def _by_shared_params(low: "Lowering", cones: dict) -> list[list[str]]:
    """The candidate values in sets whose cones share a trainable parameter (per-block
    lookups of one table: their sums move together or not at all)."""
    parent = {v: v for v in cones}

    def root(v: str) -> str:
        while parent[v] != v:
            parent[v] = v = parent[parent[v]]
        return v

    first: dict[str, str] = {}  # parameter → the first candidate whose cone reads it
    for value, cone in cones.items():
        for p in _trainable(low, cone[1]) if cone else ():
            if p in first:
                a, b = root(first[p]), root(value)
                if a != b:
                    parent[b] = a
            else:
                first[p] = value
    sets: dict[str, list[str]] = {}
    for value in cones:
        sets.setdefault(root(value), []).append(value)
    return list(sets.values())


def defer_replicated_sums(low: "Lowering") -> None:
    """Move each movable ``grad_all_reduce`` to its cone's parameters (module docstring)."""
    candidates = {v: kind for v, _, kind in low.reads if isinstance(kind, frozenset)}
    gone: set[int] = set()
    cones = {v: _cone(low, v) for v in candidates}
    for values in _by_shared_params(low, cones):
        movable = _movable(low, values, {v: candidates[v] for v in values}, cones)
        if movable is None:
            continue
        sums, cone_values = movable
        low.param_grad.update(sums)
        # every value of the cone read outside it (through a lone grad_all_reduce, as
        # checked): a step kept on an inner one would sum its part twice, there and at the
        # parameters
        for v in cone_values:
            gone |= {id(s) for s in low.grad_steps.get(v, [])}
    if gone:
        for prog in low.programs:
            prog.instrs = drop_comms(prog.instrs, gone)


def drop_comms(instrs: list, gone: set[int]) -> list:
    """``instrs`` without the Comms whose step is in ``gone``; their readers read the source."""
    rename: dict[str, str] = {}
    out = []
    for ins in instrs:
        if isinstance(ins, Comm) and id(ins.step) in gone:
            rename[ins.dst] = rename.get(ins.src, ins.src)
            continue
        out.append(renamed_reads(ins, rename))
    return out


def renamed_reads(ins: Any, rename: dict[str, str]) -> Any:
    """``ins`` reading ``rename[x]`` wherever it read local name ``x``."""
    if rename and isinstance(ins, Compute) and not rename.keys().isdisjoint(ins.reads()):
        args, kwargs = pytree.tree_map(
            lambda x: LocalRef(rename.get(x.name, x.name)) if isinstance(x, LocalRef) else x,
            (ins.args, ins.kwargs))
        return replace(ins, args=args, kwargs=kwargs)
    if rename and isinstance(ins, Comm) and set(ins.reads()) & rename.keys():
        return replace(ins, src=rename.get(ins.src, ins.src),
                       extra=tuple(rename.get(x, x) for x in ins.extra))
    return ins
