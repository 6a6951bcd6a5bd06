"""``torchweave plan`` (a plan's table, its JSON and its generated code, or the search) and
``torchweave verify`` (a plan against one device)."""

from __future__ import annotations

import argparse

from rich.console import Console


def verify_cmd(args: argparse.Namespace, console: Console) -> int:
    from torchweave.factory import load
    from torchweave.runtime.executor import StepConfig
    from torchweave.runtime.launch import LaunchConfig
    from torchweave.verify import verify

    loaded = load(args.model)
    report = verify(loaded.model, loaded.args, plan=args.plan, world_size=args.world_size,
                    steps=args.steps, tolerance=args.tolerance, dtype=args.dtype,
                    config=StepConfig(grad_accum=args.grad_accum, p2p_tags=args.p2p_tags),
                    launch=LaunchConfig(world_size=args.world_size, timeout_s=args.timeout),
                    code_dir=args.code)
    console.print(str(report), highlight=False, markup=False)
    if args.code:
        console.print(f"generated code: {args.code}/case0/rank*.py")
    return 0 if report.ok else 1


def plan_cmd(args: argparse.Namespace, console: Console) -> int:
    from torchweave.commands.sim import _capture
    from torchweave.lower.lower import lower
    from torchweave.codegen.render import write
    from torchweave.plan.show import plan_table, replication_note
    from torchweave.plan.validate import validate
    from torchweave.search import is_auto, resolve

    graph = _capture(args.model, args.meta)  # a saved graph file, or the model captured
    cluster = None
    if args.cluster:
        from torchweave.commands.sim import load_cluster

        cluster = load_cluster(args.cluster)
    world = args.world_size or (cluster.size if cluster else 2)
    if is_auto(args.plan) or args.constraints or args.preset or args.clusters:
        from torchweave.commands.search import run_search

        return run_search(args, console, graph, cluster, world)
    plan = resolve(args.plan, graph, world, cluster=cluster)
    validate(plan, graph, world_size=world)
    console.print(plan_table(plan, graph, limit=None if args.all else 40))
    if not args.all and len(graph.nodes) > 40:
        console.print(f"... {len(graph.nodes) - 40} more nodes (--all shows every node)")
    note = replication_note(plan, graph)
    if note:
        console.print(note, highlight=False, markup=False)
    if plan.notes.get("experts"):  # expert parallelism: what it split (policies/expert.py)
        console.print(f"experts: {plan.notes['experts']}", highlight=False, markup=False)
    if plan.notes.get("coshard"):  # each device runs these chains in chunks (policies/coshard.py)
        console.print(f"co-shard: {plan.notes['coshard']} (chunks per device, each recomputed in "
                      "backward)", highlight=False, markup=False)
    if args.out:
        with open(args.out, "w") as f:
            f.write(plan.to_json())
        console.print(f"wrote {args.out}")
    if args.code:
        paths = write(lower(graph, plan), args.code)
        console.print(f"wrote {len(paths)} programs: {args.code}/rank0.py ...")
    return 0


__all__ = ["plan_cmd", "verify_cmd"]
