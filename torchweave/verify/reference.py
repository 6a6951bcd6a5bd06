"""The one-device run a plan is compared with: the same training, the same batches, the
runtime's bf16 recipe where the plan has it, and the multi-forward recycling loop."""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import torch

from torchweave.runtime.executor import OptimizerFactory, StepConfig

def recycled_forward(model: torch.nn.Module, inputs: tuple, passes: int,
                     links: dict[int, str], call: Callable[..., Any] | None = None) -> torch.Tensor:
    """The one-device multi-forward loop: ``passes - 1`` passes without gradients, each
    replacing input ``i`` by the (detached) output of module ``links[i]``; then the loss
    of the pass with gradients. ``call`` runs ``model`` (default: ``model`` itself)."""
    call = call or model
    inputs, got = list(inputs), {}
    hooks = [model.get_submodule(path).register_forward_hook(
        lambda _mod, _args, out, i=i: got.__setitem__(i, out)) for i, path in links.items()]
    try:
        with torch.no_grad():
            for _ in range(passes - 1):
                call(*inputs)
                for i in links:
                    inputs[i] = got[i].detach()
    finally:
        for h in hooks:
            h.remove()
    return call(*inputs)


def _reference(model: torch.nn.Module, inputs: tuple, steps: int, optimizer: OptimizerFactory,
               config: StepConfig, recycle: tuple[int, dict[int, str]] | None = None) -> dict[str, Any]:
    """The same training on one device (with ``recycle``: the recycling loop per micro-batch).

    With ``config.precision == "bf16"`` it follows the runtime's recipe
    (``RankModule``): every forward computes in bf16 on casts of the fp32 master
    parameters and buffers, with floating inputs cast to bf16; the loss goes back
    to fp32 before backward, so gradients arrive, accumulate and are clipped in
    fp32 on the masters, and the optimizer updates the fp32 masters.
    """
    m = copy.deepcopy(model)
    named = dict(m.named_parameters())
    opt = optimizer(list(named.values()))
    losses, grads = [], {}
    for step in range(steps):
        k = config.grad_accum
        total = 0.0
        for micro in zip(*[torch.chunk(x, k, dim=0) for x in inputs]):
            call: Callable[..., Any] = m
            if config.precision == "bf16":
                micro = tuple(_bf16(x) if isinstance(x, torch.Tensor) else x for x in micro)
                call = _bf16_call(m)
            loss = call(*micro) if recycle is None else recycled_forward(m, micro, *recycle, call=call)
            (loss.float() / k if config.precision == "bf16" else loss / k).backward()
            total += float(loss.detach())
        if config.clip_grad_norm is not None:
            clip_exact(list(named.values()), config.clip_grad_norm)
        if step == 0:
            grads = {k_: v.grad.detach().clone() for k_, v in named.items() if v.grad is not None}
        losses.append(total / k)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads,
            "params": {k_: v.detach().clone() for k_, v in named.items()}}


def clip_exact(params: list[torch.Tensor], max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s rule (scale by ``max_norm / (norm + 1e-6)``
    when under 1) with the norm summed in float64, as the runtime sums it.

    PyTorch's own norm of a float32 gradient is not exact enough to judge by: on
    CPU, the 2M-element float32 head of t5-tiny comes out 4.6e-5 low, so every
    clipped gradient of a correct plan would be 3e-5 off (found by the fuzzer).
    """
    grads = [p.grad for p in params if p.grad is not None]
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    scale = max_norm / (norm + 1e-6)
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)
    return norm


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """The runtime's cast (``RankModule._cast``): floating tensors to bf16, through autograd."""
    return t.to(torch.bfloat16) if t.is_floating_point() else t


def _bf16_call(m: torch.nn.Module) -> Callable[..., Any]:
    """``m``'s forward on bf16 casts of its parameters and buffers (gradients reach the masters)."""
    state = {n: _bf16(t) for n, t in [*m.named_parameters(), *m.named_buffers()]}
    return lambda *args: torch.func.functional_call(m, state, args)
