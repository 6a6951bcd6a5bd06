"""Pipelined plans at scale: three stage groups, two data-parallel replicas, one or two blocks a stage.

A pipelined plan as the pipeline policies build it (:mod:`torchweave.policies.pipeline`)
runs ``pp`` groups of ``dp · tp`` devices, stage ``s`` on group ``s % pp``, each
stage a run of the model's identical blocks (:mod:`torchweave.sim.fold`), the
first with the prefix (embeddings) before them, the last with the suffix
(head, loss) after them, every group split the same way inside. Three kinds of
stage, then, and three kinds of pipeline rank: the first (it holds stage 0),
the last (it holds the last stage) and the middle ones, all alike.

:func:`simulate_stagefold` simulates such a plan from two cut-down models and
extrapolates, with no lowering of the full plan:

1. **stages**: a pipeline of ``pp' = min(pp, 3)`` ranks with the same
   ``virtual`` stages per rank (stage ``i·pp + q`` of the full plan is stage
   ``i·pp' + q'`` of the small one, ``q'`` the rank's kind), the same
   schedule kind, micro-batches and ZeRO stage;
2. **blocks**: every stage of the small pipeline holds ``k`` blocks, for
   ``k = 1`` and ``k = 2``. A stage's forward and backward seconds, its
   activations and a rank's model state are sums over its blocks, so affine
   in the blocks it holds: ``x(n) = x(1) + (n - 1)·(x(2) - x(1))`` per stage,
   and per rank in the blocks of all its stages;
3. **replicas**: with ``dp > 2`` and a batch split that repeats in every
   replica (as in :mod:`torchweave.sim.symmetry`), two replicas are lowered,
   their groups lifted to the full ``dp``; every size is taken from the full
   plan (:class:`~torchweave.sim.tasks.Builder` ``resized``).

The full plan's schedule then runs with the extrapolated
:class:`~torchweave.sim.pipeline.StageCost` of every stage, and each rank's
gradient sums and optimizer follow (:func:`~torchweave.sim.pipelined.finish_times`),
exactly as on the exact path: only the per-rank and per-stage sums come from
the small models.

What is approximate: where 25 MiB gradient buckets close (a bucket that
holds several blocks' gradients is extrapolated as if each block added its
share to it), and temporary buffers (the largest of one bucket, two
activations or units, which need not grow with the blocks: taken as in
:mod:`torchweave.sim.folded`). The tests compare against lowering and
simulating every rank at 64 GPUs for every schedule.

Not this path (simulated exactly instead): interlaced pipelines (shared stages),
multi-forward, custom schedules or orders, stage cuts inside a block, stages
without a block, and models without identical blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch

from torchweave.ir.graph import Graph
from torchweave.lower import steps
from torchweave.lower.program import Comm, Program
from torchweave.plan.layout import Mesh
from torchweave.plan.pipeline import Pipeline
from torchweave.plan.plan import Plan
from torchweave.plan.schedules import BUILTIN, builtin
from torchweave.sim.cluster import Cluster
from torchweave.sim.cost import ComputeModel
from torchweave.sim.backward import Buckets
from torchweave.sim.fold import _NUMBERED, Blocks, cut, find_blocks
from torchweave.sim.comm import Collective
from torchweave.sim.pipelined import RankCosts, Sums, rank_costs, run_pipeline
from torchweave.sim.symmetry import Replicas



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


def _block_index(path: str, prefix: str) -> int | None:
    """The block a parameter path is in (``blocks.3.attn.w`` → 3), or None."""
    m = _NUMBERED.match(path)
    return int(m.group(2)) if m and m.group(1) == prefix else None


def repacked(entries, per_block: dict[int, tuple[int, int]], stage_map: dict[int, int],
             cap: float) -> list[tuple[tuple[int, ...], float, frozenset[int]]] | None:
    """Gradient buckets of a rank whose stages hold more blocks than the 1-block small
    model's: each block's run of gradients repeated ``per_block[block] = (copies, full
    stage)`` times, then bucketed by the rule of :class:`~torchweave.sim.backward.Buckets`;
    the other gradients' stages mapped by ``stage_map`` (small stage → full stage).
    Returns (group, bytes, full stages) per bucket; None if a block's gradients are not one run."""
    seq, seen, i = [], set(), 0
    while i < len(entries):
        b = entries[i][4]
        j = i + 1
        while j < len(entries) and b is not None and entries[j][4] == b:
            j += 1
        if b is None:
            p, grp, nb, st, _ = entries[i]
            seq.append((p, grp, nb, frozenset(stage_map[x] for x in st)))
        else:
            if b in seen:
                return None
            seen.add(b)
            copies, stage = per_block[b]
            for c in range(copies):
                seq += [(f"{p}#{c}", grp, nb, frozenset((stage,))) for p, grp, nb, _, _ in entries[i:j]]
        i = j
    buckets, stages = Buckets(cap), {}
    out = []
    for name, grp, nb, st in seq:
        stages[name] = st
        out += buckets.add(name, grp, nb)
    out += buckets.drain()
    return [(grp, size, frozenset().union(*(stages[n] for n in names))) for grp, names, size in out]


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

    def group(grp, across: bool = False) -> tuple[int, ...]:
        qs = {r // small for r in grp}
        if len(qs) != 1:
            if across:  # a rank's list of groups: one between stage groups is kept as is
                return tuple(rank(r) for r in grp)
            raise _NotLiftable
        q = qs.pop()
        local = tuple(r % small for r in grp)
        if shape.keep != shape.dp:
            local = rep.lift(local)
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
                        lifted = groups(st.groups)
                        if lifted != tuple(st.groups) and shape.keep != shape.dp and not isinstance(
                                st, (steps.AllReduce, steps.GradAllReduce, steps.Split)):
                            return None  # data moves between replicas: not data parallel
                        st = replace(st, groups=lifted)
                    elif isinstance(st, steps.Narrow):
                        st = replace(st, boxes=tuple((rank(d), b) for d, b in st.boxes))
                    ins = replace(ins, step=st)
                instrs.append(ins)
            params = [replace(s, grad_groups=groups(s.grad_groups),
                              replicas=s.replicas * shape.dp // shape.keep) for s in prog.params]
            out.append(Program(rank(prog.rank), shape.small_pp * full, prog.plan_name,
                               list(dict.fromkeys(group(x, across=True) for x in prog.groups)), params, list(prog.inputs), instrs,
                               prog.loss, prog.loss_partial,
                               group(prog.loss_group) if prog.loss_group else None, prog.mesh))
    except _NotLiftable:
        return None
    return out


class _NotLiftable(Exception):
    pass


@dataclass
class _Small:
    """One cut-down simulation: per small rank, its costs and model state."""

    costs: dict[int, RankCosts]
    memory: dict[int, object]
    feet: dict[int, object]
    flops: float
    builder: object
    grads: dict[int, list[tuple[str, tuple[int, ...], float, frozenset[int], int | None]]]
    """Per rank: (parameter, group, bytes, stages making its gradient, block) in the
    order backward reaches them."""


def _simulate_small(graph: Graph, plan: Plan, cluster: Cluster, shape: StageShape, k: int, *,
                    dtype, model: ComputeModel, bucket_bytes: int, profiles) -> _Small | None:
    from torchweave.lower.lower import lower
    from torchweave.sim.simulate import _memory
    from torchweave.sim.tasks import Builder

    g, sized, lowered = small_models(graph, plan, shape, k)
    programs = lift(lower(g, lowered, stages=False), shape)
    if programs is None:
        return None
    builder = Builder(g, sized, cluster, dtype, model, bucket_bytes, profiles=profiles,
                      resized=shape.keep != shape.dp)
    costs, feet, grads = {}, {}, {}
    for prog in programs:
        ts, feet[prog.rank] = builder.tasks(prog)
        costs[prog.rank] = rank_costs(ts, feet[prog.rank])
        made_in: dict[str, set[int]] = {}
        for t in ts:
            if t.stage >= 0:
                for sig in t.sets:
                    made_in.setdefault(sig, set()).add(t.stage)
        block = {sh.local: _block_index(sh.path, shape.blocks.prefix) for sh in prog.params}
        grads[prog.rank] = [(p, grp, b, frozenset(made_in.get("g:" + p, ())), block.get(p))
                            for p, grp, b in feet[prog.rank].grad_order]
    ranks = sorted(costs)
    mem = _memory(sized, programs, feet, ranks, dtype, {r: 0 for r in ranks})
    return _Small(costs, dict(zip(ranks, mem)), feet, sum(c.model_flops for c in builder.costs.values()),
                  builder, grads)


def simulate_stagefold(graph: Graph, plan: Plan, cluster: Cluster, shape: StageShape, *,
                       dtype: torch.dtype | None, tokens: int, model: ComputeModel,
                       bucket_bytes: int, strict: bool, timeline: bool, profiles=None):
    """One step of ``plan`` by the stage fast path (see the module docstring); None where
    the small models cannot be lifted (the caller simulates exactly)."""
    from torchweave.plan.validate import validate
    from torchweave.sim.simulate import MemoryUse, pipeline_activations, pipelined_result

    validate(plan, graph)  # the full plan: its problems are named for the model as it is
    runs = []
    for k in (1, 2):
        run = _simulate_small(graph, plan, cluster, shape, k, dtype=dtype, model=model,
                              bucket_bytes=bucket_bytes, profiles=profiles)
        if run is None:
            return None
        runs.append(run)
    one, two = runs
    pipe = plan.pipeline
    builder = two.builder
    pp, pp2, v, g, g2 = shape.pp, shape.small_pp, shape.virtual, shape.group, shape.group
    n = shape.per_stage

    def ex(a: float, b: float, blocks: float, per: int) -> float:
        """Affine in blocks: ``a`` with ``per`` blocks, ``b`` with ``2 per``."""
        return max(0.0, a + (blocks - per) * (b - a) / per)

    def stages_of(q: int) -> list[int]:
        return [i * pp + q for i in range(v)]

    costs: dict[int, RankCosts] = {}
    memory: dict[int, MemoryUse] = {}
    for q in range(pp):
        q2 = shape.kind_of(q)
        full_stages = stages_of(q)
        blocks = sum(n[s] for s in full_stages)
        to_small = {s: shape.small_stage(s) for s in full_stages}
        to_full = {b: a for a, b in to_small.items()}
        for j in range(shape.tp):
            a, b = one.costs[q2 * g2 + j], two.costs[q2 * g2 + j]

            def per_stage(x: dict, y: dict, whole: bool = False) -> dict:
                return {s: (ex(x.get(s2, 0.0), y.get(s2, 0.0), n[s], 1) if not whole
                            else x.get(s2, 0.0)) for s, s2 in to_small.items()}

            shift = (q - q2) * g

            def resum(x: Sums | None, y: Sums | None, nb: float, per: int, coll) -> Sums | None:
                """Collectives grown with the blocks: as many more, as many more bytes, each
                costed at its extrapolated size on the full rank's group."""
                if x is None and y is None:
                    return None
                x, y = x or Sums(0, 0.0, 0.0, ()), y or Sums(0, 0.0, 0.0, ())
                count = max(1, round(ex(x.count, y.count, nb, per)))
                size = ex(x.nbytes, y.nbytes, nb, per)
                grp = tuple(d + shift for d in (y.group or x.group))
                return Sums(count, size, count * builder.comm(coll, size / count, grp), grp)

            sync = Collective.REDUCE_SCATTER if plan.zero >= 2 else Collective.ALL_REDUCE
            syncs = {}
            for key in a.syncs.keys() | b.syncs.keys():
                full_key = frozenset(to_full[s] for s in key)
                nb = sum(n[s] for s in full_key) if key else blocks
                syncs[full_key] = resum(a.syncs.get(key), b.syncs.get(key), nb,
                                        len(key) if key else v, sync)
            largest = max([two.feet[q2 * g2 + j].bucket]
                          + [x.nbytes for x in syncs.values() if x.count == 1])
            if plan.zero == 0:  # buckets close every ``bucket_bytes``: rebucket the full rank
                entries = one.grads[q2 * g2 + j]
                per_block = {e[4]: (n[to_full[next(iter(e[3]))]], to_full[next(iter(e[3]))])
                             for e in entries if e[4] is not None and len(e[3]) == 1
                             and next(iter(e[3])) in to_full}
                full = repacked([e if e[4] in per_block else (*e[:4], None) for e in entries],
                                per_block, to_full, bucket_bytes)
                if full is not None:
                    syncs, largest = {}, max((size for _, size, _ in full), default=0.0)
                    for grp, size, key in full:
                        grp = tuple(d + shift for d in grp)
                        one_sum = Sums(1, size, builder.comm(sync, size, grp), grp)
                        syncs[key] = syncs[key] + one_sum if key in syncs else one_sum
            c = RankCosts(
                fwd=per_stage(a.fwd, b.fwd), bwd=per_stage(a.bwd, b.bwd),
                activations={s: round(x) for s, x in per_stage(a.activations, b.activations).items()},
                boundary=per_stage(a.boundary, b.boundary, whole=True), syncs=syncs,
                gathers=resum(a.gathers, b.gathers, blocks, v, Collective.ALL_GATHER),
                rest=ex(a.rest, b.rest, blocks, v),
                stage_comm=ex(a.stage_comm, b.stage_comm, blocks, v),
                extra_activations=round(ex(a.extra_activations, b.extra_activations, blocks, v)))
            ma, mb = one.memory[q2 * g2 + j], two.memory[q2 * g2 + j]
            mem = {f.name: round(ex(getattr(ma, f.name), getattr(mb, f.name), blocks, v))
                   for f in fields(MemoryUse)}
            # Temporaries: forward's (constant in the blocks), the largest gradient bucket (a
            # bucket that is one sum grows with the blocks; once buckets close they do not),
            # and ZeRO-1/2's full local gradients (affine).
            temps = max(two.feet[q2 * g2 + j].held, round(largest))
            if plan.zero in (1, 2) and shape.dp > 1:
                temps = max(temps, mem["grads"] * shape.dp)
            mem["temporaries"] = temps
            r = q * g + j
            costs[r], memory[r] = c, MemoryUse(**mem)
    step, finish = run_pipeline(plan, cluster, costs)
    acts = pipeline_activations(plan, step, costs)
    ranks = list(range(plan.world_size))

    def rep(r: int) -> int:
        return r // g * g + r % g % shape.tp

    mem_all = tuple(replace(memory[rep(r)], activations=acts[rep(r)]) for r in ranks)
    total_blocks = len(shape.blocks)
    small_blocks = pp2 * v
    flops = ex(one.flops, two.flops, total_blocks, small_blocks)
    notes = (f"{total_blocks} identical '{shape.blocks.prefix}' blocks in {pipe.stages} stages on "
             f"{pp} pipeline ranks: simulated as {pp2} ranks with 1 and 2 blocks a stage"
             + (f", {shape.keep} of {shape.dp} data-parallel replicas" if shape.keep != shape.dp
                else "") + ", extrapolated (timeline: one replica)",)
    return pipelined_result(plan, cluster, step, {r: finish[rep(r)] for r in ranks},
                            {r: costs[rep(r)] for r in ranks}, mem_all, ranks, flops=flops,
                            tokens=tokens, dtype=dtype, model=model, strict=strict,
                            timeline=timeline, notes=notes, folded_blocks=total_blocks,
                            shown=set(costs))


__all__ = ["StageShape", "find_stage_shape", "simulate_stagefold"]
