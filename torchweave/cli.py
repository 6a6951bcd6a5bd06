"""The ``torchweave`` command."""

from __future__ import annotations

import argparse
import json
import sys
import time

from rich.console import Console
from rich.markup import escape

from torchweave.errors import Problem, TorchweaveError


GANTT_HELP = ("write the Gantt chart here (default: MODEL-PLAN.gantt.png in the current directory "
              "when matplotlib is installed; the plot extra)")
PLAN_HELP = ("a plan string, POLICY[:KEY=VALUE,...] (dp, zero3:recompute=full, tp:tp=4,zero=1, "
             "1f1b:tp=2,dp=2,micro=8, interleaved:pp=4,virtual=2,recompute=selective), auto "
             "(auto:preset=megatron: searched), or a plan.json")


def _inspect(args: argparse.Namespace, console: Console) -> int:
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
        return _coverage(graph, args.world_size, console)
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


def _coverage(graph, world_size: int, console: Console) -> int:
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


def _verify(args: argparse.Namespace, console: Console) -> int:
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


def _plan(args: argparse.Namespace, console: Console) -> int:
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchweave",
        description="Turn a single-device PyTorch model into a parallel training program.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ins = sub.add_parser(
        "inspect", help="capture a model and show its ops, annotations, FLOPs and bytes",
        description="MODEL is a bundled name (gpt-small, llama-tiny, ...) or path/to/file.py:factory; "
        "a factory takes no arguments and returns (model, example_inputs).",
    )
    ins.add_argument("model", metavar="MODEL")
    ins.add_argument("--meta", action="store_true",
                     help="build the model on the meta device (no weights are allocated)")
    ins.add_argument("--totals", action="store_true", help="print only the totals")
    ins.add_argument("--json", metavar="PATH", help="also write the table as JSON")
    ins.add_argument("--coverage", action="store_true",
                     help="list the ops that force replication, with what they cost under dp, tp "
                          "and sp: FLOPs repeated and bytes gathered")
    ins.add_argument("--world-size", type=int, default=2, help="ranks --coverage prices (default 2)")
    ins.add_argument("--save-graph", metavar="PATH.graph.json",
                     help="write the captured graph (no weights) for plan, simulate and explain "
                          "to take as MODEL: a large model captured once")
    ins.set_defaults(run=_inspect)
    pl = sub.add_parser("plan", help="build a plan with a policy; show it, save it as JSON, "
                        "write each rank's generated code")
    pl.add_argument("model", metavar="MODEL", help="a bundled name, path/to/file.py:factory, or a saved graph (*.graph.json)")
    pl.add_argument("--plan", default="dp", help=PLAN_HELP + " (default: dp)")
    pl.add_argument("--world-size", type=int,
                    help="ranks (default: the cluster's size with --cluster, else 2)")
    pl.add_argument("--cluster", metavar="SPEC",
                    help="auto: the cluster to search for (e.g. 1024xA100-80GB-SXM@8, or a "
                         "YAML path; default: this machine as --world-size ranks)")
    pl.add_argument("--constraints", metavar="YAML", help="auto: the constraint set to search in")
    pl.add_argument("--preset", metavar="NAME",
                    help="auto: a preset constraint set (megatron, zero3, dp, nnscaler, alpa, free)")
    pl.add_argument("--top", type=int, default=5, help="auto: how many plans to rank (default 5)")
    pl.add_argument("--exhaustive", action="store_true",
                    help="auto: simulate every point of the space instead of the best estimated "
                         "(slow: minutes on large models; a baseline for the search)")
    pl.add_argument("--clusters", metavar="A,B,...",
                    help="auto: search each cluster (specs or YAML paths, comma-separated) and "
                         "rank their best plans by dollars per million tokens after goodput")
    pl.add_argument("--out", metavar="PLAN_JSON", help="write the plan (auto: the winner) as JSON")
    pl.add_argument("--code", metavar="DIR", help="write rank{r}.py for every rank")
    pl.add_argument("--meta", action="store_true", help="build the model on the meta device")
    pl.add_argument("--all", action="store_true", help="show every node")
    pl.set_defaults(run=_plan)
    ver = sub.add_parser("verify", help="run a plan on N local processes beside one device and "
                         "compare loss, every gradient and the parameters after k steps")
    ver.add_argument("model", metavar="MODEL")
    ver.add_argument("--plan", default="dp", help=PLAN_HELP + " (default: dp)")
    ver.add_argument("--world-size", type=int, default=2)
    ver.add_argument("--steps", type=int, default=3)
    ver.add_argument("--grad-accum", type=int, default=1)
    ver.add_argument("--dtype", choices=("float64", "float32"), default="float64",
                     help="cast the model and its inputs to this on both sides (default float64: "
                          "rounding far below any real error)")
    ver.add_argument("--tolerance", type=float, default=None,
                     help="largest relative difference allowed (default: the dtype's, "
                          "1e-9 in float64, 1e-5 in float32)")
    ver.add_argument("--p2p-tags", default="auto", metavar="MODE",
                     help="pipeline messages: untagged (tag 0, as NCCL runs them), tagged, or auto "
                          "(untagged on NCCL, tagged on gloo)")
    ver.add_argument("--timeout", type=float, default=60.0, help="collective time-out, seconds")
    ver.add_argument("--code", metavar="DIR", help="keep the generated per-rank code here")
    ver.set_defaults(run=_verify)
    _add_sim_commands(sub)
    _add_train_commands(sub)
    models = sub.add_parser("models", help="list the bundled models")
    models.set_defaults(run=_models)
    for name, cmd in sub.choices.items():
        if "model" in {a.dest for a in cmd._actions}:  # every command that captures a model
            cmd.add_argument("--batch-local", metavar="OP", action="append", default=[],
                             help="declare an op's rows independent (e.g. aten.kthvalue), so "
                                  "data parallelism keeps the batch split through it; repeatable")
    return p


