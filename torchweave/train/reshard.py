"""Loading a checkpoint written under another plan or world size (resharding).

A checkpoint names every piece by the box it covers in the full tensor
(``param/<path>@<box>``), and a ZeRO member records which spans of its flat
shard hold which part of which piece. So any layout can be rebuilt: every rank
reads the saved pieces of the parameters it holds, assembles each full tensor
(and each full optimizer-state tensor), and cuts its own boxes and shards out
of them. Elementwise optimizer state (Adam's moments, SGD's momentum) follows
its parameter; scalar state (``step``) is copied. This costs one full tensor
per parameter held, at load time only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from torchweave.errors import Problem
from torchweave.runtime.executor import RankModule
from torchweave.train.checkpoint import CheckpointError, piece_key


def _box(b: Any) -> tuple[tuple[int, int], ...]:
    return tuple((int(x), int(y)) for x, y in b)


def _sl(box: Any) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def reads(module: RankModule, ranks: list[dict[str, Any]], md: Metadata,
          path: Path) -> dict[str, torch.Tensor]:
    """Empty tensors for every saved key that holds part of a parameter this rank needs."""
    need = set(module.slots)
    sdm = md.state_dict_metadata
    out: dict[str, torch.Tensor] = {}

    def add(key: str) -> None:
        item = sdm.get(key)
        if not isinstance(item, TensorStorageMetadata):
            raise CheckpointError(Problem(obj="checkpoint", value=str(path),
                                          rule=f"a complete checkpoint: {key!r} is missing",
                                          fix="load an older checkpoint (it is kept)"))
        out[key] = torch.empty(tuple(item.size), dtype=item.properties.dtype)

    for info in ranks:
        for p, piece in info.get("pieces", {}).items():
            if p in need:
                key = piece_key(p, _box(piece["box"]))
                add(f"param/{key}")
                for k in sdm:
                    if k.startswith(f"optim/{key}/"):
                        add(k)
        zero = info.get("zero")
        if zero and any(p in need for p, _ in zero["owned"]):
            prefix = f"zero/rank{info['rank']}/"
            for k in sdm:
                if k.startswith(prefix):
                    add(k)
    return out


def _assemble(module: RankModule, ranks: list[dict[str, Any]],
              got: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """Full parameters, and per parameter its full optimizer state (tensors) or scalars."""
    shapes = {p: tuple(s.full_shape) for p, s in module.slots.items()}
    full: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}

    def state_slot(p: str, name: str, like: torch.Tensor) -> torch.Tensor:
        st = state.setdefault(p, {})
        if name not in st:
            st[name] = torch.zeros(shapes[p], dtype=like.dtype)
        return st[name]

    def scalar(p: str, name: str, v: torch.Tensor) -> None:
        state.setdefault(p, {}).setdefault(name, v.clone())

    for info in ranks:
        for p, piece in info.get("pieces", {}).items():
            if p not in shapes:
                continue
            box = _box(piece["box"])
            key = piece_key(p, box)
            t = got[f"param/{key}"]
            full.setdefault(p, torch.empty(shapes[p], dtype=t.dtype))[_sl(box)] = t
            prefix = f"optim/{key}/"
            for k, v in got.items():
                if k.startswith(prefix):
                    name = k[len(prefix):]
                    if v.shape == t.shape and v.dim():
                        state_slot(p, name, v)[_sl(box)] = v
                    else:
                        scalar(p, name, v)
        zero = info.get("zero")
        if not zero or not any(p in shapes for p, _ in zero["owned"]):
            continue
        prefix = f"zero/rank{info['rank']}/"
        master = got[prefix + "master"]
        names = [k[len(prefix):] for k in got if k.startswith(prefix) and k != prefix + "master"]
        for a, b, i, off in zero["spans"]:
            p, box = zero["owned"][i][0], _box(zero["owned"][i][1])
            if p not in shapes:
                continue
            for name in names:
                v = got[prefix + name]
                if v.shape != master.shape:
                    scalar(p, name, v)
                    continue
                dst = state_slot(p, name, v)[_sl(box)]
                flat = dst.reshape(-1) if dst.is_contiguous() else None
                if flat is None:  # a strided box: copy through a contiguous buffer
                    buf = dst.contiguous().reshape(-1)
                    buf[off:off + b - a] = v[a:b]
                    dst.copy_(buf.view(dst.shape))
                else:
                    flat[off:off + b - a] = v[a:b]
    return full, state


def apply_resharded(module: RankModule, ranks: list[dict[str, Any]],
                    got: dict[str, torch.Tensor]) -> None:
    """Cut this rank's pieces, optimizer state and ZeRO shard out of the assembled tensors."""
    full, state = _assemble(module, ranks, got)
    module.load_full(full, state)


__all__ = ["apply_resharded", "reads"]
