"""Print a plan as a table: one row per node."""

from __future__ import annotations

import math

from rich.table import Table
from rich.text import Text

from torchweave.ir.graph import Graph
from torchweave.plan.plan import Plan
from torchweave.plan.schedules import format_schedule


def _devices(devs: list[int]) -> str:
    if devs == list(range(devs[0], devs[0] + len(devs))) and len(devs) > 2:
        return f"{devs[0]}..{devs[-1]}"
    return ",".join(map(str, devs))


def plan_table(plan: Plan, graph: Graph, *, limit: int | None = None) -> Table:
    """op, source, annotation, op-trans and op-assign of every node."""
    title = f"plan {plan.name!r}: {plan.world_size} devices" + (f", mesh {plan.mesh}" if plan.mesh else "")
    if plan.zero:
        title += f", ZeRO-{plan.zero} over {plan.zero_axis}"
    pipe = plan.pipeline
    caption = None
    if pipe is not None:
        title += (f", {pipe.kind} pipeline: {pipe.stages} stages on groups "
                  f"{[list(g) for g in pipe.groups]}, {pipe.micro_batches} micro-batches")
        caption = "schedule (pipeline rank × step):\n" + format_schedule(pipe.schedule)
    # names, sources and schedules are data: plain text, never rich markup
    table = Table(title=Text(title), caption=Text(caption) if caption else None,
                  caption_justify="left")
    cols = ("node", "op", "source", "annotation", "op-trans", "op-assign") + (("stage",) if pipe else ())
    for col in cols:
        table.add_column(col, overflow="fold")
    for node in graph.nodes[:limit]:
        trans = " ".join(map(str, plan.transforms(node.name))) or "whole"
        row = [node.name, node.target.split(".")[1], node.source, node.annotation or "",
               trans, _devices(plan.assignment.get(node.name, []))]
        if pipe is not None:
            stage = pipe.stage_of.get(node.name)
            row.append("all" if stage in pipe.shared else str(stage))
        table.add_row(*map(Text, row))
    return table


REPLICATION_NOTE = 0.05
"""Above this share of the forward FLOPs run replicated, ``plan``, ``verify`` and ``train``
say so in one line."""


def replicated_flops(plan: Plan, graph: Graph) -> tuple[float, list[tuple[str, float]]]:
    """The share of the forward FLOPs that run replicated (a node replicated ``R×n``:
    whole, or a piece, on several devices at once), and each op kind's share of the whole,
    largest first."""
    from torchweave.ops import info

    total, by_op = 0.0, {}
    for node in graph.nodes:
        flops = info(graph, node).flops
        total += flops
        if math.prod(t.parts for t in plan.transforms(node.name) if t.dim is None) > 1:
            by_op[node.target] = by_op.get(node.target, 0.0) + flops
    if total <= 0:
        return 0.0, []
    ranked = sorted(((op, f / total) for op, f in by_op.items()), key=lambda x: -x[1])
    return sum(f for _, f in ranked), ranked


def replication_note(plan: Plan, graph: Graph) -> str:
    """One line when more than :data:`REPLICATION_NOTE` of the FLOPs run replicated, else ``""``."""
    share, ranked = replicated_flops(plan, graph)
    if share <= REPLICATION_NOTE:
        return ""
    big = [(op, s) for op, s in ranked if s >= 0.01][:3]
    top = ", ".join(f"{op} {s:.0%}" for op, s in big)
    return (f"note: {share:.0%} of the forward FLOPs run replicated under {plan.name!r} ({top}"
            f"{', ...' if len(ranked) > len(big) else ''}): each such op repeats its work on "
            f"every device it is on (R×n in the plan table's op-trans; an op without an "
            f"annotation can only run so)")