def _add_sim_commands(sub) -> None:
    from torchweave import commands

    cluster_help = "a cluster string (8xA100-80GB-SXM, 16xH100-80GB-SXM@8) or a cluster YAML path"
    sim = sub.add_parser("simulate", help="predict one training step of a plan on a cluster: step "
                         "time, bubble, memory per device, MFU, tokens/s, $ per million tokens")
    sim.add_argument("model", metavar="MODEL", help="a bundled name, path/to/file.py:factory, or a saved graph (*.graph.json)")
    sim.add_argument("--cluster", required=True, metavar="SPEC", help=cluster_help)
    sim.add_argument("--plan", action="append", metavar="PLAN",
                     help=PLAN_HELP + " (default: dp). Give it several times to rank several "
                     "plans on one capture: a table of them follows")
    sim.add_argument("--world-size", type=int, help="ranks (default: the cluster's size)")
    sim.add_argument("--meta", action="store_true", help="build the model on the meta device")
    sim.add_argument("--grad-accum", type=int, default=1, metavar="K",
                     help="micro-batches per optimizer step: the model's example batch is the "
                          "global batch, cut into K (non-pipelined plans; a pipeline's is its micro)")
    sim.add_argument("--dtype", choices=("fp32", "bf16", "fp16"),
                     help="compute dtype (bf16: mixed precision; default: the model's)")
    sim.add_argument("--trace", metavar="OUT_JSON", help="write the timeline as Chrome trace JSON")
    sim.add_argument("--gantt", metavar="OUT_PNG", help=GANTT_HELP)
    sim.add_argument("--no-gantt", action="store_true", help="write no Gantt chart")
    sim.add_argument("--json", metavar="OUT_JSON",
                     help="write each plan's numbers as JSON (a list: plan string, step time, "
                     "memory per rank, MFU, tokens/s, ...)")
    sim.add_argument("--profile", action="store_true",
                     help="time the plan's ops on this machine (cached in ~/.cache/torchweave) and "
                     "use them instead of the roofline")
    sim.set_defaults(run=commands.simulate_cmd)
    exp = sub.add_parser("explain", help="per op: partition, devices, communication, time and "
                         "memory of a plan; top costs; --vs compares with another plan")
    exp.add_argument("plan", metavar="PLAN", help="plan.json or a policy name")
    exp.add_argument("model", metavar="MODEL", help="a bundled name, path/to/file.py:factory, or a saved graph (*.graph.json)")
    exp.add_argument("--cluster", required=True, metavar="SPEC", help=cluster_help)
    exp.add_argument("--vs", metavar="PLAN", help="another plan.json or policy name: why not it?")
    exp.add_argument("--world-size", type=int, help="ranks for a policy name (default: cluster size)")
    exp.add_argument("--meta", action="store_true", help="build the model on the meta device")
    exp.add_argument("--dtype", choices=("fp32", "bf16", "fp16"))
    exp.add_argument("--top", type=int, default=5, help="how many top costs and differences")
    exp.add_argument("--all", action="store_true", help="show every op")
    exp.add_argument("--gantt", metavar="OUT_PNG", help=GANTT_HELP)
    exp.add_argument("--no-gantt", action="store_true", help="write no Gantt chart")
    exp.set_defaults(run=commands.explain_cmd)
    cal = sub.add_parser("calibrate", help="measure this machine (matmul, copy, gloo collectives) "
                         "and save a cluster YAML that --cluster accepts")
    cal.add_argument("--world-sizes", type=int, nargs="+", default=[2], metavar="N")
    cal.add_argument("--out", default="cpu.yaml", metavar="YAML", help="default: cpu.yaml")
    cal.add_argument("--quick", action="store_true", help="one message size, 2 ranks (tests)")
    cal.set_defaults(run=commands.calibrate_cmd)


