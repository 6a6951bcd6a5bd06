"""The state one rank's step shares between its parts: what forward learned, for backward
and the gradient sums (:mod:`~torchweave.sim.step.build`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchweave.lower.program import Program


@dataclass(frozen=True)
class NodeCost:
    fwd: float
    bwd: float
    out_bytes: tuple[int, ...]
    """Local bytes of each output on a rank that runs a piece."""
    grad: bool
    """Whether any output carries a gradient (``Graph.grad_values``): else the node has no
    backward and saves nothing for one."""
    model_flops: float
    """Forward and backward FLOPs of the whole node."""


@dataclass
class Footprint:
    """What one rank's step allocates, besides the model state (bytes)."""

    params: int = 0
    """Parameter elements held."""
    kept: int = 0
    """Of ``params``, the elements a ZeRO plan keeps whole (``lower.program.zero_owns``:
    what its group does not sum, such as a tied weight's copies, summed across stage groups,
    a norm's under sequence parallelism, and under ep all but the experts): the runtime all-reduces their gradients and keeps
    their full optimizer state. 0 without ZeRO."""
    stage_activations: dict[int, int] = field(default_factory=dict)
    """Pipelined plans: activation bytes by stage (for the whole batch)."""
    boundary: dict[int, float] = field(default_factory=dict)
    """Pipelined plans: bytes received into each stage from other stage groups."""
    n_fwd: int = 0
    """How many of the rank's tasks are forward (the rest: backward, sync, optimizer)."""
    gathered: list[int] = field(default_factory=list)
    """ZeRO-3: units in the order forward gathers them."""
    buffers: int = 0
    activations: int = 0
    temporaries: int = 0
    """The largest of what ``held`` counts and the gradient buckets."""
    held: int = 0
    """Forward's temporaries: twice the largest activation (one micro-batch's, in a
    pipeline), two ZeRO-3 units."""
    bucket: int = 0
    """The largest gradient bucket."""
    grad_order: list[tuple[str, tuple[int, ...], float]] = field(default_factory=list)
    """(parameter, group, bytes) in the order backward reaches each gradient sum."""


@dataclass
class RankForward:
    """What one rank's forward pass leaves for its backward."""

    prog: Program
    foot: Footprint
    params: dict
    """Local name → ``ParamSlot`` of the parameters that take a gradient."""
    nbytes: dict[str, float] = field(default_factory=dict)
    """Local bytes of every value the rank holds."""
    first_reader: dict[str, int] = field(default_factory=dict)
    """Parameter → the instruction that reads it first (its gradient is complete after
    that instruction's backward)."""
    refs_of: dict[int, list[str]] = field(default_factory=dict)
    """Compute instruction → the local values it reads."""
    unit_of: dict[str, int] = field(default_factory=dict)
    """ZeRO-3: owned parameter → its unit (:mod:`torchweave.lower.units`)."""
    members: dict[int, list[str]] = field(default_factory=dict)
    """ZeRO-3: unit → its parameters."""
    views: dict[str, str] = field(default_factory=dict)
    """A co-shard chunk's slice of a parameter → the parameter (its reader needs the unit)."""
    regather: dict[str, tuple[Any, float, str]] = field(default_factory=dict)
    """A ``regather`` all-gather's result → (its step, its bytes, the graph value it
    moves): saved as the shard."""
    regather_readers: dict[int, list[str]] = field(default_factory=dict)
    """Compute instruction → the regathered results it saved (gathered again before its
    backward, once for all the instruction's readers: :mod:`torchweave.runtime.regather`)."""


@dataclass
class SyncInputs:
    """What :func:`~torchweave.sim.step.backward.place_syncs` needs of one rank besides its tasks."""

    params: dict
    """Local name → ``ParamSlot`` of the parameters that take a gradient."""
    nbytes: dict[str, float]
    """Local bytes of each of them."""


def mine(groups, rank: int) -> tuple[int, ...]:
    """The group of ``groups`` that holds ``rank`` (alone if none does)."""
    for grp in groups:
        if rank in grp:
            return tuple(grp)
    return (rank,)


__all__ = ["Footprint", "NodeCost", "RankForward", "SyncInputs", "mine"]
