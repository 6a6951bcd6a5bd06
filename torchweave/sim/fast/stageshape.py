"""The regular shape of a pipelined plan, and the small models the stage fast path simulates.

:func:`find_stage_shape` recognises a plan as the pipeline policies build it
(see :mod:`torchweave.sim.fast.stagefold`); :func:`small_models` cuts it down to
``min(pp, 3)`` pipeline ranks, ``k`` blocks a stage and two data-parallel
replicas; :func:`lift` puts the lowered small programs back on the full
``dp``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from torchweave.ir.graph import Graph
from torchweave.lower import steps
from torchweave.lower.program import Comm, Program
from torchweave.plan.layout import Mesh
from torchweave.plan.stage_plan import Pipeline
from torchweave.plan.plan import Plan
from torchweave.plan.schedules import BUILTIN, builtin
from torchweave.sim.fast.fold import Blocks, cut, find_blocks
from torchweave.sim.fast.symmetry import Replicas, _NotLiftable, lift_group


@dataclass(frozen=True)
class StageShape:
    """A pipelined plan's regular structure (see the module docstring)."""

    pp: int
    virtual: int
    dp: int
    tp: int
    """Devices of one replica inside a group (a group is ``dp · tp`` devices)."""
    blocks: Blocks
    per_stage: tuple[int, ...]
    """Blocks in each stage of the full plan."""
    keep: int
    """Data-parallel replicas lowered (``dp``, or 2 when the replicas are symmetric)."""

    @property
    def group(self) -> int:
        return self.dp * self.tp

    @property
    def small_pp(self) -> int:
        return min(self.pp, 3)

    def kind_of(self, q: int) -> int:
        """The small pipeline's rank standing for full pipeline rank ``q``."""
        if q == 0:
            return 0
        return self.small_pp - 1 if q == self.pp - 1 else 1

    def small_stage(self, s: int) -> int:
        i, q = divmod(s, self.pp)
        return i * self.small_pp + self.kind_of(q)


def find_stage_shape(graph: Graph, plan: Plan, *, symmetry: bool = True) -> StageShape | None:
    """The plan's :class:`StageShape`, or None where this path does not apply; ``symmetry``:
    lower two data-parallel replicas where the rest repeat them."""
    pipe = plan.pipeline
    if (pipe is None or pipe.kind not in BUILTIN or pipe.recycle is not None or pipe.shared
            or plan.orders or plan.mesh is None or len(plan.mesh.axes) != 3):
        return None
    pp, w = len(pipe.groups), plan.world_size
    (_, mp), (_, dp), (_, tp) = plan.mesh.axes
    if mp != pp or pp * dp * tp != w or pipe.stages % pp:
        return None
    g, v = dp * tp, pipe.stages // pp
    if any(tuple(grp) != tuple(range(q * g, (q + 1) * g)) for q, grp in enumerate(pipe.groups)):
        return None
    if any(r != s % pp for s, r in enumerate(pipe.stage_rank)):
        return None
    try:
        if pipe.schedule != builtin(pipe.kind, pp, v, pipe.micro_batches):
            return None
    except Exception:  # noqa: BLE001 - not a built-in shape: simulate exactly
        return None
    relative = replace(plan, assignment={n: [d % g for d in ds] for n, ds in plan.assignment.items()})
    blocks = find_blocks(graph, relative)
    if blocks is None:
        return None
    stage = [pipe.stage_of.get(n.name, -1) for n in graph.nodes]
    if any(b < a for a, b in zip(stage, stage[1:])) or min(stage, default=-1) < 0:
        return None
    first, end = blocks.spans[0][0], blocks.spans[-1][1]
    if set(stage[:first]) - {0} or set(stage[end:]) - {pipe.stages - 1}:
        return None
    per = [0] * pipe.stages
    for a, b in blocks.spans:
        if len(set(stage[a:b])) != 1:
            return None  # a stage starts inside a block
        per[stage[a]] += 1
    if min(per) < 1:
        return None
    small = min(pp, 3) * v
    if 2 * small > len(blocks) or (pp <= 3 and max(per) <= 2 and dp <= 2):
        return None  # the small models would not be smaller
    keep = 2 if symmetry and dp > 2 and _replicas_repeat(plan, dp, tp) else dp
    return StageShape(pp, v, dp, tp, blocks, tuple(per), keep)


def _replicas_repeat(plan: Plan, dp: int, tp: int) -> bool:
    """Every node's first split is the batch over ``dp`` replicas that repeat inside each group."""
    g = dp * tp
    shift = (torch.arange(dp) * tp)[:, None]
    for node, trans in plan.trans.items():
        if not trans or trans[0].parts != dp:
            return False
        devs = plan.assignment.get(node)
        if devs is None or len(devs) % dp:
            return False
        base = devs[0] // g * g
        a = torch.tensor(devs).view(dp, -1) - base
        if int(a.min()) < 0 or int(a[0].max()) >= tp or not torch.equal(a - a[0], shift.expand_as(a)):
            return False
    return True


