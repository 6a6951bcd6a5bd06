"""Ops declared batch-local (``torchweave.batch_local``): data parallelism keeps the batch
split through them, verified against one device; a wrong declaration is caught by verify."""

from __future__ import annotations

import pytest
import torch

import torchweave
from torchweave.cli import main
from torchweave.coverage import coverage
from torchweave.errors import TorchweaveError
from torchweave.ops import REGISTRY
from torchweave.verify import Case, verify_many


class Rows(torch.nn.Module):
    """kthvalue along each row (rows independent), or down the batch (``across``: not)."""

    def __init__(self, across: bool = False) -> None:
        super().__init__()
        self.proj, self.across = torch.nn.Linear(8, 8), across

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return torch.kthvalue(h, 2, dim=0 if self.across else -1).values.pow(2).mean()


def factory():
    torch.manual_seed(0)
    return Rows(), (torch.randn(8, 8),)


@pytest.fixture
def declared():
    yield torchweave.batch_local("aten.kthvalue")
    REGISTRY.specs.pop("aten.kthvalue", None)


def _row(model, inputs):
    """kthvalue's coverage row: None when no policy runs it replicated."""
    rows = {r.op: r for r in coverage(torchweave.capture(model, inputs), world_size=2)}
    return rows.get("aten.kthvalue")


def test_undeclared_the_op_gathers_the_batch() -> None:
    row = _row(*factory())
    assert not row.annotated and row.costs["dp"].bytes_gathered > 0


@pytest.mark.dist
def test_declared_the_batch_stays_split_and_matches_one_device(declared) -> None:
    model, inputs = factory()
    row = _row(model, inputs)
    assert row is None or "dp" not in row.costs  # dp no longer repeats it
    wrong = Rows(across=True)
    wrong.load_state_dict(model.state_dict())
    ok, bad = verify_many([Case(model, inputs, "dp", steps=2, name="rows"),
                           Case(wrong, inputs, "dp", steps=2, name="across")], world_size=2)
    assert ok.ok, str(ok)
    assert not bad.ok and bad.loss_diff > 1e-3, str(bad)  # a wrong declaration is caught


def test_from_the_command_line_and_a_train_config(capsys) -> None:
    try:
        assert main(["inspect", f"{__file__}:factory", "--coverage", "--batch-local",
                     "aten.kthvalue"]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if "aten.kthvalue" in x)
        assert "yes" in line
    finally:
        REGISTRY.specs.pop("aten.kthvalue", None)
    from torchweave.train.build import build_model
    from torchweave.train.loading import load_config

    cfg = load_config(None, ["--model.batch_local=[aten.kthvalue]"])
    try:
        build_model(cfg.model, vocab_size=256, seq_len=16)
        assert "aten.kthvalue" in REGISTRY.specs
    finally:
        REGISTRY.specs.pop("aten.kthvalue", None)
    with pytest.raises(TorchweaveError, match="namespace.op"):
        build_model(load_config(None, ["--model.batch_local=[kthvalue]"]).model,
                    vocab_size=256, seq_len=16)
