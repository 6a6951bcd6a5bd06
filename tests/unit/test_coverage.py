"""`torchweave inspect --coverage` and the published table of annotated ops."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.conftest import captured
from torchweave.cli import main
from torchweave.coverage import coverage, registry_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_table_is_the_registry() -> None:
    text = (ROOT / "docs" / "coverage.md").read_text()
    assert text[text.index("| op |"):] == registry_markdown()


def test_moe_expert_einsum_is_priced_under_dp() -> None:
    rows = {r.op: r for r in coverage(captured("moe-tiny"), world_size=2)}
    dp = rows["aten.einsum"].costs["dp"]
    # the experts' einsum runs whole on both ranks: its work repeated, its split input gathered
    assert dp.nodes >= 1 and dp.flops_repeated > 1e6 and dp.bytes_gathered > 0
    assert rows["aten.einsum"].annotated


class KthValue(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.kthvalue(self.proj(x), 2, dim=-1).values.pow(2).mean()


def factory():
    return KthValue(), (torch.randn(4, 8),)


def test_an_unannotated_op_is_listed_with_its_cost(capsys) -> None:
    import torchweave

    rows = {r.op: r for r in coverage(torchweave.capture(*factory()), world_size=2)}
    assert not rows["aten.kthvalue"].annotated
    assert main(["inspect", f"{__file__}:factory", "--coverage"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "aten.kthvalue" in line)
    assert "NO" in line and "B" in line
