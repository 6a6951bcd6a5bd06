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
and match messages by (stage, direction, micro-batch), e.g. with tags or by
posting receives in the order their sends are issued. Under blocking sends
more schedules deadlock than this check finds.

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
_Key = tuple[Kind, int, int]  # (kind, stage, micro)


def dry_run(schedule: Schedule, stage_to_rank: StageToRank, stages: int, micro: int) -> None:
    """Raise :class:`ScheduleError` if the schedule is malformed, incomplete or deadlocks."""
    problems = _structure(schedule, stage_to_rank, stages, micro)
    if problems:
        shown = problems[:_MAX_LISTED]
        if len(problems) > _MAX_LISTED:
            shown.append(Problem(obj="…", value=f"{len(problems) - _MAX_LISTED} more problems",
                                 rule="fix the ones above first"))
        raise ScheduleError(shown, header=f"invalid schedule ({stages} stages, {micro} micro-batches):\n"
                                          + format_schedule(schedule))
    stuck = _run(schedule)
    if stuck:
        raise ScheduleError(_stuck_problems(schedule, stuck), header=(
            f"schedule deadlocks: rank(s) {', '.join(map(str, sorted(stuck)))} wait forever "
            "at the [bracketed] steps\n" + format_schedule(schedule, stuck)))


def _structure(schedule: Schedule, stage_to_rank: StageToRank, stages: int, micro: int) -> list[Problem]:
    problems: list[Problem] = []
    where: dict[_Key, tuple[int, int]] = {}  # key -> (rank, step)
    for rank, actions in sorted(schedule.items()):
        for step, a in enumerate(actions):
            here = f"rank {rank} step {step}"
            if not (a.stage < stages and a.micro < micro):
                problems.append(Problem(obj=here, value=str(a),
                                        rule=f"stages are 0..{stages - 1}, micro-batches 0..{micro - 1}"))
                continue
            if stage_to_rank.get(a.stage) != rank:
                problems.append(Problem(
                    obj=here, value=str(a),
                    rule=f"stage {a.stage} runs on rank {stage_to_rank.get(a.stage)}, not rank {rank}",
                    fix=f"move {a} to rank {stage_to_rank.get(a.stage)}'s list"))
                continue
            key = (a.kind, a.stage, a.micro)
            if key in where:
                problems.append(Problem(obj=here, value=str(a),
                                        rule=f"each action runs once; also at rank {rank} step {where[key][1]}"))
                continue
            where[key] = (rank, step)

    def step(kind: Kind, s: int, m: int) -> int | None:
        found = where.get((kind, s, m))
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
        return (Kind.I if (Kind.I, s, m) in where else Kind.B, s, m)

    for s in range(stages):
        for m in range(micro):
            present((Kind.F, s, m), "every micro-batch runs forward on every stage")
            has_b, has_i, has_w = ((k, s, m) in where for k in (Kind.B, Kind.I, Kind.W))
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
                present((missing, s, m), "a split backward runs both I and W")
            before((Kind.F, s, m), bwd(s, m), f"the F of stage {s} micro-batch {m} precedes its backward")
            before((Kind.I, s, m), (Kind.W, s, m), "W runs after its I")
    for s in range(stages - 1):
        local = stage_to_rank.get(s) == stage_to_rank.get(s + 1)
        for m in range(micro):
            if local:
                before((Kind.F, s, m), (Kind.F, s + 1, m), f"stage {s} feeds stage {s + 1} on one rank")
                before(bwd(s + 1, m), bwd(s, m), f"stage {s + 1}'s gradient feeds stage {s}")
                continue
            fix = "add the communication with add_communication(schedule, stage_to_rank)"
            for key, producer, rule in (
                ((Kind.SEND_F, s, m), (Kind.F, s, m),
                 f"stage {s} sends its output to stage {s + 1} on another rank"),
                ((Kind.RECV_F, s + 1, m), (Kind.F, s + 1, m),
                 f"stage {s + 1} receives its input from stage {s} on another rank"),
                ((Kind.SEND_B, s + 1, m), bwd(s + 1, m),
                 f"stage {s + 1} sends its input gradient to stage {s}"),
                ((Kind.RECV_B, s, m), bwd(s, m),
                 f"stage {s} receives its output gradient from stage {s + 1}"),
            ):
                if producer in where:  # a missing F or backward is reported once, above
                    present(key, rule, fix)
            before((Kind.F, s, m), (Kind.SEND_F, s, m), "a send follows the action that produces it")
            before((Kind.RECV_F, s + 1, m), (Kind.F, s + 1, m), "a receive precedes the action that needs it")
            before(bwd(s + 1, m), (Kind.SEND_B, s + 1, m), "a send follows the action that produces it")
            before((Kind.RECV_B, s, m), bwd(s, m), "a receive precedes the action that needs it")
    for kind, s, m in where:
        peer = {Kind.SEND_F: s + 1, Kind.RECV_F: s - 1, Kind.SEND_B: s - 1, Kind.RECV_B: s + 1}.get(kind)
        if peer is not None and (peer not in stage_to_rank or stage_to_rank[peer] == stage_to_rank[s]):
            problems.append(Problem(obj=f"rank {where[(kind, s, m)][0]}", value=_fmt((kind, s, m)),
                                    rule=f"communication only between stages on different ranks; "
                                         f"stage {peer} is {'absent' if peer not in stage_to_rank else 'local'}"))
    return problems


