"""Pipeline schedules: torchweave's GPipe, 1F1B and interleaved 1F1B beside torch.distributed.pipelining.

Same model, same stages, same micro-batches, same weights and batch on both
sides, on gloo, one torch thread per rank:

- the model is a stack of residual MLP blocks (``BLOCKS`` x [Linear(D, H) ->
  GELU -> Linear(H, D)]) with loss ``out.pow(2).mean()``, input ``[BATCH, D]``;
- ``gpipe`` and ``1f1b``: one stage per rank (``BLOCKS / p`` blocks each),
  against ``ScheduleGPipe`` and ``Schedule1F1B``; ``interleaved``: two stages per rank (stage ``s`` on rank
  ``s % p``), against ``ScheduleInterleaved1F1B``;
- torchweave gets the whole model and a plan (``pipeline(...)`` cut at the same
  block boundaries); PyTorch gets the hand-cut stage modules.

Both sides warm up, then their timed steps alternate, with a barrier before
each (rank 0's median step is reported). Each side then runs one more step
under saved-tensor hooks, which count the bytes of activations kept for
backward at their peak, per rank. For torchweave the executor also measures,
per rank, time blocked in receives; the bubble is ``1 − Σ busy / (p ×
slowest rank's step)``, beside the textbook ``(p−1)/(m+p−1)`` (1F1B; for
interleaved ``(p−1)/(v·m+p−1)``) and the unit-time simulation of the same
schedule. ``zb`` (ZB-H1) races ``ScheduleInterleavedZeroBubble`` on one stage per
rank, which gives ZB-H1's order, where this torch has it (else it runs on torchweave
alone), beside 1F1B's textbook bubble and its own unit-time simulation. Peak
in-flight micro-batches per rank are set beside the schedule's own count (GPipe: all
``m``; 1F1B: ``p − r``; ZB-H1: ``p``, counted until each ``W``).

Run: python bench/pipeline.py [--world-sizes 2 4] [--steps 6] [--micro 8] [--readme]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from mlp import ResidualMLP, block_cuts  # bench/mlp.py (the script's folder is on sys.path)

BLOCKS, D, H, BATCH, SEED = 8, 512, 2048, 128, 0
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-3)
PEERS = ("gpipe", "1f1b", "interleaved")
"""Schedules with a torch.distributed.pipelining peer on the same stages (ZB-H1's,
``ScheduleInterleavedZeroBubble`` on one stage per rank, only where this torch has it)."""


def make() -> tuple[ResidualMLP, torch.Tensor]:
    torch.manual_seed(SEED)
    return ResidualMLP(D, H, BLOCKS), torch.randn(BATCH, D, generator=torch.Generator().manual_seed(SEED))


def stages_of(rank: int, p: int, v: int) -> list[int]:
    return [s for s in range(p * v) if s % p == rank]


class SavedBytes:
    """Peak bytes of activations saved for backward (parameters not counted)."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def pack(self, t: torch.Tensor) -> Any:
        if t.is_leaf and t.requires_grad:
            return t
        return _Held(t, self)

    @staticmethod
    def unpack(h: Any) -> torch.Tensor:
        return h.t if isinstance(h, _Held) else h


class _Held:
    __slots__ = ("t", "n", "owner")

    def __init__(self, t: torch.Tensor, owner: SavedBytes) -> None:
        self.t, self.n, self.owner = t, t.untyped_storage().nbytes(), owner
        owner.live += self.n
        owner.peak = max(owner.peak, owner.live)

    def __del__(self) -> None:
        self.owner.live -= self.n


# --------------------------------------------------------------------------- sides


