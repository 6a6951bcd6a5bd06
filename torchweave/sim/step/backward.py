"""Backward, gradient sync and optimizer tasks of one rank (:mod:`torchweave.sim.step.build`, steps 2 and 3).

The Program's instructions in reverse, each compute with its backward time and
each communication step with its backward dual (``lower/steps.py``); the
gradient sync of each parameter joins a bucket once the backward of its first
reader is issued; AdamW after every sync, ZeRO-1/2 gathering the updated shards.
"""

from __future__ import annotations

import math

from torchweave.lower import steps
from torchweave.lower.program import Comm, Compute, optimizer_numels, zero_owns
from torchweave.sim.hardware.collective_cost import Collective
from torchweave.sim.hardware.profile import optimizer_key
from torchweave.sim.step.context import StepContext
from torchweave.sim.step.engine import COMM, COMPUTE, LOCAL, Task
from torchweave.sim.step.pipelined import hidden
from torchweave.sim.step.signals import (
    OPTIMIZER, Kind, Meet, Of, Rendezvous, Signal, grad, regathered,
)
from torchweave.sim.step.state import Footprint, RankForward, SyncInputs, mine

REACH = Kind.REACH
"""A marker in a rank's backward (not run by the engine): the gradient of parameter
``name`` may now sum over ``group``, once what it ``waits`` for is ready (``nbytes`` local bytes; ``closes`` for a ZeRO-3 unit's
parameter: whether it completes the unit). :func:`place_syncs` replaces the markers with the
bucketed sums; :mod:`torchweave.sim.fast.folded` copies them with the blocks first."""


def backward(self: StepContext, state: RankForward) -> list[Task]:
    """The backward of ``state.prog`` with :data:`REACH` markers where gradients may sum.

    ZeRO-3 units (``state.unit_of``, :mod:`torchweave.lower.units`) are gathered again on
    first use in backward, their gradients reduce-scattered once all exist."""
    prog, foot, params, nbytes = state.prog, state.foot, state.params, state.nbytes
    first_reader, refs_of, unit_of, members = (state.first_reader, state.refs_of, state.unit_of,
                                               state.members)
    r, out = prog.rank, []
    left = {u: len(ps) for u, ps in members.items()}
    kept = foot.gathered[-1] if foot.gathered else None  # forward ends with it gathered
    order = foot.gathered[::-1]  # the order backward is expected to use the units in
    position = {u: i for i, u in reversed(list(enumerate(order)))}  # first place of each
    done: set[int] = set()  # units gathered (or prefetched) in backward
    seen: set[int] = set()  # units backward has used
    gathered: set[str] = set()
    ahead, first = _prefetches(self, state)  # popped as their gathers are issued

    def gather(u: int, p: str, stage: int | None, block: int | None, how: str) -> None:
        done.add(u)
        gathered.update(members[u])
        if u == kept:
            return
        grp = mine(params[p].grad_groups, r)
        size = sum(nbytes[q] for q in members[u])
        out.append(Task(COMM, f"all_gather unit {u} bwd{how}", (),
                        tuple(regathered(q) for q in members[u]),
                        self.comm(Collective.ALL_GATHER, size, grp),
                        Rendezvous(Meet.UNIT_BACKWARD, u, grp), self.meet_of(grp), stage,
                        block=block))

    def reached(p: str, idx: int, block: int | None) -> None:
        """The backward of ``p``'s first reader is issued: its gradient may sync."""
        if first_reader.get(p) != idx:
            return
        for grp in params[p].grad_groups:
            grp = mine((grp,), r)
            closes = None
            if p in unit_of:
                left[unit_of[p]] -= 1
                closes = not left[unit_of[p]]
            out.append(Task(REACH, p, (grad(p),), group=grp, nbytes=nbytes[p], block=block,
                            closes=closes))

    for idx in range(len(prog.instrs) - 1, -1, -1):
        ins = prog.instrs[idx]
        (stage, crossing), block = self.stage(ins), self.block(ins)
        v = first.pop(stage, None) if isinstance(ins, (Compute, Comm)) else None
        if v is not None:
            # a stage's (or the step's) backward begins: the last saved regathered
            # activation of its forward is gathered from now (runtime/regather.Forward)
            at = (grad(ins.dst),) if isinstance(ins, Comm) else tuple(grad(o) for o in ins.outputs)
            out.append(_regather(self, state, v, at, r, stage, block))
        if isinstance(ins, Compute) and ins.aux:  # a view, sum or join of pieces: no time
            out.append(Task(LOCAL, f"{ins.node} ({ins.fn}) bwd", tuple(grad(o) for o in ins.outputs),
                            tuple(grad(a) for a in refs_of[idx]), stage=stage, block=block))
            for p in refs_of[idx]:
                reached(p, idx, block)
        elif isinstance(ins, Compute):
            cost = self.costs[ins.node]
            refs = refs_of[idx]
            for p in (state.views.get(x, x) for x in refs):
                u = unit_of.get(p)
                if u is None or u in seen:
                    continue
                seen.add(u)
                if u not in done:
                    gather(u, p, stage, block, "")
                # A unit's first use in backward prefetches the next one
                # (runtime/zero3.py ``_backward_unit``), before this unit's
                # reduce-scatter takes the communication stream.
                nxt = next((v for v in order[position[u] + 1:] if v not in done),
                           None) if u in position else None
                if nxt is not None:
                    gather(nxt, members[nxt][0], stage, block, " (prefetch)")
            if not cost.grad:
                continue
            waits = tuple(grad(o) for o in ins.outputs) + tuple(
                regathered(p) for p in (state.views.get(x, x) for x in refs)
                if p in gathered and unit_of.get(p) != kept)
            for v in state.regather_readers.get(idx, ()):
                waits += (regathered(v),)
                nxt = ahead.pop(v, None)  # v's first read starts the next (runtime/regather.py)
                if nxt is not None:
                    at = tuple(grad(o) for o in ins.outputs) + (regathered(v),)
                    out.append(_regather(self, state, nxt, at, r, stage, block))
            out.append(Task(COMPUTE if cost.bwd else LOCAL, f"{ins.node} bwd", waits,
                            tuple(grad(a) for a in refs),
                            cost.bwd * (self.per_micro(ins) if stage is not None else 1),
                            stage=stage, block=block))
            for p in refs:
                reached(p, idx, block)
        elif isinstance(ins, Comm):
            out.append(_comm_bwd(self, ins, r, nbytes))
            out[-1].stage, out[-1].crossing, out[-1].block = stage, crossing, block
            if stage is not None:
                out[-1].dur *= self.per_micro(ins)
                out[-1].latency *= self.per_micro(ins)
            reached(ins.src, idx, block)
    return out


