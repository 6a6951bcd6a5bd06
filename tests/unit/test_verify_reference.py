"""The single-device reference that verify judges plans against."""

from __future__ import annotations

import math

import torch

from torchweave.verify import clip_exact


def test_the_reference_clips_by_the_exact_norm() -> None:
    """A float32 gradient of two million elements (the size of t5-tiny's head): the norm
    the reference clips by is the float64 one, to float32 rounding."""
    torch.manual_seed(0)
    p = torch.zeros(32128, 64, requires_grad=True)
    p.grad = torch.randn(32128, 64) * torch.rand(32128, 1) ** 4 * 1e-3
    exact = math.sqrt(float(p.grad.double().pow(2).sum()))
    want = p.grad.double() * (0.01 / (exact + 1e-6))
    norm = clip_exact([p], 0.01)
    assert abs(norm / exact - 1) < 1e-12
    assert float((p.grad.double() - want).abs().max() / want.abs().max()) < 1e-6


def test_under_the_threshold_nothing_changes() -> None:
    p = torch.zeros(3, requires_grad=True)
    p.grad = torch.tensor([1e-3, 0.0, -2e-3])
    before = p.grad.clone()
    clip_exact([p, torch.zeros(2, requires_grad=True)], 1.0)  # a parameter with no gradient
    assert torch.equal(p.grad, before)


def test_a_bf16_tensor_is_judged_against_its_own_spread() -> None:
    """Where bf16 alone moves a tensor far on one device, it may move that far times
    BF16_NOISE_FACTOR under a plan, and the report says so; elsewhere the tolerance holds."""
    from torchweave.verify import BF16_NOISE_FACTOR, Report

    r = Report("p", 2, 2, 0.05, losses=[(1.0, 1.0)], grads={"norm.bias": 0.3, "w": 0.01},
               params={"w": 0.01}, bf16_grads={"norm.bias": 0.3 / BF16_NOISE_FACTOR * 1.1, "w": 0.5})
    assert r.ok, str(r)
    assert r.allowed("grad", "w") == BF16_NOISE_FACTOR * 0.5 and r.allowed("param", "w") == 0.05
    assert "bf16 allows" in str(r) and "judged loosely" in str(r)
    r.bf16_grads["norm.bias"] = 0.3 / BF16_NOISE_FACTOR * 0.9
    assert not r.ok and "<-- over" in str(r)
    r.bf16_grads.clear()
    r.grads["norm.bias"] = 0.05
    assert r.ok and "judged loosely" not in str(r)


def test_the_report_names_every_tensor_in_full() -> None:
    from torchweave.verify import Report

    long = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    r = Report("p", 2, 2, 1e-5, losses=[(1.0, 1.0)], grads={long: 0.5, "w": 0.0}, params={long: 0.0})
    text = str(r)
    assert f"grad {long}" in text and f"param after steps {long}" in text
    header = next(line for line in text.splitlines() if "max rel diff" in line)
    row = next(line for line in text.splitlines() if line.startswith(f"  grad {long}"))
    assert row.index("0.5") + len("0.5") == header.index("max rel diff") + len("max rel diff")
    assert "<-- over" in row


class _NoFloat64(torch.nn.Module):
    """A kernel with no float64 version (the bf16/float32-only grouped matmul)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4, 4))

    def forward(self, x):
        if x.dtype == torch.float64:
            raise RuntimeError("Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double")
        return (x @ self.w).sum()


def test_a_model_with_no_float64_kernel_is_judged_in_float32_and_says_why() -> None:
    from torchweave.verify import Case, cast_cases

    model = _NoFloat64()
    (case,) = cast_cases([Case(model, (torch.randn(2, 4),), "dp")])
    assert case.dtype == "float32" and "does not run in float64" in case.dtype_note
    assert next(case.model.parameters()).dtype == torch.float32


def test_transformers_experts_run_their_float64_loop_in_the_float64_reference() -> None:
    """transformers' MoE experts default to a grouped matmul with no float64 kernel; the
    float64 copy runs their loop over experts instead (the same sums), so the model is
    cast, not refused, and the user's model is left as it was."""
    import pytest

    pytest.importorskip("transformers")
    from tests.conftest import built
    from torchweave.verify import Case, cast_cases

    model, inputs = built("hf-mixtral-tiny")[:2]
    impl = model.model.config._experts_implementation
    assert impl not in (None, "eager")
    (case,) = cast_cases([Case(model, inputs, "dp")])
    assert case.dtype == "float64" and not case.dtype_note
    assert case.model.model.config._experts_implementation == "eager"
    assert model.model.config._experts_implementation == impl
    assert torch.isfinite(case.model(*case.inputs))


def test_verify_judges_every_copy_of_a_piece_not_the_last_one_written() -> None:
    """Several ranks hold one piece (data-parallel replicas; each pipeline stage's copy of a
    tied weight). Verify assembled whole tensors by letting the last rank's piece win, so a
    copy that drifted on an earlier rank went unseen. Each copy now makes an assembly of
    its own, and each is compared with one device."""
    from tests.conftest import captured
    from torchweave.verify import _assemble

    graph = captured("gpt-tiny")
    whole = ((0, 256), (0, 64))
    good, drifted = torch.ones(256, 64), torch.ones(256, 64)
    drifted[3, 5] = 2.0
    ranks = [{"wte.weight": (whole, drifted)}, {"wte.weight": (whole, good)}]
    seen = [a["wte.weight"] for a in _assemble(ranks, graph)]
    assert len(seen) == 2 and seen[0][3, 5] == 2.0 and seen[1][3, 5] == 1.0
