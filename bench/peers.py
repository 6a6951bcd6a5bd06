"""torchweave against PyTorch's own parallel APIs: every pair in one job, at 2, 4 and 8 ranks.

Each row races one torchweave plan against the PyTorch feature that does the same job,
reusing the benches that already build both sides (nothing here builds a model):

- ``dp`` vs DDP, ``zero3`` vs FSDP2, ``zero2`` vs FSDP2 with ``reshard_after_forward=False``,
  ``tp`` vs DTensor TP (bench/parallel.py: a GPT, and an MLP stack for tp);
- ``gpipe``, ``1f1b``, ``interleaved``, ``zb`` vs torch.distributed.pipelining's
  ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B`` and
  ``ScheduleInterleavedZeroBubble`` on one stage per rank (ZB-H1's order), on the same
  stages (bench/pipeline.py: 8 residual MLP blocks, m = 8);
- ``ppdp``: ``1f1b`` and ``interleaved`` over pp = world/2 x dp = 2 vs the same schedules
  over DDP-wrapped stages (bench/pipeline_dp.py);
- ``trainer``: ``torchweave train``'s loop vs a bare ``backward_step``/``clip``/
  ``optimizer_step`` loop over the same dp module (bench/trainer.py);
- ``first``: time to first step, ``dp`` vs DDP, each its own launch, from the launch to
  the end of every rank's first step (bench/first_step.py); the columns hold seconds x
  1000 (ms), the target is the peer's plus 1 s.

Every launch alternates the timed steps of both sides after a barrier (trainer: blocks of
steps), so load from other jobs falls on both alike, and gives one ratio torchweave ms /
peer ms (rank 0's medians; below 1 means torchweave is faster). A row is one pair at one
world size over ``--launches`` separate launches: the median ratio and its min-max, each
side's median ms, the largest loss difference seen (losses are checked to agree within
1e-4 relative), and memory per rank where the bench measures it (torchweave MiB / peer
MiB): ``state``, parameters + gradients + AdamW state held, the larger of after forward
and after backward (rank 0; FSDP2's gathered parameters count while it keeps them); ``act``,
the peak bytes saved for backward, the largest rank's. Targets: ratio <= 1.00 (trainer:
<= 1.02) and memory <= the peer's. A pair that cannot run at a world size, or a side that
fails, gets a row that says so; the run goes on.

Run: python bench/peers.py [--worlds 2 4 8] [--launches 3] [--steps N] [--only dp zero3 ...]
                           [--quick] [--readme [--readme-path PATH]]

Resident memory (peak RSS per rank) is bench/rss.py's: both sides of a pair share one
process here, and a process has one resident set, so it runs each side in its own launch.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import re
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

import first_step  # bench/first_step.py (the script's folder is on sys.path)
import parallel  # bench/parallel.py
import pipeline  # bench/pipeline.py
import pipeline_dp  # bench/pipeline_dp.py
from readme_section import README, write_section

MICRO = 8
"""Micro-batches per pipeline (per replica for ppdp), as bench/pipeline.py's default."""
LOSS_RTOL = 1e-4
TW_ONLY = "none: torchweave only"
GROUPS = ["dp", "zero3", "zero2", "tp", "gpipe", "1f1b", "interleaved", "zb", "ppdp", "trainer",
          "first"]


@dataclass
class Budget:
    steps: int
    warmup: int
    trainer_block: int
    timeout_s: float = 120.0


@dataclass
class Launch:
    """One launch of one pair: each side's median ms, or why it has none."""

    tw_ms: float | None = None
    peer_ms: float | None = None
    loss_diff: float | None = None
    loss_ok: bool = True
    mem: list[tuple[float, float]] = field(default_factory=list)  # (tw, peer) MiB per rank
    errors: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        return self.tw_ms / self.peer_ms if self.tw_ms and self.peer_ms else None


@dataclass(frozen=True)
class Pair:
    name: str
    group: str  # what --only picks
    peer: str
    run: Callable[[int, Budget], Launch]
    skip: Callable[[int], str | None] = lambda world: None
    target: float = 1.00
    mem_kind: str = ""
    slack_ms: float | None = None
    """An additive target instead of a ratio: torchweave ms <= peer ms + this."""

    def goal(self) -> str:
        return f"<= peer + {self.slack_ms / 1e3:g} s" if self.slack_ms is not None \
            else f"<= {self.target:.2f}x"


# --------------------------------------------------------------------------- one launch of a kind


