"""The bundled models: loss, gradients and torch.export for every tiny factory."""

from __future__ import annotations

import math

import pytest
import torch

from torchweave.models import FACTORIES, build, get_factory
from torchweave.models.gpt import GPT, GPTConfig, flops_per_token, num_params

TINY = [
    "gpt-tiny", "llama-tiny", "vit-tiny", "swin-tiny", "t5-tiny", "moe-tiny", "moe-dropless-tiny", "moe-grouped-tiny",
    "hf-gpt2-tiny", "hf-llama-tiny",
]

# Parameters that legitimately get no gradient from the example loss. None today:
# every parameter of every tiny model feeds the loss (the MoE router is reached
# through the combine weights, the T5 bias tables through the attention masks).
UNUSED: dict[str, set[str]] = {}


def _build(name: str):
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    return build(name)


@pytest.mark.parametrize("name", TINY)
def test_forward_backward(name: str) -> None:
    model, inputs = _build(name)
    assert isinstance(inputs, tuple) and all(isinstance(t, torch.Tensor) for t in inputs)
    loss = model(*inputs)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    missing = [
        n for n, p in model.named_parameters()
        if p.requires_grad and p.grad is None and n not in UNUSED.get(name, set())
    ]
    assert not missing, f"no gradient for {missing}"
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert not bad, f"non-finite gradient for {bad}"


@pytest.mark.parametrize("name", TINY)
def test_export(name: str) -> None:
    model, inputs = _build(name)
    ep = torch.export.export(model, inputs, strict=False)
    torch.testing.assert_close(ep.module()(*inputs), model(*inputs))


@pytest.mark.parametrize("name", TINY)
def test_example_inputs_deterministic_and_divisible(name: str) -> None:
    _, a = _build(name)
    _, b = _build(name)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
        assert x.shape[0] % 4 == 0, x.shape  # batch
        if x.dim() == 2:
            assert x.shape[1] % 4 == 0  # sequence length


def test_unknown_name() -> None:
    with pytest.raises(KeyError, match="gpt-tiny"):
        get_factory("no-such-model")
    assert set(TINY) <= set(FACTORIES)


def test_gpt_param_count_and_flops() -> None:
    for tie, bias in [(True, True), (False, False)]:
        cfg = GPTConfig(
            vocab_size=256, block_size=32, n_layer=2, n_head=4, d_model=64, tie_weights=tie, bias=bias
        )
        assert sum(p.numel() for p in GPT(cfg).parameters()) == num_params(cfg)
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, d_model=64)
    n = num_params(cfg, include_position_embedding=False)
    assert n == num_params(cfg) - 32 * 64
    assert flops_per_token(cfg, 16) == 6 * n + 12 * 2 * 64 * 16


def test_gpt_175b_on_meta() -> None:
    model, (idx, targets) = build("gpt-175b")
    assert idx.is_meta and targets.is_meta and idx.shape == (1, 2048)
    assert all(p.is_meta for p in model.parameters())
    n = sum(p.numel() for p in model.parameters())
    assert n == num_params(model.cfg) and math.isclose(n, 174.6e9, rel_tol=1e-3)
    assert math.isclose(flops_per_token(model.cfg, 2048), 1.0765e12, rel_tol=1e-3)


def test_grouped_routing_routes_each_group_as_the_whole_batch_routes_itself() -> None:
    """``group_size``: each group of tokens is routed with its own capacity, exactly as a
    batch of just that group is routed whole; one group of the whole batch is the whole
    batch's routing; a size that does not divide the tokens is named with a fix."""
    from torchweave.models.moe import MoEConfig, MoELayer

    torch.manual_seed(0)
    kw = dict(vocab_size=8, block_size=16, n_layer=1, n_head=2, d_model=16, ffn_hidden=8,
              n_expert=4, top_k=2, capacity_factor=0.75)
    whole = MoELayer(MoEConfig(**kw))
    x = torch.randn(3, 16, 16)
    for size, parts in ((48, 1), (16, 3), (8, 6)):
        grouped = MoELayer(MoEConfig(**kw, group_size=size))
        grouped.load_state_dict(whole.state_dict())
        y, aux = grouped(x)
        if parts == 1:
            y1, aux1 = whole(x)
            torch.testing.assert_close(y, y1)
            torch.testing.assert_close(aux, aux1)
            continue
        flat = x.reshape(parts, 1, size, 16)
        alone = torch.cat([whole(flat[g])[0] for g in range(parts)], 1).reshape(3, 16, 16)
        torch.testing.assert_close(y, alone)
    assert not torch.allclose(y, whole(x)[0])  # groups of 8 fill their own, smaller buffers
    with pytest.raises(ValueError, match="group_size=5 does not divide"):
        MoELayer(MoEConfig(**kw, group_size=5))(x)
    with pytest.raises(ValueError, match="group_size=0"):
        MoEConfig(**kw, group_size=0)


def test_dropless_routing_drops_no_token_where_a_capacity_does() -> None:
    """``capacity_factor=None``: every token reaches each of its top-k experts (its combine
    weights sum to 1), where a capacity of 0.5 drops some; both keep static shapes."""
    from torchweave.models.moe import MoEConfig, MoELayer

    torch.manual_seed(0)
    x = torch.randn(64, 16)
    weights = {}
    for factor in (None, 0.5):
        layer = MoELayer(MoEConfig(vocab_size=8, block_size=8, n_layer=1, n_head=2, d_model=16,
                                   ffn_hidden=8, n_expert=4, top_k=2, capacity_factor=factor))
        layer.router.weight.data[:, 0] = torch.tensor([9.0, 8.0, 0.0, 0.0])  # a skewed load
        combine, dispatch, _ = layer.route(x)
        assert combine.shape == (64, 4, 64 if factor is None else 16)
        weights[factor] = combine.sum((1, 2))
    torch.testing.assert_close(weights[None], torch.ones(64))
    assert (weights[0.5] < 0.99).any()
    with pytest.raises(ValueError, match="dropless"):
        MoEConfig(vocab_size=8, block_size=8, n_layer=1, n_head=2, d_model=16, ffn_hidden=8,
                  n_expert=4, capacity_factor=0.0)
