"""Pipeline decisions of a plan, built from the three primitives.

- **op-assign** of whole stages: ``stage_of`` puts each node in a stage, and
  ``stage_rank`` puts each stage on a device group (``groups[k]`` is pipeline
  rank ``k``). Inside its group a node is split and assigned as usual.
- **op-trans** of the batch: ``micro_batches`` pieces along dim 0, each run
  through every stage.
- **op-order**: ``schedule``, each pipeline rank's compute actions
  (``F``, ``B``, ``I``, ``W``) in the order it runs them. Every device of a
  group runs its group's list. Sends and receives are not stored: they follow
  from the stages (lowering derives them), and the dry run places them next to
  their compute (:func:`~torchweave.plan.schedules.add_communication`).

With ``recycle`` (:mod:`torchweave.plan.recycle`) each micro-batch runs
several forward passes, all but the last without gradients (``R`` actions),
the last stage's outputs fed back to stage 0 between passes.

A stage with ``stage_rank[s] == ALL`` is *shared*: it runs on every device
(the interlaced pipeline's embedding and LM head; see
:mod:`torchweave.plan.interlaced`).

Recompute groups (``Plan.recompute``) are separate: they apply to pipelined
and plain plans alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchweave.errors import Problem
from torchweave.plan.interlaced import ALL, check_shared
from torchweave.plan.recycle import Recycle
from torchweave.plan.schedules import (
    Action, Schedule, ScheduleError, add_communication, dry_run, format_schedule,
)

Group = tuple[int, ...]


@dataclass(kw_only=True)
class Pipeline:
    """Stages on device groups, micro-batches and the schedule."""

    groups: list[Group]
    """Pipeline rank → its devices (disjoint)."""
    stage_of: dict[str, int]
    """Node → stage."""
    stage_rank: list[int]
    """Stage → pipeline rank (index into ``groups``), or ``ALL`` for a shared stage."""
    micro_batches: int
    """Micro-batches per step (the batch's dim 0 is cut into this many)."""
    schedule: Schedule
    """Pipeline rank → compute actions, in order."""
    kind: str = "custom"
    """The built-in that made the schedule, or ``custom``."""
    recycle: Recycle | None = None
    """Multi-forward: passes per micro-batch and the recycled outputs."""

    @property
    def passes(self) -> int:
        """Forward passes per micro-batch (1 unless recycling)."""
        return self.recycle.passes if self.recycle is not None else 1

    @property
    def stages(self) -> int:
        return len(self.stage_rank)

    def rank_of_device(self, device: int) -> int | None:
        """The pipeline rank whose group holds ``device``."""
        return next((k for k, g in enumerate(self.groups) if device in g), None)

    def stages_of_device(self, device: int) -> list[int]:
        k = self.rank_of_device(device)
        return [s for s, r in enumerate(self.stage_rank) if r == k or r == ALL]

    @property
    def shared(self) -> list[int]:
        """Stages that run on every device."""
        return [s for s, r in enumerate(self.stage_rank) if r == ALL]

    def devices_of_stage(self, stage: int) -> Group:
        r = self.stage_rank[stage]
        return tuple(sorted(d for g in self.groups for d in g)) if r == ALL else self.groups[r]

    def to_data(self) -> dict[str, Any]:
        extra = {"recycle": self.recycle.to_data()} if self.recycle is not None else {}
        return {**extra, 
            "groups": [list(g) for g in self.groups],
            "stage_of": self.stage_of,
            "stage_rank": self.stage_rank,
            "micro_batches": self.micro_batches,
            "schedule": {str(r): [str(a) for a in acts] for r, acts in sorted(self.schedule.items())},
            "kind": self.kind,
        }

    @staticmethod
    def from_data(data: dict[str, Any]) -> "Pipeline":
        return Pipeline(
            groups=[tuple(int(d) for d in g) for g in data["groups"]],
            stage_of={n: int(s) for n, s in data["stage_of"].items()},
            stage_rank=[int(r) for r in data["stage_rank"]],
            micro_batches=int(data["micro_batches"]),
            schedule={int(r): [Action.parse(a) for a in acts] for r, acts in data["schedule"].items()},
            kind=data.get("kind", "custom"),
            recycle=Recycle.from_data(data["recycle"]) if data.get("recycle") else None,
        )


def check_pipeline(pipe: Pipeline, *, world_size: int, nodes: dict[str, Any],
                   devices_of: dict[str, set[int]], edges: list[tuple[str, str]]) -> list[Problem]:
    """Every problem with ``pipe``, the schedule's dry run last (it raises with the grid)."""
    out: list[Problem] = []
    obj = "plan pipeline"
    seen: dict[int, int] = {}
    for k, g in enumerate(pipe.groups):
        if not g:
            out.append(Problem(obj=f"{obj} group {k}", value="()", rule="a group has devices"))
        for d in g:
            if not 0 <= d < world_size:
                out.append(Problem(obj=f"{obj} group {k}", value=f"device {d}",
                                   rule=f"devices are 0..{world_size - 1}"))
            elif d in seen:
                out.append(Problem(obj=f"{obj} group {k}", value=f"device {d}",
                                   rule=f"groups are disjoint; device {d} is also in group {seen[d]}"))
            seen[d] = k
    sizes = [len(g) for g in pipe.groups]
    if sum(sizes) != world_size:
        out.append(Problem(
            obj=f"{obj} groups", value=str([list(g) for g in pipe.groups]),
            rule=f"the groups cover the world: {' + '.join(map(str, sizes)) or '0'} = {sum(sizes)} "
                 f"!= world_size({world_size})",
            fix="give every device to exactly one pipeline group"))
    p = len(pipe.groups)
    bad = [r for r in pipe.stage_rank if not 0 <= r < p and r != ALL]
    if bad:
        out.append(Problem(obj=f"{obj} stage_rank", value=str(pipe.stage_rank),
                           rule=f"each stage runs on a pipeline rank 0..{p - 1}"))
    idle = [k for k in range(p) if k not in pipe.stage_rank]
    if idle and not bad:
        out.append(Problem(
            obj=f"{obj} stage_rank", value=str(pipe.stage_rank),
            rule=f"every pipeline rank runs a stage: {pipe.stages} stages on {p} groups leave "
                 f"group(s) {idle} idle",
            fix=f"cut the model into a multiple of {p} stages, or use fewer groups"))
    if pipe.micro_batches < 1:
        out.append(Problem(obj=f"{obj} micro_batches", value=str(pipe.micro_batches),
                           rule="at least 1 micro-batch"))
    for name in nodes:
        s = pipe.stage_of.get(name)
        if s is None:
            out.append(Problem(obj=f"node {name}", value="no stage", rule="every node is in a stage",
                               fix="set plan.pipeline.stage_of[node]"))
        elif not 0 <= s < pipe.stages:
            out.append(Problem(obj=f"node {name}", value=f"stage {s}",
                               rule=f"stages are 0..{pipe.stages - 1}"))
        elif not bad:
            group = set(pipe.devices_of_stage(s))
            extra = sorted(devices_of.get(name, set()) - group)
            if extra:
                out.append(Problem(
                    obj=f"node {name}", value=f"devices {extra}",
                    rule=f"a node's pieces run on its stage's group: stage {s} is on "
                         f"{sorted(group)}", fix="op-assign its pieces to devices of that group"))
    for a, b in edges:
        sa, sb = pipe.stage_of.get(a), pipe.stage_of.get(b)
        if sa is not None and sb is not None and sa > sb:
            out.append(Problem(obj=f"node {b} (stage {sb})", value=f"reads {a} of stage {sa}",
                               rule="a stage reads only from itself and earlier stages",
                               fix=f"move {a} to stage {sb} or earlier"))
    return out


def check_schedule(pipe: Pipeline) -> None:
    """Dry-run the schedule over every pipeline rank; raise :class:`ScheduleError` with the grid."""
    if pipe.shared and pipe.recycle is None:  # with recycling: reported by check_recycle
        check_shared(pipe.schedule, pipe.stage_rank, pipe.micro_batches)
        return
    stage_to_rank = dict(enumerate(pipe.stage_rank))
    sched = pipe.schedule
    extra = sorted(set(sched) - set(range(len(pipe.groups))))
    if extra:
        raise ScheduleError(Problem(obj="schedule", value=f"pipeline ranks {extra}",
                                    rule=f"the schedule has rows 0..{len(pipe.groups) - 1}"),
                            header=format_schedule(sched))
    full = {k: list(sched.get(k, [])) for k in range(len(pipe.groups))}
    key = (tuple(tuple(full[k]) for k in sorted(full)), tuple(pipe.stage_rank), pipe.stages,
           pipe.micro_batches, pipe.passes)
    if key in _CHECKED:  # the same schedule already ran dry without a problem
        return
    if not any(a.kind.is_comm for acts in full.values() for a in acts):
        full = add_communication(full, stage_to_rank)
    dry_run(full, stage_to_rank, pipe.stages, pipe.micro_batches, pipe.passes)
    if len(_CHECKED) >= 64:
        _CHECKED.clear()
    _CHECKED.add(key)


_CHECKED: set[tuple] = set()
"""Schedules :func:`check_schedule` found sound (the search checks the same schedule on
many plans; a dry run of 96 stages × 48 micro-batches takes a third of a second)."""


def compute_only(schedule: Schedule) -> Schedule:
    """The F, B, I and W actions of each rank, in order (the runtime derives its messages)."""
    return {r: [a for a in acts if a.kind.is_compute] for r, acts in schedule.items()}



def apply_orders(schedule: Schedule, orders: list[tuple[Action, Action]]) -> Schedule:
    """``schedule`` reordered so that each ``(before, after)`` holds: user op-order on stage actions.

    Each rank's actions are re-sorted topologically under the given orders
    plus each (stage, micro-batch)'s own F → B/I → W; among actions free to
    run, the one earliest in ``schedule`` goes first, so an empty list changes
    nothing. Orders between ranks, cycles and unknown actions are reported.
    """
    rank_of = {a: r for r, acts in schedule.items() for a in acts}
    problems = []
    for before, after in orders:
        for a in (before, after):
            if a not in rank_of:
                problems.append(Problem(obj="op-order", value=str(a), rule="orders name actions of the schedule"))
        if before in rank_of and after in rank_of and rank_of[before] != rank_of[after]:
            problems.append(Problem(obj="op-order", value=f"{before} before {after}",
                                    rule="op-order relates actions on one rank",
                                    fix="communication already orders actions across ranks"))
    if problems:
        raise ScheduleError(problems, header="cannot apply the op-order constraints")
    out: Schedule = {}
    for rank, acts in schedule.items():
        pos = {a: i for i, a in enumerate(acts)}
        need: dict[Action, set[Action]] = {a: set() for a in acts}
        for before, after in orders:
            if rank_of[after] == rank:
                need[after].add(before)
        for a in acts:
            for kind in _AFTER.get(a.kind.value, ()):
                same = [b for b in acts if b.stage == a.stage and b.micro == a.micro
                        and b.kind.value == kind and (a.kind.value != "R" or b.iteration < a.iteration)]
                if same:
                    need[a].add(max(same, key=lambda b: b.iteration))
        done: list[Action] = []
        left = sorted(acts, key=pos.get)
        while left:
            ready = next((a for a in left if need[a] <= set(done)), None)
            if ready is None:
                raise ScheduleError(Problem(obj=f"rank {rank}", value=", ".join(map(str, left[:6])),
                                            rule="op-order constraints form no cycle"),
                                    header=format_schedule({rank: acts}))
            done.append(ready)
            left.remove(ready)
        out[rank] = done
    return out


_AFTER = {"B": ("F",), "I": ("F",), "W": ("I",), "F": ("R",), "R": ("R",)}
"""Kinds each action waits for, on its own (stage, micro-batch): ``F`` and ``R`` wait for
the ``R`` pass before them."""
