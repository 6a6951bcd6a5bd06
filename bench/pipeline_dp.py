"""Pipeline × data parallelism: torchweave's ``1f1b:dp=2`` beside PyTorch's pipelining over DDP.

Four ranks, pp = 2 stages × dp = 2 replicas, the residual MLP stack of
``bench/pipeline.py`` (8 blocks of Linear(512, 2048) → GELU → Linear(2048, 512),
input [128, 512], loss ``out.pow(2).mean()``), m = 8 micro-batches per replica.

- **torchweave**: the whole model, the whole batch and the plan
  ``pipeline(graph, 4, schedule=..., dp=2, micro=8, cuts=...)``, cut at the
  same blocks. The replicas' gradient sums come from the plan; a stage's
  buckets start as soon as its last backward has produced them (the column
  "tw"), or all after the last action (``StepConfig(overlap=False)``, the
  column "tw, sums at the end").
- **PyTorch**: each rank's stage wrapped in ``DistributedDataParallel`` over
  its replica group and given to ``PipelineStage`` over its pipeline group,
  under ``Schedule1F1B`` / ``ScheduleInterleaved1F1B``, which skip the
  all-reduce (``no_sync``) on all but the last micro-batch's backward. Each
  replica gets its half of the batch.

Rank layout on both sides: pipeline position ``rank // 2``, replica
``rank % 2`` (torchweave's layout for ``dp=2``). Both sides start from the same
weights and step AdamW; timed steps alternate after a barrier; rank 0's median
is reported, with the ratios. The loss column compares torchweave's loss with
the mean of the two replicas' PyTorch losses.

Run: python bench/pipeline_dp.py [--schedules 1f1b interleaved] [--micro 8] [--steps 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from mlp import block_cuts  # bench/mlp.py (the script's folder is on sys.path)
from pipeline import BLOCKS, OPTIMIZER, make  # bench/pipeline.py

PP, DP = 2, 2


def _stages(position: int, v: int, pp: int = PP) -> list[int]:
    return [s for s in range(pp * v) if s % pp == position]


def torch_side(ctx, schedule: str, micro: int, pp: int = PP, dp: int = DP):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
    from torch.nn.parallel import DistributedDataParallel as DDP

    position, replica, v = ctx.rank // dp, ctx.rank % dp, 2 if schedule == "interleaved" else 1
    pp_groups = [dist.new_group([j * dp + d for j in range(pp)]) for d in range(dp)]
    dp_groups = [dist.new_group([j * dp + d for d in range(dp)]) for j in range(pp)]
    model, x = make()
    per = BLOCKS // (pp * v)
    stages, params = [], []
    for s in _stages(position, v, pp):
        mod = nn.Sequential(*[model.blocks[i] for i in range(s * per, (s + 1) * per)])
        params += list(mod.parameters())
        # One block a stage under ScheduleInterleaved1F1B (pp = 4, v = 2 over the 8 blocks):
        # PyTorch 2.13's reducer fails its bucket rebuild after the first step ("rebuilt
        # parameter indices size is not same as original model parameters size"); with
        # find_unused_parameters it never rebuilds, at the cost of one walk of the stage's
        # small autograd graph per step. Every other shape runs DDP's defaults.
        ddp = DDP(mod, process_group=dp_groups[position], bucket_cap_mb=25,
                  find_unused_parameters=per == 1)
        stages.append(PipelineStage(ddp, s, pp * v, torch.device("cpu"), group=pp_groups[replica]))
    loss_fn = lambda out, target: out.pow(2).mean()  # noqa: E731
    sched = (ScheduleInterleaved1F1B(stages, micro, loss_fn=loss_fn) if schedule == "interleaved"
             else Schedule1F1B(stages[0], micro, loss_fn=loss_fn))
    opt = OPTIMIZER(params)
    half = x.chunk(dp)[replica]
    first, last = 0 in _stages(position, v, pp), pp * v - 1 in _stages(position, v, pp)
    target = torch.zeros(half.shape[0])

    def step() -> float:
        losses: list[torch.Tensor] = []
        sched.step(*((half,) if first else ()), **({"target": target, "losses": losses} if last else {}))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not last:
            return float("nan")
        loss = torch.stack(losses).detach().mean()
        dist.all_reduce(loss, group=dp_groups[position])
        return float(loss) / dp

    return step


def tw_side(ctx, schedule: str, micro: int, overlap: bool, pp: int = PP, dp: int = DP):
    from torchweave.parallel import parallelize
    from torchweave.policies.pipeline_policy import pipeline
    from torchweave.runtime.executor import StepConfig

    v = 2 if schedule == "interleaved" else 1
    model, x = make()

    def plan(graph, world_size):
        return pipeline(graph, world_size, schedule=schedule, dp=dp, micro=micro,
                        cuts=block_cuts(graph, BLOCKS, pp * v))

    module = parallelize(model, (x,), plan=plan, groups=ctx.groups, optimizer=OPTIMIZER,
                         config=StepConfig(overlap=overlap, bucket_mb=25.0))
    return lambda: module.train_step(x)


def rank_main(ctx, schedule: str, micro: int, warmup: int, steps: int, pp: int = PP,
              dp: int = DP, end: bool = True) -> dict[str, Any]:
    """``end``: also time torchweave with its gradient sums after the last action ("tw-end")."""
    sides = {"torch": torch_side(ctx, schedule, micro, pp, dp),
             "tw": tw_side(ctx, schedule, micro, True, pp, dp)}
    if end:
        sides["tw-end"] = tw_side(ctx, schedule, micro, False, pp, dp)
    times: dict[str, list[float]] = {n: [] for n in sides}
    losses: dict[str, list[float]] = {n: [] for n in sides}
    names = list(sides)
    for i in range(warmup + steps):
        for name in (names if i % 2 == 0 else names[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            losses[name].append(sides[name]())
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {n: {"ms": statistics.median(times[n]) * 1e3, "losses": losses[n]} for n in sides}


def measure(schedule: str, micro: int, warmup: int, steps: int, pp: int = PP, dp: int = DP,
            end: bool = True) -> list[dict[str, Any]]:
    """One launch on ``pp * dp`` ranks: each rank's ``rank_main`` result (the last rank holds
    the last stage and its losses)."""
    from torchweave.runtime.launch import LaunchConfig, spawn

    cfg = LaunchConfig(world_size=pp * dp, threads_per_rank=1, timeout_s=300.0)
    return spawn(rank_main, cfg, schedule, micro, warmup, steps, pp, dp, end)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "interleaved"])
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    rows = ["| schedule | pp × dp | m | torchweave ms | tw, sums at the end ms | pipelining + DDP ms | "
            "ratio tw/torch | ratio tw/sums at the end | max loss diff |",
            "|---|---|---|---|---|---|---|---|---|"]
    for schedule in args.schedules:
        results = measure(schedule, args.micro, args.warmup, args.steps)
        r0, last = results[0], results[-1]  # rank 3 holds the last stage and its losses
        diff = max(max(abs(a - b) for a, b in zip(last["tw"]["losses"], last[n]["losses"]))
                   for n in ("torch", "tw-end"))
        rows.append(f"| {schedule} | {PP} × {DP} | {args.micro} | {r0['tw']['ms']:.0f} | {r0['tw-end']['ms']:.0f} | "
                    f"{r0['torch']['ms']:.0f} | {r0['tw']['ms'] / r0['torch']['ms']:.2f}x | "
                    f"{r0['tw']['ms'] / r0['tw-end']['ms']:.2f}x | {diff:.1e} |")
        print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