def small_models(graph: Graph, plan: Plan, shape: StageShape, k: int
                 ) -> tuple[Graph, Plan, Plan]:
    """The cut-down graph with ``k`` blocks a stage, its plan with the full ``dp`` (whose
    sizes the simulator takes) and with ``shape.keep`` replicas (which is lowered)."""
    pp2, v = shape.small_pp, shape.virtual
    stages = pp2 * v
    g, _ = cut(graph, plan, shape.blocks, stages * k)
    pipe = plan.pipeline
    prefix_end = shape.blocks.spans[0][0]
    stage_of: dict[str, int] = {}
    for i, node in enumerate(g.nodes):
        if i < prefix_end:
            stage_of[node.name] = 0
        elif i < prefix_end + stages * k * _block_len(shape):
            stage_of[node.name] = (i - prefix_end) // (k * _block_len(shape))
        else:
            stage_of[node.name] = stages - 1
    micro = _micro(pipe.kind, pipe.micro_batches, pp2)
    out = []
    for dp in (shape.dp, shape.keep):
        size = dp * shape.tp
        trans, assign = {}, {}
        for node in g.nodes:
            t = plan.trans.get(node.name)
            devs = plan.assignment.get(node.name)
            if devs is None:
                continue
            rel = [d % shape.group for d in devs][:len(devs) // shape.dp * dp]
            base = stage_of[node.name] % pp2 * size
            assign[node.name] = [base + d for d in rel]
            if t is not None:
                trans[node.name] = ([replace(t[0], parts=dp), *t[1:]] if dp != shape.dp else list(t))
        names = [a for a, _ in plan.mesh.axes]
        small = Plan(world_size=pp2 * size, name=plan.name,
                     mesh=Mesh(((names[0], pp2), (names[1], dp), (names[2], shape.tp))),
                     trans=trans, assignment=assign, zero=plan.zero, zero_axis=plan.zero_axis,
                     notes=dict(plan.notes),
                     recompute=[grp for grp in (tuple(n for n in r if n in stage_of)
                                                for r in plan.recompute) if grp])
        small.pipeline = Pipeline(
            groups=[tuple(range(q * size, (q + 1) * size)) for q in range(pp2)],
            stage_of=stage_of, stage_rank=[s % pp2 for s in range(stages)],
            micro_batches=micro, kind=pipe.kind, schedule=builtin(pipe.kind, pp2, v, micro))
        out.append(small)
    return g, out[0], out[1]


def _block_len(shape: StageShape) -> int:
    a, b = shape.blocks.spans[1]
    return b - a


def _micro(kind: str, micro: int, pp: int) -> int:
    """A micro-batch count the small schedule accepts (its actions are not simulated:
    the full plan's schedule is, and the Programs are the whole batch's)."""
    return micro if kind != "interleaved" or micro % pp == 0 else pp * math.ceil(micro / pp)


def lift(programs: list[Program], shape: StageShape) -> list[Program] | None:
    """The lowered programs (``keep`` replicas a group) in the full-``dp`` small world: each
    group's data-parallel groups lifted to ``dp`` members (None: not liftable)."""
    small, full = shape.keep * shape.tp, shape.group
    rep = Replicas(shape.dp, shape.tp)

    def rank(r: int) -> int:
        return r // small * full + r % small

    def group(grp, across: bool = False, parts: bool = False) -> tuple[int, ...]:
        qs = {r // small for r in grp}
        if len(qs) != 1:
            if across:  # a rank's list of groups: one between stage groups is kept as is
                return tuple(rank(r) for r in grp)
            if parts:  # a tied weight's copies on several stage groups: each part lifted
                return tuple(sorted(d for q in sorted(qs)
                                    for d in group(tuple(r for r in grp if r // small == q))))
            raise _NotLiftable
        q = qs.pop()
        local = tuple(r % small for r in grp)
        if shape.keep != shape.dp:
            local = lift_group(rep, local)
            if local is None:
                raise _NotLiftable
        return tuple(q * full + r for r in local)

    def groups(gs) -> tuple:
        return tuple(dict.fromkeys(group(g) for g in gs))

    def transfers(ts) -> tuple:
        return tuple(replace(t, src=rank(t.src), dst=rank(t.dst)) for t in ts)

    out = []
    try:
        for prog in programs:
            if prog.rank % small >= shape.tp:
                continue  # replica 0 of each group stands for all
            instrs = []
            for ins in prog.instrs:
                if isinstance(ins, Comm):
                    st = ins.step
                    if isinstance(st, steps.P2P):
                        st = replace(st, transfers=transfers(st.transfers),
                                     grad_back=transfers(st.grad_back),
                                     shapes=tuple((rank(d), s) for d, s in st.shapes),
                                     grad_scale=tuple((rank(d), s) for d, s in st.grad_scale))
                    elif hasattr(st, "groups"):
                        # a group that grows when lifted spans replicas: only sums may (data
                        # parallelism's); any other collective there moves data between them
                        grown = any(len(group(x)) != len(x) for x in st.groups)
                        if grown and not st.SPANS_REPLICAS:
                            return None  # data moves between replicas: not data parallel
                        st = replace(st, groups=groups(st.groups))
                    elif isinstance(st, steps.Narrow):
                        st = replace(st, boxes=tuple((rank(d), b) for d, b in st.boxes))
                    ins = replace(ins, step=st)
                instrs.append(ins)
            params = [replace(s, grad_groups=tuple(dict.fromkeys(group(g, parts=True)
                                                                 for g in s.grad_groups)),
                              replicas=s.replicas * shape.dp // shape.keep) for s in prog.params]
            out.append(Program(rank(prog.rank), shape.small_pp * full, prog.plan_name,
                               list(dict.fromkeys(group(x, across=True) for x in prog.groups)), params, list(prog.inputs), instrs,
                               prog.loss, prog.loss_partial,
                               group(prog.loss_group) if prog.loss_group else None, prog.mesh))
    except _NotLiftable:
        return None
    return out


__all__ = ["StageShape", "find_stage_shape", "lift", "small_models"]