def place_syncs(self: StepContext, tasks: list[Task], foot: Footprint, inputs: SyncInputs,
                rank: int) -> list[Task]:
    """``tasks`` with every :data:`REACH` marker replaced by the gradient sums it closes,
    then AdamW after all of them and, for ZeRO-1/2, the gather of the updated shards.

    ZeRO-1/2 reduce every owned gradient in one collective after backward
    (runtime/zero.py ``finish_grads``); ZeRO-3 by unit; plain data parallel in buckets."""
    zero, params = self.plan.zero, inputs.params
    buckets = Buckets(math.inf if zero in (1, 2) else self.bucket_bytes)
    count: dict[tuple, int] = {}
    synced: list[Signal] = []
    out: list[Task] = []
    waits: dict = {}  # a marker's name -> what its sum waits for

    sharded = self.plan.zero_group(rank)

    def flush(grp: tuple, names: list[str], size: float) -> None:
        # ZeRO-2 reduce-scatters what it owns; a tied weight's copies are all-reduced
        coll = Collective.REDUCE_SCATTER if zero >= 2 and grp == sharded else Collective.ALL_REDUCE
        n = count[grp] = count.get(grp, 0) + 1
        foot.temporaries = max(foot.temporaries, int(size))
        foot.bucket = max(foot.bucket, int(size))
        tag = Signal(Of.SYNCED, f"{n} {grp}")
        out.append(Task(COMM, f"{coll.value} grads #{n} ({len(names)} params)",
                        tuple(w for p in names for w in waits[p]), (tag,), self.comm(coll, size, grp),
                        Rendezvous(Meet.GRAD_SUM, n, grp), self.meet_of(grp), nbytes=int(size)))
        synced.append(tag)

    for t in tasks:
        if t.kind != REACH:
            out.append(t)
            continue
        foot.grad_order.append((t.name, t.group, t.nbytes))
        waits[t.name] = t.waits
        for done in buckets.add(t.name, t.group, t.nbytes, closes=t.closes):
            flush(*done)
    for done in buckets.drain():
        flush(*done)
    local = sum(inputs.nbytes[p] for p in params)
    dp = max(1, len(sharded))
    kept = sum(inputs.nbytes[p] for p, s in params.items() if not zero_owns(s, sharded))
    shard = (local - kept) / dp + kept if zero >= 1 else local
    bw = self.cluster.device.memory_bandwidth * self.model.bandwidth
    t_opt = 7 * shard / bw
    if self.profiles is not None:  # ZeRO steps one flat shard; else one tensor per parameter
        numels = optimizer_numels(params.values(), sharded)
        t_opt = self.profiles.lookup(optimizer_key(numels)) or (t_opt,)
        t_opt = t_opt[0]
    out.append(Task(COMPUTE, "optimizer (AdamW)", tuple(synced), (OPTIMIZER,), t_opt))
    if 1 <= zero <= 2 and dp > 1:
        grp, gathered = sharded, local - kept
        out.append(Task(COMM, "all_gather params", (OPTIMIZER,), (),
                        self.comm(Collective.ALL_GATHER, gathered, grp),
                        Rendezvous(Meet.PARAM_GATHER, None, grp), self.meet_of(grp),
                        nbytes=int(gathered)))
    return out


