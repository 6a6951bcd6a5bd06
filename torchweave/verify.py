"""``verify``: run a plan on N local processes beside a single-device run; compare.

Both runs start from the same weights and see the same batch every step. The
report holds the largest relative difference in the loss of every step, in
every gradient after the first backward (gathered from its pieces), and in
every parameter after the last optimizer step. A multi-forward plan is
compared with the one-device recycling loop (:func:`recycled_forward`).
"""

from __future__ import annotations

import copy
import math
import dataclasses
import traceback
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch

from torchweave.plan.show import replication_note
from torchweave.parallel import Compiled, compile_plan, rank_module
from torchweave.policies import PlanLike
from torchweave.runtime.executor import OptimizerFactory, StepConfig, default_optimizer
from torchweave.runtime.launch import LaunchConfig, RankContext, spawn


BF16_TOLERANCE = 3e-2
"""Relative tolerance of a bf16 plan (``StepConfig(precision="bf16")``) against the
one-device bf16 reference, which follows the runtime's recipe. Measured on llama-tiny,
2 ranks (loss / largest gradient / largest parameter difference), 2026-12-02:

- correct plans: dp 7.6e-5 / 2.6e-3 / 7.8e-4, zero3 the same, tp 4.1e-5 / 8.2e-3 /
  2.2e-3, interlaced 9.3e-5 / 8.4e-3 / 1.5e-3, 1f1b 6e-8 / 0 / 0 (the same bf16 ops
  in the same order). Where they differ, it is where the plan sums in another
  order or rounds a partial sum to bf16 before the all-reduce (tp);
- a wrong plan, dp without its gradient all-reduce: 1.4e-2 / 0.75 / 5.6e-2.

So 3e-2 is 3.6x the worst correct plan and 25x below the wrong one. (For scale:
an fp32 run against the bf16 reference differs by 9.9e-5 / 8.8e-3 / 2.8e-3 —
as much as tp's rounding — so no tolerance tells "bf16 ignored" from a correct
tp plan; tests check that separately.)

Not for MoE: moe-tiny's compiled bf16 program and the eager bf16 recipe differ
even on one rank (loss 5.5447 against 5.5440, gradients up to 1.8 relative: top-k
routing and capacity drops flip on bf16 ties), so the fuzzer compares its bf16
draws with fp32 (``Case.reference="fp32"``) at its own 5e-2."""

BF16_NOISE_FACTOR = 20.0
"""A bf16 plan's tensor may differ from the reference by this many times its *spread*
(how far one device's bf16 run of it is from its fp32 run), where that is more
than the tolerance; the report names each tensor judged so.

Why: where a gradient is a sum whose terms cancel (a LayerNorm bias under a
residual, swin-tiny's ``norm1.bias``), bf16 rounding of the terms is large
against the result, and any other order of the same bf16 sums lands as far
off: the fuzzer's correct swin-tiny and moe-tiny plans differed by 0.05 to
0.36 there. One tolerance cannot both pass those and catch a wrong plan
elsewhere, so each tensor is judged against its own spread.

Measured by ``python bench/bf16_spread.py`` (bf16 draws of the fuzz run, 2026-12-02):
correct plans need at most 6.8 times their spread; the same plans with their
gradient all-reduces dropped exceed 92 times it on some tensor, every one. 20
sits 2.9x above the one and 4.6x below the other."""


