"""Data from rank 0 to every rank, over the world group: text as UTF-8 bytes in a ``uint8``
tensor, tensors as themselves. Nothing is pickled, so what arrives is read as data only
(see :func:`torchweave.front.shared_front`)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from torchweave.runtime.groups import GroupCache


def _device(groups: GroupCache) -> torch.device:
    """NCCL moves device tensors only; gloo, host ones."""
    return groups.device if groups.nccl else torch.device("cpu")


def broadcast_text(groups: GroupCache, text: str | None) -> str:
    """Rank 0's ``text`` on every rank (the others pass None)."""
    dev = _device(groups)
    data = text.encode() if groups.rank == 0 and text is not None else b""
    n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    dist.broadcast(n, 0)
    size = int(n.item())
    if groups.rank == 0:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev) if size else \
            torch.empty(0, dtype=torch.uint8, device=dev)
    else:
        buf = torch.empty(size, dtype=torch.uint8, device=dev)
    if size:
        dist.broadcast(buf, 0)
    return bytes(buf.cpu().numpy().tobytes()).decode()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s data as a flat ``uint8`` tensor on the CPU (what :func:`broadcast_tensor` sends:
    bytes travel on every backend, whatever the dtype)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).clone()


def broadcast_tensor(groups: GroupCache, data: torch.Tensor | None, shape: tuple[int, ...],
                     dtype: torch.dtype) -> torch.Tensor:
    """Rank 0's tensor (its :func:`as_bytes`; the others pass None) of ``shape`` and
    ``dtype``, as every rank was told, on every rank, on the CPU."""
    dev = _device(groups)
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = data.to(dev) if groups.rank == 0 and data is not None else \
        torch.empty(size, dtype=torch.uint8, device=dev)
    if size:
        dist.broadcast(buf, 0)
    return buf.cpu().view(dtype).reshape(shape)
