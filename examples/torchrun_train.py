"""Train a bundled model with a torchweave plan under torchrun (one node or many).

    torchrun --standalone --nproc-per-node 2 examples/torchrun_train.py --plan tp --steps 5
    torchrun --nnodes 2 --node-rank R --master-addr HOST --nproc-per-node 8 examples/torchrun_train.py

Every rank builds the same model from the same seed and compiles the same
plan; each runs only its own generated code.
"""

from __future__ import annotations

import argparse

import torch

import torchweave
from torchweave.models import FACTORIES
from torchweave.runtime.launch import init_from_env


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--plan", default="dp")
    ap.add_argument("--world-size", type=int, required=True, help="must equal torchrun's")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    ctx = init_from_env(torchweave.LaunchConfig(world_size=args.world_size, timeout_s=args.timeout))
    torch.manual_seed(0)
    model, inputs = FACTORIES[args.model]()
    module = torchweave.parallelize(model, inputs, plan=args.plan, groups=ctx.groups)
    for step in range(args.steps):
        loss = module.train_step(*inputs)
        if ctx.rank == 0:
            print(f"step {step} loss {loss:.6f}", flush=True)
    ctx.close()


if __name__ == "__main__":
    main()
