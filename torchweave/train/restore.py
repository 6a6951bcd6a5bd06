"""Loading torchweave checkpoints (see :mod:`torchweave.train.checkpoint` for the layout).

Loading reads nothing through plain ``pickle``: tensors come through
``torch.load(weights_only=True)`` (inside DCP), and DCP's ``.metadata`` through
an unpickler that admits an exact list of classes (:data:`_ALLOWED`). Every rank reads
everything into scratch tensors first, and the module is changed only once all
ranks have succeeded.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torchweave.errors import Problem
from torchweave.runtime.executor import RankModule
from torchweave.runtime.train_state import set_groups

from torchweave.train.reshard import apply_resharded, reads
from torchweave.train.checkpoint import (
    CheckpointError,
    FORMAT,
    Restored,
    _META,
    _agree,
    _first_line,
    _world,
    checkpoints,
    latest,
)


_DCP = "torch.distributed.checkpoint"
_DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16",
           "float32", "float64", "complex64", "complex128")
_ALLOWED = frozenset({
    *((f"{_DCP}.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    *(("torch", n) for n in _DTYPES),
    ("torch.serialization", "_get_layout"),  # a layout from its name: a lookup in torch's dict
    ("pathlib", "PosixPath"),  # storage_meta.checkpoint_id
})
"""Every (module, name) the ``.metadata`` of a torchweave checkpoint holds (torch 2.13),
read off real checkpoints of every plan and ZeRO stage. Nothing else: no dotted names
(pickle resolves ``a.b`` by ``getattr``, and DCP's modules import ``os``), no
``builtins`` (``getattr`` reaches anything), and no ``BytesStorageMetadata``:
torchweave keeps non-tensor values in JSON, and DCP reads byte entries with
``torch.load(weights_only=False)``."""


class _Refused(pickle.UnpicklingError):
    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.target = f"{module}.{name}"


class _MetadataUnpickler(pickle.Unpickler):
    """Admits exactly the classes of :data:`_ALLOWED`."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise _Refused(module, name)
        return super().find_class(module, name)


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        with self.fs.create_stream(self._get_metadata_path(rank), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError("checkpoint metadata is not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _refused(path: Path, target: str) -> CheckpointError:
    older = [p for _, p in checkpoints(path.parent) if p != path]
    fix = (f"load only checkpoints you trust; to go on from the previous one, move {path} "
           f"out of {path.parent} (or load {older[-1]} explicitly)"
           if older else "load only checkpoints you trust, or start without --resume")
    return CheckpointError(Problem(
        obj="checkpoint metadata", value=f"{path / '.metadata'} tries to load {target}",
        rule="a checkpoint's metadata loads only DCP's metadata classes, torch sizes, dtypes "
             "and paths; it was refused before anything in it ran", fix=fix))


def _corrupt(path: Path, what: str) -> CheckpointError:
    return CheckpointError(Problem(
        obj="checkpoint", value=str(path), rule=f"a complete torchweave checkpoint: {what}",
        fix="load an older checkpoint (it is kept), or start without --resume"))


def _read_layout(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]], Metadata]:
    try:
        meta = json.loads((path / _META).read_text())
        if meta.get("format") != FORMAT:
            raise _corrupt(path, f"format {meta.get('format')!r}, expected {FORMAT}")
        ranks = [json.loads((path / f"rank{r}.json").read_text())
                 for r in range(int(meta["world_size"]))]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise _corrupt(path, _first_line(e)) from None
    try:
        md = _SafeReader(path).read_metadata()
    except _Refused as e:
        raise _refused(path, e.target) from None
    except Exception as e:  # noqa: BLE001 - a truncated or foreign .metadata
        raise _corrupt(path, f"DCP metadata unreadable ({_first_line(e)})") from None
    return meta, ranks, md


def _check_model(module: RankModule, path: Path, ranks: list[dict[str, Any]]) -> None:
    """The first tensor of the model whose shape or dtype the checkpoint does not match."""
    found: dict[str, dict[str, Any]] = {}
    for info in ranks:
        for p, piece in info.get("pieces", {}).items():
            found.setdefault(p, piece)
    for slot in module.program.params:
        expected = tuple(slot.full_shape)
        dtype = str(module.params[slot.path].dtype).removeprefix("torch.")
        have = found.get(slot.path)
        if have is None:
            value = "not in the checkpoint"
        elif tuple(have["shape"]) != expected:
            value = f"found shape {tuple(have['shape'])}"
        elif have["dtype"] != dtype:
            value = f"found dtype {have['dtype']}"
        else:
            continue
        raise CheckpointError(Problem(
            obj=f"tensor {slot.path}", value=value,
            rule=f"the model expects shape {expected}, dtype {dtype}; checkpoint {path} "
                 "is of a different model",
            fix="load a checkpoint written by this model"))


def load(path: str | os.PathLike, module: RankModule) -> Restored:
    """Restore ``module``'s pieces and optimizer state from checkpoint ``path``; collective.

    Nothing in ``module`` changes unless every rank read everything.
    """
    path = Path(path)
    rank, world = _world()
    error: Exception | None = None
    plan_tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {}
    ranks: list[dict[str, Any]] = []
    same = True
    try:
        meta, ranks, md = _read_layout(path)
        _check_model(module, path, ranks)
        same = _same_layout(module, meta, md, rank, world)
        plan_tensors = (_templates(module, path, meta, md, rank, world) if same
                        else reads(module, ranks, md, path))
    except CheckpointError as e:
        error = e
    _agree(error, "checkpoint load")

    try:
        dcp.load(plan_tensors, storage_reader=_SafeReader(path))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - truncated or altered files
        error = _corrupt(path, f"reading tensors failed ({_first_line(e)})")
    _agree(error, "checkpoint load")

    if not same:
        try:
            apply_resharded(module, ranks, plan_tensors)
        except (KeyError, RuntimeError, IndexError) as e:  # pieces that do not cover a tensor
            error = _corrupt(path, f"resharding failed ({_first_line(e)})")
        _agree(error, "checkpoint load")
        groups = ranks[0].get("optimizer_groups", {})
        saved = groups.get("optimizer") or groups.get("zero") or []
        for opt in module.optimizers():
            set_groups(opt, saved)
        return Restored(step=int(meta["step"]), path=path, extra=dict(ranks[0].get("extra", {})),
                        same_layout=False)
    info = ranks[rank]
    module.load_held(plan_tensors, info.get("optimizer_groups", {}))
    extra: dict[str, Any] = dict(info.get("extra", {}))
    for k in info.get("extra_tensors", []):
        extra[k] = plan_tensors[f"extra/rank{rank}/{k}"]
    return Restored(step=int(meta["step"]), path=path, extra=extra)


def _same_layout(module: RankModule, meta: dict[str, Any], md: Metadata, rank: int,
                 world: int) -> bool:
    """Whether this rank's pieces and ZeRO shard are saved exactly as it holds them."""
    if int(meta["world_size"]) != world:
        return False
    sdm = md.state_dict_metadata
    held = module.held_shapes()
    for key, (shape, _) in held.items():
        item = sdm.get(key)
        if item is None or (key.startswith("zero/") and not (
                isinstance(item, TensorStorageMetadata) and tuple(item.size) == shape)):
            return False
    zero = f"zero/rank{rank}/"
    return any(k.startswith(zero) for k in held) or not any(k.startswith(zero) for k in sdm)


def load_latest(directory: str | os.PathLike, module: RankModule) -> Restored | None:
    """Load the newest complete checkpoint under ``directory``; ``None`` if there is none."""
    found = latest(directory)
    return None if found is None else load(found, module)


def _templates(module: RankModule, path: Path, meta: dict[str, Any], md: Metadata,
               rank: int, world: int) -> dict[str, torch.Tensor]:
    """Empty tensors for every key this rank reads, shaped as the checkpoint says."""
    sdm = md.state_dict_metadata
    out: dict[str, torch.Tensor] = {}

    def add(key: str, like: torch.Tensor | None = None) -> None:
        item = sdm.get(key)
        if not isinstance(item, TensorStorageMetadata):
            raise _corrupt(path, f"tensor {key!r} missing from its DCP metadata")
        if like is not None and tuple(item.size) != tuple(like.shape):
            raise _corrupt(path, f"tensor {key!r} has shape {tuple(item.size)}, "
                                 f"expected {tuple(like.shape)}")
        out[key] = torch.empty(tuple(item.size), dtype=item.properties.dtype)

    for key, (shape, dtype) in module.held_shapes().items():  # local, unlike state_pieces()
        add(key, torch.empty(shape, dtype=dtype))
        # a piece's optimizer state is under optim/<piece>/, the ZeRO shard's beside its master
        state = ("optim/" + key.removeprefix("param/") + "/" if key.startswith("param/")
                 else key.removesuffix("master"))
        for k in sdm:
            if k.startswith(state) and k != key:
                add(k)
    for k in sdm:
        if k.startswith(f"extra/rank{rank}/"):
            add(k)
    return out


__all__ = ["load", "load_latest"]
