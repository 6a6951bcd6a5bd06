"""Check a schedule before launch, and measure its bubble and memory.

:func:`dry_run` checks structure first, collecting every problem: each action
on the rank of its stage and in range; each (stage, micro-batch) with one
``F`` and one backward (``B``, or ``I`` then ``W``); on each rank ``F`` before
its backward, ``I`` before its ``W``, a receive before the action that needs
it and a send after the action that produces it; between consecutive stages
on different ranks, every send and receive present.

It then runs all ranks step by step under this communication model:

- a send is buffered: it completes when issued and never blocks;
- a receive blocks until the matching send (same stage boundary, direction
  and micro-batch) has been issued, on whichever rank and in whatever order.

So the runtime must post sends without waiting for the receiver (``isend``)
and match messages by (stage, direction, micro-batch). It does so without
tags: each rank posts its receives in the order their senders send, which
adds no wait under this model (the messages a receive then takes first were
sent before the one it waits for); lowering derives every message in that
order and checks, per pair of ranks, that both sides issue one sequence
(:mod:`torchweave.lower.messages`). Under blocking sends more schedules
deadlock than this check finds.

A rank that can never take its next step is stuck; the error prints the grid
of ranks and steps with each stuck cell in brackets.
"""

from __future__ import annotations

from torchweave.errors import Problem
from torchweave.plan.schedules.actions import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    StageToRank,
    format_schedule,
)

_MAX_LISTED = 20
_Key = tuple[Kind, int, int, int]  # (kind, stage, micro, pass)


def _key(a: Action) -> _Key:
    return (a.kind, a.stage, a.micro, a.iteration)


def dry_run(schedule: Schedule, stage_to_rank: StageToRank, stages: int, micro: int,
            passes: int = 1) -> None:
    """Raise :class:`ScheduleError` if the schedule is malformed, incomplete or deadlocks.

    ``passes`` > 1: each micro-batch first runs ``passes - 1`` forwards without
    gradients (``R`` passes ``0 … passes-2``), each fed the last stage's output of
    the one before, then its ``F`` and backward.
    """
    problems = _structure(schedule, stage_to_rank, stages, micro, passes)
    if problems:
        shown = problems[:_MAX_LISTED]
        if len(problems) > _MAX_LISTED:
            shown.append(Problem(obj="…", value=f"{len(problems) - _MAX_LISTED} more problems",
                                 rule="fix the ones above first"))
        raise ScheduleError(shown, header=f"invalid schedule ({stages} stages, {micro} micro-batches"
                                          + (f", {passes} passes" if passes > 1 else "") + "):\n"
                                          + format_schedule(schedule))
    stuck = _run(schedule, last=stages - 1)
    if stuck:
        raise ScheduleError(_stuck_problems(schedule, stuck, stages - 1), header=(
            f"schedule deadlocks: rank(s) {', '.join(map(str, sorted(stuck)))} wait forever "
            "at the [bracketed] steps\n" + format_schedule(schedule, stuck)))


