"""``verify``: run a plan on N local processes beside a single-device run; compare.

Both runs start from the same weights and see the same batch every step. The
report holds the largest relative difference in the loss of every step, in
every gradient after the first backward (gathered from its pieces), in every
parameter after the last step of the case's optimizer (AdamW by default), and
in every parameter after as many steps of plain SGD, where a wrong gradient
shows up in proportion. A multi-forward plan is compared with the one-device
recycling loop (:func:`recycled_forward`).

:func:`verify` and :func:`verify_many` run in float64 by default, the model and
its floating inputs cast on both sides (gloo carries float64): rounding is then
about 1e-15, far below any real error, and AdamW's division of near-zero
gradients by their own root no longer turns rounding into visible steps.
``dtype="float32"`` and bf16 plans (``StepConfig(precision="bf16")``, from fp32
masters) are judged at tolerances derived from their dtype (:data:`TOLERANCES`).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from torchweave.plan.show import replication_note
from torchweave.parallel import Compiled, compile_plan, rank_module
from torchweave.policies import PlanLike
from torchweave.runtime.executor import OptimizerFactory, StepConfig, default_optimizer
from torchweave.runtime.launch import LaunchConfig, RankContext, spawn
from torchweave.verify.assemble import _assemble, _worst
from torchweave.verify.reference import _reference, clip_exact, recycled_forward
from torchweave.verify.report import (
    BF16_NOISE_FACTOR, BF16_TOLERANCE, NOISE_FLOORS, STEP_FACTOR, TOLERANCES, Report, _rel_tensor,
)

SGD_LR = 0.05
"""Learning rate of the SGD steps every case also runs (its parameters compared after)."""


def _sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=SGD_LR)


def _rank_run(ctx: RankContext, jobs: list[tuple]) -> list[dict[str, Any]]:
    """Run every job on this rank, reusing the process group and its subgroups.

    On a GPU, TF32 is turned off in this (verify-only) process: cuDNN convolutions use it by
    default (``torch.backends.cudnn.allow_tf32``), and its 10-bit mantissa differs from the
    CPU reference by about 1e-3, which is the kernel's rounding, not the plan's."""
    if ctx.device.type == "cuda":
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    out = []
    for compiled, inputs, steps, optimizer, config, sgd in jobs:
        try:
            result = _rank_job(ctx, compiled, inputs, steps, optimizer, config)
            if sgd:
                result["sgd"] = _rank_job(ctx, compiled, inputs, steps, _sgd, config)["params"]
            out.append(result)
        except Exception as exc:  # noqa: BLE001 - reported per job; other jobs go on
            if ctx.world_size > 1:
                # the other ranks may be waiting on this one: stop them all, reporting this
                # rank's error rather than a peer's time-out
                raise
            frames = [f for f in traceback.extract_tb(exc.__traceback__) if "rank" in f.filename]
            where = f" at {frames[-1].filename}:{frames[-1].lineno} `{frames[-1].line}`" if frames else ""
            out.append({"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}{where}"})
    return out


def _rank_job(ctx: RankContext, compiled: Compiled, inputs: tuple, steps: int,
              optimizer: OptimizerFactory, config: StepConfig) -> dict[str, Any]:
    module = rank_module(compiled, ctx.groups, optimizer=optimizer, config=config)
    losses, grads, comm = [], {}, {}
    for step in range(steps):
        with ctx.groups.counter.window() as window:
            losses.append(module.backward_step(*inputs))
        if step == 0:
            grads = module.grad_pieces()
            comm = {f"{k.value}/{d.value}": n for (k, d), n in window.counts().items()}
        module.optimizer_step()
    return {"losses": losses, "grads": _on_cpu(grads), "params": _on_cpu(module.state_pieces()),
            "comm": comm}


def _on_cpu(pieces: dict[str, tuple[Any, torch.Tensor | None]]) -> dict[str, tuple[Any, Any]]:
    """Pieces moved to the CPU (a rank on a GPU returns them to a parent that compares on CPU)."""
    return {path: (box, None if t is None else t.cpu()) for path, (box, t) in pieces.items()}


@dataclass
class Case:
    """One model, inputs and plan to verify."""

    model: torch.nn.Module
    inputs: tuple[Any, ...]
    plan: PlanLike
    steps: int = 3
    optimizer: OptimizerFactory = default_optimizer
    config: StepConfig = field(default_factory=StepConfig)
    name: str = ""
    dtype: Literal["float64", "float32"] = "float64"
    """What :func:`verify_many` casts the model and its floating inputs to, on both sides
    (a bf16 plan computes from fp32 masters: float32). Callers of :func:`run_compiled`
    compile, so their models run in the dtype they have."""
    sgd: bool = True
    """Also run ``steps`` steps of SGD and compare the parameters after them."""
    reference: Literal["recipe", "fp32"] = "recipe"
    """The one-device run of a bf16 case: ``recipe`` follows the runtime's bf16 recipe
    (see ``_reference``); ``fp32`` trains in fp32 (the fuzzer's, whose bf16 MoE draws
    route differently from the eager recipe: see ``BF16_TOLERANCE``)."""
    dtype_note: str = ""
    """Set by :func:`cast_cases` when a float64 case runs in float32 instead, and why."""


def verify(model: torch.nn.Module, example_inputs: tuple[Any, ...], *, plan: PlanLike,
           world_size: int, steps: int = 3, tolerance: float | None = None,
           optimizer: OptimizerFactory = default_optimizer, config: StepConfig = StepConfig(),
           launch: LaunchConfig | None = None, code_dir: str | None = None,
           dtype: Literal["float64", "float32"] = "float64") -> Report:
    """Run ``plan`` on ``world_size`` local processes and on one device; compare.

    ``tolerance``: the largest relative difference allowed; by default the dtype's
    (:data:`TOLERANCES`)."""
    case = Case(model, example_inputs, plan, steps, optimizer, config, dtype=dtype)
    return verify_many([case], world_size=world_size, tolerance=tolerance, launch=launch,
                       code_dir=code_dir)[0]


def verify_many(cases: list[Case], *, world_size: int, tolerance: float | None = None,
                launch: LaunchConfig | None = None, code_dir: str | None = None) -> list[Report]:
    """Verify several cases in one launch of ``world_size`` processes.

    Every plan is compiled and checked before anything starts. On one rank, a case
    that raises is reported as failed and the others still run; on several, a raising
    rank stops the launch with its own error
    (:class:`~torchweave.runtime.launch.RankFailedError`), since its peers may be
    waiting on it.
    """
    cases = cast_cases(cases)
    compiled, graphs = [], {}  # one capture per model and shape, shared by its plans
    for i, c in enumerate(cases):
        sub = os.path.join(code_dir, f"case{i}") if code_dir else None
        compiled.append(compile_plan(c.model, c.inputs, c.plan, world_size=world_size, code_dir=sub,
                                     micro_batches=c.config.grad_accum,
                                     precision=c.config.precision, graphs=graphs))
    launch = launch or LaunchConfig(world_size=world_size, timeout_s=60.0)
    return run_compiled(cases, compiled, launch=launch, tolerance=tolerance)


def dtype_of(case: Case) -> str:
    """The dtype a case is judged in: ``bf16``, or its ``dtype``."""
    return "bf16" if case.config.precision == "bf16" else case.dtype


def cast_cases(cases: list[Case]) -> list[Case]:
    """Each case with its model and floating inputs cast to its dtype (bf16 plans: float32);
    a model shared by several cases is cast once, so they share one capture."""
    casts: dict[tuple[int, torch.dtype], torch.nn.Module] = {}
    refused: dict[int, str] = {}  # model id → why it does not run in float64
    out = []
    for c in cases:
        dtype = torch.float32 if c.config.precision == "bf16" else getattr(torch, c.dtype)
        if dtype == torch.float64 and id(c.model) not in refused:
            refused[id(c.model)] = _float64_refusal(c.model, c.inputs)
        note = refused.get(id(c.model), "") if dtype == torch.float64 else ""
        if note:
            c, dtype = dataclasses.replace(c, dtype="float32", dtype_note=note), torch.float32
        key = (id(c.model), dtype)
        if key not in casts:
            casts[key] = cast_model(c.model, dtype)
        out.append(dataclasses.replace(c, model=casts[key], inputs=_cast_inputs(c.inputs, dtype)))
    return out


def _cast_inputs(inputs: tuple[Any, ...], dtype: torch.dtype) -> tuple[Any, ...]:
    return tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                 for x in inputs)


def cast_model(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of ``model`` with its floating parameters and buffers in ``dtype``. In float64,
    transformers' experts modules run their loop over experts (``eager``) instead of the
    grouped matmul, which has no float64 kernel: the same sums, so that such models are
    judged in float64 like any other."""
    out = copy.deepcopy(model).to(dtype)
    if dtype == torch.float64:
        for m in out.modules():
            cfg = getattr(m, "config", None)
            if hasattr(m, "_is_expert_parallel") and getattr(cfg, "_experts_implementation", None) \
                    not in (None, "eager"):
                cfg._experts_implementation = "eager"
    return out