def _side_error(name: str, side: dict[str, Any]) -> str | None:
    if "error" not in side:
        return None
    if "traceback" in side:
        print(side["traceback"], file=sys.stderr, flush=True)
    return f"{name} failed: {side['error']}"


def _losses(launch: Launch, tw: list[float], peer: list[float]) -> None:
    pairs = [(a, b) for a, b in zip(tw, peer) if not (math.isnan(a) or math.isnan(b))]
    if pairs:
        launch.loss_diff = max(abs(a - b) for a, b in pairs)
        launch.loss_ok = all(abs(a - b) <= LOSS_RTOL * max(1.0, abs(b)) for a, b in pairs)


def _fill(launch: Launch, tw: dict[str, Any], peer: dict[str, Any], loss_tw: dict[str, Any],
          loss_peer: dict[str, Any]) -> Launch:
    """Each side's ms and errors, and the losses of the rank that holds them."""
    launch.errors += [e for e in (_side_error("torchweave", tw), _side_error("peer", peer)) if e]
    launch.tw_ms, launch.peer_ms = tw.get("ms"), peer.get("ms")
    _losses(launch, loss_tw.get("losses", []), loss_peer.get("losses", []))
    return launch


def run_parallel(bench: str, world: int, b: Budget) -> Launch:
    res = parallel.launch(bench, world, b.warmup, b.steps, None, b.timeout_s)
    tw, pt = res["tw"], res["torch"]
    launch = _fill(Launch(), tw, pt, tw, pt)
    if "mem" in tw and "mem" in pt:
        launch.mem = [(tw["mem"] / 2**20, pt["mem"] / 2**20)]
    return launch


def run_pipeline(schedule: str, world: int, b: Budget) -> Launch:
    results = pipeline.measure(schedule, world, MICRO, b.warmup, b.steps, zb_peer=zb_peer())
    if "torch" not in results[0]:  # zb without a peer in this torch
        results = [{**r, "torch": {}} for r in results]
    launch = _fill(Launch(), results[0]["tw"], results[0]["torch"], results[-1]["tw"],
                   results[-1]["torch"])
    if all("saved_mb" in r["tw"] and "saved_mb" in r["torch"] for r in results):
        launch.mem = [(r["tw"]["saved_mb"], r["torch"]["saved_mb"]) for r in results]
    return launch


def run_ppdp(schedule: str, world: int, b: Budget) -> Launch:
    results = pipeline_dp.measure(schedule, MICRO, b.warmup, b.steps, pp=world // 2, dp=2,
                                  end=False)
    return _fill(Launch(), results[0]["tw"], results[0]["torch"], results[-1]["tw"],
                 results[-1]["torch"])


def run_trainer(world: int, b: Budget) -> Launch:
    import trainer  # bench/trainer.py (imports the trainer and its logging: only when asked)

    res = trainer.measure("dp", world, steps=b.trainer_block, repeats=max(2, b.steps))
    return Launch(tw_ms=statistics.median(res["trainer"]) * 1e3,
                  peer_ms=statistics.median(res["bare"]) * 1e3)


# --------------------------------------------------------------------------- which pairs run where


def run_first(world: int, b: Budget) -> Launch:
    """Both sides, one launch each (which goes first alternates with the launches made)."""
    order = ("ddp", "tw") if run_first.calls % 2 == 0 else ("tw", "ddp")
    run_first.calls += 1
    got = {side: first_step.launch(side, world, b.timeout_s) for side in order}
    launch = Launch(tw_ms=got["tw"]["s"] * 1e3, peer_ms=got["ddp"]["s"] * 1e3)
    _losses(launch, [got["tw"]["loss"]], [got["ddp"]["loss"]])
    return launch


run_first.calls = 0  # type: ignore[attr-defined]


def zb_peer() -> bool:
    """torch.distributed.pipelining has a zero-bubble schedule that runs one stage per rank."""
    import torch.distributed.pipelining as pp

    return hasattr(pp, "ScheduleInterleavedZeroBubble")


def pipeline_skip(schedule: str, world: int) -> str | None:
    stages = world * (2 if schedule == "interleaved" else 1)
    if pipeline.BLOCKS % stages:
        return f"needs {stages} stages of whole blocks; the model has {pipeline.BLOCKS} blocks"
    return None


