"""no_grad and autocast blocks inside forward: inlined as plain ops, with eager's gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchweave
from tests.conftest import state_of
from torchweave.errors import CaptureError
from torchweave.ir import run_graph


class Regions(nn.Module):
    """A scale computed under no_grad (a method decorated as transformers' rotary is) and a
    product under autocast(enabled=False): gradients flow through ``a`` only, not ``b``."""

    def __init__(self, autocast_on: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.autocast_on = autocast_on

    @torch.no_grad()
    def scale(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(x).sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, s = self.a(x), self.scale(x)
        with torch.autocast("cpu", enabled=self.autocast_on):
            h = h * s
        return (h * h).mean()


def _node_targets(graph) -> list[str]:
    return [n.target for n in graph.nodes]


def test_no_grad_and_disabled_autocast_regions_replay_with_eagers_gradients() -> None:
    torch.manual_seed(0)
    model, x = Regions(), torch.randn(4, 8)
    graph = torchweave.capture(model, (x,))
    assert "aten.detach.default" in _node_targets(graph)
    assert not any("wrap_with" in t for t in _node_targets(graph))
    loss = model(x)
    loss.backward()
    state = {k: v.detach().clone().requires_grad_(v.requires_grad)
             for k, v in state_of(model).items()}
    (got,) = run_graph(graph, state, (x,))
    got.backward()
    torch.testing.assert_close(got, loss)
    for name, p in model.named_parameters():
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        have = state[name].grad if state[name].grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(have, want, msg=lambda m, n=name: f"{n}: {m}")
    assert model.b.weight.grad is None  # the no_grad region really stops the gradient


def test_an_enabled_autocast_region_is_refused_with_the_fix() -> None:
    with pytest.raises(CaptureError) as info:
        torchweave.capture(Regions(autocast_on=True), (torch.randn(4, 8),))
    msg = str(info.value)
    assert "autocast" in msg and "precision" in msg and "test_capture_regions.py" in msg


class Nested(nn.Module):
    """transformers' rotary embedding on CUDA: a disabled autocast inside a no_grad method."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    @torch.no_grad()
    def rotary(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return self.b(x).cos()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * self.rotary(x)
        return (h * h).mean()


def test_a_disabled_autocast_nested_in_no_grad_is_inlined_and_stops_the_gradient() -> None:
    torch.manual_seed(0)
    model, x = Nested(), torch.randn(4, 8)
    graph = torchweave.capture(model, (x,))
    assert not any("wrap_with" in t for t in _node_targets(graph))
    state = {k: v.detach().clone().requires_grad_(v.requires_grad)
             for k, v in state_of(model).items()}
    (got,) = run_graph(graph, state, (x,))
    got.backward()
    model(x).backward()
    torch.testing.assert_close(state["a.weight"].grad, model.a.weight.grad)
    assert state["b.weight"].grad is None and model.b.weight.grad is None


class ClampsInPlace(nn.Module):
    """Weight clipping and an activation clamp inside no_grad, written in place."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.what = what

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():
            if self.what == "activation":
                h.clamp_(-0.2, 0.2)
            else:
                self.a.weight.clamp_(-0.1, 0.1)
        return (self.b(h) ** 2).mean()


@pytest.mark.parametrize("what", ["activation", "parameter"])
def test_an_in_place_change_inside_no_grad_is_refused_not_captured_wrong(what: str) -> None:
    # eager keeps the clamped tensor's gradient history (and the parameter's new value);
    # a captured graph would detach it, so capture refuses with the way out
    with pytest.raises(CaptureError) as info:
        torchweave.capture(ClampsInPlace(what), (torch.randn(4, 8),))
    msg = str(info.value)
    assert "in place" in msg and ("optimizer" in msg or "new tensor" in msg), msg


class ReturnsRegionResult(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor):
        with torch.no_grad():
            y = self.a(x)
        return (self.b(x) * y.sin()).mean(), y


def test_the_exported_programs_signature_follows_the_inlined_outputs() -> None:
    from torchweave.capture.regions import inline_regions

    ep = torch.export.export(ReturnsRegionResult(), (torch.randn(4, 8),), strict=False)
    assert inline_regions(ep) == 1
    ep.validate()  # the signature names the nodes that now produce the outputs
    graph = torchweave.capture(ReturnsRegionResult(), (torch.randn(4, 8),))
    assert len(graph.outputs) == 2
