"""Sharded, atomic checkpoints of a :class:`RankModule` through ``torch.distributed.checkpoint``.

Layout of one checkpoint, ``<directory>/step-<N>``::

    .metadata, __<r>_0.distcp   DCP's files: every tensor, keyed as below
    rank<r>.json                what rank r held: boxes, full shapes, dtypes,
                                optimizer hyper-parameters, JSON extras
    torchweave.json             format, step, world size, plan; written last

Tensor keys (each piece once; replicas of a piece share its key, and DCP
writes it once):

- ``param/<path>@<box>``: a parameter or buffer piece, ``box`` as
  ``a:b,c:d`` over the full tensor;
- ``optim/<path>@<box>/<name>``: that piece's optimizer state (``exp_avg``...);
- ``zero/rank<r>/master`` and ``zero/rank<r>/<name>``: a ZeRO member's flat
  master shard and its optimizer state;
- ``extra/rank<r>/<key>``: tensors of the caller's ``extra`` (RNG states...).

Atomicity: ranks write into ``step-<N>.tmp``; after every rank has finished,
rank 0 renames it to ``step-<N>`` and only then deletes checkpoints beyond
``keep``. A name without ``.tmp`` is therefore always complete, and a failed
write leaves the older checkpoints as they were.

Loading reads nothing through plain ``pickle``: tensors come through
``torch.load(weights_only=True)`` (inside DCP), and DCP's ``.metadata`` through
an unpickler that admits only DCP's metadata classes.

Not yet: resharding (loading under another plan or world size). The rank
files keep every rank's boxes and the plan so that it can be added.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from torchweave.errors import Problem, TorchweaveError
from torchweave.runtime.executor import RankModule

FORMAT = 1
_STEP_RE = re.compile(r"^step-(\d+)$")
_META = "torchweave.json"


class CheckpointError(TorchweaveError):
    """A checkpoint that cannot be written, or cannot be loaded into this model."""


@dataclass
class OptimizerState:
    """Optimizer state of one rank, as flat tensors and JSON hyper-parameters."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """DCP keys (``optim/...``, ``zero/...``) → tensors."""
    groups: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """``optimizer`` / ``zero`` → its ``param_groups`` without the parameters."""


@dataclass
class Restored:
    """What :func:`load` gives back besides the module's restored state."""

    step: int
    path: Path
    extra: dict[str, Any]
    """This rank's ``extra`` as saved: JSON values and tensors."""


# ---------------------------------------------------------------- keys
def box_str(box: Any) -> str:
    return ",".join(f"{a}:{b}" for a, b in box)


def piece_key(path: str, box: Any) -> str:
    return f"{path}@{box_str(box)}"


def _num_key(name: str, value: Any) -> tuple[str, torch.Tensor] | None:
    """A non-tensor optimizer state entry as a tensor, its type kept in the name."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return f"{name}#int", torch.tensor(float(value), dtype=torch.float64)
    if isinstance(value, float):
        return f"{name}#float", torch.tensor(value, dtype=torch.float64)
    return None


def _state_tensors(prefix: str, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for name, v in state.items():
        if isinstance(v, torch.Tensor):
            out[f"{prefix}/{name}"] = v.detach()
        elif (kv := _num_key(name, v)) is not None:
            out[f"{prefix}/{kv[0]}"] = kv[1]
    return out


def _json_groups(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    groups = []
    for g in opt.param_groups:
        entry = {}
        for k, v in g.items():
            if k == "params":
                continue
            try:
                json.dumps(v)
            except TypeError:
                continue
            entry[k] = v
        groups.append(entry)
    return groups


def optimizer_state(module: RankModule) -> OptimizerState:
    """This rank's optimizer state, keyed by piece (or by ZeRO member)."""
    out = OptimizerState()
    if module.optimizer is not None:
        paths = {id(t): p for p, t in module.params.items()}
        for p, st in module.optimizer.state.items():
            path = paths[id(p)]
            out.tensors.update(_state_tensors(
                f"optim/{piece_key(path, module.slots[path].box)}", st))
        out.groups["optimizer"] = _json_groups(module.optimizer)
    if module.opt is not None:
        prefix = f"zero/rank{module.program.rank}"
        out.tensors[f"{prefix}/master"] = module.opt.master.detach()
        out.tensors.update(_state_tensors(prefix, module.opt.inner.state.get(module.opt.master, {})))
        out.groups["zero"] = _json_groups(module.opt.inner)
    return out


