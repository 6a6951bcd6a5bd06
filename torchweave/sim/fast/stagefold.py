"""Pipelined plans at scale: three stage groups, two data-parallel replicas, one or two blocks a stage.

A pipelined plan as the pipeline policies build it (:mod:`torchweave.policies.pipeline_policy`)
runs ``pp`` groups of ``dp · tp`` devices, stage ``s`` on group ``s % pp``, each
stage a run of the model's identical blocks (:mod:`torchweave.sim.fast.fold`), the
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
   replica (as in :mod:`torchweave.sim.fast.symmetry`), two replicas are lowered,
   their groups lifted to the full ``dp``; every size is taken from the full
   plan (:class:`~torchweave.sim.step.build.Builder` ``resized``).

The full plan's schedule then runs with the extrapolated
:class:`~torchweave.sim.step.schedule.StageCost` of every stage, and each rank's
gradient sums and optimizer follow (:func:`~torchweave.sim.step.pipelined.finish_times`),
exactly as on the exact path: only the per-rank and per-stage sums come from
the small models.

What is approximate: where 25 MiB gradient buckets close (a bucket that
holds several blocks' gradients is extrapolated as if each block added its
share to it), and temporary buffers (the largest of one bucket, two
activations or units, which need not grow with the blocks: taken as in
:mod:`torchweave.sim.fast.folded`). The tests compare against lowering and
simulating every rank at 64 GPUs for every schedule.

Not this path (simulated exactly instead): interlaced pipelines (shared stages),
multi-forward, custom schedules or orders, stage cuts inside a block, stages
without a block, and models without identical blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from torchweave.ir.graph import Graph
from torchweave.lower.lower import lower
from torchweave.plan.plan import Plan
from torchweave.plan.validate import validate
from torchweave.sim.explain.result import MemoryUse
from torchweave.sim.fast.stageshape import StageShape, find_stage_shape, lift, small_models
from torchweave.sim.hardware.cluster import Cluster
from torchweave.sim.hardware.collective_cost import Collective
from torchweave.sim.hardware.compute import ComputeModel
from torchweave.sim.hardware.memory import model_state_memory
from torchweave.sim.step.backward import Buckets
from torchweave.sim.step.build import Builder
from torchweave.sim.step.pipelined import RankCosts, Sums, rank_costs, run_pipeline
from torchweave.sim.step.run import memory_use, pipeline_activations, pipelined_result
from torchweave.sim.step.signals import grad


def repacked(entries, per_block: dict[int, tuple[int, int]], stage_map: dict[int, int],
             cap: float) -> list[tuple[tuple[int, ...], float, frozenset[int]]] | None:
    """Gradient buckets of a rank whose stages hold more blocks than the 1-block small
    model's: each block's run of gradients repeated ``per_block[block] = (copies, full
    stage)`` times, then bucketed by the rule of :class:`~torchweave.sim.step.backward.Buckets`;
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
    zero_group: dict[int, tuple[int, ...]]
    """Per rank: the group its ZeRO shards are over (``Plan.zero_group`` of the small plan,
    whose data-parallel degree is the full plan's); ``()`` without ZeRO."""


def _simulate_small(graph: Graph, plan: Plan, cluster: Cluster, shape: StageShape, k: int, *,
                    dtype, model: ComputeModel, bucket_bytes: int, profiles) -> _Small | None:
    g, sized, lowered = small_models(graph, plan, shape, k)
    programs = lift(lower(g, lowered, stages=False), shape)
    if programs is None:
        return None
    builder = Builder(g, sized, cluster, dtype, model, bucket_bytes, profiles=profiles,
                      resized=shape.keep != shape.dp, micro=plan.pipeline.micro_batches)
    costs, feet, grads = {}, {}, {}
    for prog in programs:
        ts, feet[prog.rank] = builder.tasks(prog)
        costs[prog.rank] = rank_costs(ts, feet[prog.rank], cluster.device.comm_overlaps_compute)
        made_in: dict = {}
        for t in ts:
            if t.stage is not None:
                for sig in t.sets:
                    made_in.setdefault(sig, set()).add(t.stage)
        block = {sh.local: shape.blocks.index_of(sh.path) for sh in prog.params}
        grads[prog.rank] = [(p, grp, b, frozenset(made_in.get(grad(p), ())), block.get(p))
                            for p, grp, b in feet[prog.rank].grad_order]
    ranks = sorted(costs)
    mem = memory_use(sized, programs, feet, ranks, dtype, {r: 0 for r in ranks})
    return _Small(costs, dict(zip(ranks, mem)), feet, sum(c.model_flops for c in builder.costs.values()),
                  builder, grads, {p.rank: sized.zero_group(p.rank) for p in programs})


