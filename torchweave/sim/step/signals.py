"""What tasks say to each other and to the engine: the step's small protocol.

A :class:`~torchweave.sim.step.engine.Task` waits for and sets *ready* names:

- a forward value is its graph name (``str``);
- anything else is a :class:`Signal`: the gradient of a value, a ZeRO-3 parameter
  gathered again in backward, a gradient sum done, the optimizer done;
- a copy of either, made by the fast paths or by accumulation, is :class:`Renamed`.

A collective's :class:`Rendezvous` is the key every member of its group shares;
it says what the collective is for (:class:`Meet`), so readers ask
``key.meet is Meet.GRAD_SUM`` rather than parsing strings. The three shapes of
ready names never compare equal to one another (a ``str``, a pair led by an
:class:`Of`, a triple led by anything and a :class:`Copying`).
"""

from __future__ import annotations

from enum import IntEnum, StrEnum
from typing import NamedTuple, Union


class Kind(StrEnum):
    """What a task occupies."""

    COMPUTE = "compute"
    """The compute stream."""
    COMM = "comm"
    """The communication stream (a collective meets its group there)."""
    LOCAL = "local"
    """No stream and no time: it only passes readiness on (views, local slices)."""
    REACH = "reach"
    """Not run: a marker in backward where a parameter's gradient may start summing
    (:func:`~torchweave.sim.step.backward.place_syncs` replaces every one)."""


class Of(IntEnum):
    """What a :class:`Signal` is about."""

    GRAD = 1
    """The gradient of the named value is complete."""
    REGATHERED = 2
    """Gathered again for backward: ZeRO-3, the named parameter's unit; a ``regather``
    all-gather (``lower/steps.py``), the named activation."""
    SYNCED = 3
    """Gradient sum number ``name`` is done."""
    OPTIMIZER = 4
    """The optimizer step is done."""


class Signal(NamedTuple):
    of: Of
    name: str = ""


class Copying(IntEnum):
    MICRO = 1
    """One of the first ``k - 1`` micro-batches of an accumulated step (:mod:`~torchweave.sim.step.accum`)."""
    BLOCK = 2
    """One of the repeated blocks copied by the folding fast path (:mod:`~torchweave.sim.fast.folded`)."""


class Renamed(NamedTuple):
    of: "Ready"
    how: Copying
    index: int


Ready = Union[str, Signal, Renamed]
"""A name a task waits for or sets."""


def grad(value: str) -> Signal:
    return Signal(Of.GRAD, value)


def regathered(param: str) -> Signal:
    return Signal(Of.REGATHERED, param)


OPTIMIZER = Signal(Of.OPTIMIZER)
"""What the optimizer task sets; a task that waits for it follows the optimizer."""


class Meet(IntEnum):
    """What a collective is for."""

    FORWARD = 1
    """A communication step of the forward (``lower/steps.py``)."""
    BACKWARD = 2
    """The backward dual of one."""
    UNIT_FORWARD = 3
    """ZeRO-3: a unit's parameters gathered for forward."""
    UNIT_BACKWARD = 4
    """ZeRO-3: gathered again (or prefetched) for backward."""
    GRAD_SUM = 5
    """A bucket of gradients summed (all-reduce, or reduce-scatter under ZeRO-2/3)."""
    PARAM_GATHER = 6
    """ZeRO-1/2: the updated shards gathered after the optimizer."""
    REGATHER = 7
    """An activation saved as its shard, gathered again for backward."""


class Rendezvous(NamedTuple):
    """The key a collective's members meet on: the same on every member, distinct per
    collective. ``micro``/``block``: the copy it belongs to (-1: the original)."""

    meet: Meet
    what: object
    """Which one: a value, a unit, a bucket number (with ``group``, unique)."""
    group: tuple[int, ...]
    micro: int = -1
    block: int = -1


__all__ = ["Copying", "Kind", "Meet", "OPTIMIZER", "Of", "Ready", "Renamed", "Rendezvous", "Signal",
           "grad", "regathered"]
