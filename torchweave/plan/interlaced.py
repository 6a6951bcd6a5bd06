"""Interlaced pipelines: shared stages on every device between pipelined ones.

A *shared* stage (``stage_rank[s] == ALL``) runs on every device. In the
interlaced pipeline the token embedding before the blocks and the LM head
with its loss after them are shared and tensor-parallel across all devices,
while the blocks between are pipelined, one stage per rank. A shared action
holds collectives over all devices, so every rank runs every shared action,
and in the same order; the dry run treats each as a barrier that all ranks
must reach. Messages between a shared stage and its pipelined neighbour are
not actions: the schedule's own order covers them (the neighbour's rank runs
both sides).
"""

from __future__ import annotations

from torchweave.errors import Problem
from torchweave.plan.schedules import (
    Action, Kind, Schedule, ScheduleError, add_communication, dry_run, format_schedule,
    one_f_one_b,
)
from torchweave.plan.schedules.check import _run

ALL = -1
"""``stage_rank`` of a shared stage: it runs on every pipeline rank, over all devices."""


def interlaced_1f1b(ranks: int, micro: int) -> Schedule:
    """Stage 0 and stage ``ranks + 1`` shared; block stage ``r + 1`` on rank ``r``, in 1F1B.

    Every rank runs the embedding's forward for every micro-batch first; then
    1F1B over its block stage, with the head's forward and backward of
    micro-batch ``j`` just before its own backward of ``j`` (on the last rank
    that is right after its forward of ``j``); then the embedding's backwards.
    """
    head = ranks + 1
    out: Schedule = {}
    for r, actions in one_f_one_b(ranks, micro).items():
        row = [Action(0, Kind.F, m) for m in range(micro)]
        for a in actions:
            if a.kind is Kind.B:
                row += [Action(head, Kind.F, a.micro), Action(head, Kind.B, a.micro)]
            row.append(Action(a.stage + 1, a.kind, a.micro))
        out[r] = row + [Action(0, Kind.B, m) for m in range(micro)]
    return out


def check_shared(schedule: Schedule, stage_rank: list[int], micro: int) -> None:
    """The dry run for schedules with shared stages; raise :class:`ScheduleError` with the grid."""
    shared = {s for s, r in enumerate(stage_rank) if r == ALL}
    blocks = [s for s in range(len(stage_rank)) if s not in shared]
    renum = {s: i for i, s in enumerate(blocks)}
    problems = _shared_structure(schedule, shared, micro) + _neighbours(schedule, stage_rank, shared, micro)
    if problems:
        raise ScheduleError(problems, header="invalid interlaced schedule:\n" + format_schedule(schedule))
    sub = {r: [Action(renum[a.stage], a.kind, a.micro) for a in acts if a.stage not in shared]
           for r, acts in schedule.items()}
    sub_map = {renum[s]: stage_rank[s] for s in blocks}
    dry_run(add_communication(sub, sub_map), sub_map, len(blocks), micro)
    full = {}
    for r, acts in schedule.items():
        row: list[Action] = []
        for a in acts:
            if a.stage in shared:
                row.append(a)
                continue
            for c in add_communication({r: [Action(renum[a.stage], a.kind, a.micro)]}, sub_map)[r]:
                row.append(Action(blocks[c.stage], c.kind, c.micro))
        full[r] = row
    stuck = _run(full, frozenset(shared))
    if stuck:
        raise ScheduleError(Problem(
            obj="schedule", value=", ".join(f"rank {r} at {full[r][s]}" for r, s in sorted(stuck.items())),
            rule="every rank reaches each shared action (a collective over all devices) in turn",
            fix="order the shared actions so that no rank waits at one for a rank that waits for it"),
            header="schedule deadlocks at the [bracketed] steps\n" + format_schedule(full, stuck))


def _shared_structure(schedule: Schedule, shared: set[int], micro: int) -> list[Problem]:
    out = []
    rows = {r: [a for a in acts if a.stage in shared] for r, acts in schedule.items()}
    want = sorted((Action(s, k, m) for s in shared for k in (Kind.F, Kind.B) for m in range(micro)), key=str)
    first = min(rows) if rows else 0
    for r, row in sorted(rows.items()):
        if sorted(row, key=str) != want:
            missing = sorted(set(want) - set(row), key=str)
            out.append(Problem(obj=f"rank {r}", value=f"shared actions {', '.join(map(str, row[:8]))}",
                               rule="every rank runs each shared stage's F and B once per micro-batch",
                               fix=f"add {', '.join(map(str, missing[:6]))}" if missing else ""))
        elif row != rows[first]:
            out.append(Problem(obj=f"rank {r}", value=" ".join(map(str, row)),
                               rule=f"every rank runs the shared actions in one order, rank {first}'s: "
                                    + " ".join(map(str, rows[first]))))
        for s in shared:
            for m in range(micro):
                f, b = Action(s, Kind.F, m), Action(s, Kind.B, m)
                if f in row and b in row and row.index(f) > row.index(b):
                    out.append(Problem(obj=f"rank {r}", value=f"{b} before {f}",
                                       rule="a micro-batch's F precedes its backward"))
    return out


def _neighbours(schedule: Schedule, stage_rank: list[int], shared: set[int], micro: int) -> list[Problem]:
    """A shared stage and its pipelined neighbour, on the neighbour's rank: data flows in order."""
    out = []
    for s in shared:
        for n, feeds in ((s + 1, True), (s - 1, False)):
            if n in shared or not 0 <= n < len(stage_rank):
                continue
            row = schedule.get(stage_rank[n], [])
            for m in range(micro):
                up, down = (s, n) if feeds else (n, s)
                for a, b in ((Action(up, Kind.F, m), Action(down, Kind.F, m)),
                             (Action(down, Kind.B, m), Action(up, Kind.B, m))):
                    if a in row and b in row and row.index(a) > row.index(b):
                        out.append(Problem(obj=f"rank {stage_rank[n]}", value=f"{b} before {a}",
                                           rule=f"stage {up} feeds stage {down}: {a} runs first"))
    return out
