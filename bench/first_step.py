"""Time to first step: a launch of N ranks, from the launch to the end of every rank's first
training step, for torchweave's ``dp`` and for DDP, on bench/parallel.py's GPT.

Each side is its own launch (process start, imports, model, then torchweave's capture,
plan, lowering and codegen, or DDP's wrapping; then one step with AdamW), so the time
includes what a user waits for. bench/peers.py races the two (its ``first`` rows).

Run: python bench/first_step.py [--worlds 2 4 8] [--launches 3] [--readme]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def rank_main(ctx, side: str) -> tuple[float, float]:
    """(when this rank's first step ended, its loss: the whole batch's)."""
    import torch
    import torch.distributed as dist

    from parallel import make_gpt  # bench/parallel.py

    model, batch = make_gpt()
    if side == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        if batch[0].shape[0] % ctx.world_size:
            raise ValueError(f"DDP's shards: the batch of {batch[0].shape[0]} does not split "
                             f"over {ctx.world_size} ranks")
        n = batch[0].shape[0] // ctx.world_size
        part = [x[ctx.rank * n:(ctx.rank + 1) * n] for x in batch]
        loss = ddp(*part)
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        value = float(total) / ctx.world_size
    else:
        from torchweave.parallel import parallelize

        pm = parallelize(model, batch, plan="dp", groups=ctx.groups)
        value = float(pm.train_step(*batch))
    return time.time(), value


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
    args = ap.parse_args()
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
