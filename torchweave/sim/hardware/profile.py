"""Profiled op timings: the other source of compute times besides the roofline.

Each piece of a node that a plan runs is timed on the device at hand, forward
and backward, with the piece's local shapes (:func:`profile_graph`). Timings
are cached by op, local input shapes and dtypes, constant arguments and
device (:class:`OpProfiles`), in a JSON file the caller names (the CLI uses
``~/.cache/torchweave/op-profiles/<device>.json``), so a model is timed once
per device and a plan that cuts it the same way reuses the entries.

The simulator (:class:`~torchweave.sim.step.build.Builder`) takes a profiled time
in place of the roofline for each node whose key is in the table. Timing a
piece on ``threads`` threads while ``ranks`` processes share ``cores`` cores is
not what each rank sees; ``scale`` (default 1) multiplies every looked-up time
(``bench/sim_accuracy.py`` passes ranks per core when there are more ranks than
cores, as ``calibrate`` does for its rates).

How a piece is timed: inputs are random tensors of the piece's local shapes
(integer tensors are zeros, a valid index for every op); arguments are the ones
lowering gives the piece (:func:`torchweave.lower.pieces.local_call`).
Forward is the median of ``reps`` calls after one warm-up, with autograd
recording as in training; backward is the
median of ``torch.autograd.grad`` of every floating output with respect to
every floating input, with a fresh forward each time (outside the timing).
Ops that fail to run this way keep their roofline time.
"""

from __future__ import annotations

import importlib
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchweave.ir.graph import Graph, Node, Ref, resolve_target
from torchweave.lower.pieces import PieceInfo, local_call, tensor_box
from torchweave.ops import info
from torchweave.plan.plan import Plan

VERSION = 1


@dataclass
class OpProfiles:
    """Measured (forward, backward) seconds by op key, for one device."""

    device: str
    """What the times were measured on (and how: threads per process)."""
    table: dict[str, tuple[float, float]] = field(default_factory=dict)
    scale: float = 1.0
    """Multiplies every looked-up time (see the module docstring)."""

    def lookup(self, key: str) -> tuple[float, float] | None:
        hit = self.table.get(key)
        return None if hit is None else (hit[0] * self.scale, hit[1] * self.scale)

    def save(self, path: str | Path) -> None:
        """Write this device's table into the cache at ``path`` (other devices' are kept)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        devices = _read(path)
        devices[self.device] = {k: list(v) for k, v in sorted(self.table.items())}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": VERSION, "devices": devices}, indent=0))
        tmp.replace(path)

    @staticmethod
    def load(path: str | Path, *, device: str, scale: float = 1.0) -> "OpProfiles":
        """``device``'s table from the cache at ``path`` (empty when absent)."""
        table = _read(Path(path)).get(device, {})
        return OpProfiles(device, {k: (v[0], v[1]) for k, v in table.items()}, scale)


def _read(path: Path) -> dict[str, dict[str, list[float]]]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data.get("devices", {}) if data.get("version") == VERSION else {}


def first_piece(plan: Plan, node: str) -> PieceInfo | None:
    """Piece ``(0, …, 0)`` of ``node`` (every piece of an even split has its shapes)."""
    devs = plan.assignment.get(node)
    if not devs:
        return None
    chunks: dict[str, tuple[int, int]] = {}
    for t in plan.transforms(node):
        if t.dim is not None:
            chunks[t.dim] = (0, chunks.get(t.dim, (0, 1))[1] * t.parts)
    return PieceInfo(tuple(0 for _ in plan.transforms(node)), chunks, 0, devs[0])


@dataclass(frozen=True)
class _Call:
    key: str
    fn: str
    args: Any
    kwargs: Any
    inputs: tuple[tuple[tuple[int, ...], torch.dtype], ...]


def _call(graph: Graph, node: Node, piece: PieceInfo, dtype: torch.dtype | None) -> _Call:
    op = info(graph, node)
    specs = op.bound.annotation.inputs
    shapes: list[tuple[tuple[int, ...], torch.dtype]] = []
    k = iter(range(len(specs)))

    def local(x: Any) -> Any:
        if not isinstance(x, Ref):
            return x
        i = next(k)
        meta = graph.values[x.name].meta
        box = tensor_box(op.bound, specs[i], meta.shape, piece) if i < len(specs) else None
        shape = tuple(b - a for a, b in box) if box is not None else meta.shape
        dt = dtype if dtype is not None and meta.dtype.is_floating_point else meta.dtype
        shapes.append((shape, dt))
        return _Slot(len(shapes) - 1)

    args, kwargs = _tree(local, (node.args, node.kwargs))
    outs = graph.output_metas(node)
    out_box = tensor_box(op.bound, op.bound.annotation.outputs[0], outs[0].shape, piece) if outs else ()
    fn, args, kwargs = local_call(op.spec, node.target, args, kwargs, op.bound, out_box, piece)
    key = f"{fn}|{[(list(s), str(d)) for s, d in shapes]}|{_const(args)}|{_const(kwargs)}"
    return _Call(key, fn, args, kwargs, tuple(shapes))


def op_key(graph: Graph, node: Node, piece: PieceInfo | None, dtype: torch.dtype | None) -> str | None:
    """The cache key of ``node``'s ``piece`` (None: no piece)."""
    return None if piece is None else _call(graph, node, piece, dtype).key


@dataclass(frozen=True)
class _Slot:
    index: int


def _tree(fn, x: Any) -> Any:
    if isinstance(x, tuple):
        return tuple(_tree(fn, y) for y in x)
    if isinstance(x, list):
        return [_tree(fn, y) for y in x]
    if isinstance(x, dict):
        return {k: _tree(fn, v) for k, v in x.items()}
    return fn(x)


