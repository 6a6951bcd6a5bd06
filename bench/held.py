"""Bytes a rank holds for training state, as the PyTorch sides of the benches count them
(DTensors: their local shard; each storage once)."""

from __future__ import annotations

from typing import Any

import torch


def local(t: Any) -> Any:
    """A DTensor's local shard; anything else as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def held_bytes(tensors: list[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shard)."""
    storages: dict[int, int] = {}
    for t in tensors:
        t = local(t)
        if not isinstance(t, torch.Tensor):
            continue
        s = t.untyped_storage()
        storages[s.data_ptr() or id(s)] = s.nbytes()
    return sum(storages.values())


def optimizer_state(opt: torch.optim.Optimizer | None) -> list[Any]:
    if opt is None:
        return []
    return [v for st in opt.state.values() for v in st.values()]


def fsdp_shards(model: torch.nn.Module) -> list[Any]:
    """The sharded parameters FSDP2 holds (not reachable by ``parameters()`` while it has put
    the gathered ones in their place). FSDP2's own attributes: none on another version."""
    out = []
    for m in model.modules():
        state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
        group = getattr(state, "_fsdp_param_group", None)
        out += [fp.sharded_param for fp in getattr(group, "fsdp_params", None) or []]
    return out