# ---------------------------------------------------------------- collective helpers
def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _agree(error: Exception | None, what: str) -> None:
    """Raise on every rank if any rank failed (so none waits in a later collective)."""
    rank, world = _world()
    failed = error is not None
    if world > 1:
        flag = torch.tensor([rank + 1 if failed else 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and not failed:
            raise CheckpointError(Problem(
                obj=what, value=f"failed on rank {int(flag.item()) - 1}",
                rule="every rank must succeed", fix="see that rank's error"))
    if failed:
        if isinstance(error, TorchweaveError):
            raise error
        raise CheckpointError(Problem(obj=what, value=f"{type(error).__name__}: {error}",
                                      rule="every rank must succeed")) from error


def _barrier() -> None:
    if _world()[1] > 1:
        dist.barrier()


def _first_line(e: BaseException) -> str:
    """``Type: first line``; for DCP's gathered failures, of the first rank's cause."""
    if isinstance(e, CheckpointException) and getattr(e, "failures", None):
        rank, cause = sorted(e.failures.items())[0]
        inner = cause[0] if isinstance(cause, tuple) else cause  # (exception, traceback)
        if isinstance(inner, BaseException):
            return f"rank {rank}: {_first_line(inner)}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


# ---------------------------------------------------------------- listing
def checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``directory`` as (step, path), oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = []
    for child in d.iterdir():
        m = _STEP_RE.match(child.name)
        if m and child.is_dir() and (child / _META).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``directory``, or ``None``."""
    found = checkpoints(directory)
    return found[-1][1] if found else None


# ---------------------------------------------------------------- save
def save(module: RankModule, optimizer_state_: OptimizerState | None, step: int,
         extra: dict[str, Any] | None, directory: str | os.PathLike, *, keep: int = 3,
         plan: str | None = None) -> Path:
    """Write this rank's share of a checkpoint of ``step``; collective over all ranks.

    ``optimizer_state_`` defaults to :func:`optimizer_state` of ``module``.
    ``extra`` holds per-rank JSON values and tensors (scheduler, data position,
    RNG). ``plan`` is the plan's JSON, kept for resharding. Returns the final
    path. Raises :class:`CheckpointError` on every rank if any rank's write
    fails; older checkpoints are then untouched.
    """
    rank, world = _world()
    directory = Path(directory)
    final = directory / f"step-{step}"
    tmp = directory / f"step-{step}.tmp"
    opt = optimizer_state_ if optimizer_state_ is not None else optimizer_state(module)
    pieces = module.state_pieces()  # collective under ZeRO-3: every rank calls it

    error: Exception | None = None
    if rank == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)  # left by an earlier failed write
            tmp.mkdir()
        except OSError as e:
            error = _write_error(directory, e)
    _agree(error, "checkpoint save")

    state: dict[str, torch.Tensor] = {}
    for path, (box, t) in pieces.items():
        state[f"param/{piece_key(path, box)}"] = t
    state.update(opt.tensors)
    json_extra: dict[str, Any] = {}
    for k, v in (extra or {}).items():
        if isinstance(v, torch.Tensor):
            state[f"extra/rank{rank}/{k}"] = v.detach()
        else:
            json_extra[k] = v
    rank_info = {
        "rank": rank,
        "pieces": {path: {"box": [list(r) for r in box], "shape": list(module.slots[path].full_shape),
                          "dtype": str(t.dtype).removeprefix("torch.")}
                   for path, (box, t) in pieces.items()},
        "optimizer_groups": opt.groups,
        "extra": json_extra,
        "extra_tensors": sorted(k for k, v in (extra or {}).items() if isinstance(v, torch.Tensor)),
    }
    try:
        text = json.dumps(rank_info)
    except TypeError as e:
        error = CheckpointError(Problem(obj="checkpoint extra", value=str(e),
                                        rule="JSON values or tensors"))
    _agree(error, "checkpoint save")

    try:
        dcp.save(state, storage_writer=FileSystemWriter(tmp, single_file_per_rank=True,
                                                        thread_count=1, overwrite=True))
        _write_text(tmp / f"rank{rank}.json", text)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - one clear error
        error = _write_error(directory, e)
    _agree(error, "checkpoint save")

    if rank == 0:
        try:
            _write_text(tmp / _META, json.dumps({
                "format": FORMAT, "step": step, "world_size": world,
                "plan_name": module.program.plan_name, "plan": plan,
            }))
            _fsync_dir(tmp)
            if final.exists():  # the same step saved again: replace it
                old = directory / f"step-{step}.old"
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
            _fsync_dir(directory)
        except OSError as e:
            error = _write_error(directory, e)
        if error is None:
            for _, old_path in checkpoints(directory)[:-keep] if keep > 0 else []:
                shutil.rmtree(old_path, ignore_errors=True)
    _agree(error, "checkpoint save")
    return final


def _write_error(directory: Path, e: BaseException) -> CheckpointError:
    return CheckpointError(Problem(
        obj="checkpoint directory", value=str(directory),
        rule=f"writable, with room for the checkpoint ({_first_line(e)})",
        fix="free space or fix permissions; the last good checkpoint is kept"))


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- load
class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what DCP's ``Metadata`` is made of."""

    _BUILTINS = {"set", "frozenset", "list", "dict", "tuple", "slice", "getattr"}

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint."):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None),
                                                               (torch.dtype, torch.layout,
                                                                torch.memory_format))):
            return getattr(torch, name)
        if (module, name) in {("torch.serialization", "_get_layout"),  # layout from its name
                              ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                              ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}:
            return super().find_class(module, name)
        if module == "collections" and name == "OrderedDict":
            return super().find_class(module, name)
        if module == "builtins" and name in self._BUILTINS - {"getattr"}:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, "
                                     "which a checkpoint never needs")


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
    try:
        meta, ranks, md = _read_layout(path)
        _check_model(module, path, ranks)
        plan_tensors = _templates(module, path, meta, md, rank, world)
    except CheckpointError as e:
        error = e
    _agree(error, "checkpoint load")

    try:
        dcp.load(plan_tensors, storage_reader=_SafeReader(path))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - truncated or altered files
        error = _corrupt(path, f"reading tensors failed ({_first_line(e)})")
    _agree(error, "checkpoint load")

    _apply(module, plan_tensors, ranks[rank])
    info = ranks[rank]
    extra: dict[str, Any] = dict(info.get("extra", {}))
    for k in info.get("extra_tensors", []):
        extra[k] = plan_tensors[f"extra/rank{rank}/{k}"]
    return Restored(step=int(meta["step"]), path=path, extra=extra)


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

    resharding = int(meta["world_size"]) != world
    for p, slot in module.slots.items():  # not state_pieces(): that is collective under ZeRO-3
        box = slot.box
        t = torch.empty([b - a for a, b in box], dtype=module.params[p].dtype)
        key = f"param/{piece_key(p, box)}"
        if resharding or key not in sdm:
            raise CheckpointError(Problem(
                obj="checkpoint", value=f"{path}: written by {meta['world_size']} ranks under "
                                        f"plan {meta.get('plan_name')!r}",
                rule=f"the same world size and plan as this run ({world} ranks, plan "
                     f"{module.program.plan_name!r}); piece {key!r} is not in it",
                fix="resume with the plan and world size that wrote it (resharding is not "
                    "supported yet)"))
        add(key, t)
        for k in sdm:
            if k.startswith(f"optim/{piece_key(p, box)}/"):
                add(k)
    if module.opt is not None:
        prefix = f"zero/rank{rank}/"
        add(prefix + "master", module.opt.master)
        for k in sdm:
            if k.startswith(prefix) and k != prefix + "master":
                add(k)
    for k in sdm:
        if k.startswith(f"extra/rank{rank}/"):
            add(k)
    return out


