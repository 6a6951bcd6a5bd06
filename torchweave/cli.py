"""The ``torchweave`` command."""

from __future__ import annotations

import argparse
import json
import sys
import time

from rich.console import Console

from torchweave.errors import TorchweaveError


def _inspect(args: argparse.Namespace, console: Console) -> int:
    import resource

    import torchweave
    from torchweave.factory import load
    from torchweave.summary import render

    t0 = time.perf_counter()
    loaded = load(args.model, meta=args.meta)
    graph = torchweave.capture(loaded.model, loaded.args, loaded.kwargs, name=loaded.name)
    took = time.perf_counter() - t0
    summary = torchweave.summarize(graph)
    render(summary, console, ops=not args.totals)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    console.print(f"captured in {took:.2f} s, peak RSS {rss:.2f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary.to_dict(), f, indent=1)
        console.print(f"wrote {args.json}")
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
    ins.set_defaults(run=_inspect)
    models = sub.add_parser("models", help="list the bundled models")
    models.set_defaults(run=_models)
    return p


def _models(args: argparse.Namespace, console: Console) -> int:
    from torchweave.models import FACTORIES

    for name, fn in FACTORIES.items():
        doc = (fn.__doc__ or "").strip().splitlines()
        console.print(f"{name:16s} {doc[0] if doc else ''}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 200)
    try:
        return int(args.run(args, console))
    except TorchweaveError as exc:
        console.print(f"[red]error:[/red] {exc}", markup=True, highlight=False)
        return 2


if __name__ == "__main__":
    sys.exit(main())
