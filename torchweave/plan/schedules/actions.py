"""Pipeline actions and schedules: small values with short printed forms.

An :class:`Action` is (stage, kind, micro-batch). It prints as ``1F0`` (stage 1,
forward, micro-batch 0), ``0SEND_F3`` or ``2W1``, and :meth:`Action.parse`
reads that back. Multi-forward plans (recycling, as in AlphaFold 2) add
``R``, a forward without gradients, with its pass after a dot: ``1R0.2`` is
stage 1's third no-gradient pass of micro-batch 0; the pass with gradients is
the plain ``F``. A :data:`Schedule` maps each rank to its actions, in the
order the rank runs them. Schedules print as a grid (one row per rank, one
column per step) and round-trip through CSV (one row per rank, one action
per cell).

Communication actions name the stage that runs them: ``0SEND_F3`` is stage 0
sending its output of micro-batch 3 forward, matched by ``1RECV_F3`` on the
rank of stage 1; ``1SEND_B3`` is stage 1 sending the gradient of its input
backward, matched by ``0RECV_B3``. ``sSEND_Rm.k`` sends stage ``s``'s output of
no-gradient pass ``k`` on: to stage ``s+1``, or from the last stage back to
stage 0, where ``0RECV_Rm.(k+1)`` takes it for the next pass (the ``F`` after
the last ``R`` receives ``0RECV_Rm.P`` with ``P`` the number of ``R`` passes).
"""

from __future__ import annotations

import csv
import enum
import io
from dataclasses import dataclass

from torchweave.errors import Problem, TorchweaveError


class ScheduleError(TorchweaveError):
    """A malformed, incomplete, misplaced or deadlocking pipeline schedule."""


class Kind(enum.Enum):
    """What an action does with its (stage, micro-batch)."""

    F = "F"
    """Forward."""
    B = "B"
    """Full backward: input and weight gradients together."""
    I = "I"  # noqa: E741 -- the letter is the name used in the zero-bubble papers
    """Backward for the input gradient only; its ``W`` follows later."""
    W = "W"
    """Backward for the weight gradient only, after its ``I``."""
    SEND_F = "SEND_F"
    """Send this stage's output to the next stage."""
    RECV_F = "RECV_F"
    """Receive this stage's input from the previous stage."""
    SEND_B = "SEND_B"
    """Send the gradient of this stage's input to the previous stage."""
    RECV_B = "RECV_B"
    """Receive the gradient of this stage's output from the next stage."""
    R = "R"
    """Forward without gradients (a recycling pass); its pass number follows a dot."""
    SEND_R = "SEND_R"
    """Send the output of a no-gradient pass on (the last stage: back to stage 0)."""
    RECV_R = "RECV_R"
    """Receive the input of a no-gradient pass (stage 0: the recycled output)."""

    # A member is its own singleton: hashed by identity in C, not by ``Enum.__hash__``'s
    # Python call on its name (timing a schedule hashes millions of action keys). Nothing
    # may depend on the iteration order of a set of kinds (string hashes vary by process too).
    __hash__ = object.__hash__

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_comm(self) -> bool:
        return not self.is_compute

    @property
    def is_backward(self) -> bool:
        """``B`` or ``I``: the action that produces the input gradient."""
        return self in (Kind.B, Kind.I)


