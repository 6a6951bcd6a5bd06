"""A rank's training state by key, for checkpoints: its pieces, their optimizer state and
its ZeRO shard, each under the key of the (parameter path, box) it covers.

Keys (the checkpoint layout of :mod:`torchweave.train.checkpoint`):

- ``param/<path>@<box>``: a parameter or buffer piece, ``box`` as ``a:b,c:d`` over the
  full tensor (:func:`piece_key`);
- ``optim/<path>@<box>/<name>``: that piece's optimizer state (``exp_avg``, ``step#int``);
- ``zero/rank<r>/master`` and ``zero/rank<r>/<name>``: a ZeRO member's flat master
  shard and its optimizer state.

:class:`~torchweave.runtime.executor.RankModule` exposes these as methods; the trainer's
checkpoint code reads and writes a module only through them, never through ZeRO's
master shard or the inner optimizers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torchweave.runtime.executor import RankModule


@dataclass
class OptimizerState:
    """Optimizer state of one rank, as flat tensors and JSON hyper-parameters."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Keys (``optim/...``, ``zero/...``) → tensors."""
    groups: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """``optimizer`` / ``zero`` → its ``param_groups`` without the parameters."""


def box_str(box: Any) -> str:
    return ",".join(f"{a}:{b}" for a, b in box)


def piece_key(path: str, box: Any) -> str:
    """The name of the piece of ``path`` covering ``box``: ``path@a:b,c:d``."""
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


def _state_from(tensors: dict[str, torch.Tensor], prefix: str, skip: str = "") -> dict[str, Any]:
    """The optimizer state saved under ``prefix``: the inverse of :func:`_state_tensors`."""
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


def set_groups(opt: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    """Hyper-parameters saved by :func:`optimizer_state` back into ``opt``'s groups."""
    for group, entry in zip(opt.param_groups, saved):
        for k, v in entry.items():
            if k in group:
                group[k] = tuple(v) if isinstance(group[k], tuple) and isinstance(v, list) else v


def _zero_prefix(module: RankModule) -> str:
    return f"zero/rank{module.program.rank}"


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
    if module.zero_opt is not None:
        prefix = _zero_prefix(module)
        out.tensors[f"{prefix}/master"] = module.zero_opt.master.detach()
        out.tensors.update(_state_tensors(prefix, module.zero_opt.inner.state.get(module.zero_opt.master, {})))
        out.groups["zero"] = _json_groups(module.zero_opt.inner)
    return out


def zero_spans(module: RankModule) -> dict[str, Any] | None:
    """Which spans of this ZeRO member's flat shard hold which piece (``None``: no ZeRO)."""
    opt = module.zero_opt
    if opt is None:
        return None
    paths = {id(t): p for p, t in module.params.items()}
    lay = opt.layout
    owned = [[paths[id(t)], [list(r) for r in module.slots[paths[id(t)]].box]] for t in opt.owned]
    spans = []
    for a, b, i in lay.segments(opt.index):
        u = lay.unit_of[i]
        off = a - lay.starts[u] + opt.index * lay.cols[u] - lay.offsets[i]
        spans.append([a, b, i, off])
    return {"owned": owned, "spans": spans}


def held_shapes(module: RankModule) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every ``param/`` key this rank holds, and its ZeRO ``master`` key: shape and dtype.
    Local only (unlike :meth:`~torchweave.runtime.executor.RankModule.state_pieces`, which
    gathers under ZeRO-3)."""
    out = {f"param/{piece_key(p, s.box)}": (tuple(b - a for a, b in s.box), module.params[p].dtype)
           for p, s in module.slots.items()}
    if module.zero_opt is not None:
        out[f"{_zero_prefix(module)}/master"] = (tuple(module.zero_opt.master.shape),
                                                 module.zero_opt.master.dtype)
    return out


def load_held(module: RankModule, tensors: dict[str, torch.Tensor],
              groups: dict[str, list[dict[str, Any]]]) -> None:
    """Set every piece, its optimizer state and the ZeRO shard from ``tensors`` saved under
    this very layout (the keys of :func:`held_shapes` and their ``optim/`` and ``zero/``
    state), and the optimizers' hyper-parameters from ``groups``."""
    opt = module.zero_opt
    stage3 = opt is not None and opt.stage == 3
    with torch.no_grad():
        for p, t in module.params.items():
            if stage3 and opt.owns(t):
                continue  # held as the master shard
            t.copy_(tensors[f"param/{piece_key(p, module.slots[p].box)}"])
        if module.optimizer is not None:
            for p, t in module.params.items():
                st = _state_from(tensors, f"optim/{piece_key(p, module.slots[p].box)}/")
                if st:
                    module.optimizer.state[t] = st
            set_groups(module.optimizer, groups.get("optimizer", []))
        if opt is not None:
            prefix = _zero_prefix(module) + "/"
            opt.master.copy_(tensors[prefix + "master"])
            st = _state_from(tensors, prefix, skip="master")
            if st:
                opt.inner.state[opt.master] = st
            set_groups(opt.inner, groups.get("zero", []))


def load_full(module: RankModule, full: dict[str, torch.Tensor],
              state: dict[str, dict[str, torch.Tensor]]) -> None:
    """Cut this rank's pieces, their optimizer state and its ZeRO shard out of whole tensors:
    ``full`` by parameter path, ``state`` by path then state name (elementwise state as a
    whole tensor, scalars as they are)."""
    opt = module.zero_opt
    stage3 = opt is not None and opt.stage == 3

    def sl(p: str) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in module.slots[p].box)

    with torch.no_grad():
        for p, t in module.params.items():
            if not (stage3 and opt.owns(t)):
                t.copy_(full[p][sl(p)])
        if module.optimizer is not None:
            mine = {id(x) for g in module.optimizer.param_groups for x in g["params"]}
            for p, t in module.params.items():
                st = state.get(p)
                if st and id(t) in mine:
                    module.optimizer.state[t] = {
                        k: (v[sl(p)].clone() if v.dim() else v.clone()) for k, v in st.items()}
        if opt is not None:
            owned = [p for p, t in module.params.items() if opt.owns(t)]
            opt.load_state(module.params, {p: full[p][sl(p)] for p in owned},
                           {p: {k: (v[sl(p)] if v.dim() else v) for k, v in state.get(p, {}).items()}
                            for p in owned})


__all__ = ["OptimizerState", "box_str", "held_shapes", "load_full", "load_held", "optimizer_state",
           "piece_key", "set_groups", "zero_spans"]
