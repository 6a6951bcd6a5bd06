"""Print a plan as a table: one row per node."""

from __future__ import annotations

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
