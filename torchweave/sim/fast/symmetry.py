"""Data-parallel symmetry: lower and simulate one replica instead of all of them.

A plan on ``W = D × T`` ranks has *replica symmetry* when its mesh's outermost
axis has ``D`` devices, every node's first transform has ``D`` parts (from that
axis: a data-parallel split or replica) and its pieces along that transform sit on
consecutive blocks of ``T`` ranks, the same way in every block: piece
``(i, rest)`` runs on rank ``i·T + j`` where ``(0, rest)`` runs on rank ``j``.
The mesh-based policies (``dp``, ``zero*``, ``tp``, ``sp`` with ``dp`` outermost)
build plans of this shape. The ranks ``j, T + j, 2T + j, …`` then run the same
program on different data, and communicate across replicas only in
collectives that span every replica alike (gradient sums, the loss's sum).

So the simulator:

1. lowers a *reduced* plan with two replicas instead of ``D``
   (:func:`reduce_plan`): the same transforms with ``2`` parts for the first
   one, and the first ``2T`` ranks. Two are needed, not one, so that a
   collective that crosses replicas shows as one;
2. *lifts* the reduced programs of replica 0 back to the full world
   (:func:`lift_programs`): a group that spans both reduced replicas becomes
   the same positions in all ``D``; a group inside one replica is kept;
3. simulates the ``T`` programs of replica 0 only. A collective meets among
   the simulated members of its group (by symmetry the others arrive at the
   same time) and costs what it costs on the full group.

Sizes along the split dimension differ between the reduced and the full plan
(``B/2`` against ``B/D``). The simulator takes every size from the full plan
(:class:`~torchweave.sim.step.build.Builder` ``cost_plan``); only local slices
(``Narrow``) carry a box, and their sizes are taken from the consumer's piece
under the full plan. A point-to-point transfer across replicas cannot be
lifted, and neither can a gather, scatter or all-to-all across
replicas (the replica axis then is not data parallel, and the choice of
steps may depend on its size): :func:`lift_programs` returns None and the
caller lowers every rank. Only sums (the loss, gradients) and local
slices of a replicated tensor (the batch split) cross replicas.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from torchweave.ir.graph import Graph
from torchweave.lower import steps
from torchweave.lower.lower import lower
from torchweave.lower.program import Comm, Program
from torchweave.plan.layout import Mesh
from torchweave.plan.plan import Order, PieceRef, Plan
from torchweave.sim.explain.result import Replicas


def lift_group(rep: Replicas, group: tuple[int, ...]) -> tuple[int, ...] | None:
    """A group of the two-replica world, in the full world (None: not liftable)."""
    t = rep.size
    blocks = {r // t for r in group}
    if len(blocks) == 1:
        return tuple(group)
    pos = [sorted(r % t for r in group if r // t == b) for b in sorted(blocks)]
    if len(pos) != 2 or pos[0] != pos[1]:
        return None
    return tuple(i * t + j for i in range(rep.count) for j in pos[0])


def find_replicas(plan: Plan, nodes: list[str]) -> Replicas | None:
    """The replica symmetry of ``plan`` (see the module docstring), or None."""
    w = plan.world_size
    if plan.orders:  # replicas may be ordered differently: simulate each (exact path)
        return None
    first = {t[0].parts for n in nodes if (t := plan.transforms(n))}
    if len(first) != 1 or any(not plan.transforms(n) for n in nodes):
        return None
    d = first.pop()
    if d < 2 or w % d or plan.mesh is None or plan.mesh.axes[0][1] != d:
        return None
    t = w // d
    shift = (torch.arange(d) * t)[:, None]
    for n in nodes:
        devs = plan.assignment.get(n)
        if devs is None or len(devs) % d:
            return None
        a = torch.tensor(devs).view(d, -1)
        if int(a[0].max()) >= t or int(a[0].min()) < 0 or not torch.equal(a - a[0], shift.expand_as(a)):
            return None
    return Replicas(d, t)


def reduce_plan(plan: Plan, rep: Replicas, keep: int = 2) -> Plan:
    """The plan with ``keep`` replicas: first transform ``keep`` parts, first ``keep·T`` ranks."""
    mesh = plan.mesh
    if mesh is not None:  # the outermost axis of size D is the replicas' one
        mesh = (Mesh(((mesh.axes[0][0], keep), *mesh.axes[1:])) if mesh.axes[0][1] == rep.count
                else None)
    out = Plan(world_size=keep * rep.size, name=plan.name, mesh=mesh, zero=plan.zero,
               zero_axis=plan.zero_axis, notes=dict(plan.notes),
               recompute=[tuple(g) for g in plan.recompute])
    for node, trans in plan.trans.items():
        out.trans[node] = [replace(trans[0], parts=keep), *trans[1:]]
        devs = plan.assignment[node]
        out.assignment[node] = list(devs[:len(devs) // rep.count * keep])
    out.orders = [Order(PieceRef(o.before.node, o.before.piece), PieceRef(o.after.node, o.after.piece))
                  for o in plan.orders if o.before.piece[:1] < (keep,) and o.after.piece[:1] < (keep,)]
    return out


def lift_programs(programs: list[Program], rep: Replicas) -> list[Program] | None:
    """Replica 0's programs with every group lifted to the full world (None: not liftable)."""
    cache: dict[tuple[int, ...], tuple[int, ...] | None] = {}

    def lift(g: tuple[int, ...]) -> tuple[int, ...]:
        if g not in cache:
            cache[g] = lift_group(rep, tuple(g))
        if cache[g] is None:
            raise _NotLiftable
        return cache[g]  # type: ignore[return-value]

    def groups(gs) -> tuple:
        return tuple(dict.fromkeys(lift(g) for g in gs))

    out = []
    try:
        for prog in programs[:rep.size]:
            instrs = []
            for ins in prog.instrs:
                if isinstance(ins, Comm):
                    st = ins.step
                    if isinstance(st, steps.P2P):
                        if any(r >= rep.size for r in steps.devices_of(st)):
                            return None
                    elif hasattr(st, "groups"):
                        lifted = groups(st.groups)
                        if lifted != tuple(st.groups) and not st.SPANS_REPLICAS:
                            return None  # data moves between replicas: not data parallel
                        ins = replace(ins, step=replace(st, groups=lifted))
                instrs.append(ins)
            params = [replace(s, grad_groups=groups(s.grad_groups),
                              replicas=s.replicas * rep.count // 2) for s in prog.params]
            new = Program(prog.rank, rep.count * rep.size, prog.plan_name, list(groups(prog.groups)),
                          params, list(prog.inputs), instrs, prog.loss, prog.loss_partial,
                          lift(prog.loss_group) if prog.loss_group else None, prog.mesh)
            out.append(new)
    except _NotLiftable:
        return None
    return out


class _NotLiftable(Exception):
    pass


SYMMETRY_RANKS = 16
"""Plans on this many ranks are simulated one data-parallel replica for all (when symmetric)."""


def lower_programs(graph: Graph, plan: Plan, symmetry: bool | None):
    """Programs to simulate, and the replica symmetry used (None: every rank lowered).
    ``symmetry`` None: one replica for all when there are more than two on
    ``SYMMETRY_RANKS`` ranks or more; True: whenever the plan has them; False: never."""
    rep = find_replicas(plan, [n.name for n in graph.nodes]) if symmetry is not False else None
    if rep is not None and (symmetry or (rep.count > 2 and plan.world_size >= SYMMETRY_RANKS)):
        # ``lower`` validates the reduced plan; the full one has its shape (find_replicas).
        lifted = lift_programs(lower(graph, reduce_plan(plan, rep)), rep)
        if lifted is not None:
            return lifted, rep
    return lower(graph, plan), None


__all__ = ["SYMMETRY_RANKS", "Replicas", "find_replicas", "lift_group", "lower_programs", "lift_programs", "reduce_plan"]