def simulate_stagefold(graph: Graph, plan: Plan, cluster: Cluster, shape: StageShape, *,
                       dtype: torch.dtype | None, tokens: int, model: ComputeModel,
                       bucket_bytes: int, strict: bool, timeline: bool, profiles=None):
    """One step of ``plan`` by the stage fast path (see the module docstring); None where
    the small models cannot be lifted (the caller simulates exactly)."""
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
    precision = "bf16-mixed" if dtype in (torch.bfloat16, torch.float16) else "fp32"
    pp, pp2, v, g = shape.pp, shape.small_pp, shape.virtual, shape.group
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
            r2 = q2 * g + j  # the small model's rank standing for ranks q·g + j
            a, b = one.costs[r2], two.costs[r2]

            def per_stage(x: dict, y: dict, whole: bool = False) -> dict:
                return {s: (ex(x.get(s2, 0.0), y.get(s2, 0.0), n[s], 1) if not whole
                            else x.get(s2, 0.0)) for s, s2 in to_small.items()}

            shift = (q - q2) * g

            def moved(grp: tuple[int, ...]) -> tuple[int, ...]:
                """A small rank's group on the full rank: its own pipeline rank's members
                shifted with it; a tied weight's copies on the first or the last pipeline
                rank stay on the first or move to the last."""
                return tuple(d + (shift if d // g == q2 else (pp - pp2) * g if d // g == pp2 - 1
                                  else 0 if d // g == 0 else shift) for d in grp)

            def resum(x: Sums | None, y: Sums | None, nb: float, per: int, coll) -> Sums | None:
                """Collectives grown with the blocks: as many more, as many more bytes, each
                costed at its extrapolated size on the full rank's group."""
                if x is None and y is None:
                    return None
                x, y = x or Sums(0, 0.0, 0.0, ()), y or Sums(0, 0.0, 0.0, ())
                count = max(1, round(ex(x.count, y.count, nb, per)))
                size = ex(x.nbytes, y.nbytes, nb, per)
                grp = moved(y.group or x.group)
                return Sums(count, size, count * builder.comm(coll, size / count, grp), grp)

            # ZeRO-2 reduce-scatters what it owns (what its group sums); the rest (a tied
            # weight's copies, across stage groups; a norm's under sequence parallelism,
            # over tp × dp) is all-reduced
            zgroup = two.zero_group[r2]
            sync = Collective.REDUCE_SCATTER if plan.zero >= 2 else Collective.ALL_REDUCE
            syncs = {}
            for key in a.syncs.keys() | b.syncs.keys():
                stages, grp = key
                full_stages = frozenset(to_full[s] for s in stages)
                nb = sum(n[s] for s in full_stages) if stages else blocks
                got = resum(a.syncs.get(key), b.syncs.get(key), nb, len(stages) if stages else v,
                            sync if tuple(grp) == zgroup else Collective.ALL_REDUCE)
                syncs[(full_stages, got.group)] = got
            largest = max([two.feet[r2].bucket]
                          + [x.nbytes for x in syncs.values() if x.count == 1])
            if plan.zero == 0:  # buckets close every ``bucket_bytes``: rebucket the full rank
                entries = one.grads[r2]
                per_block = {e[4]: (n[to_full[next(iter(e[3]))]], to_full[next(iter(e[3]))])
                             for e in entries if e[4] is not None and len(e[3]) == 1
                             and next(iter(e[3])) in to_full}
                full = repacked([e if e[4] in per_block else (*e[:4], None) for e in entries],
                                per_block, to_full, bucket_bytes)
                if full is not None:
                    syncs, largest = {}, max((size for _, size, _ in full), default=0.0)
                    for grp, size, key in full:
                        grp = moved(grp)
                        coll = sync if len({d // g for d in grp}) == 1 else Collective.ALL_REDUCE
                        one_sum = Sums(1, size, builder.comm(coll, size, grp), grp)
                        k = (key, grp)
                        syncs[k] = syncs[k] + one_sum if k in syncs else one_sum
            c = RankCosts(
                fwd=per_stage(a.fwd, b.fwd), bwd=per_stage(a.bwd, b.bwd),
                activations={s: round(x) for s, x in per_stage(a.activations, b.activations).items()},
                boundary=per_stage(a.boundary, b.boundary, whole=True), syncs=syncs,
                gathers={x.group: x for x in (
                    resum(a.gathers.get(k), b.gathers.get(k), blocks, v, Collective.ALL_GATHER)
                    for k in a.gathers.keys() | b.gathers.keys())},
                rest=ex(a.rest, b.rest, blocks, v),
                stage_comm=ex(a.stage_comm, b.stage_comm, blocks, v),
                extra_activations=round(ex(a.extra_activations, b.extra_activations, blocks, v)))
            ma, mb = one.memory[r2], two.memory[r2]
            mem = {f.name: round(ex(getattr(ma, f.name), getattr(mb, f.name), blocks, v))
                   for f in fields(MemoryUse)}
            # Temporaries: forward's (constant in the blocks), the largest gradient bucket (a
            # bucket that is one sum grows with the blocks; once buckets close they do not),
            # and ZeRO-1/2's full local gradients (affine).
            temps = max(two.feet[r2].held, round(largest))
            if plan.zero in (1, 2) and len(zgroup) > 1:  # what ZeRO does not own is whole
                kept = model_state_memory(round(ex(one.feet[r2].kept, two.feet[r2].kept, blocks, v)),
                                          precision=precision).grads
                temps = max(temps, (mem["grads"] - kept) * len(zgroup))
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
