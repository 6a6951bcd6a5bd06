"""Shared fixtures: captured tiny models, reused across tests."""

from __future__ import annotations

import functools

import pytest
import torch

TINY = ["gpt-tiny", "llama-tiny", "vit-tiny", "swin-tiny", "t5-tiny", "moe-tiny",
        "hf-gpt2-tiny", "hf-llama-tiny"]


@functools.lru_cache(maxsize=None)
def built(name: str):
    """(model, inputs) of a bundled tiny model, seeded."""
    from torchweave.models import FACTORIES

    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    return FACTORIES[name]()


@functools.lru_cache(maxsize=None)
def captured(name: str):
    import torchweave

    model, inputs = built(name)[:2]
    return torchweave.capture(model, inputs, name=name)


def state_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def pytest_addoption(parser) -> None:
    parser.addoption("--random-plans", type=int, default=30,
                     help="how many seeded random plans the random-plan test verifies")
    parser.addoption("--fuzz-plans", type=int, default=40,
                     help="how many drawn plans the fuzz test runs (at least 40)")


def assert_grads_match_model(module, model: torch.nn.Module, inputs, loss: float) -> None:
    """``module``'s loss and every gradient equal the model's own on ``inputs`` (one device)."""
    model.zero_grad()
    want = model(*inputs)
    want.backward()
    assert abs(loss - float(want.detach())) < 1e-5
    for name, p in model.named_parameters():
        torch.testing.assert_close(module.params[name].grad, p.grad, rtol=1e-5, atol=1e-7)


def saved_bytes(module, inputs) -> int:
    """Bytes of activations that forward keeps for backward (parameters not counted)."""
    seen: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in module.params.values()}

    def pack(t: torch.Tensor):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module.forward(*inputs)
    return sum(seen.values())


@pytest.fixture
def in_tmp_dir(tmp_path, monkeypatch):
    """Run in a fresh directory: commands that write files there by default (simulate's and
    explain's Gantt charts) leave nothing in the checkout."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