class Buckets:
    """Gradients summed together, DDP-style: per group, a bucket fills in the order
    backward reaches its parameters and is summed once it holds ``cap`` bytes (or when
    ``closes`` says: a ZeRO-3 unit is complete); :meth:`drain` sums what is left."""

    def __init__(self, cap: float) -> None:
        self.cap = cap
        self.names: dict[tuple, list[str]] = {}
        self.fill: dict[tuple, float] = {}

    def add(self, name: str, group: tuple, nbytes: float, *, closes: bool | None = None
            ) -> list[tuple[tuple, list[str], float]]:
        """Add one gradient; the buckets it closes as (group, names, bytes)."""
        self.names.setdefault(group, []).append(name)
        self.fill[group] = self.fill.get(group, 0.0) + nbytes
        full = closes if closes is not None else self.fill[group] >= self.cap
        return [self._close(group)] if full else []

    def drain(self) -> list[tuple[tuple, list[str], float]]:
        return [self._close(g) for g in list(self.names)]

    def _close(self, group: tuple) -> tuple[tuple, list[str], float]:
        return group, self.names.pop(group), self.fill.pop(group)


def _prefetches(self: StepContext, state: RankForward
                ) -> tuple[dict[str, str], dict[int | None, str]]:
    """Regathered activation → the one its first read starts gathering: the next that
    backward reads in the same stage; and each stage's first (gathered from the start of
    its backward). Every regathered activation is one of these, so each is gathered once,
    before its first read. :mod:`torchweave.runtime.regather`."""
    last: dict[int | None, str] = {}
    first: dict[int | None, str] = {}
    ahead: dict[str, str] = {}
    seen: set[str] = set()
    for idx in sorted(state.regather_readers, reverse=True):
        st = self.stage(state.prog.instrs[idx])[0]
        for v in state.regather_readers[idx]:
            if v in seen:
                continue
            seen.add(v)
            if st in last:
                ahead[last[st]] = v
            else:
                first[st] = v
            last[st] = v
    return ahead, first


def _regather(self: StepContext, state: RankForward, v: str, waits: tuple, r: int,
              stage: int | None, block: int | None) -> Task:
    """``v``, saved as its shard, gathered again for backward once ``waits`` are ready (two
    gathered copies are alive at most: the forward counts them among the temporaries)."""
    step, size, value = state.regather[v]
    grp = mine(step.groups, r)
    k = self.repeats(stage, value)  # in a pipeline, once a micro-batch (StepContext.times)
    t = Task(COMM, f"all_gather {v} again", waits, (regathered(v),),
             k * self.comm(Collective.ALL_GATHER, size / k, grp),
             Rendezvous(Meet.REGATHER, v, grp), self.meet_of(grp), stage, block=block)
    if not hidden(t, self.cluster.device.comm_overlaps_compute):  # a pipeline stage pays it
        t.latency = self.latency_of(value, Collective.ALL_GATHER, size, grp, k)
    return t


def _comm_bwd(self: StepContext, ins: Comm, r: int, nbytes) -> Task:
    step = ins.step
    name = f"{steps.name_of(step)} {ins.value} bwd"
    waits, sets = (grad(ins.dst),), (grad(ins.src),)
    if ins.value not in self.grads or isinstance(step, steps.Narrow):  # no gradient to move
        return Task(LOCAL, name, waits, sets)
    if isinstance(step, steps.P2P):
        return Task(COMM, name, waits, sets, self.p2p(step.grad_back, r, ins.value, self.times(ins)),
                    latency=self.p2p_latency(ins, step.grad_back, r))
    coll = step.backward_collective()
    if coll is None:
        return Task(LOCAL, name, waits, sets)
    grp = mine(step.groups, r)
    size = step.backward_bytes(nbytes.get(ins.src, 0.0), nbytes.get(ins.dst, 0.0))
    coll = Collective(coll)
    return Task(COMM, name, waits, sets, self.comm_of(ins, coll, size, grp),
                Rendezvous(Meet.BACKWARD, ins.dst, grp), self.meet_of(grp),
                latency=self.latency(ins, coll, size, grp))
