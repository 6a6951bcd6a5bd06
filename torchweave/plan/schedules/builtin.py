"""Built-in pipeline schedules: compute actions per rank, in order.

Each function returns a :data:`~torchweave.plan.schedules.actions.Schedule`
holding only ``F``, ``B``, ``I`` and ``W`` actions;
:func:`~torchweave.plan.schedules.sendrecv.add_communication` adds the sends and
receives. Stage ``s`` runs on rank ``s`` except in :func:`interleaved_1f1b`,
where it runs on rank ``s % ranks``.

The textbook numbers, with ``p`` ranks and ``m`` micro-batches, ``F`` = 1 and
``B`` = 2 time units (``I`` = ``W`` = 1):

- GPipe idles ``(p-1)/(m+p-1)`` of the time and holds all ``m`` micro-batches;
- 1F1B idles the same but holds at most ``p - r`` micro-batches on rank ``r``;
- interleaved 1F1B with ``v`` stages per rank idles about ``(p-1)/(v·m+p-1)``;
- ZB-H1 idles about two thirds of 1F1B's time, in 1F1B's memory.
"""

from __future__ import annotations

from torchweave.errors import Problem
from torchweave.plan.schedules.actions import Action, Kind, Schedule, ScheduleError


def _check_counts(fn: str, **counts: int) -> None:
    problems = [
        Problem(obj=f"{fn}({name}={value!r})", value=repr(value), rule=f"{name} is a whole number >= 1")
        for name, value in counts.items()
        if not isinstance(value, int) or isinstance(value, bool) or value < 1
    ]
    if problems:
        raise ScheduleError(problems, header=f"bad arguments to {fn}")


def check_stage_count(stages: int, ranks: int, virtual: int = 1) -> None:
    """Every rank runs ``virtual`` stages: ``stages == ranks * virtual``."""
    if stages != ranks * virtual:
        raise ScheduleError(Problem(
            obj="pipeline stages", value=f"stages={stages}",
            rule=f"each of the ranks runs {virtual} stage(s): "
                 f"stages({stages}) != ranks({ranks}) * virtual({virtual})",
            fix=f"cut the model into {ranks * virtual} stages, or use "
                f"{stages // virtual if stages % virtual == 0 else 'another number of'} ranks",
        ))


def gpipe(stages: int, micro: int) -> Schedule:
    """All forwards, then all backwards, on each stage."""
    _check_counts("gpipe", stages=stages, micro=micro)
    return {
        s: [Action(s, Kind.F, m) for m in range(micro)] + [Action(s, Kind.B, m) for m in range(micro)]
        for s in range(stages)
    }


def one_f_one_b(stages: int, micro: int) -> Schedule:
    """Warm up with ``stages - s - 1`` forwards, alternate one F and one B, then drain the Bs."""
    _check_counts("one_f_one_b", stages=stages, micro=micro)
    schedule: Schedule = {}
    for s in range(stages):
        warmup = min(stages - s - 1, micro)
        actions = [Action(s, Kind.F, m) for m in range(warmup)]
        for k in range(micro - warmup):
            actions += [Action(s, Kind.F, warmup + k), Action(s, Kind.B, k)]
        actions += [Action(s, Kind.B, m) for m in range(micro - warmup, micro)]
        schedule[s] = actions
    return schedule


