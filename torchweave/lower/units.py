"""ZeRO-3 units: which parameter pieces one all-gather (and one reduce-scatter) moves together.

One rule, read by the runtime (``runtime/zero.py`` lays its flat buffers out by
it) and by the simulator (``sim/step/forward.py`` gathers by it):

- owned pieces are taken in the order the rank's program first reads them
  (:func:`read_order`);
- consecutive pieces with the same *key* (the path up to its first numbered
  part, ``blocks.3.attn.q_proj.weight`` → ``blocks.3``; else ``""``) share a
  unit of at most ``UNIT_BYTES`` fp32 bytes; a unit never splits a piece
  (:func:`group_units`).

A unit is gathered at the first read of any of its pieces in forward, again at
the first one in backward (except the unit forward ended with, which is kept),
and its gradients are reduce-scattered together once all of them exist.
"""

from __future__ import annotations

from torchweave.lower.program import ParamSlot, Program
from torchweave.lower.stages import reads

UNIT_BYTES = 32 * 2**20
"""Most fp32 bytes in one unit (a unit never splits a piece)."""


def unit_key(path: str) -> str:
    """Pieces with the same key may share a unit: the path up to its first numbered part
    (``blocks.3.attn.q_proj.weight`` → ``blocks.3``), else ``""``."""
    parts = path.split(".")
    for j, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[:j + 1])
    return ""


def group_units(keys: list[str], nbytes: list[int], budget: int = UNIT_BYTES) -> list[list[int]]:
    """Pieces (their keys and fp32 bytes, in read order) → the piece indices of each unit."""
    units: list[list[int]] = []
    key, used = None, 0
    for i, (k, n) in enumerate(zip(keys, nbytes)):
        if not units or k != key or (used + n > budget and used):
            units.append([])
            key, used = k, 0
        units[-1].append(i)
        used += n
    return units


def first_uses(prog: Program, instrs: list | None = None) -> dict[int, list[ParamSlot]]:
    """Instruction index → the parameters read there first."""
    by_local = {p.local: p for p in prog.params}
    seen: set[str] = set()
    out: dict[int, list[ParamSlot]] = {}
    for i, ins in enumerate(prog.instrs if instrs is None else instrs):
        for n in reads(ins):
            if n in by_local and n not in seen:
                seen.add(n)
                out.setdefault(i, []).append(by_local[n])
    return out


def read_order(prog: Program) -> list[ParamSlot]:
    """The program's parameters in the order it first reads them."""
    uses = first_uses(prog)
    return [p for i in sorted(uses) for p in uses[i]]


def read_paths(prog: Program) -> list[str]:
    """Parameter paths in the order the program (and so its generated ``forward``) first
    reads them: the order ZeRO's flat shard and the runtime's gradient buckets follow."""
    return [prm.path for prm in read_order(prog)]


__all__ = ["UNIT_BYTES", "first_uses", "group_units", "read_order", "read_paths", "unit_key"]
