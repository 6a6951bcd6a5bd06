"""``verify``: run a plan on N local processes beside a single-device run; compare.

Both runs start from the same weights and see the same batch every step. The
report holds the largest relative difference in the loss of every step, in
every gradient after the first backward (gathered from its pieces), and in
every parameter after the last optimizer step.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from torchweave.parallel import Compiled, compile_plan, rank_module
from torchweave.policies import PlanLike
from torchweave.runtime.executor import OptimizerFactory, StepConfig, default_optimizer
from torchweave.runtime.launch import LaunchConfig, RankContext, spawn


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
        return max(self.loss_diff, self.max_grad_diff, self.max_param_diff) <= self.tolerance

    def __str__(self) -> str:
        mark = "OK" if self.ok else "MISMATCH"
        lines = [f"verify {self.plan!r} on {self.world_size} ranks, {self.steps} steps: {mark} "
                 f"(tolerance {self.tolerance:g} relative)",
                 f"  {'what':44s} {'max rel diff':>12s}",
                 f"  {'loss (' + str(len(self.losses)) + ' steps)':44s} {self.loss_diff:12.3g}"]
        for title, diffs in (("grad", self.grads), ("param after steps", self.params)):
            worst = sorted(diffs.items(), key=lambda kv: -kv[1])[:5]
            for path, d in worst:
                flag = "" if d <= self.tolerance else "  <-- over"
                lines.append(f"  {title + ' ' + path:44.44s} {d:12.3g}{flag}")
        if self.noise:
            lines.append(f"  zero-gradient parameters (compared by gradient only): {', '.join(self.noise)}")
        lines.append(f"  losses (one device / plan): "
                     + ", ".join(f"{a:.6f}/{b:.6f}" for a, b in self.losses))
        return "\n".join(lines)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _rel_tensor(got: torch.Tensor, want: torch.Tensor, floor: float = 1e-12) -> float:
    """Norm-wise relative difference ``‖got − want‖ / max(‖want‖, floor)``."""
    if want.numel() == 0:
        return 0.0
    diff = float((got.double() - want.double()).norm())
    return diff / max(float(want.double().norm()), floor)


def _rank_run(ctx: RankContext, compiled: Compiled, inputs: tuple, steps: int,
              optimizer: OptimizerFactory, config: StepConfig) -> dict[str, Any]:
    module = rank_module(compiled, ctx.groups, optimizer=optimizer, config=config)
    losses, grads = [], {}
    for step in range(steps):
        with ctx.groups.counter.window() as window:
            losses.append(module.backward_step(*inputs))
        if step == 0:
            grads = module.grad_pieces()
            comm = {f"{k.value}/{d.value}": n for (k, d), n in window.counts().items()}
        module.optimizer_step()
    return {"losses": losses, "grads": grads, "params": module.state_pieces(), "comm": comm}


def _assemble(pieces: list[dict[str, tuple[Any, torch.Tensor | None]]],
              shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for rank_pieces in pieces:
        for path, (box, t) in rank_pieces.items():
            if t is None:
                continue
            full = out.setdefault(path, torch.zeros(shapes[path], dtype=t.dtype))
            full[tuple(slice(a, b) for a, b in box)] = t.to(full.dtype)
    return out


def verify(model: torch.nn.Module, example_inputs: tuple[Any, ...], *, plan: PlanLike,
           world_size: int, steps: int = 3, tolerance: float = 1e-5,
           optimizer: OptimizerFactory = default_optimizer, config: StepConfig = StepConfig(),
           launch: LaunchConfig | None = None, code_dir: str | None = None) -> Report:
    """Run ``plan`` on ``world_size`` local processes and one device; compare."""
    compiled = compile_plan(model, example_inputs, plan, world_size=world_size, code_dir=code_dir)
    launch = launch or LaunchConfig(world_size=world_size, timeout_s=60.0)
    results = spawn(_rank_run, launch, compiled, example_inputs, steps, optimizer, config)
    ref = _reference(model, example_inputs, steps, optimizer, config)
    report = Report(compiled.plan.name, world_size, steps, tolerance,
                    comm=results[0]["comm"])
    report.losses = list(zip(ref["losses"], results[0]["losses"]))
    shapes = {p.target: p.meta.shape for p in compiled.graph.params()}
    compare(report, ref, _assemble([r["grads"] for r in results], shapes),
            _assemble([r["params"] for r in results], shapes))
    return report


def compare(report: Report, ref: dict[str, Any], grads: dict[str, torch.Tensor],
            params: dict[str, torch.Tensor]) -> None:
    """Fill ``report`` with norm-wise relative differences.

    A parameter whose true gradient is zero (a key bias before softmax, say)
    has a computed gradient of pure rounding noise, which AdamW divides by its
    own square root into steps of size ``lr``: no two summation orders agree
    on it. Such parameters are compared through their gradients (against the
    model's largest gradient) and left out of the after-steps comparison, and
    the report names them.
    """
    scale = max((float(g.double().norm()) for g in ref["grads"].values()), default=0.0)
    floor = max(scale * 1e-6, 1e-12)
    for path, want in ref["grads"].items():
        report.grads[path] = _rel_tensor(grads[path], want, floor) if path in grads else float("inf")
        if float(want.double().norm()) < floor:
            report.noise.append(path)
    for path, want in ref["params"].items():
        if path in report.noise:
            continue
        report.params[path] = _rel_tensor(params[path], want) if path in params else float("inf")


def _reference(model: torch.nn.Module, inputs: tuple, steps: int, optimizer: OptimizerFactory,
               config: StepConfig) -> dict[str, Any]:
    """The same training on one device."""
    m = copy.deepcopy(model)
    named = dict(m.named_parameters())
    opt = optimizer(list(named.values()))
    losses, grads = [], {}
    for step in range(steps):
        k = config.grad_accum
        total = 0.0
        for micro in zip(*[torch.chunk(x, k, dim=0) for x in inputs]):
            loss = m(*micro)
            (loss / k).backward()
            total += float(loss.detach())
        if config.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(m.parameters(), config.clip_grad_norm)
        if step == 0:
            grads = {k_: v.grad.detach().clone() for k_, v in named.items() if v.grad is not None}
        losses.append(total / k)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads,
            "params": {k_: v.detach().clone() for k_, v in named.items()}}
