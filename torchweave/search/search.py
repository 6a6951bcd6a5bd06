"""``plan="auto"``: search the space a constraint set leaves for the fastest plan that fits.

1. **The space** (:mod:`torchweave.search.space`): every (tp, pp, dp, micro,
   schedule, virtual, recompute, ZeRO, sp) point the constraints allow whose
   arithmetic works for the world, the batch and the blocks.
2. **Partitions**: for each ``tp`` where the constraints allow ``split: solved``,
   the solver (:mod:`torchweave.search.intra`, an ILP) picks each op's split;
   a partition equal to Megatron's rules adds nothing and is dropped.
   **Proxies**: one short simulation per way of splitting a block (tp, sp,
   recompute, split, coshard, ep) gives one block's and the rest's cost
   (:mod:`torchweave.search.estimate`); a split the model refuses or an op rule
   forbids takes its points out, with the reason
   (:mod:`torchweave.search.proxies`). Degrees are tried in increasing order
   while they make a block faster: once a degree is no faster than a smaller
   one, larger ones are not tried (they only add communication), and the result
   says so.
3. **Estimate** every point by arithmetic, drop those over the memory budget.
4. **Re-rank** (:mod:`torchweave.search.select`): the best ``top + 3`` points (48 on
   small models, :data:`CHEAP`), the best point of each family whose estimates share
   a bias and the best point of the ``megatron`` preset (for comparison) are built as
   plans, checked against the constraints' op rules, cuts, pins and ties, and
   simulated in full by the event simulator; then the points their family's measured
   bias promotes. The ranking is the simulator's; the estimate's error on each is kept.

Models without at least 4 identical blocks are small enough to simulate every
point directly; so are the interlaced and ZeRO-3 points of any model
(:func:`~torchweave.search.estimate.estimable`). Everything is deterministic: points are ordered by estimate,
then by their plan string.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from torchweave.errors import Problem, TorchweaveError
from torchweave.ir.graph import Graph
from torchweave.plan.plan import Plan
from torchweave.policies.recompute import block_of
from torchweave.policies.stage_cuts import shared_lookups
from torchweave.policies.spec import PlanSpec
from torchweave.search.admit import admissible
from torchweave.search.constraints import Constraints
from torchweave.search.constraints_file import preset
from torchweave.search.cuts import seconds_points
from torchweave.policies.expert import expert_count
from torchweave.search.estimate import Estimate, estimable, estimate
from torchweave.search.intra import Partition, describe, solve, tp_dims
from torchweave.search.pool import Failed, Runner, env_workers
from torchweave.search.proxies import by_degree, proxy_key
from torchweave.search.select import ROUNDS, corrected, families
from torchweave.search.space import Point, points
from torchweave.sim.hardware.cluster import Cluster
from torchweave.sim.fast.fold import find_blocks, with_twin
from torchweave.search.timed import Timing
from torchweave.sim.simulate import SimResult, simulate, without_cyclic_gc

GiB = 2**30
CHEAP = 20_000
"""Graph nodes × ranks under which a simulation costs little: the search then simulates its
best 48 points instead of ``top + 3`` (the estimate is least accurate on small models,
where fixed per-op costs do not shrink with the micro-batch)."""


@dataclass
class Ranked:
    """One plan the search simulated."""

    point: Point
    estimate: Estimate | None
    """The search's own estimate (None: simulated directly, a model without blocks)."""
    result: SimResult
    plan: Plan

    @property
    def spec(self) -> str:
        return self.point.spec

    @property
    def estimate_error(self) -> float | None:
        """|estimate − simulated| / simulated step time."""
        if self.estimate is None or not self.result.step_time:
            return None
        return abs(self.estimate.step_s - self.result.step_time) / self.result.step_time

    def breakdown(self) -> dict[str, float]:
        """Seconds per step by part (the busiest rank), and peak GiB."""
        r = self.result
        return {"step": r.step_time, "compute": max(r.compute_time, default=0.0),
                "comm": max(r.comm_time, default=0.0), "bubble %": 100 * (r.pipeline_bubble or 0.0),
                "peak GiB": max(m.peak for m in r.memory) / GiB}


