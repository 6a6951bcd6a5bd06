"""Trainer overhead: ``torchweave train``'s loop against a bare ``train_step`` loop, same plan.

    python bench/trainer.py                 # 2 ranks, dp, 15 blocks of 10 steps each side: ~30 s
    python bench/trainer.py --plan zero2 --world-size 4

In one launch, every rank builds the trainer of a small character-level GPT
(the demo's data; d=128, 2 layers, sequence 64, global batch 8) and, per
block of steps, times (a) the trainer's loop: sampling the global batch, forward,
backward, gradient norm and clipping, the LR schedule, the optimizer step,
JSON-lines and TensorBoard metrics and the progress line, for N steps; and
(b) a bare loop over the *same* parallel module: ``backward_step`` on a batch
already in memory, ``clip(1.0)``, ``optimizer_step``, for N steps. Blocks of
the two alternate, a barrier before each (each trainer block continues the
same run, as ``run()`` does after a resume). The table shows rank 0's median
per-step time of each, their ratio, and the median over blocks of the ratio of
each trainer block to the bare block right after it (adjacent blocks share the
machine's load, so this moves less); target: at most 1.03. Also, measured
inside the same trainer blocks and so free of the load that moves both
sides, the share of the trainer's loop spent outside the step
itself (sampling, metrics, progress) relative to the step.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console

from torchweave.runtime.launch import LaunchConfig, spawn
from torchweave.train.config import _plan_dp
from torchweave.train.loading import load_config
from torchweave.train.loop import Trainer

BASE = {
    "model": {"factory": "gpt", "kwargs": {"n_layer": 2, "n_head": 4, "d_model": 128}},
    "data": {"kind": "text", "seq_len": 64},
    "optim": {"lr": 1e-3, "clip_grad_norm": 1.0},
    "schedule": {"warmup_steps": 5, "kind": "cosine"},
    "checkpoint": {"every": 0},
    "log_every": 10,
    "resume": False,
}


def _rank(ctx, args) -> dict:
    out = {"trainer": [], "bare": [], "outside": []}
    world = args.world_size
    dp = _plan_dp(args.plan, world)[0]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, [
            f"--run_dir={Path(tmp) / 'run'}", f"--steps={args.steps}",
            f"--parallel.plan={args.plan}", f"--parallel.world_size={world}",
            f"--parallel.micro_batch={8 // dp}", "--parallel.global_batch=8"], base=BASE)
        trainer = Trainer(cfg, ctx, console=Console(file=open(os.devnull, "w")))
        module = trainer.module
        trainer.cfg = dataclasses.replace(cfg, steps=2)  # warm-up
        trainer.run()
        for _ in range(args.repeats):
            # a block of the trainer's own loop, continuing where the last one stopped
            trainer.cfg = dataclasses.replace(cfg, steps=trainer.step + args.steps)
            dist.barrier()
            res = trainer.run()
            out["trainer"].append(res.loop_s / args.steps)
            out["outside"].append((res.loop_s - res.compute_s) / res.compute_s)
            batches = [trainer.sampler.next_batch() for _ in range(args.steps)]
            dist.barrier()
            t0 = time.perf_counter()
            for batch in batches:
                module.backward_step(*batch)
                module.clip(1.0)
                module.optimizer_step()
            out["bare"].append((time.perf_counter() - t0) / args.steps)
    return out


def measure(plan: str = "dp", world_size: int = 2, steps: int = 10,
            repeats: int = 15) -> dict[str, list[float]]:
    """One launch: rank 0's per-block seconds per step, ``trainer`` and ``bare`` (alternating
    blocks of ``steps`` steps, ``repeats`` of each), and ``outside`` (the trainer's share of
    time outside the step, per block)."""
    args = argparse.Namespace(plan=plan, world_size=world_size, steps=steps, repeats=repeats)
    return spawn(_rank, LaunchConfig(world_size=world_size, timeout_s=120,
                                     threads_per_rank=1), args)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", default="dp")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10, help="steps per block")
    ap.add_argument("--repeats", type=int, default=15, help="blocks of each side, alternating")
    args = ap.parse_args()
    t0 = time.perf_counter()
    res = measure(args.plan, args.world_size, args.steps, args.repeats)
    tr, bare = statistics.median(res["trainer"]), statistics.median(res["bare"])
    outside = statistics.median(res["outside"])
    paired = statistics.median(t / b for t, b in zip(res["trainer"], res["bare"]))
    print("| plan | world size | trainer ms/step | bare loop ms/step | ratio of medians | "
          "median of paired ratios | trainer time outside the step |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {args.plan} | {args.world_size} | {tr * 1e3:.2f} | {bare * 1e3:.2f} | "
          f"{tr / bare:.3f}x | {paired:.3f}x | {outside:.2%} |")
    print(f"\nper repeat, trainer: {[round(x * 1e3, 2) for x in res['trainer']]} ms; "
          f"bare: {[round(x * 1e3, 2) for x in res['bare']]} ms; "
          f"torch {torch.__version__}, {time.perf_counter() - t0:.0f} s in all", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
