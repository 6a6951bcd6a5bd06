"""Train a bundled model with a torchweave plan under torchrun, in your own loop.

    torchrun --standalone --nproc-per-node 2 examples/torchrun_train.py --world-size 2 --plan tp
    torchrun --nnodes 2 --node-rank R --master-addr HOST --nproc-per-node 8 \\
        examples/torchrun_train.py --world-size 16 --plan 1f1b:tp=2,dp=4

Every rank builds the same model from the same seed and compiles the same
plan; each runs only its own generated code. The loop is plain PyTorch:
``torch.optim.AdamW``, a cosine schedule, gradient clipping. ``--save DIR``
writes the trained weights with ``torch.distributed.checkpoint`` under the
model's own parameter names (``dcp.load`` reads them into a plain model).
"""

from __future__ import annotations

import argparse
import math

import torch

import torchweave
from torchweave.models import FACTORIES
from torchweave.runtime.launch import init_from_env


def cosine(steps: int):
    return lambda step: 0.5 * (1 + math.cos(math.pi * step / steps))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--plan", default="dp")
    ap.add_argument("--world-size", type=int, required=True, help="must equal torchrun's")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--save", default=None, help="a directory for the trained weights (DCP)")
    args = ap.parse_args()
    ctx = init_from_env(torchweave.LaunchConfig(world_size=args.world_size, timeout_s=args.timeout))
    torch.manual_seed(0)
    model, inputs = FACTORIES[args.model]()
    pm = torchweave.parallelize(model, inputs, plan=args.plan, groups=ctx.groups)
    opt = torchweave.optimizer(pm, torch.optim.AdamW, lr=args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine(args.steps))
    pipelined = pm.program.segments != []
    for step in range(args.steps):
        if pipelined:  # a pipeline runs forward and backward in one schedule
            loss = pm.step(*inputs)
        else:
            loss = pm(*inputs)
            loss.backward()
            loss = loss.item()
        opt.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if ctx.rank == 0:
            print(f"step {step} loss {loss:.6f}", flush=True)
    if args.save:
        import torch.distributed.checkpoint as dcp

        dcp.save(pm.state_dict(), checkpoint_id=args.save)
    ctx.close()


if __name__ == "__main__":
    main()