@dataclass
class Report:
    """Differences between the plan and one device; ``ok`` when all are within tolerance."""

    plan: str
    world_size: int
    steps: int
    tolerance: float
    losses: list[tuple[float, float]] = field(default_factory=list)
    """(single device, plan) per step."""
    grads: dict[str, float] = field(default_factory=dict)
    params: dict[str, float] = field(default_factory=dict)
    comm: dict[str, int] = field(default_factory=dict)
    """Communication calls of rank 0 in one step, by kind and direction."""
    noise: list[str] = field(default_factory=list)
    """Parameters whose true gradient is zero: compared by gradient only."""
    error: str = ""
    """Set when the plan failed to run."""
    masked: dict[str, int] = field(default_factory=dict)
    """Elements left out of the after-steps comparison (zero true gradient), per parameter."""
    bf16_grads: dict[str, float] = field(default_factory=dict)
    """bf16 plans only: per gradient, how far one device's bf16 run is from its fp32 run
    (the same relative measure). A gradient may differ by ``BF16_NOISE_FACTOR`` times
    this where that is more than ``tolerance``."""
    bf16_params: dict[str, float] = field(default_factory=dict)
    """The same for parameters after the steps."""
    replicated: str = ""
    """A note when much of the plan's work runs replicated (``plan.show.replication_note``)."""

    def allowed(self, what: str, path: str) -> float:
        """The largest relative difference ``what`` (``grad`` or ``param``) of ``path`` may show."""
        spread = (self.bf16_grads if what == "grad" else self.bf16_params).get(path, 0.0)
        return max(self.tolerance, BF16_NOISE_FACTOR * spread)

    @property
    def loose(self) -> dict[str, float]:
        """Tensors judged above ``tolerance`` because bf16 alone moves them that far."""
        out = {}
        for what, diffs in (("grad", self.grads), ("param", self.params)):
            for path in diffs:
                if self.allowed(what, path) > self.tolerance:
                    out[f"{what} {path}"] = self.allowed(what, path)
        return out

    @property
    def loss_diff(self) -> float:
        return max((_rel(a, b) for b, a in self.losses), default=0.0)

    @property
    def max_grad_diff(self) -> float:
        return max(self.grads.values(), default=0.0)

    @property
    def max_param_diff(self) -> float:
        return max(self.params.values(), default=0.0)

    @property
    def ok(self) -> bool:
        if self.error or not self.losses:
            return False
        return self.loss_diff <= self.tolerance and all(
            d <= self.allowed(what, path)
            for what, diffs in (("grad", self.grads), ("param", self.params))
            for path, d in diffs.items())

    def __str__(self) -> str:
        mark = "OK" if self.ok else ("FAILED: " + self.error if self.error else "MISMATCH")
        rows = []  # (what, diff, flag): names are never cut, the column fits the longest
        for what, title, diffs in (("grad", "grad", self.grads),
                                   ("param", "param after steps", self.params)):
            worst = sorted(diffs.items(), key=lambda kv: -kv[1] / self.allowed(what, kv[0]))[:5]
            for path, d in worst:
                limit = self.allowed(what, path)
                flag = "" if d <= limit else "  <-- over"
                if limit > self.tolerance:
                    flag += f"  (bf16 allows {limit:.3g})"
                rows.append((f"{title} {path}", d, flag))
        loss = f"loss ({len(self.losses)} steps)"
        width = max([44, len(loss)] + [len(r[0]) for r in rows])
        lines = [f"verify {self.plan!r} on {self.world_size} ranks, {self.steps} steps: {mark} "
                 f"(tolerance {self.tolerance:g} relative)",
                 f"  {'what':{width}s} {'max rel diff':>12s}",
                 f"  {loss:{width}s} {self.loss_diff:12.3g}"]
        lines += [f"  {name:{width}s} {d:12.3g}{flag}" for name, d, flag in rows]
        if self.loose:
            lines.append(f"  {len(self.loose)} tensors judged loosely, bf16 alone moving them "
                         f"over {self.tolerance:g} on one device (see their 'bf16 allows')")
        if self.masked:
            lines.append("  elements with zero true gradient, compared by gradient only: "
                         + ", ".join(f"{k} ({n})" for k, n in self.masked.items()))
        if self.noise:
            lines.append(f"  zero-gradient parameters (compared by gradient only): {', '.join(self.noise)}")
        lines.append(f"  losses (one device / plan): "
                     + ", ".join(f"{a:.6f}/{b:.6f}" for a, b in self.losses))
        if self.replicated:
            lines.append(f"  {self.replicated}")
        return "\n".join(lines)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _rel_tensor(got: torch.Tensor, want: torch.Tensor, floor: float = 1e-12) -> float:
    """Norm-wise relative difference ``‖got − want‖ / max(‖want‖, floor)``."""
    if want.numel() == 0:
        return 0.0
    diff = float((got.double() - want.double()).norm())
    return diff / max(float(want.double().norm()), floor)


