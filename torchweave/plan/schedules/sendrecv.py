"""Add the sends and receives a compute-only schedule needs.

Between consecutive stages on different ranks:

- after ``F`` of stage ``s`` micro ``m``: ``sSEND_Fm``; just before ``F`` of
  stage ``s+1`` micro ``m`` on its rank: ``(s+1)RECV_Fm``;
- after ``B`` or ``I`` of stage ``s+1`` micro ``m``: ``(s+1)SEND_Bm``; just
  before ``B`` or ``I`` of stage ``s`` micro ``m``: ``sRECV_Bm``.

Consecutive stages on one rank hand their tensors over in memory and need no
action. ``W`` needs nothing from another rank.

No-gradient passes (``R``) move forward like ``F``, and the last stage's
output goes back to stage 0 for the next pass: after ``R`` of the last stage
micro ``m`` pass ``k``, ``(last)SEND_Rm.k``; just before stage 0's next pass of
``m`` (``R`` pass ``k+1``, or its ``F`` after the last ``R``), ``0RECV_Rm.(k+1)``.
"""

from __future__ import annotations

from torchweave.errors import Problem
from torchweave.plan.schedules.actions import Action, Kind, Schedule, ScheduleError, StageToRank


def add_communication(schedule: Schedule, stage_to_rank: StageToRank) -> Schedule:
    """A new schedule with each rank's compute actions and the sends and receives they need."""
    problems: list[Problem] = []
    for rank, actions in sorted(schedule.items()):
        for step, a in enumerate(actions):
            if a.kind.is_comm:
                problems.append(Problem(
                    obj=f"rank {rank} step {step}", value=str(a),
                    rule="add_communication takes compute actions only (F, B, I, W, R)",
                    fix="pass the schedule before communication was added",
                ))
            elif a.stage not in stage_to_rank:
                problems.append(Problem(
                    obj=f"rank {rank} step {step}", value=str(a),
                    rule=f"every stage has a rank; stage_to_rank covers stages {sorted(stage_to_rank)}",
                ))
    if problems:
        raise ScheduleError(problems, header="cannot add communication")

    def crosses(a: int, b: int) -> bool:
        return a in stage_to_rank and b in stage_to_rank and stage_to_rank[a] != stage_to_rank[b]

    last = max(stage_to_rank, default=0)
    passes = recycle_passes(schedule)
    out: Schedule = {}
    for rank, actions in schedule.items():
        new: list[Action] = []
        for a in actions:
            s, m, k = a.stage, a.micro, a.iteration
            if a.kind is Kind.R:
                if crosses(s - 1, s) or (s == 0 and k > 0 and crosses(last, 0)):
                    new.append(Action(s, Kind.RECV_R, m, k))
                new.append(a)
                if crosses(s, s + 1) or (s == last and crosses(last, 0)):
                    new.append(Action(s, Kind.SEND_R, m, k))
            elif a.kind is Kind.F:
                if crosses(s - 1, s):
                    new.append(Action(s, Kind.RECV_F, m))
                if s == 0 and passes.get(m) and crosses(last, 0):
                    new.append(Action(s, Kind.RECV_R, m, passes[m]))
                new.append(a)
                if crosses(s, s + 1):
                    new.append(Action(s, Kind.SEND_F, m))
            elif a.kind.is_backward:
                if crosses(s, s + 1):
                    new.append(Action(s, Kind.RECV_B, m))
                new.append(a)
                if crosses(s - 1, s):
                    new.append(Action(s, Kind.SEND_B, m))
            else:
                new.append(a)
        out[rank] = new
    return out


def recycle_passes(schedule: Schedule) -> dict[int, int]:
    """Micro-batch → how many ``R`` passes precede its ``F`` (absent: none)."""
    out: dict[int, int] = {}
    for actions in schedule.values():
        for a in actions:
            if a.kind is Kind.R:
                out[a.micro] = max(out.get(a.micro, 0), a.iteration + 1)
    return out
