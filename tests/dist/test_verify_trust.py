"""verify at its defaults (float64, AdamW and SGD steps): no correct plan is flagged, and
deliberately wrong plans (a missing gradient all-reduce, a gradient summed twice) are caught."""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import built
from torchweave.parallel import compile_plan
from torchweave.runtime.launch import LaunchConfig
from torchweave.verify import Case, cast_cases, run_compiled, verify_many
from torchweave.verify.report import FP64_TOLERANCE

pytestmark = pytest.mark.dist

PLANS = ("dp", "tp", "zero3", "1f1b", "sp")


def test_correct_plans_pass_at_the_defaults_far_below_the_tolerance() -> None:
    cases = [Case(*built(m)[:2], p, name=f"{m}/{p}") for m in ("gpt-tiny", "llama-tiny")
             for p in PLANS]
    for report in verify_many(cases, world_size=2):
        assert report.ok, str(report)
        assert report.tolerance == FP64_TOLERANCE
        worst = max(report.loss_diff, report.max_grad_diff, report.max_param_diff,
                    max(report.sgd.values()))
        print(f"{report.plan}: worst relative difference {worst:.3g}")
        assert worst < FP64_TOLERANCE / 100  # rounding, 1e-15 to 1e-12
        # float64 leaves out only elements whose gradient is exactly zero: rows of the
        # embedding tables that the batch's tokens and 16 positions never reach
        assert report.sgd and set(report.masked) <= {"wpe.weight", "wte.weight", "embed.weight"}


def _wrong(compiled, mutate):
    for prog in compiled.programs:
        prog.params[:] = [mutate(s) for s in prog.params]
    return compiled


def test_a_missing_all_reduce_and_a_gradient_summed_twice_are_caught() -> None:
    model, inputs = built("gpt-tiny")[:2]
    cases = cast_cases([Case(model, inputs, "dp", name="dp without its all-reduce"),
                        Case(model, inputs, "tp", name="tp with norms summed twice")])
    compiled = [compile_plan(c.model, c.inputs, c.plan, world_size=2) for c in cases]
    _wrong(compiled[0], lambda s: dataclasses.replace(s, grad_groups=()))
    every = (0, 1)

    def twice(s):  # a replicated norm's full gradient summed over the tensor-parallel ranks
        if s.replicas > 1 and not s.grad_groups and "ln" in s.path and s.requires_grad:
            return dataclasses.replace(s, grad_groups=(every,))
        return s

    _wrong(compiled[1], twice)
    assert any(s.grad_groups for s in compiled[1].programs[0].params if "ln" in s.path)
    missing, doubled = run_compiled(cases, compiled, launch=LaunchConfig(world_size=2))
    for report in (missing, doubled):
        assert not report.ok, str(report)
        assert report.max_grad_diff > 1e-3 and max(report.sgd.values()) > 1e-4, str(report)
    assert "MISMATCH" in str(doubled) and "ln_" in str(doubled)