def _structure(schedule: Schedule, stage_to_rank: StageToRank, stages: int, micro: int,
               passes: int) -> list[Problem]:
    problems: list[Problem] = []
    where: dict[_Key, tuple[int, int]] = {}  # key -> (rank, step)
    last = stages - 1
    for rank, actions in sorted(schedule.items()):
        for step, a in enumerate(actions):
            here = f"rank {rank} step {step}"
            if not (a.stage < stages and a.micro < micro):
                problems.append(Problem(obj=here, value=str(a),
                                        rule=f"stages are 0..{stages - 1}, micro-batches 0..{micro - 1}"))
                continue
            if a.kind is Kind.R and a.iteration >= passes - 1:
                problems.append(Problem(
                    obj=here, value=str(a),
                    rule=(f"{passes} forward pass(es) per micro-batch: no-gradient passes are "
                          f"0..{passes - 2}" if passes > 1 else
                          "R runs only in multi-forward plans (passes > 1)"),
                    fix="drop it, or raise the plan's passes"))
                continue
            if stage_to_rank.get(a.stage) != rank:
                problems.append(Problem(
                    obj=here, value=str(a),
                    rule=f"stage {a.stage} runs on rank {stage_to_rank.get(a.stage)}, not rank {rank}",
                    fix=f"move {a} to rank {stage_to_rank.get(a.stage)}'s list"))
                continue
            key = _key(a)
            if key in where:
                problems.append(Problem(obj=here, value=str(a),
                                        rule=f"each action runs once; also at rank {rank} step {where[key][1]}"))
                continue
            where[key] = (rank, step)

    def step(kind: Kind, s: int, m: int, k: int = 0) -> int | None:
        found = where.get((kind, s, m, k))
        return None if found is None else found[1]

    def before(a: _Key, b: _Key, rule: str) -> None:
        """On one rank, ``a`` runs before ``b`` (both present)."""
        sa, sb = step(*a), step(*b)
        if sa is not None and sb is not None and sa > sb:
            problems.append(Problem(
                obj=f"rank {where[a][0]}", value=f"{_fmt(a)} at step {sa} after {_fmt(b)} at step {sb}",
                rule=rule))

    def present(key: _Key, rule: str, fix: str = "") -> None:
        if key not in where:
            problems.append(Problem(obj=f"stage {key[1]} micro-batch {key[2]}", value=f"no {_fmt(key)}",
                                    rule=rule, fix=fix))

    def bwd(s: int, m: int) -> _Key:
        return (Kind.I if (Kind.I, s, m, 0) in where else Kind.B, s, m, 0)

    def fwd(s: int, m: int, k: int) -> _Key:
        """Pass ``k`` of stage ``s``: ``R`` before the last pass, ``F`` on it."""
        return (Kind.R, s, m, k) if k < passes - 1 else (Kind.F, s, m, 0)

    for s in range(stages):
        for m in range(micro):
            present((Kind.F, s, m, 0), "every micro-batch runs forward on every stage")
            for k in range(passes - 1):
                present((Kind.R, s, m, k), f"every micro-batch runs {passes - 1} no-gradient pass(es) "
                                           "on every stage", fix=f"add {s}R{m}.{k} to rank "
                                                                 f"{stage_to_rank.get(s)}")
                before((Kind.R, s, m, k), fwd(s, m, k + 1), "a stage runs its passes in order")
            has_b, has_i, has_w = ((k, s, m, 0) in where for k in (Kind.B, Kind.I, Kind.W))
            if not (has_b or has_i):
                problems.append(Problem(
                    obj=f"stage {s} micro-batch {m}", value="no backward",
                    rule="every micro-batch runs backward on every stage: B, or I then W",
                    fix=f"add {s}B{m} to rank {stage_to_rank.get(s)}"))
            elif has_b and (has_i or has_w):
                problems.append(Problem(obj=f"stage {s} micro-batch {m}", value="B and I/W",
                                        rule="a backward is either B or I then W, not both"))
            elif has_i != has_w:
                missing = Kind.W if has_i else Kind.I
                present((missing, s, m, 0), "a split backward runs both I and W")
            before((Kind.F, s, m, 0), bwd(s, m), f"the F of stage {s} micro-batch {m} precedes its backward")
            before((Kind.I, s, m, 0), (Kind.W, s, m, 0), "W runs after its I")
    fix = "add the communication with add_communication(schedule, stage_to_rank)"
    for s in range(stages - 1):
        local = stage_to_rank.get(s) == stage_to_rank.get(s + 1)
        for m in range(micro):
            for k in range(passes - 1):
                _link(where, problems, present, before, fwd(s, m, k), fwd(s + 1, m, k),
                      (Kind.SEND_R, s, m, k), (Kind.RECV_R, s + 1, m, k), local,
                      f"stage {s} feeds stage {s + 1}")
            if local:
                before((Kind.F, s, m, 0), (Kind.F, s + 1, m, 0), f"stage {s} feeds stage {s + 1} on one rank")
                before(bwd(s + 1, m), bwd(s, m), f"stage {s + 1}'s gradient feeds stage {s}")
                continue
            for key, producer, rule in (
                ((Kind.SEND_F, s, m, 0), (Kind.F, s, m, 0),
                 f"stage {s} sends its output to stage {s + 1} on another rank"),
                ((Kind.RECV_F, s + 1, m, 0), (Kind.F, s + 1, m, 0),
                 f"stage {s + 1} receives its input from stage {s} on another rank"),
                ((Kind.SEND_B, s + 1, m, 0), bwd(s + 1, m),
                 f"stage {s + 1} sends its input gradient to stage {s}"),
                ((Kind.RECV_B, s, m, 0), bwd(s, m),
                 f"stage {s} receives its output gradient from stage {s + 1}"),
            ):
                if producer in where:  # a missing F or backward is reported once, above
                    present(key, rule, fix)
            before((Kind.F, s, m, 0), (Kind.SEND_F, s, m, 0), "a send follows the action that produces it")
            before((Kind.RECV_F, s + 1, m, 0), (Kind.F, s + 1, m, 0),
                   "a receive precedes the action that needs it")
            before(bwd(s + 1, m), (Kind.SEND_B, s + 1, m, 0), "a send follows the action that produces it")
            before((Kind.RECV_B, s, m, 0), bwd(s, m), "a receive precedes the action that needs it")
    loop_local = stage_to_rank.get(last) == stage_to_rank.get(0)
    for m in range(micro):
        for k in range(passes - 1):
            _link(where, problems, present, before, (Kind.R, last, m, k), fwd(0, m, k + 1),
                  (Kind.SEND_R, last, m, k), (Kind.RECV_R, 0, m, k + 1), loop_local,
                  f"the last stage's output of pass {k} is stage 0's input of pass {k + 1}")
    for (kind, s, m, k), (rank, _) in where.items():
        peer = {Kind.SEND_F: s + 1, Kind.RECV_F: s - 1, Kind.SEND_B: s - 1, Kind.RECV_B: s + 1,
                Kind.SEND_R: s + 1 if s < last else 0, Kind.RECV_R: s - 1 if s > 0 else last}.get(kind)
        if peer is not None and (peer not in stage_to_rank or stage_to_rank[peer] == stage_to_rank[s]):
            problems.append(Problem(obj=f"rank {rank}", value=_fmt((kind, s, m, k)),
                                    rule=f"communication only between stages on different ranks; "
                                         f"stage {peer} is {'absent' if peer not in stage_to_rank else 'local'}"))
    return problems


