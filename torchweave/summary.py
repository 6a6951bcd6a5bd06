"""What ``torchweave inspect`` shows: one row per op, and the totals."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from torchweave.ir.graph import Graph
from torchweave.ops import OpInfo, info


@dataclass(frozen=True)
class Row:
    node: str
    op: str
    source: str
    module: str
    shapes: str
    annotation: str
    splittable: str
    gflops: float
    mbytes: float


@dataclass(frozen=True)
class Summary:
    """A graph's ops and totals."""

    model: str
    rows: list[Row]
    params: int
    param_bytes: int
    forward_flops: float
    train_flops: float
    """Forward plus backward FLOPs of one training step."""
    unannotated: list[str]

    def to_dict(self) -> dict:
        return {
            "model": self.model, "params": self.params, "param_bytes": self.param_bytes,
            "forward_flops": self.forward_flops, "train_flops": self.train_flops,
            "unannotated": self.unannotated, "ops": [r.__dict__ for r in self.rows],
        }


def _short(target: str) -> str:
    parts = target.split(".")
    return parts[1] if len(parts) >= 3 and parts[-1] in ("default", "Tensor", "int", "Scalar") \
        else ".".join(parts[1:])


def summarize(graph: Graph) -> Summary:
    infos: list[OpInfo] = [info(graph, n) for n in graph.nodes]
    rows = []
    for i in infos:
        n = i.node
        ins = " ".join(str(m) for m in graph.input_metas(n))
        outs = " ".join(str(m) for m in graph.output_metas(n))
        splittable = " ".join(str(i.bound.dim(d)) for d in i.bound.splittable())
        rows.append(Row(n.name, _short(n.target), n.source, n.module, f"{ins} -> {outs}",
                        n.annotation or str(i.bound), splittable or "-", i.flops / 1e9,
                        i.bytes / 2**20))
    fwd = sum(i.flops for i in infos)
    return Summary(
        model=graph.model_name, rows=rows, params=graph.num_params(),
        param_bytes=sum(v.meta.nbytes for v in graph.params()),
        forward_flops=fwd, train_flops=fwd + sum(i.bwd_flops for i in infos),
        unannotated=sorted({i.node.target for i in infos if i.spec is None}),
    )


def render(summary: Summary, console: Console, *, ops: bool = True) -> None:
    if ops:
        table = Table(title=f"{summary.model}: {len(summary.rows)} ops", show_lines=False)
        for col, just in (("op", "left"), ("source", "left"), ("shapes", "left"),
                          ("annotation", "left"), ("splittable", "left"),
                          ("GFLOPs", "right"), ("MB", "right")):
            table.add_column(col, justify=just, overflow="fold")  # type: ignore[arg-type]
        for r in summary.rows:
            table.add_row(*map(Text, (r.op, r.source, r.shapes, r.annotation, r.splittable,
                                      f"{r.gflops:.4g}", f"{r.mbytes:.3g}")))
        console.print(table)
    console.print(f"parameters:          {summary.params:,} ({summary.param_bytes / 2**20:,.1f} MiB)")
    console.print(f"forward FLOPs:       {summary.forward_flops:.4g}")
    console.print(f"FLOPs per train step: {summary.train_flops:.4g} (forward + backward)")
    if summary.unannotated:
        console.print(f"[yellow]replicate-only (no annotation): {escape(', '.join(summary.unannotated))}",
                      markup=True)
