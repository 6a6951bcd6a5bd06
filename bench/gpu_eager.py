"""The ``eager`` section of bench/gpu_check.py: torchweave at world size 1 against eager PyTorch.

One seeded GPT, one batch and one AdamW factory, trained on the device two ways:
eager PyTorch (``loss = model(idx, tgt); loss.backward(); opt.step();
opt.zero_grad(set_to_none=True)``) and ``parallelize(plan="dp")`` at world size 1
with ``train_step``. A one-rank ``GroupCache`` needs no process group (the bf16
and sim sections build their one-rank modules the same way), so both sides run in
this process: no rank is spawned, whose start alone costs about 6 s on the GPU
machine. Timed steps alternate between the sides so that drift in clocks or load
falls on both alike; one step of each under torch.profiler shows where a gap is.
"""

from __future__ import annotations

import copy
import functools
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from gpu_sections import Ctx  # bench/gpu_sections.py (the script's folder is on sys.path)

OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-3)
"""The one optimizer factory of both sides (torch's defaults otherwise), as in bench/parallel.py."""
LOSS_TOLERANCE = 1e-3
"""Of the first loss: both sides run the same aten ops, so they agree to rounding; more
than this means torchweave trains differently."""
TOP_OPS = 8


@dataclass
class Side:
    """One way of training: ``step()`` trains one step and returns its loss."""

    name: str
    step: Callable[[], float]
    held: int = 0
    """Device bytes that building and warming up this side added (weights, optimizer state)."""
    step_peak: int = 0
    """The most device bytes a timed step allocated above what was allocated before it."""
    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)


def eager(ctx: Ctx) -> None:
    from torchweave.models.gpt import GPTConfig, num_params

    if ctx.smoke:
        cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, d_model=32)
        batch, warm, timed = (4, 32), 2, 5  # a loaded 2-core machine: up to 1 s a step
    else:
        cfg = GPTConfig(vocab_size=8192, block_size=512, n_layer=8, n_head=8, d_model=512)
        batch, warm, timed = (8, 512), 3, 10
    ctx.log(f"GPT (vocab {cfg.vocab_size}, {cfg.n_layer} layers, {cfg.n_head} heads, d={cfg.d_model}), "
            f"batch {batch[0]} x {batch[1]}, fp32, AdamW(lr=1e-3), on `{ctx.device}`: eager PyTorch "
            f"against `parallelize(plan=\"dp\")` at world size 1 (`train_step`), in this process. "
            f"{warm} warm-up steps each, then {timed} timed steps each, alternating, synchronized "
            f"around each; ratio torchweave / eager (below 1: torchweave faster).", "")
    sides: list[Side] = []
    with tempfile.TemporaryDirectory(prefix="tw-eager-") as code_dir:
        with ctx.part("build both sides from the same weights, warm up, time"):
            sides = _build(cfg, batch, ctx.device, code_dir, warm)
            for i in range(timed):
                if i and ctx.left() < 15:  # leave time for the lines and the profile
                    ctx.log(f"  - stopped after {i} timed steps each: section budget")
                    break
                for side in sides:
                    _run(side, ctx.device, timed=True)
            _log_timing(ctx, sides, weights=4 * num_params(cfg))
        if len(sides) == 2 and ctx.left() > 10:
            with ctx.part("torch.profiler: one step of each side"):
                _log_profile(ctx, sides, ctx.device)


def _build(cfg, batch: tuple[int, int], dev: torch.device, code_dir: str, warm: int) -> list[Side]:
    """Both sides from copies of one seeded model, each built and warmed up before the next,
    so that each one's ``held`` is its own."""
    from torchweave.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(cfg)
    data = torch.randint(0, cfg.vocab_size, (batch[0], batch[1] + 1),
                         generator=torch.Generator().manual_seed(0))
    idx, tgt = data[:, :-1].contiguous().to(dev), data[:, 1:].contiguous().to(dev)
    sides = []
    makers = (("eager", _eager_side),
              ("torchweave", functools.partial(_torchweave_side, code_dir=code_dir)))
    for name, make in makers:
        before = _allocated(dev)
        side = Side(name, make(copy.deepcopy(model).to(dev), idx, tgt))
        for _ in range(warm):
            _run(side, dev, timed=False)
        side.held = _allocated(dev) - before
        sides.append(side)
    return sides


def _eager_side(model: torch.nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> Callable[[], float]:
    opt = OPTIMIZER(model.parameters())

    def step() -> float:
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())  # train_step returns a float too: both wait for the loss

    return step


def _torchweave_side(model: torch.nn.Module, idx: torch.Tensor, tgt: torch.Tensor, *,
                     code_dir: str) -> Callable[[], float]:
    """Captured on the device, as a user on a GPU would: the graph holds the device's
    kernels (CUDA's attention, not the CPU's)."""
    from torchweave.parallel import parallelize
    from torchweave.runtime.groups import GroupCache

    one_rank = GroupCache(rank=0, world_size=1, timeout_s=30.0, device=idx.device)
    module = parallelize(model, (idx, tgt), plan="dp", groups=one_rank, optimizer=OPTIMIZER,
                         code_dir=code_dir)
    return lambda: module.train_step(idx, tgt)