def _rank_run(ctx: RankContext, jobs: list[tuple]) -> list[dict[str, Any]]:
    """Run every job on this rank, reusing the process group and its subgroups."""
    out = []
    for compiled, inputs, steps, optimizer, config in jobs:
        try:
            out.append(_rank_job(ctx, compiled, inputs, steps, optimizer, config))
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


def _assemble(pieces: list[dict[str, tuple[Any, torch.Tensor | None]]],
              shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for rank_pieces in pieces:
        for path, (box, t) in rank_pieces.items():
            if t is None or path not in shapes:
                continue
            full = out.setdefault(path, torch.zeros(shapes[path], dtype=t.dtype))
            full[tuple(slice(a, b) for a, b in box)] = t.to(full.dtype)
    return out


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
    reference: Literal["recipe", "fp32"] = "recipe"
    """The one-device run of a bf16 case: ``recipe`` follows the runtime's bf16 recipe
    (see ``_reference``); ``fp32`` trains in fp32 (the fuzzer's, whose bf16 MoE draws
    route differently from the eager recipe: see ``BF16_TOLERANCE``)."""


def verify(model: torch.nn.Module, example_inputs: tuple[Any, ...], *, plan: PlanLike,
           world_size: int, steps: int = 3, tolerance: float = 1e-5,
           optimizer: OptimizerFactory = default_optimizer, config: StepConfig = StepConfig(),
           launch: LaunchConfig | None = None, code_dir: str | None = None) -> Report:
    """Run ``plan`` on ``world_size`` local processes and on one device; compare."""
    case = Case(model, example_inputs, plan, steps, optimizer, config)
    return verify_many([case], world_size=world_size, tolerance=tolerance, launch=launch,
                       code_dir=code_dir)[0]


def verify_many(cases: list[Case], *, world_size: int, tolerance: float = 1e-5,
                launch: LaunchConfig | None = None, code_dir: str | None = None) -> list[Report]:
    """Verify several cases in one launch of ``world_size`` processes.

    Every plan is compiled and checked before anything starts. On one rank, a case
    that raises is reported as failed and the others still run; on several, a raising
    rank stops the launch with its own error
    (:class:`~torchweave.runtime.launch.RankFailedError`), since its peers may be
    waiting on it.
    """
    compiled, graphs = [], {}  # one capture per model and shape, shared by its plans
    for i, c in enumerate(cases):
        sub = os.path.join(code_dir, f"case{i}") if code_dir else None
        compiled.append(compile_plan(c.model, c.inputs, c.plan, world_size=world_size, code_dir=sub,
                                     micro_batches=c.config.grad_accum,
                                     precision=c.config.precision, graphs=graphs))
    launch = launch or LaunchConfig(world_size=world_size, timeout_s=60.0)
    return run_compiled(cases, compiled, launch=launch, tolerance=tolerance)


def run_compiled(cases: list[Case], compiled: list[Compiled], *, launch: LaunchConfig,
                 tolerance: float = 1e-5) -> list[Report]:
    """Run already compiled cases in one launch and compare each with one device.

    The ranks run ``compiled``'s Programs as they are: a test may edit one (drop a
    gradient all-reduce, say) to check that the comparison catches it.

    A case that raises, on a launch of several ranks, and a rank that dies or times
    out fail the whole launch (:class:`~torchweave.runtime.launch.RankFailedError`,
    naming the rank that failed first); on one rank a raising case is reported as failed.
    """
    jobs = [(comp, c.inputs, c.steps, c.optimizer, c.config) for comp, c in zip(compiled, cases)]
    results = spawn(_rank_run, launch, jobs)
    return [_report(case, comp, [r[i] for r in results], launch.world_size, tolerance)
            for i, (case, comp) in enumerate(zip(cases, compiled))]


def _report(case: Case, comp: Compiled, per_rank: list[dict[str, Any]], world_size: int,
            tolerance: float) -> Report:
    """One case's report from every rank's results and a one-device run."""
    report = Report(case.name or comp.plan.name, world_size, case.steps, tolerance,
                    replicated=replication_note(comp.plan, comp.graph))
    errors = [f"rank {r}: {x['error']}" for r, x in enumerate(per_rank) if "error" in x]
    if errors:
        report.error = "; ".join(errors)
        return report
    config = case.config
    if comp.plan.pipeline is not None:  # one device runs the same micro-batches
        config = dataclasses.replace(config, grad_accum=comp.plan.pipeline.micro_batches)
    else:  # the plan's accum (compile_plan merged it with the step's grad_accum)
        config = dataclasses.replace(config, grad_accum=comp.plan.accum)

    def one_device(precision: str) -> dict[str, Any]:
        return _reference(case.model, case.inputs, case.steps, case.optimizer,
                          dataclasses.replace(config, precision=precision), _recycle_of(comp))

    ref = one_device("fp32" if case.reference == "fp32" else config.precision)
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
    shapes = {p.target: p.meta.shape for p in comp.graph.params()}
    compare(report, ref, _assemble([r["grads"] for r in per_rank], shapes),
            _assemble([r["params"] for r in per_rank], shapes), truth)
    return report


def compare(report: Report, ref: dict[str, Any], grads: dict[str, torch.Tensor],
            params: dict[str, torch.Tensor], truth: dict[str, torch.Tensor] | None = None) -> None:
    """Fill ``report`` with norm-wise relative differences.

    A parameter whose true gradient is zero (a key bias before softmax, say)
    has a computed gradient of pure rounding noise, which AdamW divides by its
    own square root into steps of size ``lr``: no two summation orders agree
    on it. Such parameters (and such elements of larger ones, such as the key
    part of a fused QKV bias) are compared through their gradients, against
    the model's largest gradient, and left out of the after-steps comparison;
    the report names them and counts the elements. ``truth``: the gradients that
    tell which are zero (default ``ref``'s; a bf16 run passes the fp32 ones, since
    bf16 rounding noise is far above the floor).
    """
    truth = ref["grads"] if truth is None else truth
    scale = max((float(g.double().norm()) for g in truth.values()), default=0.0)
    floor = max(scale * 1e-6, 1e-12)
    top = max((float(g.abs().max()) for g in truth.values() if g.numel()), default=0.0)
    for path, want in ref["grads"].items():
        noise = float(truth.get(path, want).double().norm()) < floor
        if noise:
            report.noise.append(path)
        denom = max(scale, 1e-12) if noise else 1e-12
        report.grads[path] = _rel_tensor(grads[path], want, denom) if path in grads else float("inf")
    for path, want in ref["params"].items():
        if path in report.noise:
            continue
        if path not in params:
            report.params[path] = float("inf")
            continue
        got = params[path]
        g = truth.get(path)
        if g is not None:
            keep = g.abs() >= top * 1e-6  # elements whose own gradient is not rounding noise
            if not bool(keep.all()):
                report.masked[path] = int((~keep).sum())
                got, want = got[keep], want[keep]
        report.params[path] = _rel_tensor(got, want)


def recycled_forward(model: torch.nn.Module, inputs: tuple, passes: int,
                     links: dict[int, str], call: Callable[..., Any] | None = None) -> torch.Tensor:
    """The one-device multi-forward loop: ``passes - 1`` passes without gradients, each
    replacing input ``i`` by the (detached) output of module ``links[i]``; then the loss
    of the pass with gradients. ``call`` runs ``model`` (default: ``model`` itself)."""
    call = call or model
    inputs, got = list(inputs), {}
    hooks = [model.get_submodule(path).register_forward_hook(
        lambda _mod, _args, out, i=i: got.__setitem__(i, out)) for i, path in links.items()]
    try:
        with torch.no_grad():
            for _ in range(passes - 1):
                call(*inputs)
                for i in links:
                    inputs[i] = got[i].detach()
    finally:
        for h in hooks:
            h.remove()
    return call(*inputs)


def _recycle_of(comp: Compiled) -> tuple[int, dict[int, str]] | None:
    """(passes, input position → module) of a multi-forward plan."""
    from torchweave.plan.recycle import resolve_links

    pipe = comp.plan.pipeline
    if pipe is None or pipe.recycle is None:
        return None
    links, _ = resolve_links(comp.graph, pipe.recycle)
    return pipe.recycle.passes, {link.index: out for link, (_, out) in zip(links, pipe.recycle.links)}


def _reference(model: torch.nn.Module, inputs: tuple, steps: int, optimizer: OptimizerFactory,
               config: StepConfig, recycle: tuple[int, dict[int, str]] | None = None) -> dict[str, Any]:
    """The same training on one device (with ``recycle``: the recycling loop per micro-batch).

    With ``config.precision == "bf16"`` it follows the runtime's recipe
    (``RankModule``): every forward computes in bf16 on casts of the fp32 master
    parameters and buffers, with floating inputs cast to bf16; the loss goes back
    to fp32 before backward, so gradients arrive, accumulate and are clipped in
    fp32 on the masters, and the optimizer updates the fp32 masters.
    """
    m = copy.deepcopy(model)
    named = dict(m.named_parameters())
    opt = optimizer(list(named.values()))
    losses, grads = [], {}
    for step in range(steps):
        k = config.grad_accum
        total = 0.0
        for micro in zip(*[torch.chunk(x, k, dim=0) for x in inputs]):
            call: Callable[..., Any] = m
            if config.precision == "bf16":
                micro = tuple(_bf16(x) if isinstance(x, torch.Tensor) else x for x in micro)
                call = _bf16_call(m)
            loss = call(*micro) if recycle is None else recycled_forward(m, micro, *recycle, call=call)
            (loss.float() / k if config.precision == "bf16" else loss / k).backward()
            total += float(loss.detach())
        if config.clip_grad_norm is not None:
            clip_exact(list(named.values()), config.clip_grad_norm)
        if step == 0:
            grads = {k_: v.grad.detach().clone() for k_, v in named.items() if v.grad is not None}
        losses.append(total / k)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads,
            "params": {k_: v.detach().clone() for k_, v in named.items()}}


def clip_exact(params: list[torch.Tensor], max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s rule (scale by ``max_norm / (norm + 1e-6)``
    when under 1) with the norm summed in float64, as the runtime sums it.

    PyTorch's own norm of a float32 gradient is not exact enough to judge by: on
    CPU, the 2M-element float32 head of t5-tiny comes out 4.6e-5 low, so every
    clipped gradient of a correct plan would be 3e-5 off (found by the fuzzer).
    """
    grads = [p.grad for p in params if p.grad is not None]
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    scale = max_norm / (norm + 1e-6)
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)
    return norm


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """The runtime's cast (``RankModule._cast``): floating tensors to bf16, through autograd."""
    return t.to(torch.bfloat16) if t.is_floating_point() else t


def _bf16_call(m: torch.nn.Module) -> Callable[..., Any]:
    """``m``'s forward on bf16 casts of its parameters and buffers (gradients reach the masters)."""
    state = {n: _bf16(t) for n, t in [*m.named_parameters(), *m.named_buffers()]}
    return lambda *args: torch.func.functional_call(m, state, args)
