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

Loading lives in :mod:`torchweave.train.restore`.

Resharding (loading under another plan or world size) is in
:mod:`torchweave.train.reshard`: the rank files keep every rank's boxes and
each ZeRO member's map from its flat shard to the pieces it holds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from torchweave.errors import Problem, TorchweaveError
from torchweave.runtime.executor import RankModule
from torchweave.runtime.train_state import OptimizerState, box_str, piece_key

FORMAT = 1
_STEP_RE = re.compile(r"^step-(\d+)$")
_META = "torchweave.json"


class CheckpointError(TorchweaveError):
    """A checkpoint that cannot be written, or cannot be loaded into this model."""


@dataclass
class Restored:
    """What :func:`load` gives back besides the module's restored state."""

    step: int
    path: Path
    extra: dict[str, Any]
    """This rank's ``extra`` as saved: JSON values and tensors. After resharding,
    rank 0's JSON values only (per-rank tensors such as RNG states do not carry over)."""
    same_layout: bool = True
    """False when the checkpoint was written under another plan or world size."""


def optimizer_state(module: RankModule) -> OptimizerState:
    """This rank's optimizer state, keyed by piece (or by ZeRO member)."""
    return module.optimizer_state()



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
        "zero": module.zero_spans(),
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




__all__ = [
    "CheckpointError", "OptimizerState", "Restored", "box_str", "checkpoints", "latest",
    "optimizer_state", "piece_key", "save",
]
