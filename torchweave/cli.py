"""The ``torchweave`` command: the argument parser and the dispatch, nothing else.

Each subcommand's body is ``torchweave.commands.<name>``, imported when it runs.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.markup import escape

from torchweave.errors import TorchweaveError


GANTT_HELP = ("write the Gantt chart here (default: MODEL-PLAN.gantt.png in the current directory "
              "when matplotlib is installed; the plot extra)")
PLAN_HELP = ("a plan string, POLICY[:KEY=VALUE,...] (dp, zero3:recompute=full, tp:tp=4,zero=1, "
             "1f1b:tp=2,dp=2,micro=8, interleaved:pp=4,virtual=2,recompute=selective), auto "
             "(auto:preset=megatron: searched), or a plan.json")


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
    ins.set_defaults(run=_lazy("inspect", "inspect_cmd"))
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
    pl.set_defaults(run=_lazy("plan", "plan_cmd"))
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
    ver.set_defaults(run=_lazy("plan", "verify_cmd"))
    _add_sim_commands(sub)
    _add_train_commands(sub)
    models = sub.add_parser("models", help="list the bundled models")
    models.set_defaults(run=_lazy("inspect", "models_cmd"))
    for name, cmd in sub.choices.items():
        if "model" in {a.dest for a in cmd._actions}:  # every command that captures a model
            cmd.add_argument("--batch-local", metavar="OP", action="append", default=[],
                             help="declare an op's rows independent (e.g. aten.kthvalue), so "
                                  "data parallelism keeps the batch split through it; repeatable")
    return p


def _add_sim_commands(sub) -> None:
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
    sim.set_defaults(run=_lazy("sim", "simulate_cmd"))
    exp = sub.add_parser("explain", help="per op: partition, devices, communication, time and "
                         "memory of a plan; top costs; --vs compares with another plan")
    exp.add_argument("model", metavar="MODEL", nargs="+",
                     help="a bundled name, path/to/file.py:factory, or a saved graph (*.graph.json); "
                     "the older form PLAN MODEL is read too")
    exp.add_argument("--plan", dest="plan_option", metavar="PLAN",
                     help=PLAN_HELP + " (or a plan.json), as simulate, plan and verify take it")
    exp.add_argument("--cluster", required=True, metavar="SPEC", help=cluster_help)
    exp.add_argument("--vs", metavar="PLAN", help="another plan.json or policy name: why not it?")
    exp.add_argument("--world-size", type=int, help="ranks for a policy name (default: cluster size)")
    exp.add_argument("--meta", action="store_true", help="build the model on the meta device")
    exp.add_argument("--dtype", choices=("fp32", "bf16", "fp16"))
    exp.add_argument("--top", type=int, default=5, help="how many top costs and differences")
    exp.add_argument("--all", action="store_true", help="show every op")
    exp.add_argument("--gantt", metavar="OUT_PNG", help=GANTT_HELP)
    exp.add_argument("--no-gantt", action="store_true", help="write no Gantt chart")
    exp.set_defaults(run=_lazy("explain", "explain_cmd"))
    cal = sub.add_parser("calibrate", help="measure this machine (matmul, copy, gloo collectives) "
                         "and save a cluster YAML that --cluster accepts")
    cal.add_argument("--world-sizes", type=int, nargs="+", default=[2], metavar="N")
    cal.add_argument("--out", default="cpu.yaml", metavar="YAML", help="default: cpu.yaml")
    cal.add_argument("--quick", action="store_true", help="one message size, 2 ranks (tests)")
    cal.set_defaults(run=_lazy("calibrate", "calibrate_cmd"))


def _add_train_commands(sub) -> None:
    tr = sub.add_parser(
        "train", help="train from a YAML config on N local processes or under torchrun",
        description="Train from a typed YAML config. Any field can be overridden as "
        "--section.field=value (e.g. --optim.lr=3e-4 --parallel.world_size=4). Runs N local "
        "processes, or joins the job when started by torchrun. Resumes from the newest "
        "checkpoint in the run's checkpoint folder.")
    tr.add_argument("config", nargs="?", metavar="CONFIG_YAML",
                    help="the config (default: all defaults)")
    tr.set_defaults(run=_lazy("train", "train_run"), overrides=True)
    demo = sub.add_parser(
        "demo", help="train a small GPT on the bundled text with 4 CPU ranks (about 2 minutes)",
        description="The demo config (a character-level GPT, plan chosen by the simulator, "
        "4 ranks), with --section.field=value overrides (e.g. --steps=100).")
    demo.set_defaults(run=_lazy("train", "demo_run"), overrides=True)


def _lazy(module: str, name: str):
    """A command's ``run``: imported from ``torchweave.commands.<module>`` when it runs, so
    that ``torchweave --help`` imports no model code."""

    def run(args: argparse.Namespace, console: Console) -> int:
        import importlib

        return getattr(importlib.import_module(f"torchweave.commands.{module}"), name)(args, console)

    run.__name__ = name
    return run


def plain_console() -> Console:
    """The CLI's console: nothing it prints is read as rich markup (error texts, node
    names and module paths hold square brackets); the few styled lines say so."""
    return Console(width=None if sys.stdout.isatty() else 200, markup=False)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and getattr(args, "plan_option", "") is None:  # explain's older PLAN MODEL, with
        words = next((i for i, w in enumerate(extra) if w.startswith("-")), len(extra))  # an
        args.model, extra = args.model + extra[:words], extra[words:]  # option between the two
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