_COMPUTE = frozenset({Kind.F, Kind.B, Kind.I, Kind.W, Kind.R})
_PASSED = frozenset({Kind.R, Kind.SEND_R, Kind.RECV_R})
"""Kinds that carry a pass number (``.k``)."""
# Longest names first, so that "SEND_F" is not read as "S" + ... and so on.
_KIND_NAMES = sorted((k.value for k in Kind), key=len, reverse=True)


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``kind`` of ``stage`` on micro-batch ``micro``
    (``iteration``: which no-gradient pass, for ``R`` and its messages)."""

    stage: int
    kind: Kind
    micro: int
    iteration: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            raise TypeError(f"Action.kind is a Kind, not {self.kind!r}")
        if self.stage < 0 or self.micro < 0 or self.iteration < 0:
            raise ScheduleError(Problem(
                obj=f"Action(stage={self.stage}, kind={self.kind.value}, micro={self.micro})",
                value=f"stage={self.stage}, micro={self.micro}, iteration={self.iteration}",
                rule="stage, micro-batch and pass are numbered from 0",
            ))
        if self.iteration and self.kind not in _PASSED:
            raise ScheduleError(Problem(
                obj=f"Action {self.stage}{self.kind.value}{self.micro}", value=f"pass {self.iteration}",
                rule="only R, SEND_R and RECV_R carry a pass number",
                fix="drop the '.k' suffix"))

    def __str__(self) -> str:
        base = f"{self.stage}{self.kind.value}{self.micro}"
        return f"{base}.{self.iteration}" if self.kind in _PASSED else base

    def __repr__(self) -> str:
        return f"Action({self})"

    @staticmethod
    def parse(text: str) -> Action:
        """Read ``<stage><kind><micro>[.<pass>]`` (``1F0``, ``0SEND_B3``, ``2R1.0``); raise
        pointing at the bad text."""
        s = text.strip()
        lead = len(text) - len(text.lstrip())
        iteration = None
        head, dot, tail = s.rpartition(".")
        if dot:
            if not tail.isdigit():
                raise _parse_error(text, lead + len(head) + 1, "a pass number follows the dot")
            s, iteration = head, int(tail)
        i = 0
        while i < len(s) and s[i].isdigit():
            i += 1
        if i == 0:
            raise _parse_error(text, lead, "an action starts with its stage number")
        if i == len(s):
            raise _parse_error(text, lead + i, "a kind follows the stage number")
        j = len(s)
        while j > i and s[j - 1].isdigit():
            j -= 1
        if j == len(s):
            raise _parse_error(text, lead + len(s), "an action ends with its micro-batch number")
        name = s[i:j]
        if name not in _KIND_NAMES:
            raise _parse_error(text, lead + i, f"unknown kind {name!r}; kinds are "
                               + ", ".join(k.value for k in Kind))
        kind = Kind(name)
        if (iteration is None) == (kind in _PASSED):
            rule = (f"{name} takes its pass after a dot, e.g. {s}.0" if iteration is None
                    else f"only R, SEND_R and RECV_R carry a pass number, not {name}")
            raise _parse_error(text, lead + len(s), rule)
        return Action(int(s[:i]), kind, int(s[j:]), iteration or 0)


def _parse_error(text: str, pos: int, rule: str) -> ScheduleError:
    caret = " " * pos + "^"
    return ScheduleError(Problem(
        obj=f"action {text!r}", value=f"\n    {text}\n    {caret}", rule=rule,
        fix="write <stage><kind><micro>, e.g. 1F0, 2W1 or 0SEND_F3 (R passes: 1R0.2)",
    ))


Schedule = dict[int, list[Action]]
"""Rank → the actions it runs, in order."""

StageToRank = dict[int, int]
"""Stage → the rank that runs it."""


def loop_stage_to_rank(stages: int, ranks: int) -> StageToRank:
    """Stage ``s`` on rank ``s % ranks``: one stage per rank, or interleaved virtual stages."""
    if stages < 1 or ranks < 1:
        raise ScheduleError(Problem(obj="loop_stage_to_rank", value=f"stages={stages}, ranks={ranks}",
                                    rule="at least one stage and one rank"))
    return {s: s % ranks for s in range(stages)}


def stages_on_rank(stage_to_rank: StageToRank) -> dict[int, list[int]]:
    """Rank → its stages, ascending."""
    out: dict[int, list[int]] = {}
    for stage in sorted(stage_to_rank):
        out.setdefault(stage_to_rank[stage], []).append(stage)
    return out


def infer_stage_to_rank(schedule: Schedule) -> StageToRank:
    """Read where each stage runs from the schedule's compute actions."""
    found: dict[int, set[int]] = {}
    for rank, actions in schedule.items():
        for a in actions:
            found.setdefault(a.stage, set()).add(rank)
    problems = [
        Problem(obj=f"stage {s}", value=f"ranks {sorted(r)}", rule="a stage runs on one rank")
        for s, r in sorted(found.items()) if len(r) > 1
    ]
    if problems:
        raise ScheduleError(problems, header="cannot infer the stage-to-rank map")
    return {s: next(iter(r)) for s, r in sorted(found.items())}


def format_schedule(schedule: Schedule, marks: dict[int, int] | None = None) -> str:
    """A grid: one row per rank, one column per step; ``marks`` (rank → step) are bracketed."""
    marks = marks or {}
    steps = max((len(a) for a in schedule.values()), default=0)
    steps = max([steps] + [s + 1 for s in marks.values()])
    cells: dict[int, list[str]] = {}
    for rank in sorted(schedule):
        row = [str(a) for a in schedule[rank]] + ["."] * (steps - len(schedule[rank]))
        if rank in marks:
            row[marks[rank]] = f"[{row[marks[rank]]}]"
        cells[rank] = row
    width = max([len(c) for row in cells.values() for c in row] + [len(str(steps - 1)), 1])
    label = max([len(f"rank {r}") for r in cells] + [4])
    lines = ["step".ljust(label) + " | " + " ".join(str(i).ljust(width) for i in range(steps))]
    lines.append("-" * len(lines[0]))
    for rank, row in cells.items():
        lines.append(f"rank {rank}".ljust(label) + " | " + " ".join(c.ljust(width) for c in row))
    return "\n".join(line.rstrip() for line in lines)


def to_csv(schedule: Schedule) -> str:
    """One row per rank: the rank, then one action per cell."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for rank in sorted(schedule):
        writer.writerow([rank] + [str(a) for a in schedule[rank]])
    return buf.getvalue()


def from_csv(text: str) -> Schedule:
    """Read :func:`to_csv`'s form back; blank cells and lines are skipped; every bad cell is reported."""
    schedule: Schedule = {}
    problems: list[Problem] = []
    for line_no, row in enumerate(csv.reader(io.StringIO(text)), start=1):
        if not any(cell.strip() for cell in row):
            continue
        head = row[0].strip()
        if not head.isdigit():
            problems.append(Problem(obj=f"CSV line {line_no}, column 1", value=repr(row[0]),
                                    rule="each row starts with its rank number"))
            continue
        rank = int(head)
        if rank in schedule:
            problems.append(Problem(obj=f"CSV line {line_no}", value=f"rank {rank}",
                                    rule="one row per rank"))
            continue
        actions: list[Action] = []
        for col, cell in enumerate(row[1:], start=2):
            if not cell.strip():
                continue
            try:
                actions.append(Action.parse(cell))
            except ScheduleError as err:
                for p in err.problems:
                    problems.append(Problem(obj=f"CSV line {line_no}, column {col}: {p.obj}",
                                            value=p.value, rule=p.rule, fix=p.fix))
        schedule[rank] = actions
    if problems:
        raise ScheduleError(problems, header="cannot read the schedule CSV")
    return schedule
