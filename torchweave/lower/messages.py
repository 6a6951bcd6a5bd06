"""Pipeline messages per action, in one order per pair of ranks (no reliance on tags).

NCCL ignores message tags, and gloo with one tag matches the messages
between two ranks in the order each side posts them. So every pair of ranks
must post its sends and receives in one order. This pass derives, from each
rank's actions and segments, every message the pipeline executor
(:mod:`torchweave.runtime.schedule_runner`) issues, and the executor issues exactly
these lists:

- ``sends``: after the action's compute, in order: an ``F`` or ``R`` sends its
  boundaries' transfers (then, on a no-gradient pass, the recycled outputs),
  ``B`` and ``I`` the gradients of the boundaries they received, ordered by
  (boundary, transfer);
- ``needs``: what the action's compute reads from other ranks (the mirror
  image: boundaries received by ``F``/``R``, recycled inputs on stage 0, the
  gradients of sent boundaries on ``B``/``I``);
- ``posts``: the receives the rank posts before the action's compute, in the
  order each sender sends. A rank that needs message ``x`` from rank ``p``
  first receives every message ``p`` sends it before ``x`` that it has not
  received yet, and keeps them until the action that needs them: receiving in
  the order of need alone differs from the sender's order in many built-in
  schedules (1F1B with recycling: stage 0 needs a recycled input after
  gradients the last stage sent later; interleaved with one micro-batch).
  This adds no wait: ``p`` sent those messages before ``x``.

:func:`check_order` then checks, for every ordered pair of ranks, that the
sender's sends and the receiver's posts are one sequence, and that each
message is posted no later than the action that needs it; it raises a
:class:`~torchweave.plan.schedules.ScheduleError` naming the pair, the first
position where they differ and the grid of the two ranks' actions.
"""

from __future__ import annotations

from dataclasses import replace

from torchweave.errors import Problem
from torchweave.lower.program import Exchange, Message, Program
from torchweave.lower.steps import P2P
from torchweave.plan.schedules import Kind, ScheduleError, format_schedule


def links(prog: Program) -> dict[int, P2P]:
    """Link index -> its transfers: the boundaries, then the recycle links."""
    out = {bd.index: bd.step for seg in prog.segments for bd in seg.recvs + seg.sends}
    out.update({prog.boundaries + i: link.step for i, link in enumerate(prog.recycle)})
    return out


def _messages(prog: Program, index: int, step: P2P, m: int, grad: bool, k: int, *,
              sending: bool) -> list[Message]:
    transfers = step.grad_back if grad else step.transfers
    return [Message(index, m, grad, j, k, t.src, t.dst) for j, t in enumerate(transfers)
            if (t.src if sending else t.dst) == prog.rank]


def _own(prog: Program, a) -> tuple[list[Message], list[Message]]:
    """(needs, sends) of action ``a`` on ``prog``'s rank, self-messages included."""
    seg = next(s for s in prog.segments if s.stage == a.stage)
    last = prog.passes - 1
    m = a.micro
    needs: list[Message] = []
    sends: list[Message] = []
    if a.kind in (Kind.F, Kind.R):
        k = last if a.kind is Kind.F else a.iteration
        for bd in sorted(seg.recvs, key=lambda b: b.index):
            needs += _messages(prog, bd.index, bd.step, m, False, k, sending=False)
        for i, link in enumerate(prog.recycle):
            if k > 0 and a.stage == 0 and prog.rank in dict(link.boxes):
                needs += _messages(prog, prog.boundaries + i, link.step, m, False, k - 1, sending=False)
        for bd in sorted(seg.sends, key=lambda b: b.index):
            sends += _messages(prog, bd.index, bd.step, m, False, k, sending=True)
        for i, link in enumerate(prog.recycle):
            if k < last and link.output in seg.outputs:
                sends += _messages(prog, prog.boundaries + i, link.step, m, False, k, sending=True)
    elif a.kind.is_backward:
        for bd in sorted(seg.sends, key=lambda b: b.index):
            if bd.grad:
                needs += _messages(prog, bd.index, bd.step, m, True, last, sending=False)
        for bd in sorted(seg.recvs, key=lambda b: b.index):
            if bd.grad:
                sends += _messages(prog, bd.index, bd.step, m, True, last, sending=True)
    return needs, sends


