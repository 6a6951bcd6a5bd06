"""bf16 plans are captured on a bf16 meta copy of the model: it must be the same model."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import built
from torchweave.front import _capture_once, _meta_copy


@pytest.mark.parametrize("name", ["gpt-tiny", "hf-gpt2-tiny"])
def test_bf16_capture_keeps_tied_weights_tied(name) -> None:
    """Found by bench/fuzz.py: the tied token embedding / LM head became two parameters under
    bf16, each trained on its own share of the gradient (wte's gradient 0.8 off one device)."""
    model, inputs = built(name)[:2]
    fp32 = {p.target: p.aliases for p in _capture_once(model, inputs, 1, "fp32").params()}
    bf16 = {p.target: p.aliases for p in _capture_once(model, inputs, 1, "bf16").params()}
    assert bf16 == fp32
    assert any(aliases for aliases in fp32.values()), f"{name} has a tied pair"


def test_meta_copy_copies_no_data_and_leaves_the_model_alone() -> None:
    model, _ = built("gpt-tiny")[:2]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copy = _meta_copy(model, torch.bfloat16)
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in copy.parameters())
    assert copy.lm_head.weight is copy.wte.weight
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert next(model.parameters()).device.type == "cpu"
