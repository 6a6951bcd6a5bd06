"""The space a constraint set leaves: every (tp, pp, dp, micro, schedule, virtual, recompute, ZeRO, sp,
split, co-shard)
point as a plan string, with the reason each excluded point is excluded.

A point is a plan string of the built-in policies (:mod:`torchweave.policies.spec`),
so whatever the search returns can be written down, read, changed and run
like any other plan. Points are pruned here by arithmetic alone (no graph
work): the mesh covers the world, the batch splits into ``dp × micro``
pieces, the blocks split into ``pp × virtual`` stages, and the constraints
allow every degree.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchweave.search.constraints import Constraints


@dataclass(frozen=True, order=True)
class Point:
    tp: int
    pp: int
    dp: int
    micro: int
    schedule: str
    """``none`` (no pipeline) or a pipeline schedule."""
    virtual: int
    recompute: str
    zero: int
    sp: bool
    split: str = "rule"
    """How ops split on ``tp``: ``rule`` (Megatron's) or ``solved`` (:mod:`~torchweave.search.intra`)."""
    coshard: int = 0
    """The output head run in this many chunks per device (0: whole; ``coshard=K``)."""
    ep: int = 1
    """Experts split over this many devices (``ep``; models with expert parameters only)."""
    tied: str = "copy"
    """Pipelines: ``send`` runs lookups of a parameter several stages read where it is held
    (``tied=send``); ``copy`` keeps a copy on each stage."""
    cuts: tuple[str, ...] = ()
    """Pipelines: the modules where stages 1, 2, … start (``cuts=``; empty: the policy's
    FLOP-balanced cut)."""

    @property
    def spec(self) -> str:
        """The plan string that builds this point."""
        if self.schedule == "interlaced":
            return f"interlaced:micro={self.micro}"
        rec = f"recompute={self.recompute}" if self.recompute != "none" else ""
        split = "sequence" if self.sp and self.schedule != "none" else self.split
        if split != "rule":
            rec = ",".join(x for x in (rec, f"split={split}") if x)
        if self.coshard:
            rec = ",".join(x for x in (rec, f"coshard={self.coshard}") if x)
        if self.schedule == "none" and self.ep > 1:
            opts = [f"ep={self.ep}", f"dp={self.dp}", f"tp={self.tp}"] + (
                [f"zero={self.zero}"] if self.zero else [])
            return "ep:" + ",".join(opts + ([rec] if rec else []))
        if self.schedule == "none":
            if self.tp == 1:
                base = "dp" if self.zero == 0 else f"zero{self.zero}"
                return base + (f":{rec}" if rec else "")
            opts = [f"tp={self.tp}", f"dp={self.dp}"] + ([f"zero={self.zero}"] if self.zero else [])
            return ("sp" if self.sp else "tp") + ":" + ",".join(opts + ([rec] if rec else []))
        opts = [f"tp={self.tp}", f"pp={self.pp}", f"dp={self.dp}", f"micro={self.micro}"]
        if self.schedule == "interleaved":
            opts.append(f"virtual={self.virtual}")
        if self.zero:
            opts.append(f"zero={self.zero}")
        if self.ep > 1:
            opts.append(f"ep={self.ep}")
        if self.tied != "copy":
            opts.append(f"tied={self.tied}")
        if self.cuts:
            opts.append("cuts=" + "+".join(self.cuts))
        return f"{self.schedule}:" + ",".join(opts + ([rec] if rec else []))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def points(world: int, batch: int, blocks: int, c: Constraints, *, numbered: int | None = None,
           experts: int = 0, lookups: bool = False) -> tuple[list[Point], list[str]]:
    """Every point of the space for ``world`` ranks, a global batch of ``batch`` samples and
    ``blocks`` repeated blocks (0: no pipelines; ``numbered``: the model's numbered blocks,
    identical or not, which the interlaced pipeline spreads over the devices; default
    ``blocks``); and why the degrees the constraints allow are left out, where all of some
    degree is. ``experts``: how many experts the model's expert ops index (0: none); with
    some, expert-parallel points (:func:`expert_points`) join the space. ``lookups``: the
    model has lookups that ``tied=send`` would move (elsewhere it builds the same plan as
    ``copy``, so only ``copy`` is a point)."""
    out: list[Point] = []
    why: list[str] = []
    tps = [t for t in divisors(world) if c.tp.allows(t)]
    if not tps:
        why.append(f"tp {c.tp}: no value divides the world ({world})")
    for tp in tps:
        for pp in (p for p in divisors(world // tp) if c.pp.allows(p)):
            dp = world // (tp * pp)
            if not c.dp.allows(dp) or batch % dp:
                continue
            local = batch // dp
            if pp == 1:
                if "none" not in c.schedules:
                    continue
                for zero in _zeros(c.zero, dp):
                    if zero == 3 and tp > 1:
                        continue  # ZeRO-3 is the data-parallel policy's (zero3)
                    for rec in c.recompute:
                        for sp, split in _kinds(tp, c):
                            for co in _chunks(c.coshard, local):
                                out.append(Point(tp, 1, dp, 1, "none", 1, rec, zero, sp, split, co))
                continue
            if not blocks:
                continue
            for sched, v, m in _pipelines(pp, blocks, local, c):
                for zero in _zeros([z for z in c.zero if z <= 1], dp):
                    for rec in c.recompute:
                        for sp, split in _kinds(tp, c):
                            for co in _chunks(c.coshard, local // m):
                                for tied in (c.tied if lookups else ("copy",)):
                                    out.append(Point(tp, pp, dp, m, sched, v, rec, zero, sp, split,
                                                     co, tied=tied))
    out += interlaced_points(world, batch, blocks if numbered is None else numbered, c)
    if experts:
        out += expert_points(world, batch, blocks, c, experts)
    if tps and not out:
        why.append(f"no (tp, pp, dp, micro) in the constraints fits {world} ranks, a batch of "
                   f"{batch} and {blocks} blocks: tp {c.tp}, pp {c.pp}, dp {c.dp}, "
                   f"micro {c.micro}, schedules {', '.join(c.schedules)}")
    return sorted(set(out)), why


def expert_points(world: int, batch: int, blocks: int, c: Constraints, experts: int) -> list[Point]:
    """Expert-parallel points: ``ep`` > 1 devices split the ``experts``, ``dp × ep`` the batch,
    with ``tp`` inside and, where the model has blocks, in pipelines of every schedule the
    constraints allow (interleaved with its ``virtual`` stages). ZeRO-1 and -2 without a
    pipeline, ZeRO-1 in one (ZeRO-3's gathers and ep's transfers can deadlock:
    ``parallel._check_zero3_order``)."""
    out = []
    for tp in (t for t in divisors(world) if c.tp.allows(t)):
        for pp in (p for p in divisors(world // tp) if c.pp.allows(p)):
            if pp > 1 and not blocks:
                continue
            for ep in (e for e in divisors(world // (tp * pp))
                       if e > 1 and c.ep.allows(e) and experts % e == 0):
                dp = world // (tp * pp * ep)
                if not c.dp.allows(dp * ep) or batch % (dp * ep):  # the batch's groups: dp × ep
                    continue
                local = batch // (dp * ep)
                shapes = ([("none", 1, 1)] if "none" in c.schedules else []) if pp == 1 \
                    else _pipelines(pp, blocks, local, c)
                for sched, v, m in shapes:
                    for zero in _zeros([z for z in c.zero if z <= (2 if pp == 1 else 1)], dp):
                        for rec in c.recompute:
                            out.append(Point(tp, pp, dp, m, sched, v, rec, zero, False, ep=ep))
    return out


def _pipelines(pp: int, blocks: int, local: int, c: Constraints) -> list[tuple[str, int, int]]:
    """(schedule, virtual, micro) of every pipeline of ``pp`` ranks over ``blocks`` blocks
    and ``local`` samples a replica that the constraints allow (interlaced apart)."""
    out = []
    for sched in (s for s in c.schedules if s not in ("none", "interlaced")):
        virtuals = [v for v in range(2, blocks // pp + 1) if c.virtual.allows(v)] \
            if sched == "interleaved" else [1]
        for v in (v for v in virtuals if blocks % (pp * v) == 0):
            out += [(sched, v, m) for m in divisors(local) if c.micro.allows(m) and m >= pp
                    and (sched != "interleaved" or m % pp == 0)]
    return out


def _kinds(tp: int, c: Constraints) -> list[tuple[bool, str]]:
    """The ways to split a block on ``tp``: (sequence parallel, split) pairs."""
    if tp == 1:
        return [(False, "rule")]
    return [(False, s) for s in c.split] + ([(True, "rule")] if c.sp else [])


def _chunks(allowed, samples: int) -> list[int]:
    """The head co-shards worth a point: its chunks split a device's samples (per
    micro-batch) evenly (:func:`torchweave.policies.coshard.with_coshard_spec`)."""
    return [k for k in allowed if k == 0 or samples % k == 0]


def _zeros(allowed, dp: int) -> list[int]:
    """The ZeRO stages worth a point: without data parallelism every stage is the same
    plan, so only the lowest allowed one."""
    allowed = sorted(allowed)
    return allowed if dp > 1 else allowed[:1]


def interlaced_points(world: int, batch: int, blocks: int, c: Constraints) -> list[Point]:
    """The interlaced pipeline over every device (one block stage per device, embeddings and
    head tensor-parallel over all), at the two smallest micro-batch counts of at least the
    world that the batch and the constraints allow. It has no estimate: the search
    simulates these points directly, so they are few, and only where every device gets a
    block (``blocks ≥ world``) on at most 64 devices."""
    if "interlaced" not in c.schedules or world < 2 or world > 64 or blocks < world:
        return []
    if not (c.pp.allows(world) and c.tp.allows(1) and c.dp.allows(1) and 0 in c.zero
            and "none" in c.recompute):
        return []
    micros = [m for m in divisors(batch) if m >= world and c.micro.allows(m)][:2]
    return [Point(1, world, 1, m, "interlaced", 1, "none", 0, False) for m in micros]


__all__ = ["Point", "divisors", "interlaced_points", "points"]
