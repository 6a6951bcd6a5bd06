"""``torchweave plan MODEL --plan auto``: the search's ranking, why the winner won, what it costs.

- one cluster (``--cluster``, default this machine): the top plans with their
  breakdown, the winner against the runner-up and the best ``megatron`` plan,
  the parts of the space left out, and the winner's reliability line (failure
  rate, Young/Daly checkpoint interval, goodput, dollars per million tokens);
  ``--out`` saves the winner as plan JSON;
- several clusters (``--clusters A,B``): the best plan on each, ranked by dollars
  per million tokens after goodput.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from torchweave.errors import Problem, TorchweaveError


def _constraints(args: argparse.Namespace):
    from torchweave.policies.spec import PlanSpec
    from torchweave.search import load_constraints, preset

    spec = PlanSpec.parse(args.plan if args.plan.startswith("auto") else "auto")
    if args.constraints and (args.preset or "preset" in spec.options):
        raise TorchweaveError(Problem(obj="--constraints", value=args.constraints,
                                      rule="one constraint set: a file or a preset",
                                      fix="name the preset inside the file: 'preset: megatron'"))
    return (load_constraints(args.constraints) if args.constraints
            else preset(args.preset or spec.options.get("preset", "free")))


def _exhaustive(args: argparse.Namespace) -> bool:
    """``--plan auto:exhaustive=1`` (the same as ``--exhaustive``)."""
    from torchweave.policies.spec import PlanSpec

    return bool(args.plan.startswith("auto")
                and PlanSpec.parse(args.plan).options.get("exhaustive", False))


def run_search(args: argparse.Namespace, console: Console, graph, cluster, world: int) -> int:
    from torchweave.search import local_cluster, search
    from torchweave.search.pool import default_workers
    from torchweave.sim.hardware.reliability import reliability

    constraints = _constraints(args)
    if args.clusters:
        return _compare(args, console, graph, constraints)
    cluster = cluster or local_cluster(world)
    with console.status("searching") as status:
        result = search(graph, cluster, constraints, world_size=world, top=args.top,
                        workers=default_workers(len(graph.nodes), world),
                        exhaustive=getattr(args, "exhaustive", False) or _exhaustive(args),
                        progress=lambda msg: status.update(escape(msg)))
    table = Table(title=f"{graph.model_name}: the best plans on {cluster} "
                        f"({constraints.name}; {result.considered} points, "
                        f"{result.seconds:.1f} s)")
    for col in ("#", "plan", "step s", "compute s", "comm s", "bubble %", "peak GiB",
                "estimate s", "estimate error"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    for i, r in enumerate(result.ranked, 1):
        b = r.breakdown()
        err = r.estimate_error
        table.add_row(str(i), escape(r.spec), f"{b['step']:.4g}", f"{b['compute']:.4g}",
                      f"{b['comm']:.4g}", f"{b['bubble %']:.1f}", f"{b['peak GiB']:.2f}",
                      f"{r.estimate.step_s:.4g}" if r.estimate else "-",
                      f"{100 * err:.1f}%" if err is not None else "-")
    console.print(table)
    for line in result.why():
        console.print(f"{result.best.spec} {line}", highlight=False, markup=False)
    if result.excluded:
        console.print("left out: " + "; ".join(result.excluded[:4])
                      + (f" (+{len(result.excluded) - 4} more)" if len(result.excluded) > 4 else ""),
                      highlight=False, markup=False)
    if result.best.point.split == "solved" and result.best.point.tp in result.solved:
        console.print(result.solved[result.best.point.tp], highlight=False, markup=False)
    console.print(f"{result.best.spec}: {reliability(result.best.result, cluster)}",
                  highlight=False, markup=False)
    if args.out:
        with open(args.out, "w") as f:
            f.write(result.best.plan.to_json())
        console.print(f"wrote {args.out} ({result.best.spec})", highlight=False, markup=False)
    return 0


def _compare(args: argparse.Namespace, console: Console, graph, constraints) -> int:
    """The best plan on each of ``--clusters``, cheapest per token first."""
    from torchweave.commands.sim import load_cluster
    from torchweave.search import search
    from torchweave.search.pool import default_workers
    from torchweave.sim.hardware.reliability import reliability

    rows, failed = [], []
    for text in (t.strip() for t in args.clusters.split(",") if t.strip()):
        cluster = load_cluster(text)
        with console.status(f"searching {text}") as status:
            try:
                result = search(graph, cluster, constraints, top=1,
                                workers=default_workers(len(graph.nodes), cluster.size),
                                progress=lambda msg: status.update(escape(f"{text}: {msg}")))
            except TorchweaveError as exc:
                failed.append(f"{text}: {exc.problems[0].value}; {exc.problems[0].rule}")
                continue
        best = result.best
        rows.append((reliability(best.result, cluster), best, cluster))
    if not rows:
        raise TorchweaveError(Problem(obj="--clusters", value=args.clusters,
                                      rule="a plan fits at least one of the clusters",
                                      fix="add larger clusters; " + " | ".join(failed)))
    rows.sort(key=lambda x: (x[0].usd_per_million_tokens, str(x[2])))
    table = Table(title=f"{graph.model_name}: the best plan on each cluster, cheapest per token "
                        f"first ({constraints.name})")
    for col in ("cluster", "plan", "step s", "tokens/s", "$/M tokens", "goodput %",
                "P(failure)/h", "checkpoint every"):
        table.add_column(col, justify="left" if col in ("cluster", "plan") else "right")
    for rel, best, cluster in rows:
        table.add_row(escape(str(cluster)), escape(best.spec), f"{best.result.step_time:.4g}",
                      f"{best.result.tokens_per_s:,.0f}", f"{rel.usd_per_million_tokens:.4g}",
                      f"{100 * rel.goodput:.1f}", f"{rel.failure_per_hour:.3g}",
                      f"{rel.interval_s / 60:.3g} min")
    console.print(table)
    for line in failed:
        console.print(f"no plan fits {line}", highlight=False, markup=False)
    return 0


__all__ = ["run_search"]
