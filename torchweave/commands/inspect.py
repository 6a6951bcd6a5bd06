"""``torchweave inspect`` (a model's graph, FLOPs and memory, or its coverage) and
``torchweave models`` (the bundled models)."""

from __future__ import annotations

import argparse
import json
import time

from rich.console import Console

from torchweave.errors import Problem, TorchweaveError


def inspect_cmd(args: argparse.Namespace, console: Console) -> int:
    import resource

    import torchweave
    from torchweave.factory import load
    from torchweave.graphfile import is_graph_file, load_graph, save_graph
    from torchweave.summary import render

    if args.save_graph and not is_graph_file(args.save_graph):
        raise TorchweaveError(Problem(obj="--save-graph", value=args.save_graph,
                                      rule="a graph file's name ends in .graph.json (that is how "
                                           "plan, simulate and explain tell it from a model)",
                                      fix=f"--save-graph {args.save_graph.removesuffix('.json')}"
                                          ".graph.json"))
    t0 = time.perf_counter()
    if is_graph_file(args.model):
        graph = load_graph(args.model)
    else:
        loaded = load(args.model, meta=args.meta)
        graph = torchweave.capture(loaded.model, loaded.args, loaded.kwargs, name=loaded.name)
    took = time.perf_counter() - t0
    if args.coverage:
        return coverage_table(graph, args.world_size, console)
    summary = torchweave.summarize(graph)
    render(summary, console, ops=not args.totals)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    console.print(f"captured in {took:.2f} s, peak RSS {rss:.2f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary.to_dict(), f, indent=1)
        console.print(f"wrote {args.json}")
    if args.save_graph:
        save_graph(graph, args.save_graph)
        console.print(f"wrote {args.save_graph}: plan, simulate and explain take it as MODEL")
    return 0


def coverage_table(graph, world_size: int, console: Console) -> int:
    from rich.table import Table
    from rich.text import Text

    from torchweave.coverage import POLICIES, coverage

    rows = coverage(graph, world_size)
    costly = [r for r in rows if not r.annotated or any(
        c.flops_repeated or c.bytes_gathered for c in r.costs.values())]
    table = Table(title=Text(f"{graph.model_name}: ops that run whole on several devices under "
                             f"{', '.join(POLICIES)} at {world_size} ranks (nodes: FLOPs repeated, "
                             "bytes gathered)"), title_justify="left")
    for col in ("op", "annotated", "nodes", "example", *POLICIES):
        table.add_column(col, overflow="fold")
    for r in costly:
        cells = []
        for name in POLICIES:
            c = r.costs.get(name)
            cells.append("-" if c is None else
                         f"{c.nodes}: {_si(c.flops_repeated)}FLOP, {_si(c.bytes_gathered)}B")
        table.add_row(*map(Text, (r.op, "yes" if r.annotated else "NO", str(r.nodes), r.example,
                                  *cells)))
    console.print(table)
    free = len(rows) - len(costly)
    console.print(
        (f"{free} more op kinds run replicated at no cost (index and shape ops). " if free else "")
        + "FLOPs repeated: the work beyond one copy, over all devices, per forward; bytes "
        "gathered: split inputs made whole on each device. An op without an annotation can only "
        "run whole: torchweave.register_annotation gives it one (docs/coverage.md lists the "
        "annotated ops).", highlight=False, markup=False)
    return 0


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} "


def models_cmd(args: argparse.Namespace, console: Console) -> int:
    from torchweave.models import FACTORIES

    for name, fn in FACTORIES.items():
        doc = (fn.__doc__ or "").strip().splitlines()
        console.print(f"{name:16s} {doc[0] if doc else ''}")
    return 0


__all__ = ["coverage_table", "inspect_cmd", "models_cmd"]
