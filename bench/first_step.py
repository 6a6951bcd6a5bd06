"""Time to first step: a launch of N ranks, from the launch to the end of every rank's first
training step, for torchweave's ``dp`` and for DDP, on bench/parallel.py's GPT.

Each side is its own launch (process start, imports, model, then torchweave's capture,
plan, lowering and codegen, or DDP's wrapping; then one step with AdamW), so the time
includes what a user waits for. bench/peers.py races the two (its ``first`` rows).

``--phases``: one launch per side at each world size, each rank noting when each phase
ended (wall seconds since the launch) and the CPU seconds it had used: where the
difference goes (rank 0 captures for every rank; the others wait for its graph).

Run: python bench/first_step.py [--worlds 2 4 8] [--launches 3] [--readme] [--phases]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def first_step(ctx, side: str, mark) -> float:
    """Build ``side`` (``ddp`` or ``tw``) on bench/parallel.py's GPT and run one AdamW step,
    calling ``mark(phase)`` as each phase ends; returns the loss of the whole batch."""
    import torch
    import torch.distributed as dist

    from parallel import make_gpt  # bench/parallel.py

    model, batch = make_gpt()
    mark("model built")
    if side == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        mark("DDP and AdamW built")
        if batch[0].shape[0] % ctx.world_size:
            raise ValueError(f"DDP's shards: the batch of {batch[0].shape[0]} does not split "
                             f"over {ctx.world_size} ranks")
        n = batch[0].shape[0] // ctx.world_size
        loss = ddp(*[x[ctx.rank * n:(ctx.rank + 1) * n] for x in batch])
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        value = float(total) / ctx.world_size
    else:  # parallelize's own three steps (torchweave/parallel.py), each marked
        from torchweave.parallel import StepConfig, compile_plan, default_optimizer, rank_module
        from torchweave.parallel import shared_front, startup_collector

        mark("torchweave imported")
        with startup_collector():
            front = shared_front(model, batch, "dp", groups=ctx.groups)
            mark("graph and plan from rank 0")
            compiled = compile_plan(model, batch, "dp", world_size=ctx.world_size,
                                    only_rank=ctx.rank, front=front)
            mark("lowered, code generated")
            pm = rank_module(compiled, ctx.groups, optimizer=default_optimizer, config=StepConfig())
        value = float(pm.train_step(*batch))
    mark("first step done")
    return value


def rank_main(ctx, side: str) -> tuple[float, float]:
    """(when this rank's first step ended, its loss: the whole batch's)."""
    value = first_step(ctx, side, lambda _name: None)
    return time.time(), value


def phases_main(ctx, side: str, t0: float) -> list[tuple[str, float, float]]:
    """(phase, wall seconds since the launch when it ended, this rank's CPU seconds then)."""
    import resource

    def mark(name: str) -> None:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        marks.append((name, time.time() - t0, ru.ru_utime + ru.ru_stime))

    marks: list[tuple[str, float, float]] = []
    mark("started, torch imported")
    first_step(ctx, side, mark)
    return marks


def compile_bytecode() -> None:
    """Compile torchweave's and this folder's modules to bytecode, once, before any launch.

    ``pip install`` compiles an installed package's modules, and a first import writes
    what is missing, so a user's ranks read bytecode. Where ``PYTHONDONTWRITEBYTECODE``
    is set (as on the machine these numbers come from), an editable checkout has none,
    and every rank of every launch would compile torchweave's modules from source
    (about 0.1 CPU s a rank) while PyTorch's own, compiled when it was installed, are
    read. This puts both sides on the same footing."""
    import compileall
    from pathlib import Path

    import torchweave

    for folder in (Path(torchweave.__file__).parent, Path(__file__).parent):
        compileall.compile_dir(str(folder), quiet=1)


def phases(world: int) -> list[str]:
    """Table rows: each phase's end on rank 0 and on the last other rank, and CPU seconds."""
    import statistics as st

    from torchweave.runtime.launch import LaunchConfig, spawn

    rows = []
    for side in ("ddp", "tw"):
        t0 = time.time()
        got = spawn(phases_main, LaunchConfig(world_size=world, threads_per_rank=1,
                                              timeout_s=300.0), side, t0)
        for i, (name, wall0, cpu0) in enumerate(got[0]):
            others = [marks[i] for marks in got[1:]]
            rows.append(f"| {world} | {'torchweave dp' if side == 'tw' else 'DDP'} | {name} | "
                        f"{wall0:.2f} | {max(m[1] for m in others):.2f} | {cpu0:.2f} | "
                        f"{st.median(m[2] for m in others):.2f} | "
                        f"{cpu0 + sum(m[2] for m in others):.2f} |")
    return rows


def launch(side: str, world: int, timeout_s: float = 300.0) -> dict[str, Any]:
    """One launch: seconds from the call to the last rank's end of step 1, and rank 0's loss."""
    from torchweave.runtime.launch import LaunchConfig, spawn

    start = time.time()
    results = spawn(rank_main, LaunchConfig(world_size=world, threads_per_rank=1,
                                            timeout_s=timeout_s), side)
    return {"s": max(t for t, _ in results) - start, "loss": results[0][1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--readme", action="store_true", help="write the table into bench/README.md")
    ap.add_argument("--phases", action="store_true",
                    help="one launch per side per world size: when each phase ended, CPU seconds")
    args = ap.parse_args()
    compile_bytecode()
    if args.phases:
        rows = ["| ranks | side | phase | ends on rank 0 (s) | ends on the last other rank (s) | "
                "rank 0 CPU s | median other rank CPU s | CPU s, all ranks |",
                "|---|---|---|---|---|---|---|---|"]
        for world in args.worlds:
            rows += phases(world)
        print("\n".join(rows))
        if args.readme:
            import sys

            from readme_section import write_section  # bench/readme_section.py

            write_section("first-step-phases", "python bench/first_step.py " + " ".join(sys.argv[1:]),
                          "\n".join(rows) + "\n")
        return
    rows = ["| ranks | torchweave dp s | DDP s | difference (median of paired launches) | range | "
            "target | met |", "|---|---|---|---|---|---|---|"]
    for world in args.worlds:
        got: dict[str, list[float]] = {"tw": [], "ddp": []}
        for i in range(args.launches):
            for side in (("ddp", "tw") if i % 2 == 0 else ("tw", "ddp")):
                got[side].append(launch(side, world)["s"])
                print(f"{world} ranks, {side}: {got[side][-1]:.2f} s", flush=True)
        diffs = [a - b for a, b in zip(got["tw"], got["ddp"])]
        med = statistics.median(diffs)
        rows.append(f"| {world} | {statistics.median(got['tw']):.2f} | "
                    f"{statistics.median(got['ddp']):.2f} | {med:+.2f} s | "
                    f"{min(diffs):+.2f} – {max(diffs):+.2f} s | <= +1 s | "
                    f"{'yes' if med <= 1.0 else 'no'} |")
        print(rows[-1], flush=True)
    print("\n".join(rows))
    if args.readme:
        import sys

        from readme_section import write_section  # bench/readme_section.py

        write_section("first-step", "python bench/first_step.py " + " ".join(sys.argv[1:]),
                      f"Each launch: process start, imports, model, then torchweave's capture, "
                      f"plan, lowering and codegen, or DDP's wrapping; one AdamW step. "
                      f"{args.launches} launches per side, alternating which goes first.\n\n"
                      + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