def _link(where, problems, present, before, producer: _Key, consumer: _Key, send: _Key, recv: _Key,
          local: bool, what: str) -> None:
    """A no-gradient pass's value from ``producer`` to ``consumer``: in order on one rank,
    else by ``send`` after the producer and ``recv`` before the consumer."""
    if local:
        before(producer, consumer, f"{what} on one rank")
        return
    fix = "add the communication with add_communication(schedule, stage_to_rank)"
    if producer in where:
        present(send, f"{what}: the value is sent to another rank", fix)
        present(recv, f"{what}: the value is received from another rank", fix)
    before(producer, send, "a send follows the action that produces it")
    before(recv, consumer, "a receive precedes the action that needs it")


def _fmt(key: _Key) -> str:
    return str(Action(key[1], key[0], key[2], key[3]))


def _match(a: Action, last: int) -> _Key | None:
    """The send a receive waits for."""
    if a.kind is Kind.RECV_F:
        return (Kind.SEND_F, a.stage - 1, a.micro, 0)
    if a.kind is Kind.RECV_B:
        return (Kind.SEND_B, a.stage + 1, a.micro, 0)
    if a.kind is Kind.RECV_R:
        if a.stage > 0:
            return (Kind.SEND_R, a.stage - 1, a.micro, a.iteration)
        return (Kind.SEND_R, last, a.micro, a.iteration - 1)
    return None


_SENDS = (Kind.SEND_F, Kind.SEND_B, Kind.SEND_R)


def _run(schedule: Schedule, shared: frozenset[int] = frozenset(), *, last: int | None = None
         ) -> dict[int, int]:
    """Run every rank as far as it can; return rank -> step where it is stuck (empty: all finished).

    An action of a ``shared`` stage runs on every rank at once (a collective
    over all devices): a rank waits at it until every rank is at it. ``last``
    is the last stage (default: the highest in the schedule).
    """
    if last is None:
        last = max((a.stage for acts in schedule.values() for a in acts), default=0)
    pos = {rank: 0 for rank in schedule}
    issued: set[_Key] = set()

    def at(rank: int) -> Action | None:
        return schedule[rank][pos[rank]] if pos[rank] < len(schedule[rank]) else None

    progress = True
    while progress:
        progress = False
        for rank in schedule:
            while (a := at(rank)) is not None:
                if a.stage in shared:
                    if any(at(q) != a for q in schedule):
                        break
                    for q in schedule:
                        pos[q] += 1
                    progress = True
                    continue
                need = _match(a, last)
                if need is not None and need not in issued:
                    break
                if a.kind in _SENDS:
                    issued.add(_key(a))
                pos[rank] += 1
                progress = True
    return {rank: p for rank, p in pos.items() if p < len(schedule[rank])}


def _stuck_problems(schedule: Schedule, stuck: dict[int, int], last: int) -> list[Problem]:
    sends = {_key(a): (rank, step) for rank, actions in schedule.items() for step, a in enumerate(actions)}
    problems = []
    for rank, step in sorted(stuck.items()):
        a = schedule[rank][step]
        need = _match(a, last)
        assert need is not None, "only receives block"
        if need in sends:
            r, s = sends[need]
            why = (f"rank {r} issues {_fmt(need)} at step {s}, "
                   f"after its own stuck step {stuck[r]} ({schedule[r][stuck[r]]})")
        else:
            why = f"no rank issues {_fmt(need)}"
        problems.append(Problem(obj=f"rank {rank} step {step}", value=f"{a} waits for {_fmt(need)}", rule=why,
                                fix="reorder so that every send comes before the receives its rank waits on"))
    return problems


