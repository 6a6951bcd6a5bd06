"""Training-step speed: torchweave's parallel plans beside PyTorch's own parallel APIs.

Four pairs, each at world sizes 2 and 4 on gloo, one torch thread per rank on
both sides so they compare like with like:

- ``dp``    vs ``DistributedDataParallel``  on a GPT (d=256, 4 layers, vocab 4096, batch 8 x 128);
- ``zero3`` vs FSDP2 ``fully_shard`` (each block, then the root) on the same GPT,
  with the bytes each rank holds for parameters + gradients + AdamW state;
- ``zero2`` vs FSDP2 with ``reshard_after_forward=False`` (parameters stay gathered from
  forward to backward), same GPT, same bytes counted;
- ``tp``    vs DTensor ``parallelize_module`` (Colwise/Rowwise) on an MLP stack
  (4 x [Linear(512, 2048) -> GELU -> Linear(2048, 512)] with residuals, input [32, 512]).

Each pair runs in one launch, both sides built from the same seed, the same
weights and the same global batch: torchweave gets the full batch and slices it
itself; the DDP and FSDP2 ranks get their own 1/N slice (tensor parallelism:
every rank gets the full batch on both sides). Both sides warm up, then their
timed steps alternate (so that load from other processes falls on both alike),
with a barrier before each step so that ranks start together; the table shows
rank 0's median step. The losses of both sides are compared step by step as a
sanity check. A side that fails is reported in its row; the other goes on.

Run: python bench/parallel.py [--quick] [--steps 8] [--code-dir DIR]
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from held import fsdp_shards, held_bytes, optimizer_state  # bench/held.py (the script's folder is on sys.path)
from mlp import ResidualMLP  # bench/mlp.py

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results-parallel.md")

# --------------------------------------------------------------------------- workloads

GPT_KW = dict(vocab_size=4096, block_size=128, n_layer=4, n_head=8, d_model=256)
GPT_BATCH = (8, 128)
MLP_DIM, MLP_HIDDEN, MLP_BLOCKS, MLP_BATCH = 512, 2048, 4, 32
SEED = 0

# AdamW with torch's defaults otherwise (weight_decay=0.01); the same factory on both sides.
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-3)


def make_gpt() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    from torchweave.models.gpt import GPT, GPTConfig

    torch.manual_seed(SEED)
    model = GPT(GPTConfig(**GPT_KW))
    g = torch.Generator().manual_seed(SEED)
    b, t = GPT_BATCH
    data = torch.randint(0, GPT_KW["vocab_size"], (b, t + 1), generator=g)
    return model, (data[:, :-1].contiguous(), data[:, 1:].contiguous())


def make_mlp() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(SEED)
    model = ResidualMLP(MLP_DIM, MLP_HIDDEN, MLP_BLOCKS)
    x = torch.randn(MLP_BATCH, MLP_DIM, generator=torch.Generator().manual_seed(SEED))
    return model, (x,)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


# --------------------------------------------------------------------------- helpers


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n].contiguous()


@dataclass
class Side:
    """One side of a pair, set up on this rank: ``step()`` trains one step and returns the
    loss; ``finish()`` returns extra facts (memory, counts) after the timed steps."""

    step: Callable[[], float]
    finish: Callable[[], dict[str, Any]] = dict
    local_loss: bool = False
    """The step returns this rank's loss on its slice (averaged over ranks for the report)."""


def global_mean(losses: list[float], world: int) -> list[float]:
    """Per-step mean over ranks of each rank's local loss (equal slices: the global loss)."""
    t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / world).tolist()


# --------------------------------------------------------------------------- PyTorch sides


def _train(model: nn.Module, opt: torch.optim.Optimizer, *inputs: torch.Tensor) -> float:
    loss = model(*inputs)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def torch_ddp(ctx, code_dir: str | None) -> Side:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, (idx, tgt) = make_gpt()
    idx, tgt = shard(idx, ctx.rank, ctx.world_size), shard(tgt, ctx.rank, ctx.world_size)
    ddp = DDP(model, bucket_cap_mb=25)
    opt = OPTIMIZER(list(ddp.parameters()))
    return Side(lambda: _train(ddp, opt, idx, tgt), local_loss=True)


def torch_fsdp2(ctx, code_dir: str | None, reshard: bool | None = None) -> Side:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, (idx, tgt) = make_gpt()
    total = 4 * n_params(model) * 4
    idx, tgt = shard(idx, ctx.rank, ctx.world_size), shard(tgt, ctx.rank, ctx.world_size)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    for block in model.blocks:  # reshard=None: FSDP2's default; False: the zero2 peer
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    opt = OPTIMIZER(list(model.parameters()))

    def held() -> int:
        # the module's parameters (unsharded ones while FSDP2 keeps them), every sharded
        # parameter FSDP2 holds, their gradients and the optimizer state
        params = list(model.parameters()) + fsdp_shards(model)
        return held_bytes(params + [p.grad for p in params] + optimizer_state(opt))

    def finish() -> dict[str, Any]:
        # One more step, measured after forward and after backward: the larger is the peak
        # of what training holds (FSDP2's gathered parameters exist after forward when it
        # does not reshard; gradients after backward).
        loss = model(idx, tgt)
        after_forward = held()
        loss.backward()
        mem = max(after_forward, held())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {"mem": mem, "total": total}

    return Side(lambda: _train(model, opt, idx, tgt), finish, local_loss=True)


