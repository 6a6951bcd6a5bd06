"""Peak resident memory per rank, torchweave against its peer, each side in a launch of its own.

bench/peers.py runs both sides of a pair in one process (alternating their timed steps),
which is fair for time but mixes their memory: a process's resident set is one number.
Here each side of each pair gets its own launch of fresh processes: each rank builds that
side exactly as bench/peers.py does (the same models, plans, optimizers and batches),
trains ``--steps`` steps, and reports its peak resident set size (``VmHWM`` of
``/proc/self/status``: this process image's own, where ``ru_maxrss`` would carry over the
launching process's peak through exec) and its resident set after the last step
(``/proc/self/statm``). Everything the process does
counts: imports, model, capture and code generation on torchweave's side, wrapping on
the peer's, the steps.

The table gives, per pair and world size, the largest rank's peak of each side, their
ratio (torchweave / peer: at most 1.00 is the issue's target, "peak memory per rank at
most the peer's"), and each rank's own ratio, rank 0 first: rank 0 captures the model
for every rank (``torch.export``, which imports and caches some 30 MiB that stay).

Run: python bench/rss.py [--worlds 2 4] [--steps 4] [--only dp zb ...] [--readme]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable

import torch.distributed as dist

import parallel  # bench/parallel.py (the script's folder is on sys.path)
import pipeline  # bench/pipeline.py
import pipeline_dp  # bench/pipeline_dp.py
from readme_section import write_section

MICRO = 8  # as bench/peers.py
PAIRS = ["dp", "zero3", "zero2", "tp", "gpipe", "1f1b", "interleaved", "zb", "ppdp 1f1b",
         "ppdp interleaved"]
PEER = {"dp": "DDP", "zero3": "FSDP2", "zero2": "FSDP2, reshard_after_forward=False",
        "tp": "DTensor TP", "gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
        "interleaved": "ScheduleInterleaved1F1B",
        "zb": "ScheduleInterleavedZeroBubble, 1 stage/rank",
        "ppdp 1f1b": "Schedule1F1B over DDP", "ppdp interleaved": "ScheduleInterleaved1F1B over DDP"}


def skip(pair: str, world: int) -> str | None:
    if pair.startswith("ppdp"):
        if world < 4 or world % 2:
            return "pp x dp needs at least 4 ranks, an even number"
        pp, schedule = world // 2, pair.split()[1]
    else:
        pp, schedule = world, pair
    if pair in parallel.BENCHES:
        return None
    stages = pp * (2 if schedule == "interleaved" else 1)
    if pipeline.BLOCKS % stages:
        return f"needs {stages} stages of whole blocks; the model has {pipeline.BLOCKS} blocks"
    return None


def side_step(ctx, pair: str, side: str) -> Callable[[], Any]:
    """The step of ``side`` (``tw`` or ``peer``) of ``pair``, built as bench/peers.py builds it."""
    if pair in parallel.BENCHES:
        _, _, tw, peer = parallel.BENCHES[pair]
        return (tw if side == "tw" else peer)(ctx, None).step
    if pair.startswith("ppdp"):
        schedule, pp = pair.split()[1], ctx.world_size // 2
        if side == "tw":
            return pipeline_dp.tw_side(ctx, schedule, MICRO, True, pp, 2)
        return pipeline_dp.torch_side(ctx, schedule, MICRO, pp, 2)
    make = pipeline.tw_side if side == "tw" else pipeline.torch_side
    return make(ctx, pair, MICRO)[0]


def _resident_mib() -> float:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mib() -> float:
    from torchweave.train.loop import peak_rss_mib  # VmHWM: this process image's own

    return peak_rss_mib()


def rank_main(ctx, pair: str, side: str, steps: int) -> dict[str, float]:
    step = side_step(ctx, pair, side)
    for _ in range(steps):
        dist.barrier()
        step()
    dist.barrier()
    return {"peak": _peak_mib(), "now": _resident_mib()}


def launch(pair: str, side: str, world: int, steps: int) -> list[dict[str, float]]:
    from torchweave.runtime.launch import LaunchConfig, spawn

    cfg = LaunchConfig(world_size=world, backend="gloo", timeout_s=300.0, threads_per_rank=1)
    return spawn(rank_main, cfg, pair, side, steps)


def row(pair: str, world: int, steps: int) -> str:
    why = skip(pair, world)
    if why:
        return f"| {pair} | {PEER[pair]} | {world} | — | — | — | — | — | not run: {why} |"
    got = {}
    for side in ("peer", "tw"):
        try:
            got[side] = launch(pair, side, world, steps)
        except Exception as e:  # noqa: BLE001 - a side that fails is named in its row
            first = (str(e).strip().splitlines() or [""])[0][:120].replace("|", "/")
            return f"| {pair} | {PEER[pair]} | {world} | — | — | — | — | — | {side} failed: {first} |"
    tw, peer = got["tw"], got["peer"]
    ratios = [t["peak"] / p["peak"] for t, p in zip(tw, peer)]
    top_tw, top_peer = max(r["peak"] for r in tw), max(r["peak"] for r in peer)
    now = f"{max(r['now'] for r in tw):.0f} / {max(r['now'] for r in peer):.0f}"
    ok = all(r <= 1.0 for r in ratios)
    return (f"| {pair} | {PEER[pair]} | {world} | {top_tw:.0f} | {top_peer:.0f} | "
            f"{top_tw / top_peer:.3f} | {', '.join(f'{r:.3f}' for r in ratios)} | "
            f"{now} | {'yes' if ok else 'no'} |")


HEADER = ["| pair | peer | ranks | torchweave peak MiB | peer peak MiB | ratio | each rank's ratio | "
          "after the steps MiB, tw / peer | every rank <= peer |",
          "|---|---|---|---|---|---|---|---|---|"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--only", nargs="+", choices=PAIRS, default=PAIRS)
    ap.add_argument("--readme", action="store_true", help="write the table into bench/README.md")
    ap.add_argument("--readme-path", default=None, help="another file to write the section into")
    args = ap.parse_args()
    t0 = time.time()
    rows = list(HEADER)
    for world in args.worlds:
        for pair in args.only:
            rows.append(row(pair, world, args.steps))
            print(rows[-1], flush=True)
    met = sum(1 for r in rows[2:] if r.endswith("| yes |"))
    ran = sum(1 for r in rows[2:] if r.endswith(("| yes |", "| no |")))
    import torch

    text = (f"torch {torch.__version__}, gloo, 1 thread per rank; one launch per side, "
            f"{args.steps} steps each.\n\n" + "\n".join(rows) +
            f"\n\n{met} of {ran} rows hold on every rank (peak RSS <= the peer's). "
            f"{time.time() - t0:.0f} s in all.\n")
    print(text)
    if args.readme:
        from pathlib import Path

        extra = {"path": Path(args.readme_path)} if args.readme_path else {}
        write_section("peers-rss", "python bench/rss.py " + " ".join(sys.argv[1:]), text, **extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
