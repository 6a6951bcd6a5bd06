"""A library that registers a custom op when imported (as transformers registers its own)."""

import torch


@torch.library.custom_op("twlibtest::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@twice.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    return grad * 2


twice.register_autograd(_backward)