def ppdp_skip(schedule: str, world: int) -> str | None:
    if world < 4 or world % 2:
        return "pp x dp needs pp >= 2 and dp = 2: at least 4 ranks, an even number"
    return pipeline_skip(schedule, world // 2)


def pairs() -> list[Pair]:
    peers = {"dp": "DDP", "zero3": "FSDP2", "zero2": "FSDP2, reshard_after_forward=False",
             "tp": "DTensor TP"}
    out = [Pair(b, b, peers[b], functools.partial(run_parallel, b),
                mem_kind="state" if b.startswith("zero") else "") for b in peers]
    pipes = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
             "interleaved": "ScheduleInterleaved1F1B",
             "zb": "ScheduleInterleavedZeroBubble, 1 stage/rank" if zb_peer() else
                   TW_ONLY}
    out += [Pair(s, s, peer, functools.partial(run_pipeline, s),
                 functools.partial(pipeline_skip, s), mem_kind="act") for s, peer in pipes.items()]
    out += [Pair(f"ppdp {s}", "ppdp", f"{pipes[s]} over DDP", functools.partial(run_ppdp, s),
                 functools.partial(ppdp_skip, s)) for s in ("1f1b", "interleaved")]
    out.append(Pair("trainer", "trainer", "bare train_step loop, plan dp", run_trainer,
                    target=1.02))
    out.append(Pair("first step", "first", "DDP (launch to end of step 1)", run_first,
                    slack_ms=1000.0))
    return out


# --------------------------------------------------------------------------- rows


HEADER = ["| pair | peer | ranks | torchweave ms | peer ms | ratio (median) | range | "
          "max loss diff | memory MiB/rank tw / peer | target | notes |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]


def measure(pair: Pair, world: int, launches: int, budget: Budget) -> list[Launch]:
    out = []
    for _ in range(launches):
        try:
            out.append(pair.run(world, budget))
        except Exception as e:  # noqa: BLE001 - a rank died: this launch is lost, the run goes on
            traceback.print_exc(file=sys.stderr)
            out.append(Launch(errors=[f"launch failed: {_cause(e)}"[:200]]))
    return out


def _cause(e: Exception) -> str:
    """The first exception a failed rank's traceback names (in a chained traceback, the
    root cause comes first), else the error's own first line."""
    for line in getattr(e, "traceback", "").splitlines():
        m = re.match(r"(\w+(?:Error|Exception)): (.+)", line.strip())
        if m:
            return f"rank {e.rank}: {m.group(1)}: {m.group(2)}"
    return f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0]


def _mem(pair: Pair, done: list[Launch]) -> tuple[str, str | None]:
    """The memory cell (the largest rank of each side) and, if over the peer's, why."""
    mems = [l.mem for l in done if l.mem]
    if not mems:
        return "—", None
    per_rank = [(statistics.median(m[r][0] for m in mems), statistics.median(m[r][1] for m in mems))
                for r in range(len(mems[0]))]
    tw, peer = max(t for t, _ in per_rank), max(p for _, p in per_rank)
    over = [r for r, (t, p) in enumerate(per_rank) if t > p + 0.05]
    return (f"{tw:.1f} / {peer:.1f} ({pair.mem_kind})",
            f"memory over the peer's on rank {', '.join(map(str, over))}" if over else None)


def verdict(pair: Pair, world: int, done: list[Launch]) -> tuple[str, str | None]:
    """The row, and why it misses its target (None: it meets it)."""
    ratios = [l.ratio for l in done if l.ratio is not None]
    errors = sorted({e for l in done for e in l.errors})
    tw = [l.tw_ms for l in done if l.tw_ms]
    peer = [l.peer_ms for l in done if l.peer_ms]
    diffs = [l.loss_diff for l in done if l.loss_diff is not None]
    mem, mem_miss = _mem(pair, done)
    notes = [e.replace("|", "/") for e in errors]
    if len(ratios) < len(done):
        notes.append(f"{len(done) - len(ratios)} of {len(done)} launches without a ratio")
    if pair.peer == TW_ONLY:
        notes.append("this torch has no zero-bubble schedule that runs 1 stage per rank")
    loss_ok = all(l.loss_ok for l in done)
    if not loss_ok:
        notes.append("losses DIFFER")
    med = statistics.median(ratios) if ratios else None
    ms = lambda xs: f"{statistics.median(xs):.1f}" if xs else "failed"  # noqa: E731
    row = (f"| {pair.name} | {pair.peer} | {world} | {ms(tw)} | "
           f"{ms(peer) if pair.peer != TW_ONLY else '—'} | "
           f"{f'{med:.2f}x' if med is not None else '—'} | "
           f"{f'{min(ratios):.2f}–{max(ratios):.2f}x' if ratios else '—'} | "
           f"{f'{max(diffs):.1e}' if diffs else '—'} | {mem} | {pair.goal()} | "
           f"{'; '.join(notes)} |")
    if med is None:
        miss = ["no peer" if pair.peer == TW_ONLY else "no ratio"]
    elif pair.slack_ms is not None:  # the median of each launch's difference (as first_step.py)
        over = statistics.median(l.tw_ms - l.peer_ms for l in done if l.tw_ms and l.peer_ms)
        miss = [f"{over / 1e3:+.1f} s over the peer"] if over > pair.slack_ms else []
    else:
        miss = [f"ratio {med:.2f}x"] if med > pair.target else []
    miss += [m for m in (mem_miss, None if loss_ok else "losses differ") if m]
    return row, ", ".join(miss) or None


