"""``plan="auto"``: whatever the search picks runs and matches one device (real gloo ranks)."""

from __future__ import annotations

import pytest

from tests.conftest import built
from torchweave.verify import Case, verify_many

MODELS = ["gpt-tiny", "llama-tiny", "hf-gpt2-tiny", "hf-llama-tiny"]


@pytest.mark.dist
@pytest.mark.parametrize("world_size, models", [(4, MODELS), (8, ["gpt-tiny", "hf-llama-tiny"])])
def test_auto_matches_one_device(world_size: int, models: list[str]) -> None:
    cases = []
    for name in models:
        if name.startswith("hf-"):
            pytest.importorskip("transformers")
        model, inputs = built(name)[:2]
        cases.append(Case(model, inputs, "auto", steps=3, name=f"{name}/auto"))
    for case, report in zip(cases, verify_many(cases, world_size=world_size)):
        assert report.ok, f"{case.name}: {report}"
        assert len(report.losses) == 3 and report.grads and report.params
