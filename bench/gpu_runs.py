"""Sections of bench/gpu_check.py that launch ranks or time training steps."""

from __future__ import annotations

import statistics
import tempfile
import time

import torch

from gpu_sections import Ctx, _built  # bench/gpu_sections.py (the script's folder is on sys.path)

CUDA_TOLERANCE = 1e-4
"""fp32 on CUDA against the one-device reference, which runs on the CPU: other
kernels, other summation orders (TF32 stays off, PyTorch's default)."""


def _verify(ctx: Ctx, cases, *, world_size: int, launch, tolerance: float,
            separate: bool = False, per_launch: int = 6) -> None:
    """Compile each case on its own (a policy that does not apply is a line, not a failure
    of the rest), verify the rest ``per_launch`` at a time (one launch each if a launch
    fails, or with ``separate``), a table row per case, so a launch cut off by the budget
    leaves the rows before it."""
    from torchweave.parallel import compile_plan
    from torchweave.verify import run_compiled

    ctx.log("", *_HEADER)
    ready, graphs = [], {}  # one capture per model and shape, as verify_many shares them
    for case in cases:
        try:
            ready.append((case, compile_plan(case.model, case.inputs, case.plan,
                                             world_size=world_size,
                                             micro_batches=case.config.grad_accum,
                                             precision=case.config.precision, graphs=graphs)))
        except Exception as exc:  # noqa: BLE001 - recorded as not applicable
            ctx.log(f"| {case.name} | does not apply at world size {world_size}: "
                    f"`{(str(exc).strip().splitlines() or [''])[0][:160]}` | | | | |")
    size = 1 if separate else per_launch
    groups = [ready[i:i + size] for i in range(0, len(ready), size)]
    bad = []
    while groups:
        group = groups.pop(0)
        if not group:
            continue
        if ctx.left() < 10:
            bad += [f"{c.name}: not run (section budget)" for c, _ in group]
            continue
        try:
            reports = run_compiled([c for c, _ in group], [k for _, k in group], launch=launch,
                                   tolerance=tolerance)
        except Exception as exc:  # noqa: BLE001 - the launch failed: one launch per case
            # a failed rank's own error is its traceback's last line, not the header
            # a failed rank's own error: its traceback's last unindented line (a torchweave
            # error's problem lines are indented below it)
            lines = [x for x in (getattr(exc, "traceback", None) or "").splitlines()
                     if x.strip() and not x[0].isspace()]
            first = (lines[-1] if lines else (str(exc).strip().splitlines() or [""])[0])[:200]
            if len(group) == 1:
                bad.append(f"{group[0][0].name}: launch failed: {type(exc).__name__}: {first}")
                ctx.log(f"| {group[0][0].name} | **launch failed**: `{first}` | | | | |")
            else:
                ctx.log(f"| ({len(group)} cases) | one launch failed (`{first}`): one launch each | | | | |")
                groups = [[g] for g in group] + groups
            continue
        for (case, _), r in zip(group, reports):
            if r.error:
                ctx.log(f"| {case.name} | **FAILED**: `{r.error[:240]}` | | | | |")
            else:
                comm = ", ".join(f"{k} {n}" for k, n in sorted(r.comm.items())) or "none"
                ctx.log(f"| {case.name} | {'ok' if r.ok else '**MISMATCH**'} | {r.loss_diff:.2e} | "
                        f"{r.max_grad_diff:.2e} | {r.max_param_diff:.2e} | {comm} |")
            if not r.ok:
                bad.append(case.name)
    ctx.log("")
    assert not bad, "; ".join(bad)


_HEADER = ("| plan | result | loss diff | grad diff | param diff | rank 0's communication |",
           "|---|---|---|---|---|---|")


