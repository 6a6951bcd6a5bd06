"""Irregular redistribution by point-to-point transfers, differentiable.

The lowering plans the transfers (:class:`torchweave.lower.steps.P2P`); the
generated code passes them here as plain data. Backward sends each reader's
gradient back to every holder of the region it read, scaled so that replicated
readers count once, and sums what arrives.
"""

from __future__ import annotations

from typing import Any

import torch

from torchweave.runtime.collectives import exchange


def _region(t: torch.Tensor, box) -> torch.Tensor:
    return t[tuple(slice(a, b) for a, b in box)]


def _run(group_cache, x: torch.Tensor, transfers, out_shape, rank: int) -> torch.Tensor | None:
    sends = [(dst, _region(x, sbox)) for src, dst, sbox, dbox, _ in transfers
             if src == rank and dst != rank]
    recvs = [(src, [b - a for a, b in dbox], x.dtype) for src, dst, sbox, dbox, _ in transfers
             if dst == rank and src != rank]
    got = iter(exchange(group_cache, sends, recvs))
    if out_shape is None:
        for _ in recvs:
            next(got)
        return None
    out = torch.zeros(out_shape, dtype=x.dtype, device=x.device)
    for src, dst, sbox, dbox, add in transfers:
        if dst != rank:
            continue
        piece = _region(x, sbox) if src == rank else next(got)
        target = _region(out, dbox)
        if add:
            target.add_(piece)
        else:
            target.copy_(piece)
    return out


class _P2P(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, rt: Any, spec: dict) -> torch.Tensor:
        ctx.rt, ctx.spec, ctx.shape = rt, spec, tuple(x.shape)
        shapes = dict(spec["shapes"])
        out = _run(rt.group_cache, x, spec["transfers"], shapes.get(rt.rank), rt.rank)
        return out if out is not None else x.new_zeros(0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rt, spec = ctx.rt, ctx.spec
        scale = dict(spec["grad_scale"]).get(rt.rank, 1.0)
        if grad is None or grad.numel() == 0:
            grad = torch.zeros(dict(spec["shapes"]).get(rt.rank, (0,)), device=rt.device)
        grad = grad.contiguous() * scale if scale != 1.0 else grad.contiguous()
        holder = torch.zeros(ctx.shape, dtype=grad.dtype, device=grad.device)
        back = spec["grad_back"]
        sends = [(dst, _region(grad, sbox)) for src, dst, sbox, dbox, _ in back
                 if src == rt.rank and dst != rt.rank]
        recvs = [(src, [b - a for a, b in dbox], grad.dtype) for src, dst, sbox, dbox, _ in back
                 if dst == rt.rank and src != rt.rank]
        got = iter(exchange(rt.group_cache, sends, recvs))
        for src, dst, sbox, dbox, _ in back:
            if dst != rt.rank:
                continue
            piece = _region(grad, sbox) if src == rt.rank else next(got)
            _region(holder, dbox).add_(piece)
        return holder, None, None


def p2p(rt: Any, x: torch.Tensor, spec: dict) -> torch.Tensor:
    """Redistribute ``x`` as ``spec`` says; ranks that only send get an empty token."""
    out = _P2P.apply(x, rt, spec)
    if out.numel() == 0 and x.requires_grad:
        rt.send_roots.append(out)
    return out