def _fmt(key: _Key) -> str:
    return str(Action(key[1], key[0], key[2]))


def _match(a: Action) -> _Key | None:
    """The send a receive waits for."""
    if a.kind is Kind.RECV_F:
        return (Kind.SEND_F, a.stage - 1, a.micro)
    if a.kind is Kind.RECV_B:
        return (Kind.SEND_B, a.stage + 1, a.micro)
    return None


def _run(schedule: Schedule, shared: frozenset[int] = frozenset()) -> dict[int, int]:
    """Run every rank as far as it can; return rank -> step where it is stuck (empty: all finished).

    An action of a ``shared`` stage runs on every rank at once (a collective
    over all devices): a rank waits at it until every rank is at it.
    """
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
                need = _match(a)
                if need is not None and need not in issued:
                    break
                if a.kind in (Kind.SEND_F, Kind.SEND_B):
                    issued.add((a.kind, a.stage, a.micro))
                pos[rank] += 1
                progress = True
    return {rank: p for rank, p in pos.items() if p < len(schedule[rank])}


def _stuck_problems(schedule: Schedule, stuck: dict[int, int]) -> list[Problem]:
    sends = {(a.kind, a.stage, a.micro): (rank, step)
             for rank, actions in schedule.items() for step, a in enumerate(actions)}
    problems = []
    for rank, step in sorted(stuck.items()):
        a = schedule[rank][step]
        need = _match(a)
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
             cost_i: float | None = None, cost_w: float | None = None
             ) -> dict[int, list[tuple[float, float, Action]]]:
    """Rank -> (start, end, action) for each compute action, each as early as its inputs allow.

    ``I`` and ``W`` default to half of ``B`` each. Sends and receives take no
    time; a stage's forward waits for the previous stage's, its backward for
    its own forward and the next stage's backward, ``W`` for its ``I``.
    """
    cost = {Kind.F: cost_f, Kind.B: cost_b,
            Kind.I: cost_b / 2 if cost_i is None else cost_i,
            Kind.W: cost_b / 2 if cost_w is None else cost_w}
    compute = {r: [a for a in acts if a.kind.is_compute] for r, acts in schedule.items()}
    present = {(a.kind, a.stage, a.micro) for acts in compute.values() for a in acts}
    last = max((a.stage for acts in compute.values() for a in acts), default=0)
    end: dict[_Key, float] = {}

    def grad(s: int, m: int) -> _Key:
        return (Kind.I if (Kind.I, s, m) in present else Kind.B, s, m)

    def deps(a: Action) -> list[_Key]:
        s, m = a.stage, a.micro
        if a.kind is Kind.F:
            return [(Kind.F, s - 1, m)] if s > 0 else []
        if a.kind is Kind.W:
            return [(Kind.I, s, m)]
        return [(Kind.F, s, m)] + ([grad(s + 1, m)] if s < last else [])

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
                clock[rank] = end[(a.kind, a.stage, a.micro)] = start + cost[a.kind]
                out[rank].append((start, clock[rank], a))
                progress = True
    if any(len(out[r]) < len(acts) for r, acts in compute.items()):
        raise ScheduleError(Problem(obj="schedule", value="some actions never become ready",
                                    rule="a schedule is timed only if it runs to the end",
                                    fix="run dry_run(...) to see where it is stuck"))
    return out


def bubble_fraction(schedule: Schedule, *, cost_f: float = 1.0, cost_b: float = 2.0,
                    cost_i: float | None = None, cost_w: float | None = None) -> float:
    """Idle time over total time (ranks × makespan) in :func:`timeline`'s simulation."""
    times = timeline(schedule, cost_f=cost_f, cost_b=cost_b, cost_i=cost_i, cost_w=cost_w)
    makespan = max((t[-1][1] for t in times.values() if t), default=0.0)
    if makespan == 0:
        return 0.0
    busy = sum(e - s for t in times.values() for s, e, _ in t)
    return 1.0 - busy / (len(times) * makespan)


def peak_in_flight(schedule: Schedule) -> dict[int, int]:
    """Rank -> the most (stage, micro-batch) pairs whose F ran and whose B or W has not."""
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
