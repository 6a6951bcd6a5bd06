"""In-place ops (a router's ``div_``, ``index_put_`` into a fresh tensor) are functionalized at
capture: none reaches lowering or the runtime, and the plans verify."""

from __future__ import annotations

import pytest
import torch

import torchweave


class InPlace(torch.nn.Module):
    """A router-like block: normalizes its weights in place and scatters rows into zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        w = h * 2 + 3
        w.div_(w.sum(-1, keepdim=True))
        out = torch.zeros_like(h)
        out.index_put_((torch.arange(2),), w[:2])
        return torch.nn.functional.mse_loss(out + h, y)


def _example():
    torch.manual_seed(0)
    return InPlace(), (torch.randn(4, 8), torch.randn(4, 8))


def test_the_captured_graph_has_no_in_place_op() -> None:
    model, inputs = _example()
    ops = [str(n.target).split(".")[1] for n in torchweave.capture(model, inputs).nodes]
    assert "index_put" in ops and "div" in ops, ops
    assert not [op for op in ops if op.endswith("_")], ops


@pytest.mark.dist
def test_in_place_models_verify_under_dp_and_zero3() -> None:
    from torchweave.verify import Case, verify_many

    model, inputs = _example()
    for report in verify_many([Case(model, inputs, "dp"), Case(model, inputs, "zero3")], world_size=2):
        assert report.ok, str(report)