def interleaved_1f1b(ranks: int, virtual_stages_per_rank: int, micro: int,
                     *, stages: int | None = None) -> Schedule:
    """Megatron's interleaved 1F1B: ``ranks * v`` stages, stage ``s`` on rank ``s % ranks``.

    Micro-batches run in groups of ``ranks``: within a group, each rank runs
    its first stage for the whole group, then its second, and so on; backward
    visits the stages in reverse. Rank ``r`` warms up with
    ``2(ranks - r - 1) + (v - 1) ranks`` forwards, then alternates one forward
    and one backward, then drains. ``stages``, when given, is checked against
    ``ranks * v``.
    """
    v = virtual_stages_per_rank
    _check_counts("interleaved_1f1b", ranks=ranks, virtual_stages_per_rank=v, micro=micro)
    if stages is not None:
        check_stage_count(stages, ranks, v)
    if micro % ranks:
        raise ScheduleError(Problem(
            obj=f"interleaved_1f1b(micro={micro})", value=f"micro={micro}",
            rule=f"micro-batches run in groups of ranks: micro({micro}) % ranks({ranks}) != 0",
            fix=f"use micro={micro - micro % ranks or ranks} or {micro + ranks - micro % ranks}",
        ))
    group = ranks * v
    total = micro * v

    def at(k: int, backward: bool) -> tuple[int, int]:
        """(chunk, micro-batch) of a rank's k-th forward or backward."""
        chunk = (k % group) // ranks
        return (v - 1 - chunk if backward else chunk), (k // group) * ranks + k % ranks

    schedule: Schedule = {}
    for r in range(ranks):
        warmup = min(2 * (ranks - r - 1) + (v - 1) * ranks, total)

        def fwd(k: int, r: int = r) -> Action:
            chunk, m = at(k, backward=False)
            return Action(chunk * ranks + r, Kind.F, m)

        def bwd(k: int, r: int = r) -> Action:
            chunk, m = at(k, backward=True)
            return Action(chunk * ranks + r, Kind.B, m)

        actions = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [fwd(warmup + k), bwd(k)]
        actions += [bwd(k) for k in range(total - warmup, total)]
        schedule[r] = actions
    return schedule


def zero_bubble_h1(stages: int, micro: int) -> Schedule:
    """ZB-H1 (Qi et al., 2024): backward split into ``I`` and ``W``; ``W`` fills the bubbles,
    in 1F1B's peak memory.

    Stage ``s`` runs 1F1B's order with ``B`` replaced by ``I`` (``stages - s`` forwards
    first, then each ``I`` followed by the next ``F``), and puts each micro-batch's ``W``
    ``s`` micro-batches after its ``I``: right after ``I`` on the first stage, later the
    further down the pipeline. A later stage so sends each input gradient back as soon as
    it can and does the deferred weight gradients in the time 1F1B spends waiting for the
    next forward; the leftover ``W`` passes run at the end, where the first stage, which
    runs its ``W`` at once, is still busy. Every stage then holds at most ``stages``
    micro-batches (forward done, ``W`` not yet), the first stage's 1F1B peak, and its
    idle time is ``(stages - 1)(F + I - W)`` against 1F1B's ``(stages - 1)(F + I + W)``.
    """
    _check_counts("zero_bubble_h1", stages=stages, micro=micro)
    schedule: Schedule = {}
    for s in range(stages):
        actions = [Action(s, Kind.F, m) for m in range(min(stages - s, micro))]
        next_f, next_w = len(actions), 0
        for m in range(micro):
            actions.append(Action(s, Kind.I, m))
            if m >= s:
                actions.append(Action(s, Kind.W, next_w))
                next_w += 1
            if next_f < micro:
                actions.append(Action(s, Kind.F, next_f))
                next_f += 1
        actions += [Action(s, Kind.W, m) for m in range(next_w, micro)]
        schedule[s] = actions
    return schedule


BUILTIN = ("gpipe", "1f1b", "interleaved", "zb")
"""The built-in schedule kinds, by the name plan strings use."""


def builtin(kind: str, ranks: int, virtual: int, micro: int) -> Schedule:
    """The built-in schedule ``kind`` over ``ranks`` pipeline ranks (``virtual`` stages each:
    interleaved only), ``micro`` micro-batches."""
    if kind == "gpipe":
        return gpipe(ranks, micro)
    if kind == "1f1b":
        return one_f_one_b(ranks, micro)
    if kind == "zb":
        return zero_bubble_h1(ranks, micro)
    if kind == "interleaved":
        return interleaved_1f1b(ranks, virtual, micro)
    raise ScheduleError(Problem(obj="pipeline schedule", value=repr(kind),
                                rule=f"one of {', '.join(BUILTIN)}"))