@dataclass
class SearchResult:
    ranked: list[Ranked]
    """Simulated plans that fit, fastest first."""
    considered: int
    """Points of the space priced."""
    excluded: list[str]
    """Why parts of the space were left out."""
    over_memory: list[tuple[str, float]]
    """The closest points over the budget: (plan, GiB over per device)."""
    constraints: Constraints
    cluster: Cluster
    seconds: float
    reference: Ranked | None = None
    """The best simulated plan of the ``megatron`` preset (None: none was simulated)."""
    notes: list[str] = field(default_factory=list)
    solved: dict[int, str] = field(default_factory=dict)
    """Tensor-parallel degree → how the solver's split for it differs from Megatron's rules
    (also among ``notes``)."""

    @property
    def best(self) -> Ranked:
        return self.ranked[0]

    def why(self) -> list[str]:
        """Why the winner beat the runner-up and the best megatron plan, point by point."""
        out = []
        win = self.best
        for label, other in (("runner-up", self.ranked[1] if len(self.ranked) > 1 else None),
                             ("best megatron plan", self.reference)):
            if other is None or other.spec == win.spec:
                if label != "runner-up" and other is not None:
                    out.append("is the best plan of the megatron preset's space too")
                continue
            a, b = win.breakdown(), other.breakdown()
            parts = [f"{k} {a[k]:.4g} vs {b[k]:.4g}" + (" s" if k in ("step", "compute", "comm")
                                                        else "")
                     for k in a if not math.isclose(a[k], b[k], rel_tol=1e-3)]
            why = "; ".join(parts) if parts else (
                "the same within 0.1% on every count (step, compute, comm, bubble, memory); "
                + ("first by its exact step time" if a["step"] < b["step"]
                   else "first by name, the tie-break"))
            out.append(f"beats the {label} `{other.spec}` ({b['step'] / a['step']:.3f}x): {why}")
        return out


