"""Multi-forward (recycling) pipelines: torchweave beside torch.distributed.pipelining by hand.

The model recycles as AlphaFold 2 does: ``forward(x, prev)`` adds
``proj(prev)`` to ``x``, runs ``BLOCKS`` residual MLP blocks and returns
``out.pow(2).mean()``; ``prev`` is zero on the first pass and the last block's
output of the pass before on the others. A step runs ``passes - 1`` passes
without gradients, then one with gradients and its backward, per micro-batch.

- **torchweave**: the whole model and the plan ``1f1b:micro=M,recycle=P``
  (stages cut at the same blocks as PyTorch's). The no-gradient passes are
  ``R`` actions that op-order places in the schedule; the last stage's output
  goes back to stage 0 by derived transfers, per micro-batch, as soon as it
  exists. A second torchweave column places the ``R`` actions by the greedy
  alternative (:func:`~torchweave.plan.schedules.recycle.in_bubbles`) on the
  same plan.
- **PyTorch**: hand-cut stages under ``Schedule1F1B``; each no-gradient pass
  is ``schedule.eval(...)`` over all micro-batches, its output sent from the
  last rank to the first with ``dist.send``/``dist.recv`` (what a user writes
  by hand), then ``schedule.step(...)``.

Both sides start from the same weights and batch; their timed steps alternate,
each after a barrier; rank 0's median is reported, with the ratio. The
measured bubble of torchweave is ``1 − Σ busy / (p × slowest rank's step)``
(busy = step minus time blocked in receives), beside the unit-time simulation
of the same schedule (``R`` = ``F`` = 1, ``B`` = 2) and of PyTorch's
pass-by-pass order (each pass a separate fill and drain).

Run: python bench/recycle.py [--world-sizes 2 4] [--passes 3] [--micro 8] [--steps 6]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import statistics
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from mlp import Block, block_cuts  # bench/mlp.py (the script's folder is on sys.path)

BLOCKS, D, H, BATCH, SEED = 8, 256, 1024, 64, 0
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-3)


class RecyclingMLP(nn.Module):
    """``forward(x, prev)``: ``x + proj(prev)`` through the blocks; loss ``out.pow(2).mean()``."""

    recycle = {"prev": f"blocks.{BLOCKS - 1}"}

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block(D, H) for _ in range(BLOCKS))

    def trunk(self, x: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        h = x + self.proj(prev)
        for block in self.blocks:
            h = block(h)
        return h

    def forward(self, x: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return self.trunk(x, prev).pow(2).mean()


class _First(nn.Module):
    """PyTorch's stage 0: the projection of the recycled input, then its blocks."""

    def __init__(self, proj: nn.Module, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.proj, self.blocks = proj, nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return self.blocks(x + self.proj(prev))


def make() -> tuple[RecyclingMLP, torch.Tensor, torch.Tensor]:
    torch.manual_seed(SEED)
    x = torch.randn(BATCH, D, generator=torch.Generator().manual_seed(SEED))
    return RecyclingMLP(), x, torch.zeros(BATCH, D)


def _virtual(schedule: str) -> int:
    return 2 if schedule == "interleaved" else 1


def tw_side(ctx, schedule: str, micro: int, passes: int, order: str):
    from torchweave.parallel import parallelize
    from torchweave.plan.schedules.recycle import in_bubbles
    from torchweave.policies.pipeline_policy import pipeline, with_recycle

    model, x, prev = make()

    def plan(graph, world_size):
        stages = world_size * _virtual(schedule)
        out = with_recycle(pipeline(graph, world_size, schedule=schedule, micro=micro,
                                    cuts=block_cuts(graph, BLOCKS, stages)), graph, passes)
        if order == "greedy":
            pipe = out.pipeline
            base = {r: [a for a in acts if a.kind.value != "R"] for r, acts in pipe.schedule.items()}
            pipe.schedule = in_bubbles(base, dict(enumerate(pipe.stage_rank)), micro, passes)
        return out

    module = parallelize(model, (x, prev), plan=plan, groups=ctx.groups, optimizer=OPTIMIZER)
    return (lambda: module.train_step(x, prev)), module


def torch_side(ctx, schedule: str, micro: int, passes: int, order: str):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    p, r, v = ctx.world_size, ctx.rank, _virtual(schedule)
    model, x, prev0 = make()
    n, per = p * v, BLOCKS // (p * v)
    stages, params = [], []
    for s in range(r, n, p):  # stage s on rank s % p
        blocks = [model.blocks[i] for i in range(s * per, (s + 1) * per)]
        mod = _First(model.proj, blocks) if s == 0 else nn.Sequential(*blocks)
        params += list(mod.parameters())
        stages.append(PipelineStage(mod, s, n, torch.device("cpu")))
    loss_fn = lambda out, target: out.pow(2).mean()  # noqa: E731
    sched = ScheduleInterleaved1F1B(stages, micro, loss_fn=loss_fn) if v > 1 else \
        Schedule1F1B(stages[0], micro, loss_fn=loss_fn)
    opt = OPTIMIZER(params)
    target = torch.zeros(BATCH)
    first, last = r == 0, r == p - 1

    def step() -> float:
        prev = prev0
        for _ in range(passes - 1):  # no-gradient passes, one pipeline fill and drain each
            with torch.no_grad():
                tail = {"target": target, "losses": []} if last else {}
                out = sched.eval(*((x, prev) if first else ()), **tail)
            if last:
                dist.send(out.contiguous(), 0)
            if first:
                prev = torch.empty(BATCH, D)
                dist.recv(prev, p - 1)
        losses: list[torch.Tensor] = []
        kwargs = {"target": target, "losses": losses} if last else {}
        sched.step(*((x, prev) if first else ()), **kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(torch.stack(losses).detach().mean()) if last else float("nan")

    return step, None


SIDES = {"tw": (tw_side, "default"), "tw-greedy": (tw_side, "greedy"), "torch": (torch_side, "")}


def rank_main(ctx, schedule: str, micro: int, passes: int, warmup: int, steps: int) -> dict[str, Any]:
    sides, out = {}, {}
    for name, (setup, order) in SIDES.items():
        try:
            sides[name] = setup(ctx, schedule, micro, passes, order)
        except Exception as e:  # noqa: BLE001 - reported in the table
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:150]}",
                         "traceback": traceback.format_exc()}
    times: dict[str, list[float]] = {n: [] for n in sides}
    losses: dict[str, list[float]] = {n: [] for n in sides}
    stats: dict[str, list[tuple[float, float]]] = {n: [] for n in sides}
    names = list(sides)
    for i in range(warmup + steps):
        for name in names[i % len(names):] + names[:i % len(names)]:  # rotate who goes first
            dist.barrier()
            t0 = time.perf_counter()
            losses[name].append(sides[name][0]())
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
                module = sides[name][1]
                if module is not None:
                    stats[name].append((module.stats.wall_s, module.stats.wait_s))
    for name in sides:
        out[name] = {"ms": statistics.median(times[name]) * 1e3, "losses": losses[name],
                     "stats": stats[name]}
    return out


