"""Cut each rank's program into pipeline segments, one per stage it runs.

Lowering sees a pipelined plan as any other plan: a value produced on one
stage's device group and read on another's has no regular group in common, so
it moves by point-to-point transfers (:class:`~torchweave.lower.steps.P2P`).
This pass turns each such step into a :class:`Boundary`: the receivers bind
its result as a segment input, the senders hand its source out as a segment
output, and the runtime moves it when the schedule runs that stage for a
micro-batch. Everything else stays in the segment of the stage it feeds.
Values that pass between two stages on the same rank (interleaved stages)
become an output of one segment and an input of the other.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any


from torchweave.errors import Problem
from torchweave.ir.graph import Graph
from torchweave.lower.messages import check_order, derive
from torchweave.lower.program import (
    Boundary, Comm, Compute, Free, Instr, Program, Segment,
)
from torchweave.lower.steps import P2P, devices_of
from torchweave.plan.stage_plan import Pipeline, compute_only
from torchweave.plan.plan import Plan
from torchweave.plan.validate import PlanError


def reads(ins: Instr) -> list[str]:
    """Local names an instruction reads."""
    if isinstance(ins, Compute):
        return ins.reads()
    if isinstance(ins, Comm):
        return ins.reads()
    return []


def writes(ins: Instr) -> list[str]:
    if isinstance(ins, Compute):
        return [o for o in ins.outputs if o]
    if isinstance(ins, Comm):
        return [ins.dst]
    return []


def insert_frees(instrs: list[Instr], keep: set[str]) -> list[Instr]:
    """``del`` each local tensor after its last use, except those in ``keep``."""
    last: dict[str, int] = {}
    body = [i for i in instrs if not isinstance(i, Free)]
    for i, ins in enumerate(body):
        for u in reads(ins):
            last[u] = i
    frees: dict[int, list[str]] = {}
    for name, i in last.items():
        if name not in keep:
            frees.setdefault(i, []).append(name)
    out: list[Instr] = []
    for i, ins in enumerate(body):
        out.append(ins)
        if i in frees:
            out.append(Free(tuple(sorted(frees[i]))))
    return out


def _stage_of(pipe: Pipeline, ins: Instr) -> int:
    node = ins.node if isinstance(ins, Compute) else ins.consumer  # type: ignore[union-attr]
    return pipe.stage_of[node]


def _crossing(pipe: Pipeline, ins: Instr, producer: dict[str, str]) -> bool:
    """A step that carries a value between stages: leaving the consumer's group, or a
    point-to-point transfer from another stage (a shared stage's group holds the producer's)."""
    if not isinstance(ins, Comm):
        return False
    stage = pipe.stage_of[ins.consumer]
    if not devices_of(ins.step) <= set(pipe.devices_of_stage(stage)):
        return True
    src = producer.get(ins.value)
    return isinstance(ins.step, P2P) and src is not None and pipe.stage_of[src] != stage


def split_stages(programs: list[Program], graph: Graph, plan: Plan) -> list[Program]:
    """Each program cut into its stages' segments, with its actions, micro-batch count and
    messages (a pass: new Programs, the given ones unchanged)."""
    pipe = plan.pipeline
    assert pipe is not None
    producer = {o: n.name for n in graph.nodes for o in n.outputs if o}
    keys = sorted({c.dst for prog in programs for c in prog.comms() if _crossing(pipe, c, producer)})
    index = {k: i for i, k in enumerate(keys)}
    schedule = compute_only(pipe.schedule)
    split = [replace(prog, segments=_split(prog, graph, pipe, index, producer),
                     actions=list(schedule.get(pipe.rank_of_device(prog.rank), [])),
                     micro_batches=pipe.micro_batches, boundaries=len(keys))
             for prog in programs]
    out = derive(split)
    check_order(out)
    return out


def _split(prog: Program, graph: Graph, pipe: Pipeline, index: dict[str, int],
           producer: dict[str, str]) -> list[Segment]:
    stages = pipe.stages_of_device(prog.rank)
    segs = {s: Segment(s, []) for s in stages}
    outside = {p.local for p in prog.params} | {i.local for i in prog.inputs}
    first_reader: dict[str, int] = {}
    for ins in prog.instrs:
        if isinstance(ins, Compute):
            for name in reads(ins):
                first_reader.setdefault(name, _stage_of(pipe, ins))
    defined: dict[str, int] = {}

    def hand_over(name: str, to: int) -> None:
        src = defined.get(name)
        if src is None or src == to or name in outside:
            return
        if name not in segs[src].outputs:
            segs[src].outputs.append(name)
        if name not in segs[to].inputs:
            segs[to].inputs.append(name)

    for ins in prog.instrs:
        if isinstance(ins, Free):
            continue
        s = _stage_of(pipe, ins)
        if isinstance(ins, Comm) and _crossing(pipe, ins, producer):
            if not isinstance(ins.step, P2P):
                raise PlanError(Problem(
                    obj=f"value {ins.value}", value=f"{type(ins.step).__name__} across stage groups",
                    rule="values cross between stage groups by point-to-point transfers only"))
            dtype = graph.values[ins.value].meta.dtype
            grad = dtype.is_floating_point
            r, step = prog.rank, ins.step
            receives = any(t.dst == r for t in step.transfers)
            holds = any(t.src == r for t in step.transfers) or any(t.dst == r for t in step.grad_back)
            if receives and s in segs:  # it may also hold a part: a message to itself
                segs[s].recvs.append(Boundary(ins.dst, index[ins.dst], ins.step, ins.dst, grad,
                                              str(dtype)))
                defined[ins.dst] = s
            if holds or not receives:
                src = defined.get(ins.src, first_reader.get(ins.src, stages[0]))
                if src not in segs:
                    src = stages[0]
                segs[src].sends.append(Boundary(ins.dst, index[ins.dst], ins.step, ins.src, grad,
                                                str(dtype)))
                if ins.src not in segs[src].outputs:
                    segs[src].outputs.append(ins.src)
            continue
        for name in reads(ins):
            hand_over(name, s)
        segs[s].instrs.append(ins)
        for name in writes(ins):
            defined[name] = s
    if prog.loss is not None and prog.loss in defined:
        segs[defined[prog.loss]].loss = prog.loss
    for link in prog.recycle:  # multi-forward: what this rank sends back to stage 0
        if any(t.src == prog.rank for t in link.step.transfers) and link.output not in outside:
            seg = segs[defined[link.output]]
            if link.output not in seg.outputs:
                seg.outputs.append(link.output)
    keep_inputs = {i.local for i in prog.inputs}
    for seg in segs.values():
        seg.instrs = insert_frees(seg.instrs, set(seg.outputs) | {seg.loss or ""} | keep_inputs)
    return [segs[s] for s in stages]


def describe(prog: Program) -> list[str]:
    """One line per segment (for headers and errors)."""
    out: list[Any] = []
    for seg in prog.segments:
        out.append(f"stage {seg.stage}: {sum(isinstance(i, Compute) for i in seg.instrs)} ops, "
                   f"receives {[b.key for b in seg.recvs]}, sends {[b.local for b in seg.sends]}")
    return out
