"""What verify reports: each tensor's largest relative difference from one device, and the
tolerances a plan is judged by (float64, float32, and bf16 against the runtime's recipe)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FP64_TOLERANCE = 1e-9
"""Relative tolerance in float64 (verify's default). Rounding there is about 1e-16 per
operation; correct plans of the suite differ from one device by 1e-15 to 1e-12 after 3
AdamW steps (``tests/dist/test_verify_trust.py`` prints them). A real error (a gradient
summed twice, a missing all-reduce) is 1e-3 or more: 1e-9 sits far from both."""

FP32_TOLERANCE = 1e-5
"""Relative tolerance in float32: rounding of 6e-8 per operation, accumulated over sums of
thousands of terms in another order, reaches 1e-6."""

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

TOLERANCES = {"float64": FP64_TOLERANCE, "float32": FP32_TOLERANCE, "bf16": BF16_TOLERANCE}
"""The default tolerance of each dtype verify judges in."""

NOISE_FLOORS = {"float64": 1e-12, "float32": 1e-6, "bf16": 1e-6}
"""Below this fraction of the model's largest gradient, a gradient (or one element of it)
is rounding noise of a true zero, in each judged dtype (bf16 plans take the fp32 run's
gradients as the truth). Such parameters are compared by their gradient only (AdamW
divides noise by its own root into steps of size lr). Rounding is about 1e-16 of the
terms' size in float64 and 6e-8 in float32; the zero gradients of the suite (key biases,
before a softmax) are 6e-20 of the largest in float64, and the smallest real ones
(a query bias) 6e-5."""

STEP_FACTOR = 10.0
"""Parameters after the case's own optimizer steps (AdamW) may differ by this many times
the tolerance in float64 and float32 (bf16 judges them by their spread instead). AdamW
makes each element's step about ``lr`` whatever its gradient's size, so an element's
own relative rounding error, not its share of the tensor, becomes the step's: rounding
is relative to the terms summed, so a small gradient element of a correct plan may be
off by far more than the tensor's norm-wise difference. Measured (2 AdamW steps,
``tests/dist/test_hf_zoo.py``): transformers' Qwen2-MoE under dp in float32, gradients
within 4.5e-7 of one device, its RoPE key bias after the steps 1.5e-5. The SGD steps,
linear in the gradient, keep the tolerance itself; a wrong plan is 1e-3 or more off.
Only where the SGD comparison runs (``Case.sgd``) and the tolerance is the dtype's: a
caller's own ``tolerance`` holds for every comparison."""

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
    precision: str = ""
    """Why a float64 case was judged at float32's tolerance (the model casts down itself)."""
    sgd: dict[str, float] = field(default_factory=dict)
    """Each parameter's relative difference after the same number of plain SGD steps."""
    step_factor: float = 1.0
    """``params`` (after the case's optimizer) may differ by this many times ``tolerance``
    (:data:`STEP_FACTOR` in float64 and float32)."""

    def base(self, what: str) -> float:
        """The tolerance of ``what``: ``grad``, ``step`` (after the case's optimizer) or
        ``param`` (after SGD)."""
        return self.tolerance * (self.step_factor if what == "step" else 1.0)

    def allowed(self, what: str, path: str) -> float:
        """The largest relative difference ``what`` of ``path`` may show (see :meth:`base`)."""
        spread = (self.bf16_grads if what == "grad" else self.bf16_params).get(path, 0.0)
        return max(self.base(what), BF16_NOISE_FACTOR * spread)

    @property
    def judged(self) -> tuple[tuple[str, str, dict[str, float]], ...]:
        """(kind, title, differences) of each comparison after the loss."""
        return (("grad", "grad", self.grads), ("step", "param after steps", self.params),
                ("param", "param after SGD steps", self.sgd))

    @property
    def loose(self) -> dict[str, float]:
        """Tensors judged above their tolerance because bf16 alone moves them that far."""
        out = {}
        for what, _, diffs in self.judged:
            for path in diffs:
                if self.allowed(what, path) > self.base(what):
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
            d <= self.allowed(what, path) for what, _, diffs in self.judged for path, d in diffs.items())

    def __str__(self) -> str:
        mark = "OK" if self.ok else ("FAILED: " + self.error if self.error else "MISMATCH")
        rows = []  # (what, diff, flag): names are never cut, the column fits the longest
        for what, title, diffs in self.judged:
            worst = sorted(diffs.items(), key=lambda kv: -kv[1] / self.allowed(what, kv[0]))[:5]
            for path, d in worst:
                limit = self.allowed(what, path)
                flag = "" if d <= limit else "  <-- over"
                if limit > self.base(what):
                    flag += f"  (bf16 allows {limit:.3g})"
                rows.append((f"{title} {path}", d, flag))
        loss = f"loss ({len(self.losses)} steps)"
        width = max([44, len(loss)] + [len(r[0]) for r in rows])
        steps = f"; after the steps {self.base('step'):g}" if self.step_factor != 1.0 else ""
        lines = [f"verify {self.plan!r} on {self.world_size} ranks, {self.steps} steps: {mark} "
                 f"(tolerance {self.tolerance:g} relative{steps})",
                 f"  {'what':{width}s} {'max rel diff':>12s}",
                 f"  {loss:{width}s} {self.loss_diff:12.3g}"]
        lines += [f"  {name:{width}s} {d:12.3g}{flag}" for name, d, flag in rows]
        if self.loose:
            lines.append(f"  {len(self.loose)} tensors judged loosely, bf16 alone moving them "
                         f"over {self.tolerance:g} on one device (see their 'bf16 allows')")
        if self.masked:
            lines.append("  elements whose gradient is rounding noise, compared by gradient only: "
                         + ", ".join(f"{k} ({n})" for k, n in self.masked.items()))
        if self.noise and any(p not in self.params for p in self.noise):
            lines.append(f"  zero-gradient parameters (compared by gradient only): {', '.join(self.noise)}")
        lines.append("  losses (one device / plan): "
                     + ", ".join(f"{a:.6f}/{b:.6f}" for a, b in self.losses))
        if self.replicated:
            lines.append(f"  {self.replicated}")
        if self.precision:
            lines.append(f"  {self.precision}")
        return "\n".join(lines)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _rel_tensor(got: torch.Tensor, want: torch.Tensor, floor: float = 1e-12) -> float:
    """Norm-wise relative difference ``‖got − want‖ / max(‖want‖, floor)``."""
    if want.numel() == 0:
        return 0.0
    diff = float((got.double() - want.double()).norm())
    return diff / max(float(want.double().norm()), floor)