def torch_fsdp2_keep(ctx, code_dir: str | None) -> Side:
    return torch_fsdp2(ctx, code_dir, reshard=False)


def torch_tp(ctx, code_dir: str | None) -> Side:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, parallelize_module,
    )

    model, (x,) = make_mlp()
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    plan = {}
    for i in range(MLP_BLOCKS):
        plan[f"blocks.{i}.fc1"] = ColwiseParallel()
        plan[f"blocks.{i}.fc2"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    opt = OPTIMIZER(list(model.parameters()))
    return Side(lambda: _train(model, opt, x))  # the loss is replicated: already global


# --------------------------------------------------------------------------- torchweave sides


def _parallelize(ctx, model, inputs, plan: str, code_dir: str | None):
    from torchweave.parallel import parallelize
    from torchweave.runtime.executor import StepConfig

    # Each rank writes every rank's file; one folder per rank keeps a rank from reading
    # a file that another rank is rewriting.
    where = os.path.join(code_dir, f"rank{ctx.rank}") if code_dir else None
    t0 = time.perf_counter()
    module = parallelize(model, inputs, plan=plan, groups=ctx.groups, optimizer=OPTIMIZER,
                         config=StepConfig(overlap=True, bucket_mb=25.0), code_dir=where)
    return module, time.perf_counter() - t0


def tw_side(ctx, model, batch, plan: str, code_dir: str | None, *, memory: bool) -> Side:
    total = 4 * n_params(model) * 4
    module, compile_s = _parallelize(ctx, model, batch, plan, code_dir)

    def finish() -> dict[str, Any]:
        # One more step, split so that memory is measured after forward and after backward
        # (the larger: the peak, as on the peer's side); it also counts the collectives.
        with module.rt.group_cache.counter.window() as calls:
            loss = module(*batch)
            after_forward = module.memory()  # pieces, gradients, ZeRO's shard, optimizer state
            loss.backward()
            mem = max(after_forward, module.memory())
            module.optimizer_step()
        out = {"compile_s": compile_s, "collectives": sum(calls.counts().values())}
        if memory:
            out.update(mem=mem, total=total)
        return out

    return Side(lambda: module.train_step(*batch), finish)


def tw_dp(ctx, code_dir: str | None) -> Side:
    return tw_side(ctx, *make_gpt(), "dp", code_dir, memory=False)


def tw_zero3(ctx, code_dir: str | None) -> Side:
    return tw_side(ctx, *make_gpt(), "zero3", code_dir, memory=True)


def tw_zero2(ctx, code_dir: str | None) -> Side:
    return tw_side(ctx, *make_gpt(), "zero2", code_dir, memory=True)


def tw_tp(ctx, code_dir: str | None) -> Side:
    return tw_side(ctx, *make_mlp(), "tp", code_dir, memory=False)


# --------------------------------------------------------------------------- one launch per pair

BENCHES: dict[str, tuple[str, str, Callable, Callable]] = {
    # name: (table label, what, torchweave side, PyTorch side)
    "dp": ("dp vs DDP", "GPT d=256 L=4 V=4096, batch 8x128", tw_dp, torch_ddp),
    "zero3": ("zero3 vs FSDP2", "same GPT", tw_zero3, torch_fsdp2),
    "zero2": ("zero2 vs FSDP2 (reshard_after_forward=False)", "same GPT", tw_zero2,
              torch_fsdp2_keep),
    "tp": ("tp vs DTensor TP", "MLP 4x(512->2048->512), x [32, 512]", tw_tp, torch_tp),
}


def _error(e: BaseException) -> dict[str, Any]:
    first = (str(e).strip().splitlines() or [""])[0]
    return {"error": f"{type(e).__name__}: {first}"[:160], "traceback": traceback.format_exc()}


def rank_main(ctx, bench: str, warmup: int, steps: int, code_dir: str | None) -> dict[str, Any]:
    """Set up both sides, warm both up, then alternate their timed steps (so load from
    other processes on the machine falls on both alike)."""
    _, _, tw, peer = BENCHES[bench]
    out: dict[str, Any] = {}
    sides: dict[str, Side] = {}
    for name, setup in (("torch", peer), ("tw", tw)):
        try:
            sides[name] = setup(ctx, code_dir)
        except Exception as e:  # noqa: BLE001 - reported in the table
            out[name] = _error(e)
    times: dict[str, list[float]] = {n: [] for n in sides}
    losses: dict[str, list[float]] = {n: [] for n in sides}

    def one(name: str, timed: bool) -> None:
        try:
            if timed:
                dist.barrier()
            t0 = time.perf_counter()
            losses[name].append(sides[name].step())
            if timed:
                times[name].append(time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - this side stops; the other goes on
            out[name] = _error(e)
            del sides[name]

    for i in range(warmup + steps):
        order = ["torch", "tw"] if i % 2 == 0 else ["tw", "torch"]
        for name in order:
            if name in sides:
                one(name, timed=i >= warmup)
    for name, side in sides.items():
        try:
            ls = losses[name]
            if side.local_loss:
                ls = global_mean(ls, ctx.world_size)
            out[name] = {"ms": statistics.median(times[name]) * 1e3, "losses": ls,
                         **side.finish()}
        except Exception as e:  # noqa: BLE001
            out[name] = _error(e)
    return out


def launch(bench: str, world: int, warmup: int, steps: int, code_dir: str | None,
           timeout_s: float) -> dict[str, Any]:
    from torchweave.runtime.launch import LaunchConfig, spawn

    where = os.path.join(code_dir, f"{bench}-w{world}") if code_dir else None
    cfg = LaunchConfig(world_size=world, backend="gloo", timeout_s=timeout_s, threads_per_rank=1)
    try:
        return spawn(rank_main, cfg, bench, warmup, steps, where)[0]
    except Exception as e:  # noqa: BLE001 - a rank died: both sides of this pair are lost
        err = _error(e)
        return {"torch": err, "tw": err}


# --------------------------------------------------------------------------- report


def fmt_ms(side: dict[str, Any]) -> str:
    return f"{side['ms']:.1f}" if "ms" in side else "failed"


def notes(bench: str, tw: dict[str, Any], pt: dict[str, Any], world: int) -> str:
    parts = []
    for name, side in (("torchweave", tw), ("PyTorch", pt)):
        if "error" in side:
            parts.append(f"{name} failed: {side['error']}".replace("|", "/"))
    if "losses" in tw and "losses" in pt:
        n = min(len(tw["losses"]), len(pt["losses"]))
        d = max(abs(a - b) for a, b in zip(tw["losses"][:n], pt["losses"][:n]))
        parts.append(f"max loss diff {d:.1e} over {n} steps")
    if "compile_s" in tw:
        parts.append(f"parallelize {tw['compile_s']:.1f} s")
    if "collectives" in tw:
        parts.append(f"torchweave collectives/step {tw['collectives']}")
    if bench in ("zero3", "zero2"):
        total = tw.get("total") or pt.get("total")
        mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
        if total:
            mem = [f"torchweave {mib(tw['mem'])}" if "mem" in tw else None,
                   f"FSDP2 {mib(pt['mem'])}" if "mem" in pt else None,
                   f"total/N {mib(total / world)}"]
            parts.append("params+grads+AdamW MiB/rank: " + ", ".join(m for m in mem if m))
    return "; ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="world size 2 only, 3 timed steps")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 8; quick: 3)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--worlds", type=int, nargs="+", default=None)
    ap.add_argument("--only", nargs="+", choices=list(BENCHES), default=list(BENCHES))
    ap.add_argument("--code-dir", default=None,
                    help="keep torchweave's generated rank{r}.py here (default: a temp folder)")
    ap.add_argument("--timeout", type=float, default=120.0, help="collective time-out, s")
    ap.add_argument("--out", default=RESULTS, help="markdown file for the table")
    args = ap.parse_args()
    steps = args.steps or (3 if args.quick else 8)
    worlds = args.worlds or ([2] if args.quick else [2, 4])

    header = ["| benchmark | world size | torchweave ms | PyTorch ms | ratio | notes |",
              "|---|---|---|---|---|---|"]
    print("\n".join(header), flush=True)
    rows, failures = [], []
    t_start = time.perf_counter()
    for world in worlds:
        for bench in args.only:
            label, what, _, _ = BENCHES[bench]
            res = launch(bench, world, args.warmup, steps, args.code_dir, args.timeout)
            tw, pt = res["tw"], res["torch"]
            ratio = f"{tw['ms'] / pt['ms']:.2f}x" if "ms" in tw and "ms" in pt else "-"
            row = (f"| {label} ({what}) | {world} | {fmt_ms(tw)} | {fmt_ms(pt)} | {ratio} | "
                   f"{notes(bench, tw, pt, world)} |")
            rows.append(row)
            print(row, flush=True)
            for side, name in ((tw, "torchweave"), (pt, "PyTorch")):
                if "traceback" in side:
                    failures.append(f"--- {name} {bench} at world size {world}:\n"
                                    f"{side['traceback']}")
    elapsed = time.perf_counter() - t_start
    for f in failures:
        print(f, file=sys.stderr)

    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# bench/parallel.py results", "",
        f"{stamp}; torch {torch.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPU cores, gloo, 1 thread per rank; warm-up {args.warmup}, "
        f"median of {steps} timed steps on rank 0; ratio = torchweave / PyTorch "
        f"(below 1 means torchweave is faster); run took {elapsed:.0f} s.", "",
        *header, *rows, "",
    ]
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print(f"\nwrote {args.out} ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