@without_cyclic_gc
def search(graph: Graph, cluster: Cluster, constraints: Constraints | str | None = None, *,
           world_size: int | None = None, top: int = 5, simulate_top: int | None = None,
           dtype: torch.dtype | None = None, workers: int | None = None,
           exhaustive: bool = False, progress: Callable[[str], None] | None = None
           ) -> SearchResult:
    """The best plans for ``graph`` on ``cluster`` within ``constraints`` (a
    :class:`Constraints`, a preset name; default ``free``). ``workers``: processes for
    the proxies and simulations (default 1, or ``TORCHWEAVE_SEARCH_WORKERS``; ``torchweave
    plan`` passes :func:`~torchweave.search.pool.default_workers`, the cores for a large
    search; a script that passes more needs the ``__main__`` guard). The result does not
    depend on it. ``exhaustive``: every point of the space is built and simulated, none
    estimated (the baseline the search is judged against; slow on large models)."""
    t0 = time.perf_counter()
    say = progress or (lambda _msg: None)
    c = preset(constraints or "free") if not isinstance(constraints, Constraints) else constraints
    world = world_size or cluster.size
    if world > cluster.size:
        raise TorchweaveError(Problem(obj="world_size", value=str(world),
                                      rule=f"at most the cluster's {cluster.size} devices",
                                      fix="use a larger cluster"))
    budget = (c.memory_gib * GiB) if c.memory_gib else cluster.device.memory_bytes
    precision = "bf16-mixed" if dtype in (torch.bfloat16, torch.float16) else "fp32"
    batch = _batch(graph)
    base = PlanSpec.parse("dp").build(graph, 1)
    blocks = with_twin(graph, base, find_blocks(graph, base, least=4, nested=False))
    numbered = len({k for k in (block_of(n.module or "") for n in graph.nodes) if k})
    pts, excluded = points(world, batch, len(blocks) if blocks else 0, c, numbered=numbered,
                           experts=expert_count(graph) if any(c.ep.allows(e) for e in range(2, world + 1))
                           else 0, lookups=bool(shared_lookups(graph)))
    timing = Timing(graph, blocks, cluster, dtype, batch) if blocks is not None else None
    if timing is not None:  # stages cut inside blocks by seconds (encoder-decoders, free)
        extra = seconds_points(graph, blocks, c, pts, timing.op_seconds)
        if "flops" not in c.balance:  # each such point in place of its whole-block twin
            instead = {replace(p, cuts=()) for p in extra}
            pts = [p for p in pts if p not in instead]
        pts += extra
    say(f"{len(pts)} points in the space ({c.name}) for {world} ranks, batch {batch}, "
        f"{len(blocks) if blocks else 'no'} repeated blocks")
    ests: dict[Point, Estimate] = {}
    over: list[tuple[str, float]] = []
    parts: dict[int, Partition | None] = {}
    notes: list[str] = []
    solved: dict[int, str] = {}
    n_workers = workers if workers is not None else (env_workers() or 1)
    with Runner(n_workers, graph=graph, blocks=blocks, cluster=cluster, dtype=dtype,
                precision=precision, world=world, constraints=c) as runner:
        def solve_tp(tp: int) -> Partition | None:
            say(f"solve each op's split for tp={tp}")
            parts[tp] = _solve(graph, cluster, tp, world, c, dtype, excluded, solved)
            return parts[tp]

        if blocks is None or exhaustive:  # every point simulated: every degree's split needed
            for tp in sorted({p.tp for p in pts if p.split == "solved"}):
                solve_tp(tp)
        else:  # solved as the proxies reach each degree (larger ones may not be tried)
            proxies = by_degree(runner, graph, pts, parts, solve_tp, c, excluded, say)
        pts = [p for p in pts if p.split != "solved" or parts.get(p.tp) is not None]
        if blocks is not None and not exhaustive:
            direct = [pt for pt in pts if not estimable(pt)]  # simulated, never estimated
            pipelined = [(pt, proxies[proxy_key(pt)]) for pt in pts if estimable(pt) and pt.pp > 1
                         and proxies[proxy_key(pt)] is not None]
            if pipelined:
                say(f"run {len({(p.schedule, p.pp, p.virtual, p.micro) for p, _ in pipelined})} "
                    f"pipeline schedules on their stages' costs")
            timed = timing.price(pipelined, len(blocks)) if pipelined else {}
            for pt in pts:
                if not estimable(pt):
                    continue
                px = proxies[proxy_key(pt)]
                if px is None:
                    continue
                e = estimate(pt, px, cluster, len(blocks), precision=precision,
                             schedule_s=timed.get(pt))
                if e.memory > budget:
                    over.append((pt.spec, (e.memory - budget) / GiB))
                else:
                    ests[pt] = e
            order = sorted(ests, key=lambda p: (ests[p].step_s, p.spec))
            n = simulate_top or (top + 3 if len(graph.nodes) * world > CHEAP else max(top + 3, 48))
            chosen = order[:n]
            chosen += [p for p in families(order, ests) if p not in chosen]
            ref = _reference(order)
            if ref is not None and ref not in chosen:
                chosen.append(ref)
            chosen += direct
        else:
            order, chosen = [], list(pts)
        sims = _simulate_all(runner, chosen, parts, say)
        for _ in range(ROUNDS):  # the points the simulated ones say were under-rated
            done = {pt: res[1].step_time for pt, res in sims.items() if isinstance(res, tuple)}
            fits = [done[pt] for pt in done if max(m.peak for m in sims[pt][1].memory) <= budget]
            more = corrected(order, ests, done, min(fits, default=math.inf), n_workers)
            if not more:
                break
            notes.append("simulated after correcting the estimate by its family's measured "
                         "bias: " + ", ".join(p.spec for p in more))
            sims.update(_simulate_all(runner, more, parts, say))
    ranked: list[Ranked] = []
    for pt, out in sims.items():
        if isinstance(out, Failed):
            excluded.append(f"{pt.spec}: " + "; ".join(f"{p.value}: {p.rule}" for p in out.problems))
            continue
        if isinstance(out, str):
            excluded.append(f"{pt.spec}: {out}")
            continue
        plan, res = out
        peak = max(m.peak for m in res.memory)
        if peak > budget:
            over.append((pt.spec, (peak - budget) / GiB))
            continue
        plan.notes["spec"] = pt.spec
        ranked.append(Ranked(pt, ests.get(pt), res, plan))
    ranked.sort(key=lambda r: (r.result.step_time, r.spec))
    if not ranked:
        raise TorchweaveError(_nothing_fits(c, cluster, budget, over, excluded, len(pts)))
    mega = preset("megatron")
    reference = next((r for r in ranked if _in(mega, r.point)), None)
    over.sort(key=lambda x: (x[1], x[0]))
    return SearchResult(ranked[:max(top, 1)] if top else ranked, len(pts), excluded, over[:5], c,
                        cluster, time.perf_counter() - t0, reference,
                        notes + [solved[tp] for tp in sorted(solved)], solved)


def _simulate_all(runner: Runner, pts: list[Point], parts: dict[int, Partition | None],
                  say: Callable[[str], None]) -> dict[Point, object]:
    for i, pt in enumerate(pts):
        say(f"simulate {i + 1}/{len(pts)}: {pt.spec}")
    got = runner.map(_simulate_job, [(pt, parts.get(pt.tp).dims if pt.split == "solved"
                                      else None) for pt in pts])
    return dict(zip(pts, got))