def torch_side(ctx, schedule: str, micro: int):
    from torch.distributed.pipelining import (
        PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    p, v = ctx.world_size, 2 if schedule == "interleaved" else 1
    model, x = make()
    per = BLOCKS // (p * v)
    stages, params = [], []
    for s in stages_of(ctx.rank, p, v):
        mod = nn.Sequential(*[model.blocks[i] for i in range(s * per, (s + 1) * per)])
        params += list(mod.parameters())
        stages.append(PipelineStage(mod, s, p * v, torch.device("cpu")))
    loss_fn = lambda out, target: out.pow(2).mean()  # noqa: E731
    if schedule == "interleaved":
        sched = ScheduleInterleaved1F1B(stages, micro, loss_fn=loss_fn)
    elif schedule == "zb":  # ZB1P on one stage per rank: ZB-H1 (with zb_peer, below)
        sched = ScheduleInterleavedZeroBubble(stages, micro, loss_fn=loss_fn)
    elif schedule == "gpipe":
        sched = ScheduleGPipe(stages[0], micro, loss_fn=loss_fn)
    else:
        sched = Schedule1F1B(stages[0], micro, loss_fn=loss_fn)
    opt = OPTIMIZER(params)
    first, last = 0 in stages_of(ctx.rank, p, v), p * v - 1 in stages_of(ctx.rank, p, v)
    target = torch.zeros(BATCH)

    def step() -> float:
        losses: list[torch.Tensor] = []
        args = (x,) if first else ()
        kwargs = {"target": target, "losses": losses} if last else {}
        sched.step(*args, **kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(torch.stack(losses).detach().mean()) if last else float("nan")

    return step, None


def tw_side(ctx, schedule: str, micro: int):
    from torchweave.parallel import parallelize
    from torchweave.policies.pipeline_policy import pipeline

    p, v = ctx.world_size, 2 if schedule == "interleaved" else 1
    model, x = make()

    def plan(graph, world_size):
        return pipeline(graph, world_size, schedule=schedule, micro=micro,
                        cuts=block_cuts(graph, BLOCKS, p * v))

    module = parallelize(model, (x,), plan=plan, groups=ctx.groups, optimizer=OPTIMIZER)
    return (lambda: module.train_step(x)), module


# --------------------------------------------------------------------------- one launch


def rank_main(ctx, schedule: str, micro: int, warmup: int, steps: int,
              zb_peer: bool = False) -> dict[str, Any]:
    """``zb_peer``: race zb against ``ScheduleInterleavedZeroBubble`` on one stage per rank
    (bench/peers.py does; this script's own table keeps zb on torchweave alone)."""
    sides, out = {}, {}
    with_peer = schedule in PEERS or (zb_peer and schedule == "zb")
    peers = [("torch", torch_side)] if with_peer else []  # zb: torchweave alone
    for name, setup in peers + [("tw", tw_side)]:
        try:
            sides[name] = setup(ctx, schedule, micro)
        except Exception as e:  # noqa: BLE001 - reported in the table
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:150]}",
                         "traceback": traceback.format_exc()}
    times: dict[str, list[float]] = {n: [] for n in sides}
    losses: dict[str, list[float]] = {n: [] for n in sides}
    stats: list[tuple[float, float, int]] = []
    for i in range(warmup + steps):
        for name in (["torch", "tw"] if i % 2 == 0 else ["tw", "torch"]):
            if name not in sides:
                continue
            dist.barrier()
            t0 = time.perf_counter()
            losses[name].append(sides[name][0]())
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
                if name == "tw":
                    s = sides[name][1].stats
                    stats.append((s.wall_s, s.wait_s, s.peak_live))
    for name, (step, module) in sides.items():
        counter = SavedBytes()
        dist.barrier()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            step()
        out[name] = {"ms": statistics.median(times[name]) * 1e3, "losses": losses[name],
                     "saved_mb": counter.peak / 2**20}
    if "tw" in out and "ms" in out["tw"]:
        out["tw"]["stats"] = stats
    return out