def _float64_refusal(model: torch.nn.Module, inputs: tuple[Any, ...]) -> str:
    """Why ``model`` cannot run in float64 ('' when it can), from one forward of a float64
    copy: some kernels have no float64 version (``torch._grouped_mm`` on CPU, which
    transformers' MoE experts call), and such a model is verified in float32."""
    try:
        with torch.no_grad():
            cast_model(model, torch.float64)(*_cast_inputs(inputs, torch.float64))
    except (RuntimeError, NotImplementedError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"judged in float32: the model does not run in float64 ({first[:160]})"
    return ""


def run_compiled(cases: list[Case], compiled: list[Compiled], *, launch: LaunchConfig,
                 tolerance: float | None = None) -> list[Report]:
    """Run already compiled cases in one launch and compare each with one device.

    The ranks run ``compiled``'s Programs as they are: a test may edit one (drop a
    gradient all-reduce, say) to check that the comparison catches it.

    A case that raises, on a launch of several ranks, and a rank that dies or times
    out fail the whole launch (:class:`~torchweave.runtime.launch.RankFailedError`,
    naming the rank that failed first); on one rank a raising case is reported as failed.
    """
    jobs = [(comp, c.inputs, c.steps, c.optimizer, c.config, c.sgd) for comp, c in zip(compiled, cases)]
    results = spawn(_rank_run, launch, jobs)
    return [_report(case, comp, [r[i] for r in results], launch.world_size, tolerance)
            for i, (case, comp) in enumerate(zip(cases, compiled))]


def _report(case: Case, comp: Compiled, per_rank: list[dict[str, Any]], world_size: int,
            tolerance: float | None) -> Report:
    """One case's report from every rank's results and a one-device run."""
    judged = _judged_dtype(case, comp)
    explicit = tolerance  # a caller's own tolerance holds for every comparison
    if tolerance is None:  # the compiled model's own dtype (run_compiled's callers cast it)
        tolerance = TOLERANCES[judged]
    report = Report(case.name or comp.plan.name, world_size, case.steps, tolerance,
                    replicated=replication_note(comp.plan, comp.graph),
                    step_factor=STEP_FACTOR if judged != "bf16" and explicit is None and case.sgd
                    else 1.0)
    if case.dtype_note:
        report.precision = case.dtype_note
    elif case.dtype == "float64" and judged == "float32":
        report.precision = (f"judged in float32: the model computes in a narrower dtype than "
                            f"float64 ({_narrower(comp)})")
    errors = [f"rank {r}: {x['error']}" for r, x in enumerate(per_rank) if "error" in x]
    if errors:
        report.error = "; ".join(errors)
        return report
    config = case.config
    if comp.plan.pipeline is not None:  # one device runs the same micro-batches
        config = dataclasses.replace(config, grad_accum=comp.plan.pipeline.micro_batches)
    else:  # the plan's accum (compile_plan merged it with the step's grad_accum)
        config = dataclasses.replace(config, grad_accum=comp.plan.accum)

    def one_device(precision: str, optimizer: OptimizerFactory = case.optimizer) -> dict[str, Any]:
        return _reference(case.model, case.inputs, case.steps, optimizer,
                          dataclasses.replace(config, precision=precision), _recycle_of(comp))

    ref_precision = "fp32" if case.reference == "fp32" else config.precision
    ref = one_device(ref_precision)
    truth = None
    if config.precision == "bf16":
        # which gradients are zero, from fp32; and how far bf16 alone moves each tensor
        # on one device: the other of the two one-device runs against the reference
        other = one_device("bf16" if case.reference == "fp32" else "fp32")
        fp32 = ref if case.reference == "fp32" else other
        truth = fp32["grads"]
        spread = Report(report.plan, 1, case.steps, tolerance)
        compare(spread, ref, other["grads"], other["params"], truth)
        report.bf16_grads, report.bf16_params = spread.grads, spread.params
    report.comm = per_rank[0]["comm"]
    report.losses = list(zip(ref["losses"], per_rank[0]["losses"]))
    floor = NOISE_FLOORS[judged]
    grads = _assemble([r["grads"] for r in per_rank], comp.graph)
    params = _assemble([r["params"] for r in per_rank], comp.graph)
    runs = []
    for k in range(max(len(grads), len(params))):
        report.noise.clear()  # the same each time: it is read from ``truth``
        report.masked.clear()
        compare(report, ref, grads[min(k, len(grads) - 1)], params[min(k, len(params) - 1)],
                truth, floor=floor)
        runs.append((dict(report.grads), dict(report.params)))
    report.grads, report.params = _worst([g for g, _ in runs]), _worst([p for _, p in runs])
    if case.sgd:
        sgd_ref = one_device(ref_precision, _sgd)
        report.sgd = _worst([compare_params(sgd_ref["params"], sgd,
                                            truth if truth is not None else ref["grads"],
                                            report.noise, floor=floor)
                             for sgd in _assemble([r["sgd"] for r in per_rank], comp.graph)])
    return report


def _judged_dtype(case: Case, comp: Compiled) -> str:
    """``bf16``; ``float64`` when every floating value of the graph is float64; else ``float32``
    (a model that casts down on purpose, as transformers' loss does to float32, rounds there)."""
    if case.config.precision == "bf16":
        return "bf16"
    return "float32" if _narrower(comp) else "float64"


def _narrower(comp: Compiled) -> str:
    """The first node that computes in a narrower float than float64, as ``op at source``."""
    for node in comp.graph.nodes:
        for out in node.outputs:
            v = comp.graph.values.get(out)
            if v is not None and v.meta.dtype.is_floating_point and v.meta.dtype != torch.float64:
                return f"{node.name} ({v.meta.dtype}) at {node.source or node.module or '?'}"
    for v in comp.graph.values.values():
        if v.kind != "activation" and v.meta.dtype.is_floating_point and v.meta.dtype != torch.float64:
            return f"{v.name} ({v.meta.dtype})"
    return ""


def compare(report: Report, ref: dict[str, Any], grads: dict[str, torch.Tensor],
            params: dict[str, torch.Tensor], truth: dict[str, torch.Tensor] | None = None,
            *, floor: float = NOISE_FLOORS["float32"]) -> None:
    """Fill ``report`` with norm-wise relative differences.

    A parameter whose true gradient is zero (a key bias before softmax, say)
    has a computed gradient of pure rounding noise, which AdamW divides by its
    own square root into steps of size ``lr``: no two summation orders agree
    on it. Such parameters (and such elements of larger ones, such as the key
    part of a fused QKV bias) are compared through their gradients, against
    the model's largest gradient, and left out of the after-steps comparison;
    the report names them and counts the elements. ``truth``: the gradients that
    tell which are zero (default ``ref``'s; a bf16 run passes the fp32 ones, since
    bf16 rounding noise is far above the floor). ``floor``: below what fraction of the
    largest gradient a gradient is rounding noise (:data:`NOISE_FLOORS`, by dtype).

    Float64 needs it too: a key bias's true gradient is exactly zero, its computed one
    6e-20 of the largest (transformers' BERT), and the parameter after the steps is that
    noise summed, so its relative difference is any size at all.
    """
    truth = ref["grads"] if truth is None else truth
    scale = max((float(g.double().norm()) for g in truth.values()), default=0.0)
    for path, want in ref["grads"].items():
        noise = float(truth.get(path, want).double().norm()) < max(scale * floor, 1e-300)
        if noise:
            report.noise.append(path)
        denom = max(scale, 1e-12) if noise else 1e-12
        report.grads[path] = _rel_tensor(grads[path], want, denom) if path in grads else float("inf")
    report.params.update(compare_params(ref["params"], params, truth, report.noise, report.masked,
                                        floor=floor))


def compare_params(ref: dict[str, torch.Tensor], params: dict[str, torch.Tensor],
                   truth: dict[str, torch.Tensor], noise: list[str],
                   masked: dict[str, int] | None = None, *,
                   floor: float = NOISE_FLOORS["float32"]) -> dict[str, float]:
    """Each parameter's relative difference after the steps; zero-gradient parameters (``noise``)
    and elements left out (counted into ``masked``): see :func:`compare`."""
    top = max((float(g.abs().max()) for g in truth.values() if g.numel()), default=0.0)
    out: dict[str, float] = {}
    for path, want in ref.items():
        if path in noise:
            continue
        if path not in params:
            out[path] = float("inf")
            continue
        got = params[path]
        g = truth.get(path)
        if g is not None:
            keep = g.abs() >= top * floor  # elements whose own gradient is not rounding noise
            if not bool(keep.all()):
                if masked is not None:
                    masked[path] = int((~keep).sum())
                got, want = got[keep], want[keep]
        out[path] = _rel_tensor(got, want)
    return out


def _recycle_of(comp: Compiled) -> tuple[int, dict[int, str]] | None:
    """(passes, input position → module) of a multi-forward plan."""
    from torchweave.plan.recycle import resolve_links

    pipe = comp.plan.pipeline
    if pipe is None or pipe.recycle is None:
        return None
    links, _ = resolve_links(comp.graph, pipe.recycle)
    return pipe.recycle.passes, {link.index: out for link, (_, out) in zip(links, pipe.recycle.links)}




__all__ = ["BF16_NOISE_FACTOR", "BF16_TOLERANCE", "Case", "Report", "TOLERANCES", "cast_cases", "cast_model", "clip_exact",
           "compare", "compare_params", "recycled_forward", "run_compiled", "verify", "verify_many"]