def derive(programs: list[Program]) -> list[Program]:
    """Every pipelined program with its ``messages``: one :class:`Exchange` per action (a
    pass: new Programs, the given ones unchanged).

    Receives are posted in the senders' order (see the module docstring); a
    message that no sender sends is reported by :func:`check_order`.
    """
    own = {p.rank: [_own(p, a) for a in p.actions] for p in programs}
    order: dict[tuple[int, int], list[Message]] = {}
    for rank, per_action in own.items():
        for _, sends in per_action:
            for x in sends:
                if x.dst != rank:
                    order.setdefault((rank, x.dst), []).append(x)
    where = {pair: {x: i for i, x in enumerate(xs)} for pair, xs in order.items()}
    out = []
    for prog in programs:
        cursor: dict[int, int] = {}  # sender -> how many of its messages are posted
        exchanges = []
        for needs, sends in own[prog.rank]:
            posts: list[Message] = []
            for x in needs:
                if x.src == prog.rank:
                    continue
                at = where.get((x.src, prog.rank), {}).get(x)
                done = cursor.get(x.src, 0)
                if at is None:
                    posts.append(x)  # no rank sends it: check_order names it
                elif at >= done:
                    posts += order[(x.src, prog.rank)][done:at + 1]
                    cursor[x.src] = at + 1
            exchanges.append(Exchange(
                posts=tuple(posts), needs=tuple(needs),
                sends=tuple(x for x in sends if x.dst != prog.rank),
                local=tuple(x for x in sends if x.dst == prog.rank)))
        out.append(replace(prog, messages=exchanges))
    return out


def check_order(programs: list[Program]) -> None:
    """Raise :class:`ScheduleError` unless, for every ordered pair of ranks, the sender's
    sends and the receiver's posts are one sequence, and every message an action needs
    is posted by then. Checks the ``messages`` the executor will issue."""
    sent: dict[tuple[int, int], list[tuple[Message, int]]] = {}
    got: dict[tuple[int, int], list[tuple[Message, int]]] = {}
    problems: list[Problem] = []
    marks: dict[int, int] = {}
    for prog in programs:
        posted: set[Message] = set()
        for step, ex in enumerate(prog.messages):
            for x in ex.sends:
                sent.setdefault((prog.rank, x.dst), []).append((x, step))
            for x in ex.posts:
                got.setdefault((x.src, prog.rank), []).append((x, step))
                posted.add(x)
            late = [x for x in ex.needs if x not in posted and x.src != prog.rank]
            if late:
                marks.setdefault(prog.rank, step)
                problems.append(Problem(
                    obj=f"rank {prog.rank} step {step} ({prog.actions[step]})",
                    value=f"needs {late[0]}, not received by then",
                    rule="every message is received before the action that reads it"))
    for pair in sorted(set(sent) | set(got)):
        a, b = sent.get(pair, []), got.get(pair, [])
        n = next((i for i in range(max(len(a), len(b)))
                  if i >= len(a) or i >= len(b) or a[i][0] != b[i][0]), None)
        if n is None:
            continue
        src, dst = pair
        by = {p.rank: p for p in programs}
        send = f"rank {src} sends {a[n][0]} at step {a[n][1]} ({by[src].actions[a[n][1]]})" \
            if n < len(a) else f"rank {src} sends nothing more"
        post = f"rank {dst} receives {b[n][0]} at step {b[n][1]} ({by[dst].actions[b[n][1]]})" \
            if n < len(b) else f"rank {dst} receives nothing more"
        if n < len(a):
            marks.setdefault(src, a[n][1])
        if n < len(b):
            marks.setdefault(dst, b[n][1])
        problems.append(Problem(
            obj=f"messages from rank {src} to rank {dst}", value=f"message {n}: {send}; {post}",
            rule="each pair of ranks issues its sends and receives in one order (NCCL ignores tags)",
            fix="receive in the order the peer sends (lower.messages.derive does), "
                "or reorder the schedule"))
    if problems:
        grid = {p.rank: list(p.actions) for p in programs}
        raise ScheduleError(problems, header=(
            "pipeline messages out of order between ranks, at the [bracketed] steps\n"
            + format_schedule(grid, marks)))