def _add_train_commands(sub) -> None:
    tr = sub.add_parser(
        "train", help="train from a YAML config on N local processes or under torchrun",
        description="Train from a typed YAML config. Any field can be overridden as "
        "--section.field=value (e.g. --optim.lr=3e-4 --parallel.world_size=4). Runs N local "
        "processes, or joins the job when started by torchrun. Resumes from the newest "
        "checkpoint in the run's checkpoint folder.")
    tr.add_argument("config", nargs="?", metavar="CONFIG_YAML",
                    help="the config (default: all defaults)")
    tr.set_defaults(run=_train, overrides=True)
    demo = sub.add_parser(
        "demo", help="train a small GPT on the bundled text with 4 CPU ranks (about 2 minutes)",
        description="The demo config (a character-level GPT, plan chosen by the simulator, "
        "4 ranks), with --section.field=value overrides (e.g. --steps=100).")
    demo.set_defaults(run=_demo, overrides=True)


def _train(args: argparse.Namespace, console: Console) -> int:
    from torchweave.commands.train import train_cmd

    return train_cmd(args.config, args.extra, console)


def _demo(args: argparse.Namespace, console: Console) -> int:
    from torchweave.commands.train import demo_cmd

    return demo_cmd(args.extra, console)


def _models(args: argparse.Namespace, console: Console) -> int:
    from torchweave.models import FACTORIES

    for name, fn in FACTORIES.items():
        doc = (fn.__doc__ or "").strip().splitlines()
        console.print(f"{name:16s} {doc[0] if doc else ''}")
    return 0


def plain_console() -> Console:
    """The CLI's console: nothing it prints is read as rich markup (error texts, node
    names and module paths hold square brackets); the few styled lines say so."""
    return Console(width=None if sys.stdout.isatty() else 200, markup=False)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    console = plain_console()
    try:
        if getattr(args, "batch_local", None):
            from torchweave.ops import batch_local

            batch_local(*args.batch_local)
        return int(args.run(args, console))
    except TorchweaveError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}", markup=True, highlight=False)
        return 2


if __name__ == "__main__":
    sys.exit(main())
