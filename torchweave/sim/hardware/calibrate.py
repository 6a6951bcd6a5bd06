"""Measure this machine for the simulator: what ``torchweave calibrate`` runs.

Matmul and copy rates per rank, and gloo collectives at a few sizes and rank
counts, fitted to an alpha-beta link model. With more ranks than cores, also
what sharing costs: the fraction of its share of a core a rank reaches with
every rank computing at once, and the seconds each collective waits for ranks
that arrive out of step. :func:`calibrate` returns the result as a
:class:`~torchweave.sim.hardware.cluster.Cluster` with ``rates: measured``.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from torchweave.errors import Problem, TorchweaveError
from torchweave.sim.hardware.cluster import Cluster
from torchweave.sim.hardware.devices import Link, Peak, lookup
from torchweave.sim.hardware.profile import median_time


def measure_matmul(sizes: list[int], reps: int = 3) -> float:
    """FLOP/s: the best (over sizes) median of fp32 ``n×n @ n×n``."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        t = median_time(lambda: torch.mm(a, b), reps, warmup=True)
        best = max(best, 2 * n**3 / t)
    return best


def measure_bandwidth(nbytes: int = 256 * 2**20, reps: int = 3) -> float:
    """Bytes/s of a large copy (read + write)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    t = median_time(lambda: dst.copy_(src), reps, warmup=True)
    return 2 * nbytes / t


def collective_bench(ctx, sizes: list[int], reps: int) -> list[tuple[str, int, int, float]]:
    """On each rank: median seconds of all_reduce and all_gather (``size``: bytes
    reduced, or bytes gathered in all)."""
    import torch.distributed as dist

    p = ctx.world_size
    out = []
    warm = torch.ones(max(sizes) // 4)
    for _ in range(3):  # first collectives pay connection set-up
        dist.all_reduce(warm)
    for size in sizes:
        x = torch.ones(size // 4)
        part = torch.ones(size // 4 // p)
        parts = [torch.empty_like(part) for _ in range(p)]
        for name, fn in (("all_reduce", lambda: dist.all_reduce(x)),
                         ("all_gather", lambda: dist.all_gather(parts, part))):
            times = []
            fn()
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            out.append((name, p, size, statistics.median(times)))
    return out


def shared_bench(ctx, threads: int, n: int, reps: int) -> tuple[float, float]:
    """On each rank, every rank at once: fp32 matmul FLOP/s (``n×n``), and the seconds a
    one-float all-reduce waits when the ranks come to it from computing
    (:func:`~torchweave.sim.hardware.profile.profile_sync`)."""
    import torch.distributed as dist

    from torchweave.sim.hardware.profile import OpProfiles, profile_sync

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    dist.barrier()
    t = median_time(lambda: torch.mm(a, b), reps, warmup=True)
    wait = profile_sync(OpProfiles("calibrate"), ranks=ctx.world_size,
                        all_reduce=lambda x: dist.all_reduce(x), reps=reps)
    return 2 * n**3 / t, wait


def fit_alpha_beta(samples: list[tuple[str, int, int, float]]) -> tuple[float, float]:
    """Least squares α (s per step) and β (bytes/s) of the ring models:
    all_reduce 2(p-1)α + 2(p-1)/p·B/β, all_gather (p-1)α + (p-1)/p·B/β."""
    rows, ys = [], []
    for name, p, size, t in samples:
        k = 2 if name == "all_reduce" else 1
        rows.append([k * (p - 1), k * (p - 1) / p * size])
        ys.append(t)
    sol = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64),
                             torch.tensor(ys, dtype=torch.float64)[:, None]).solution[:, 0]
    alpha, inv_beta = float(sol[0]), float(sol[1])
    if inv_beta <= 0:  # latency-dominated noise: fall back to the largest message
        name, p, size, t = max(samples, key=lambda s: s[2])
        inv_beta = t / ((2 if name == "all_reduce" else 1) * (p - 1) / p * size)
    return max(alpha, 1e-6), 1.0 / inv_beta


RunRanks = Callable[..., list[Any]]
"""``run_ranks(fn, world_size, timeout_s, *args)``: ``fn(ctx, *args)`` on ``world_size``
local gloo ranks, each rank's result in a list (the command passes the runtime's ``spawn``;
the simulator sits below the runtime and does not start processes itself)."""


def calibrate(world_sizes: Sequence[int], run_ranks: RunRanks, *, quick: bool = False,
              say: Callable[[str], None] = lambda line: None) -> Cluster:
    """Measure this machine (matmul and copy rates per rank, gloo collectives at a few sizes
    over ``world_sizes`` ranks, what sharing cores costs) and return it as a cluster whose
    device has ``rates: measured``; ``say`` gets one line per measurement."""
    world_sizes = [2] if quick else sorted(set(world_sizes))
    if any(w < 2 for w in world_sizes):
        raise TorchweaveError(Problem(obj="--world-sizes", value=str(world_sizes),
                                      rule="collectives need at least 2 ranks", fix="e.g. 2 4"))
    ranks = max(world_sizes)
    sizes = [2**20] if quick else [64 * 2**10, 2**20, 4 * 2**20]
    threads = max(1, (os.cpu_count() or 1) // ranks)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops = measure_matmul([512, 1024] if quick else [512, 1024, 2048])
        bandwidth = measure_bandwidth(64 * 2**20 if quick else 256 * 2**20)
    finally:
        torch.set_num_threads(before)
    # More ranks than cores: each rank gets a share of a core, and less than its share
    # where they contend (measured with every rank computing at once); a collective
    # then also waits for its last rank to be scheduled.
    share = min(1.0, (os.cpu_count() or 1) / (ranks * threads))
    efficiency, wait = 1.0, 0.0
    if share < 1.0:
        got = run_ranks(shared_bench, ranks, 120.0, threads, 512, 5 if quick else 9)
        together = min(r[0] for r in got)  # the slowest rank's rate
        efficiency = min(1.0, together / (flops * share))
        wait = statistics.median(r[1] for r in got)
    flops, bandwidth = flops * share * efficiency, bandwidth * share * efficiency
    say(f"per rank ({threads} thread{'s' * (threads > 1)}, {share:.2g} of a core's time "
        f"at {ranks} ranks, {efficiency:.2f} of that reached): matmul fp32 "
        f"{flops / 1e9:.3g} GFLOP/s, copy {bandwidth / 1e9:.3g} GB/s; each collective "
        f"waits {wait * 1e3:.3g} ms for ranks out of step")
    samples = []
    for w in world_sizes:
        got = run_ranks(collective_bench, w, 60.0, sizes, 3 if quick else 5)
        for i, (name, p, size, _) in enumerate(got[0]):
            t = max(r[i][3] for r in got)  # the slowest rank's median
            samples.append((name, p, size, t))
            say(f"  {name:10s} {p} ranks {size / 2**10:>6.0f} KiB: {t * 1e3:.3g} ms")
    alpha, beta = fit_alpha_beta(samples)
    say(f"alpha-beta fit: alpha {alpha * 1e6:.3g} us, beta {beta / 1e9:.3g} GB/s")
    base = lookup("CPU-2core")
    mem = mem_total() or base.memory_bytes * base.node_size
    device = dataclasses.replace(
        base, name=f"CPU-{platform.node() or 'local'}-measured",
        description=f"this machine, {os.cpu_count()} cores, one gloo rank per "
                    f"{threads} thread{'s' * (threads > 1)}; measured by torchweave calibrate",
        peak=Peak(fp32=flops), memory_bytes=mem // ranks, memory_bandwidth=bandwidth,
        intra=Link(bandwidth=beta, latency=alpha, kind="gloo over loopback (measured)"),
        node_size=ranks, rates="measured", comm_overlaps_compute=False,
        cores=None,  # the rates above are a rank's share already
        shared_efficiency=efficiency, shared_wait=wait, collective_wait=wait,
        sources=(f"measured on {platform.node() or 'this machine'}, "
                 f"{datetime.date.today().isoformat()}: per rank fp32 matmul median "
                 f"{flops / 1e9:.3g} GFLOP/s, {bandwidth / 1e9:.3g} GB/s copy, gloo "
                 f"all_reduce/all_gather at {', '.join(str(s) for s in sizes)} bytes "
                 f"over {world_sizes} ranks, alpha-beta least squares; at {ranks} ranks on "
                 f"{os.cpu_count()} cores: {efficiency:.3g} of the fair share reached, "
                 f"{wait * 1e3:.3g} ms waited per collective",))
    return Cluster(device=device, nodes=1, devices_per_node=ranks, intra=device.intra,
                   inter=device.inter, name=f"{ranks}x{device.name}")


def mem_total() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


__all__ = ["calibrate", "collective_bench", "fit_alpha_beta", "measure_bandwidth", "measure_matmul",
           "shared_bench"]