def timeline(schedule: Schedule, *, cost_f: float = 1.0, cost_b: float = 2.0,
             cost_i: float | None = None, cost_w: float | None = None, cost_r: float | None = None
             ) -> dict[int, list[tuple[float, float, Action]]]:
    """Rank -> (start, end, action) for each compute action, each as early as its inputs allow.

    ``I`` and ``W`` default to half of ``B`` each, ``R`` to ``F``. Sends and
    receives take no time; a stage's forward (``F`` or ``R``) waits for the
    previous stage's, stage 0's next pass for the last stage's previous one,
    its backward for its own forward and the next stage's backward, ``W`` for
    its ``I``.
    """
    cost = {Kind.F: cost_f, Kind.B: cost_b, Kind.R: cost_f if cost_r is None else cost_r,
            Kind.I: cost_b / 2 if cost_i is None else cost_i,
            Kind.W: cost_b / 2 if cost_w is None else cost_w}
    compute = {r: [a for a in acts if a.kind.is_compute] for r, acts in schedule.items()}
    present = {_key(a) for acts in compute.values() for a in acts}
    last = max((a.stage for acts in compute.values() for a in acts), default=0)
    deps = dependencies(present, last)
    end: dict[_Key, float] = {}
    out: dict[int, list[tuple[float, float, Action]]] = {r: [] for r in compute}
    clock = {r: 0.0 for r in compute}
    progress = True
    while progress:
        progress = False
        for rank, actions in compute.items():
            while len(out[rank]) < len(actions):
                a = actions[len(out[rank])]
                need = deps(a)
                if any(k not in end for k in need):
                    break
                start = max([clock[rank]] + [end[k] for k in need])
                clock[rank] = end[_key(a)] = start + cost[a.kind]
                out[rank].append((start, clock[rank], a))
                progress = True
    if any(len(out[r]) < len(acts) for r, acts in compute.items()):
        raise ScheduleError(Problem(obj="schedule", value="some actions never become ready",
                                    rule="a schedule is timed only if it runs to the end",
                                    fix="run dry_run(...) to see where it is stuck"))
    return out


def dependencies(present: set[_Key], last: int):
    """``deps(action)``: the compute actions (as keys) whose results it needs, among ``present``."""
    passes: dict[int, int] = {}
    for kind, _, m, k in present:
        if kind is Kind.R:
            passes[m] = max(passes.get(m, 0), k + 1)

    def grad(s: int, m: int) -> _Key:
        return (Kind.I if (Kind.I, s, m, 0) in present else Kind.B, s, m, 0)

    def deps(a: Action) -> list[_Key]:
        s, m, k = a.stage, a.micro, a.iteration
        if a.kind is Kind.R:
            if s > 0:
                return [(Kind.R, s - 1, m, k)]
            return [(Kind.R, last, m, k - 1)] if k > 0 else []
        if a.kind is Kind.F:
            if s > 0:
                return [(Kind.F, s - 1, m, 0)]
            return [(Kind.R, last, m, passes[m] - 1)] if passes.get(m) else []
        if a.kind is Kind.W:
            return [(Kind.I, s, m, 0)]
        return [(Kind.F, s, m, 0)] + ([grad(s + 1, m)] if s < last else [])

    return deps


def bubble_fraction(schedule: Schedule, *, cost_f: float = 1.0, cost_b: float = 2.0,
                    cost_i: float | None = None, cost_w: float | None = None,
                    cost_r: float | None = None) -> float:
    """Idle time over total time (ranks × makespan) in :func:`timeline`'s simulation."""
    times = timeline(schedule, cost_f=cost_f, cost_b=cost_b, cost_i=cost_i, cost_w=cost_w,
                     cost_r=cost_r)
    makespan = max((t[-1][1] for t in times.values() if t), default=0.0)
    if makespan == 0:
        return 0.0
    busy = sum(e - s for t in times.values() for s, e, _ in t)
    return 1.0 - busy / (len(times) * makespan)


def peak_in_flight(schedule: Schedule) -> dict[int, int]:
    """Rank -> the most (stage, micro-batch) pairs whose F ran and whose B or W has not
    (``R`` passes keep nothing for backward)."""
    out: dict[int, int] = {}
    for rank, actions in schedule.items():
        live: set[tuple[int, int]] = set()
        peak = 0
        for a in actions:
            if a.kind is Kind.F:
                live.add((a.stage, a.micro))
                peak = max(peak, len(live))
            elif a.kind in (Kind.B, Kind.W):
                live.discard((a.stage, a.micro))
        out[rank] = peak
    return out