def report(schedule: str, p: int, micro: int, results: list[dict[str, Any]]) -> list[str]:
    from torchweave.plan.schedules import (
        bubble_fraction, gpipe, interleaved_1f1b, one_f_one_b, peak_in_flight, zero_bubble_h1,
    )

    v = 2 if schedule == "interleaved" else 1
    sched = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb": zero_bubble_h1}.get(
        schedule, lambda p, m: interleaved_1f1b(p, v, m))(p, micro)
    textbook = (p - 1) / (v * micro + p - 1)
    r0 = results[0]
    has_peer = "torch" in r0
    sides = ("tw", "torch") if has_peer else ("tw",)
    if any("error" in r0.get(k, {}) for k in sides):
        return [f"| {schedule} | {p} | {micro} | " + " / ".join(
            r0[k].get("error", "ok") for k in sides) + " | | | | | |"]
    if not has_peer:  # no peer: 1F1B's textbook bubble, for comparison
        for r in results:
            r["torch"] = {"ms": float("nan"), "saved_mb": float("nan"), "losses": r["tw"]["losses"]}
        textbook = (p - 1) / (micro + p - 1)
    ratio = r0["tw"]["ms"] / r0["torch"]["ms"]
    per_step = list(zip(*[r["tw"]["stats"] for r in results]))  # steps × ranks
    bubbles = []
    for ranks in per_step:
        slowest = max(w for w, _, _ in ranks)
        bubbles.append(1 - sum(w - wait for w, wait, _ in ranks) / (p * slowest))
    live = [max(r["tw"]["stats"], key=lambda s: s[2])[2] for r in results]
    book_live = list(peak_in_flight(sched).values())
    mem = " / ".join(f"{r['tw']['saved_mb']:.1f}:{r['torch']['saved_mb']:.1f}" for r in results)
    loss_ok = all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in
                  zip(results[-1]["tw"]["losses"], results[-1]["torch"]["losses"]))
    row = (f"| {schedule} | {p} | {micro} | {r0['tw']['ms']:.0f} | {r0['torch']['ms']:.0f} | "
           f"{ratio:.2f}x | {statistics.median(bubbles):.2f} | {textbook:.2f} "
           f"(sim {bubble_fraction(sched):.2f}) | {live} vs {book_live} | {mem} | "
           f"{'same' if loss_ok else 'DIFFER'} |")
    if not has_peer:
        row = row.replace("nanx", "—").replace(":nan", "").replace("| nan |", "| — |")
        row = row[:row.rstrip(" |").rfind("|")] + "| — |"
    return [row]


def measure(schedule: str, p: int, micro: int, warmup: int, steps: int,
            zb_peer: bool = False) -> list[dict[str, Any]]:
    """One launch on ``p`` ranks: each rank's ``rank_main`` result (tracebacks printed)."""
    from torchweave.runtime.launch import LaunchConfig, spawn

    cfg = LaunchConfig(world_size=p, threads_per_rank=1, timeout_s=120.0)
    results = spawn(rank_main, cfg, schedule, micro, warmup, steps, zb_peer)
    for r in results:
        for side in r.values():
            if "traceback" in side:
                print(side["traceback"])
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved", "zb"])
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--readme", action="store_true", help="write the table into bench/README.md")
    args = ap.parse_args()
    import torch.distributed.pipelining as pp

    zb_peer = hasattr(pp, "ScheduleInterleavedZeroBubble")
    rows = ["| schedule | p | m | torchweave ms | torch.pipelining ms | ratio | bubble measured | "
            "bubble textbook | peak in flight per rank (measured vs schedule) | "
            "saved activations MB per rank (tw:torch) | losses |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in args.world_sizes:
        for schedule in args.schedules:
            results = measure(schedule, p, args.micro, args.warmup, args.steps, zb_peer)
            rows += report(schedule, p, args.micro, results)
            print(rows[-1], flush=True)
    print("\n".join(rows))
    if args.readme:
        from readme_section import write_section  # bench/readme_section.py

        cmd = (f"python bench/pipeline.py --world-sizes {' '.join(map(str, args.world_sizes))} "
               f"--steps {args.steps} --readme")
        write_section("pipeline", cmd, "\n".join(rows) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