def nccl_policies(ctx: Ctx) -> None:
    from torchweave.policies import POLICIES
    from torchweave.runtime.launch import LaunchConfig
    from torchweave.verify import Case

    backend = "gloo" if ctx.smoke else "nccl"
    names = ["dp"] if ctx.smoke else list(POLICIES)
    model, inputs = _built("gpt-tiny")
    cases = [Case(model, inputs, p, steps=2, name=f"gpt-tiny/{p}") for p in names]
    if not ctx.smoke:
        llama, li = _built("llama-tiny")
        cases += [Case(llama, li, p, steps=2, name=f"llama-tiny/{p}") for p in ("dp", "tp", "zero3")]
    what = "dp (the stand-in)" if ctx.smoke else "Every built-in policy"
    ctx.log(f"{what} at world size 1 on {backend} ({ctx.device.type} tensors), "
            f"2 steps, against the one-device run on the CPU; relative tolerance "
            f"{CUDA_TOLERANCE:g}.")
    with ctx.part(f"policies on {backend}"):
        _verify(ctx, cases, world_size=1, tolerance=CUDA_TOLERANCE,
                launch=LaunchConfig(world_size=1, backend=backend, timeout_s=60.0))


def gloo_cuda(ctx: Ctx) -> None:
    from torchweave.runtime.launch import LaunchConfig
    from torchweave.verify import Case

    model, inputs = _built("gpt-tiny")
    names = ["dp", "zero1", "zero2", "zero3", "tp", "sp", "1f1b"]
    ctx.log("Two gloo ranks with CUDA tensors, both on cuda:0 (`LaunchConfig(device='cuda')`); "
            "one launch per plan, so a collective gloo does not support for CUDA tensors fails "
            "only its own line.")
    launch = LaunchConfig(world_size=2, backend="gloo", device="cuda", timeout_s=30.0)
    cases = [Case(model, inputs, p, steps=2, name=f"gpt-tiny/{p}") for p in names]
    with ctx.part("gloo with CUDA tensors"):
        _verify(ctx, cases, world_size=2, tolerance=CUDA_TOLERANCE, launch=launch, separate=True)


def bf16(ctx: Ctx) -> None:
    from torchweave.runtime.executor import StepConfig
    from torchweave.runtime.launch import LaunchConfig
    from torchweave.verify import BF16_TOLERANCE, Case

    if not ctx.smoke:
        model, inputs = _built("llama-tiny")
        bf = StepConfig(precision="bf16")
        # not zero3: at one rank it fails in fp32 too (see bench/README.md)
        cases = [Case(model, inputs, p, config=bf, name=f"llama-tiny/{p}/bf16") for p in ("dp", "1f1b")]
        ctx.log(f"bf16 on NCCL at world size 1 against the one-device bf16 run (the runtime's "
                f"casts, on the CPU), relative tolerance {BF16_TOLERANCE:g}.")
        with ctx.part("bf16 plans against the bf16 reference"):
            _verify(ctx, cases, world_size=1, tolerance=BF16_TOLERANCE,
                    launch=LaunchConfig(world_size=1, backend="nccl", timeout_s=60.0))
        ctx.log("")
    steps = 3 if ctx.smoke else 30
    with ctx.part(f"bf16 against fp32: {steps} steps of gpt-tiny on {ctx.device.type}"):
        curves = {p: _curve(p, steps, ctx.device) for p in ("fp32", "bf16")}
        diffs = [abs(a - b) / abs(a) for a, b in zip(curves["fp32"], curves["bf16"])]
        ctx.log(f"  - losses fp32 {curves['fp32'][0]:.4f} -> {curves['fp32'][-1]:.4f}, "
                f"bf16 {curves['bf16'][0]:.4f} -> {curves['bf16'][-1]:.4f}; largest relative "
                f"difference {max(diffs):.2e} (want > 0: bf16 really ran; < 5e-2: it trains alike)")
        assert 0 < max(diffs) < 5e-2


def _curve(precision: str, steps: int, dev: torch.device) -> list[float]:
    """Losses of ``steps`` dp steps at world size 1 (no process group) from the same weights."""
    from torchweave.parallel import compile_plan
    from torchweave.runtime.executor import RankModule, StepConfig
    from torchweave.runtime.groups import GroupCache

    model, inputs = _built("gpt-tiny")
    with tempfile.TemporaryDirectory() as tmp:
        comp = compile_plan(model, inputs, "dp", world_size=1, code_dir=tmp, precision=precision)
        group_cache = GroupCache(rank=0, world_size=1, timeout_s=30.0, device=dev)
        module = RankModule(comp.programs[0], comp.code_paths[0], comp.state, group_cache,
                            config=StepConfig(precision=precision))
        return [module.train_step(*inputs) for _ in range(steps)]