def _apply(module: RankModule, tensors: dict[str, torch.Tensor], info: dict[str, Any]) -> None:
    groups = info.get("optimizer_groups", {})
    stage3 = module.opt is not None and module.opt.stage == 3
    with torch.no_grad():
        for p, t in module.params.items():
            if stage3 and module.opt.owns(t):
                continue  # held as the master shard
            t.copy_(tensors[f"param/{piece_key(p, module.slots[p].box)}"])
        if module.optimizer is not None:
            for p, t in module.params.items():
                prefix = f"optim/{piece_key(p, module.slots[p].box)}/"
                st = _state_from(tensors, prefix)
                if st:
                    module.optimizer.state[t] = st
            _set_groups(module.optimizer, groups.get("optimizer", []))
        if module.opt is not None:
            prefix = f"zero/rank{module.program.rank}/"
            module.opt.master.copy_(tensors[prefix + "master"])
            st = _state_from(tensors, prefix, skip="master")
            if st:
                module.opt.inner.state[module.opt.master] = st
            _set_groups(module.opt.inner, groups.get("zero", []))


def _state_from(tensors: dict[str, torch.Tensor], prefix: str, skip: str = "") -> dict[str, Any]:
    st: dict[str, Any] = {}
    for k, v in tensors.items():
        if not k.startswith(prefix):
            continue
        name = k[len(prefix):]
        if name == skip or "/" in name:
            continue
        if name.endswith("#int"):
            st[name[:-4]] = int(v.item())
        elif name.endswith("#float"):
            st[name[:-6]] = float(v.item())
        else:
            st[name] = v
    return st


def _set_groups(opt: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    for group, entry in zip(opt.param_groups, saved):
        for k, v in entry.items():
            if k in group:
                group[k] = tuple(v) if isinstance(group[k], tuple) and isinstance(v, list) else v


__all__ = [
    "CheckpointError", "OptimizerState", "Restored", "checkpoints", "latest", "load",
    "load_latest", "optimizer_state", "save",
]