def _bubble(results: list[dict[str, Any]], name: str, p: int) -> float:
    per_step = list(zip(*[r[name]["stats"] for r in results]))  # steps × ranks
    out = []
    for ranks in per_step:
        slowest = max(w for w, _ in ranks)
        out.append(1 - sum(w - wait for w, wait in ranks) / (p * slowest))
    return statistics.median(out)


def simulated(schedule: str, p: int, micro: int, passes: int) -> tuple[float, float, float]:
    """Unit-time makespans: torchweave's placement, the greedy one, and pass by pass (PyTorch)."""
    from torchweave.plan.schedules import interleaved_1f1b, loop_stage_to_rank, one_f_one_b
    from torchweave.plan.schedules.recycle import in_bubbles, makespan, multi_forward

    v = _virtual(schedule)
    s2r = loop_stage_to_rank(p * v, p)
    base = one_f_one_b(p, micro) if v == 1 else interleaved_1f1b(p, v, micro)
    forward_only = makespan({r: [a for a in acts if a.kind.value == "F"] for r, acts in base.items()})
    return (makespan(multi_forward(base, s2r, micro, passes)),
            makespan(in_bubbles(base, s2r, micro, passes)),
            (passes - 1) * forward_only + makespan(base))


def main() -> None:
    from torchweave.runtime.launch import LaunchConfig, spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "interleaved"])
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--passes", type=int, nargs="+", default=[3])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=7)
    args = ap.parse_args()
    rows = ["| schedule | p | m | passes | torchweave ms | greedy R placement ms | torch.pipelining ms | ratio tw/torch | "
            "bubble measured (tw) | simulated makespan tw : greedy : pass by pass | losses |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p, schedule, passes in itertools.product(args.world_sizes, args.schedules, args.passes):
        cfg = LaunchConfig(world_size=p, threads_per_rank=1, timeout_s=300.0)
        results = spawn(rank_main, cfg, schedule, args.micro, passes, args.warmup, args.steps)
        r0 = results[0]
        errors = {k: v["error"] for k, v in r0.items() if "error" in v}
        if errors:
            for r in results:
                for side in r.values():
                    print(side.get("traceback", ""))
            rows.append(f"| {schedule} | {p} | {args.micro} | {passes} | {errors} |")
            continue
        last = results[-1]
        same = all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for name in ("tw", "tw-greedy")
                   for a, b in zip(last[name]["losses"], last["torch"]["losses"]))
        sim = simulated(schedule, p, args.micro, passes)
        rows.append(
            f"| {schedule} | {p} | {args.micro} | {passes} | {r0['tw']['ms']:.0f} | {r0['tw-greedy']['ms']:.0f} | "
            f"{r0['torch']['ms']:.0f} | {r0['tw']['ms'] / r0['torch']['ms']:.2f}x | "
            f"{_bubble(results, 'tw', p):.2f} | {sim[0]:.0f} : {sim[1]:.0f} : {sim[2]:.0f} | "
            f"{'same' if same else 'DIFFER'} |")
        print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