def sim(ctx: Ctx) -> None:
    """Op profiles on the device; predicted against measured step time."""
    from torchweave.models.gpt import GPTConfig

    if ctx.smoke:
        cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, d_model=32)
        batch, cluster, precisions, label = (4, 32), "1xCPU-2core", ("fp32",), "a tiny GPT"
    else:
        cfg = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, d_model=768)
        batch, cluster, precisions, label = (8, 1024), "1xH200-141GB-SXM", ("fp32", "bf16"), \
            "GPT-2 small (124M: 12 layers, d=768, vocab 50257)"
    ctx.log(f"{label}, batch {batch[0]} x {batch[1]}, plan dp on 1 rank, AdamW; simulated on "
            f"`{cluster}` with the roofline and with op times profiled here. Measured: median of "
            f"timed `train_step`s after warm-up, synchronized.", "",
            )
    rows, notes = [], []
    for p in precisions:
        with ctx.part(f"{p}: profile, simulate, measure"):
            row, top = _predict_and_measure(ctx, cfg, batch, cluster, p)
            ctx.log(f"  - {row}")  # kept if the section is stopped before the table
            rows.append(row)
            notes += [f"  - {p}: profiled {x}" for x in top]
    ctx.log("", "| precision | measured ms | roofline ms (x measured) | profiled ms (x measured) | "
            "op entries profiled | peak memory GiB measured / simulated |", "|---|---|---|---|---|---|",
            *rows, "", "The largest profiled op times:", *notes)


def _predict_and_measure(ctx: Ctx, cfg, batch, cluster_name: str,
                         precision: str) -> tuple[str, list[str]]:
    """The table row (measured, roofline, profiled) and the largest profiled ops."""
    from torchweave.models.gpt import GPT
    from torchweave.parallel import compile_plan
    from torchweave.runtime.executor import RankModule, StepConfig
    from torchweave.runtime.groups import GroupCache
    from torchweave.sim import parse_cluster
    from torchweave.sim.hardware.profile import OpProfiles, profile_graph
    from torchweave.sim.simulate import simulate

    dev = ctx.device
    torch.manual_seed(0)
    with torch.device(dev):
        model = GPT(cfg)
        idx = torch.randint(0, cfg.vocab_size, batch)
    inputs = (idx, idx)
    with tempfile.TemporaryDirectory() as tmp:
        comp = compile_plan(model, inputs, "dp", world_size=1, code_dir=tmp, precision=precision)
        cluster = parse_cluster(cluster_name)
        roofline = simulate(comp.graph, comp.plan, cluster)
        profiles = OpProfiles(device=f"{cluster_name} ({dev.type}, torch {torch.__version__})")
        entries = profile_graph(comp.graph, comp.plan, profiles, reps=3 if ctx.smoke else 5, device=dev)
        profiled = simulate(comp.graph, comp.plan, cluster, profiles=profiles)
        group_cache = GroupCache(rank=0, world_size=1, timeout_s=30.0, device=dev)
        module = RankModule(comp.programs[0], comp.code_paths[0], comp.state, group_cache,
                            config=StepConfig(precision=precision))
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        warm, timed = (1, 3) if ctx.smoke else (3, 10)
        times = []
        for i in range(warm + timed):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            module.train_step(*inputs)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if i >= warm:
                times.append(time.perf_counter() - t0)
    measured = statistics.median(times)
    peak = (f"{torch.cuda.max_memory_allocated(dev) / 2**30:.2f}" if dev.type == "cuda" else "n/a")
    row = (f"| {precision} | {measured * 1e3:.2f} | {roofline.step_time * 1e3:.2f} "
           f"({roofline.step_time / measured:.2f}x) | {profiled.step_time * 1e3:.2f} "
           f"({profiled.step_time / measured:.2f}x) | {entries} | {peak} / "
           f"{roofline.memory[0].peak / 2**30:.2f} |")
    top = sorted(profiles.table.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:5]
    return row, [f"`{k.split('|')[0]}` fwd {f * 1e3:.3f} ms, bwd {b * 1e3:.3f} ms"
                 for k, (f, b) in top]


__all__ = ["bf16", "gloo_cuda", "nccl_policies", "sim"]