def _allocated(dev: torch.device) -> int:
    return torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0


def _run(side: Side, dev: torch.device, *, timed: bool) -> None:
    """One step of ``side``: its loss; timed, also its wall time and its own peak memory
    (the peak counter is reset before each step, so the other side's steps do not count)."""
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    before = _allocated(dev)
    t0 = time.perf_counter()
    side.losses.append(side.step())
    if cuda:
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    if timed:
        side.times.append(seconds)
        if cuda:
            side.step_peak = max(side.step_peak, torch.cuda.max_memory_allocated(dev) - before)


def _log_timing(ctx: Ctx, sides: list[Side], *, weights: int) -> None:
    eager_side, tw = sides
    me, mt = statistics.median(eager_side.times), statistics.median(tw.times)
    diffs = [abs(a - b) for a, b in zip(eager_side.losses, tw.losses)]
    worst = max(diffs) / abs(eager_side.losses[0])
    ctx.log(f"  - median step: eager {me * 1e3:.2f} ms, torchweave {mt * 1e3:.2f} ms; "
            f"torchweave / eager = {mt / me:.3f} (below 1: torchweave faster)",
            f"  - losses {eager_side.losses[0]:.4f} -> {eager_side.losses[-1]:.4f} over "
            f"{len(diffs)} steps; largest |eager - torchweave| {max(diffs):.2e} "
            f"({worst:.2e} of the first loss; tolerance {LOSS_TOLERANCE:g})")
    if ctx.device.type == "cuda":
        peaks = "; ".join(f"{s.name} {_gib(s.held + s.step_peak)} GiB ({_gib(s.held)} + "
                          f"{_gib(s.step_peak)})" for s in sides)
        ctx.log(f"  - peak memory (held after warm-up + a timed step's largest rise): {peaks}",
                f"    (the weights alone: {_gib(weights)} GiB; torchweave's held memory includes "
                f"the model given to `parallelize`, which the module keeps alive)")
    assert worst <= LOSS_TOLERANCE, "the two sides do not train alike"


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f}"


def _log_profile(ctx: Ctx, sides: list[Side], dev: torch.device) -> None:
    """The ops with the most self time in one profiled step of each side, side by side."""
    what = "self CUDA" if dev.type == "cuda" else "self CPU"
    tops, totals = [], []
    for side in sides:
        top, total = profile_step(side, dev)
        tops.append(top)
        totals.append(total)
    ctx.log(f"  - {what} time of the profiled step ({'all kernels' if dev.type == 'cuda' else 'all ops'}): "
            + "; ".join(f"{s.name} {t:.2f} ms (timed median {statistics.median(s.times) * 1e3:.2f} ms)"
                        for s, t in zip(sides, totals)))
    if not any(totals):
        ctx.log("  - the profiler recorded no op times here (CUPTI unavailable?)")
    ctx.log("", f"| # | eager op | {what} ms | calls | torchweave op | {what} ms | calls |",
            "|---|---|---|---|---|---|---|")
    blank = ("", 0.0, 0)
    for i in range(TOP_OPS):
        cells = []
        for top in tops:
            name, ms, calls = top[i] if i < len(top) else blank
            cells += [f"`{name[:60]}`" if name else "", f"{ms:.3f}" if name else "",
                      str(calls) if name else ""]
        ctx.log(f"| {i + 1} | " + " | ".join(cells) + " |")
    ctx.log("")


def profile_step(side, dev: torch.device, top: int = TOP_OPS) -> tuple[list[tuple[str, float, int]], float]:
    """(op, self ms, calls) of the ``top`` ops with the most self time in one step of ``side``
    (anything with a ``step()``; bench/profile_dp.py profiles its ranks with it), and the
    step's total. On CUDA an op's self time is that of the kernels it launched (the profiler
    charges each kernel to its op and also lists it on its own), so ops are ranked and the
    kernels summed, each kernel counted once; on the CPU, self CPU time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = dev.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        side.step()
        if cuda:
            torch.cuda.synchronize(dev)
    events = prof.key_averages()
    if cuda:
        def self_us(e) -> float:
            return e.self_device_time_total

        ops = [e for e in events if e.device_type == DeviceType.CPU]
        total = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA
                    and not getattr(e, "is_user_annotation", False))
    else:
        def self_us(e) -> float:
            return e.self_cpu_time_total

        ops = list(events)
        total = sum(map(self_us, ops))
    ranked = sorted((e for e in ops if self_us(e) > 0), key=self_us, reverse=True)[:top]
    return [(e.key, self_us(e) / 1e3, e.count) for e in ranked], total / 1e3


__all__ = ["eager", "profile_step"]