def _simulate_job(s: dict, pt: Point, dims: dict | None) -> tuple[Plan, SimResult] | str:
    """``pt`` built, checked against the constraints and simulated; a string says why not."""
    graph = s["graph"]
    try:
        plan = PlanSpec.parse(pt.spec).build(graph, s["world"], dims=dims)
    except TorchweaveError as exc:
        return "; ".join(p.rule for p in exc.problems)
    bad = admissible(plan, graph, s["constraints"], pt)
    if bad:
        return bad
    try:  # lowering may still refuse a plan the space allows: it is left out, with why
        res = simulate(graph, plan, s["cluster"], dtype=s["dtype"], timeline=False)
    except TorchweaveError as exc:
        return "; ".join(f"{p.value}: {p.rule}" for p in exc.problems)
    return plan, res


def _solve(graph: Graph, cluster: Cluster, tp: int, world: int, c: Constraints, dtype,
           excluded: list[str], solved: dict[int, str]) -> Partition | None:
    """The solver's partition for ``tp``; None (and why, in ``excluded``) where it is
    Megatron's own or the constraints leave none. ``solved[tp]`` gets how it differs from
    Megatron's."""
    try:
        part = solve(graph, cluster, tp=tp, world=world, dtype=dtype, rules=c.ops, ties=c.ties)
    except TorchweaveError as exc:
        excluded.append(f"split=solved, tp={tp}: " + "; ".join(f"{p.obj}: {p.rule}"
                                                              for p in exc.problems))
        return None
    if part.batch_only and c.tp.allows(1):  # dp's own point is in the space
        excluded.append(f"split=solved, tp={tp}: the solver splits only the batch (the plan "
                        f"with dp×{tp}, a point of its own)")
        return None
    try:
        rule = tp_dims(PlanSpec.parse(f"tp:tp={tp},dp=1").build(graph, tp), graph)
    except TorchweaveError:
        return part
    if rule == part.dims:
        excluded.append(f"split=solved, tp={tp}: the solver's partition is Megatron's")
        return None
    if c.sp and tp_dims(PlanSpec.parse(f"sp:tp={tp},dp=1").build(graph, tp), graph) == part.dims:
        excluded.append(f"split=solved, tp={tp}: the solver's partition is Megatron's with "
                        f"sequence parallelism (split=sequence, a point of its own)")
        return None
    diff = describe(graph, part.dims, rule)
    solved[tp] = (f"split=solved, tp={tp} ({part.status}, {part.variables} variables, "
                f"{part.seconds:.2f} s) splits, unlike Megatron's rules: " + "; ".join(diff[:8])
                + (f" (+{len(diff) - 8} more)" if len(diff) > 8 else ""))
    return part


def _batch(graph: Graph) -> int:
    for name in graph.inputs:
        shape = graph.values[name].meta.shape
        if shape:
            return int(shape[0])
    return 1


def _in(c: Constraints, pt: Point) -> bool:
    """Whether ``pt`` is in the space ``c`` leaves."""
    return (c.tp.allows(pt.tp) and c.pp.allows(pt.pp) and c.dp.allows(pt.dp * pt.ep)
            and c.ep.allows(pt.ep)
            and pt.schedule in c.schedules and pt.recompute in c.recompute
            and (pt.zero in c.zero or pt.dp == 1)
            and (c.sp or not pt.sp) and (pt.pp == 1 or c.micro.allows(pt.micro))
            and (pt.tp == 1 or pt.split in c.split) and pt.coshard in c.coshard
            and (pt.schedule != "interleaved" or c.virtual.allows(pt.virtual)))


def _reference(order: list[Point]) -> Point | None:
    mega = preset("megatron")
    return next((p for p in order if _in(mega, p)), None)


def _nothing_fits(c: Constraints, cluster: Cluster, budget: float, over, excluded, n: int
                  ) -> list[Problem]:
    if over:
        spec, short = min(over, key=lambda x: (x[1], x[0]))
        relax = ("allow recompute (recompute: [none, selective, full])" if "full" not in
                 c.recompute else "allow ZeRO (zero: [0, 1, 2, 3])" if 3 not in c.zero else
                 "co-shard the output head (coshard: [0, 2, 4])" if len(c.coshard) < 2 else
                 "allow more pipeline or tensor parallelism, or use more devices")
        return [Problem(obj=f"constraints {c.name!r}",
                        value=f"the closest plan, {spec}, needs {short:.2f} GiB more per device",
                        rule=f"a plan fits {budget / GiB:.1f} GiB per device on {cluster}",
                        fix=f"raise memory_gib, {relax}")]
    why = "; ".join(excluded[:6]) or f"none of {n} points could be built"
    return [Problem(obj=f"constraints {c.name!r}", value=f"no plan on {cluster}",
                    rule=f"some plan satisfies every constraint ({why})",
                    fix="relax the constraint named above")]


__all__ = ["Ranked", "SearchResult", "search"]