def _const(x: Any) -> str:
    return repr(_tree(lambda y: "T" if isinstance(y, _Slot) else y, x))


def _resolve(fn: str) -> Any:
    if fn.startswith("torchweave.") or fn.count(".") < 2:
        module, _, name = fn.rpartition(".")
        return getattr(importlib.import_module(module), name)
    return resolve_target(fn)


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; the CPU does not)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn, reps: int, *, warmup: bool = False, device: torch.device | str = "cpu") -> float:
    """Median wall time of ``reps`` calls of ``fn`` (after one untimed call with ``warmup``),
    each timed until ``device`` has finished it."""
    device = torch.device(device)
    if warmup:
        fn()
    out = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def time_call(call: _Call, reps: int, device: torch.device | str = "cpu") -> tuple[float, float]:
    """(forward, backward) median seconds of one piece's call, on ``device``."""
    f = _resolve(call.fn)
    device = torch.device(device)
    tensors = []
    for shape, dt in call.inputs:
        if dt.is_floating_point:
            tensors.append(torch.randn(shape, dtype=dt, device=device).requires_grad_(True))
        else:
            tensors.append(torch.zeros(shape, dtype=dt, device=device))
    args, kwargs = _tree(lambda y: tensors[y.index] if isinstance(y, _Slot) else y,
                         (call.args, call.kwargs))

    def fwd():
        return f(*args, **kwargs)

    fwd()  # with autograd recording, as in training
    t_fwd = median_time(fwd, reps, device=device)
    floats = [t for t in tensors if t.requires_grad]
    out = fwd()
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
            if isinstance(o, torch.Tensor) and o.requires_grad]
    if not floats or not outs:
        return t_fwd, 0.0
    times = []
    for _ in range(reps + 1):
        out = fwd()
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(o, torch.Tensor) and o.requires_grad]
        grads = [torch.ones_like(o) for o in outs]
        _sync(device)
        t0 = time.perf_counter()
        torch.autograd.grad(outs, floats, grads, allow_unused=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return t_fwd, statistics.median(times[1:])


def profile_graph(graph: Graph, plan: Plan, profiles: OpProfiles, *,
                  dtype: torch.dtype | None = None, reps: int = 5,
                  device: torch.device | str = "cpu") -> int:
    """Time every node piece of ``plan`` not yet in ``profiles``, and the optimizer step of
    each rank's parameters (lowered programs), on ``device``; returns how many entries
    were timed. ``profiles.device`` should name that device: keys do not."""
    from torchweave.lower.lower import lower
    from torchweave.lower.program import optimizer_numels

    done = 0
    for prog in lower(graph, plan):
        numels = optimizer_numels(prog.params, plan.zero_group(prog.rank))
        done += profile_optimizer(numels, profiles, reps=reps, device=device)
    for node in graph.nodes:
        piece = first_piece(plan, node.name)
        if piece is None:
            continue
        try:
            call = _call(graph, node, piece, dtype)
        except Exception:  # noqa: BLE001 - a node that cannot be keyed keeps its roofline
            continue
        if call.key in profiles.table:
            continue
        try:
            profiles.table[call.key] = time_call(call, reps, device)
        except Exception:  # noqa: BLE001 - an op that cannot run on random inputs
            continue
        done += 1
    return done


def optimizer_key(numels: list[int]) -> str:
    """Cache key of one AdamW step over fp32 tensors of these sizes."""
    return f"adamw|{sorted(numels)}"


def profile_optimizer(numels: list[int], profiles: OpProfiles, *, reps: int = 5,
                      device: torch.device | str = "cpu") -> bool:
    """Time ``torch.optim.AdamW.step`` over tensors of ``numels`` elements on ``device``
    (PyTorch's default implementation for the device); False when already cached.
    Stored as (step, 0)."""
    key = optimizer_key(numels)
    if key in profiles.table:
        return False
    params = [torch.zeros(n, requires_grad=True, device=device) for n in numels]
    for p in params:
        p.grad = torch.randn(p.numel(), device=device)
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()
    profiles.table[key] = (median_time(opt.step, reps, device=device), 0.0)
    return True


def sync_key(ranks: int) -> str:
    """Cache key of the extra seconds a collective over ``ranks`` costs after compute."""
    return f"sync|{ranks}"


def profile_sync(profiles: OpProfiles, *, ranks: int, all_reduce, segment: float = 0.005,
                 reps: int = 15) -> float:
    """Measure, on every rank of a running group at once, what a collective costs when the
    ranks come to it from computing rather than from waiting: the median of
    ``compute; all_reduce`` minus ``compute`` alone and ``all_reduce`` alone (``all_reduce``
    reduces one float over the group). On a machine whose cores are shared (more
    ranks than cores, other jobs) ranks arrive out of step and each collective waits
    for the last; a calibration with idle ranks does not see it. Stored as
    ``(seconds, 0)`` under :func:`sync_key`; the simulator adds it to every collective."""
    a = torch.randn(128, 128)
    t_one = median_time(lambda: a @ a, 5)
    n = max(1, int(segment / max(t_one, 1e-7)))
    x = torch.ones(1)

    def compute() -> None:
        for _ in range(n):
            a @ a

    def both() -> None:
        compute()
        all_reduce(x)

    all_reduce(x)
    t_c = median_time(compute, reps)
    t_r = median_time(lambda: all_reduce(x), reps)
    extra = max(0.0, median_time(both, reps) - t_c - t_r)
    profiles.table[sync_key(ranks)] = (extra, 0.0)
    return extra


__all__ = ["OpProfiles", "first_piece", "op_key", "optimizer_key", "profile_graph",
           "profile_optimizer", "profile_sync", "sync_key", "time_call"]