def skipped(pair: Pair, world: int, why: str) -> str:
    return (f"| {pair.name} | {pair.peer} | {world} | — | — | — | — | — | — | "
            f"{pair.goal()} | not run: {why} |")


# --------------------------------------------------------------------------- the job


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=None,
                    help="world sizes (default 2 4 8; quick: 2)")
    ap.add_argument("--launches", type=int, default=None,
                    help="launches per pair and world size (default 3; quick: 1)")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per side per launch (default 6; quick: 2); trainer: blocks")
    ap.add_argument("--only", nargs="+", choices=GROUPS, default=GROUPS)
    ap.add_argument("--quick", action="store_true",
                    help="smoke: 1 warm-up, 2 timed steps, trainer blocks of 2 steps, "
                         "2 ranks and 1 launch unless given")
    ap.add_argument("--readme", action="store_true", help="write the table into bench/README.md")
    ap.add_argument("--readme-path", type=Path, default=README,
                    help="the README that --readme writes (default bench/README.md)")
    ap.add_argument("--timeout", type=float, default=120.0, help="collective time-out, s")
    ap.add_argument("--section", default="peers",
                    help="the bench/README.md section --readme writes (default peers; e.g. "
                         "peers-8 for a run of 8 ranks on its own)")
    args = ap.parse_args(argv)
    args.worlds = args.worlds or ([2] if args.quick else [2, 4, 8])
    args.launches = args.launches or (1 if args.quick else 3)
    args.steps = args.steps or (2 if args.quick else 6)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    budget = Budget(steps=args.steps, warmup=1 if args.quick else 2,
                    trainer_block=2 if args.quick else 10, timeout_s=args.timeout)
    chosen = [p for p in pairs() if p.group in args.only]
    if "first" in args.only:
        first_step.compile_bytecode()  # as an installed package has it (see there)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores, gloo, 1 thread per rank; "
          f"{args.launches} launch(es) per row, {args.steps} timed steps per side", flush=True)
    print("\n".join(HEADER), flush=True)
    rows, misses, t0 = [], [], time.perf_counter()
    for world in args.worlds:
        for pair in chosen:
            why = pair.skip(world)
            if why:
                rows.append(skipped(pair, world, why))
            else:
                row, miss = verdict(pair, world, measure(pair, world, args.launches, budget))
                rows.append(row)
                if miss:
                    misses.append(f"{pair.name} at {world} ({miss})")
            print(rows[-1], flush=True)
    elapsed = time.perf_counter() - t0
    run = sum(1 for r in rows if "| not run:" not in r)
    summary = (f"{run - len(misses)} of {run} rows meet their target (ratio <= target, or time "
               f"<= the peer's + slack; memory <= the peer's, losses agree)" + (f"; not: {'; '.join(misses)}" if misses else "")
               + f". {len(rows) - run} not run. {elapsed:.0f} s in all.")
    print(f"\n{summary}", flush=True)
    if args.readme:
        command = "python bench/peers.py " + " ".join(argv if argv is not None else sys.argv[1:])
        head = (f"torch {torch.__version__}, {os.cpu_count()} CPU cores; {args.launches} "
                f"launch(es) per row, {args.steps} timed steps per side per launch.\n\n")
        write_section(args.section, command.strip(), head + "\n".join(HEADER + rows) + "\n\n"
                      + summary + "\n", path=args.readme_path)
        print(f"wrote the {args.section} section of {args.readme_path}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
