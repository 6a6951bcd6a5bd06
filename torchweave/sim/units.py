"""ZeRO-3 units: which parameters one all-gather (and one reduce-scatter) moves together.

The rule the runtime follows (``runtime/zero.py``), restated here because
``sim`` does not import ``runtime``: owned parameters, in the order the
program first reads them, are grouped into units of the same *key* (the path up
to its first numbered part, ``blocks.3.attn.q_proj.weight`` → ``blocks.3``;
else ``""``), of at most ``UNIT_BYTES`` fp32 bytes each (a unit never splits a
parameter). A unit is gathered at the first read of any of its parameters in
forward, again at the first one in backward (except the unit forward ended
with, which is kept), and its gradients are reduce-scattered together once all
of them exist.
"""

from __future__ import annotations

from torchweave.lower.program import Comm, Compute, LocalRef, Program

UNIT_BYTES = 32 * 2**20


def unit_key(path: str) -> str:
    parts = path.split(".")
    for j, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[:j + 1])
    return ""


def units(prog: Program, owned: dict[str, object], numel: dict[str, int],
          budget: int = UNIT_BYTES) -> dict[str, int]:
    """Owned parameter (local name) → its unit, numbered in first-read order."""
    order: list[str] = []
    seen: set[str] = set()
    for ins in prog.instrs:
        names = ([x.name for x in _leaves((ins.args, ins.kwargs)) if isinstance(x, LocalRef)]
                 if isinstance(ins, Compute) else [ins.src] if isinstance(ins, Comm) else [])
        for p in names:
            if p in owned and p not in seen:
                seen.add(p)
                order.append(p)
    out: dict[str, int] = {}
    key, used, u = None, 0, -1
    for p in order:
        k, nbytes = unit_key(owned[p].path), 4 * numel[p]
        if u < 0 or k != key or (used + nbytes > budget and used):
            u, key, used = u + 1, k, 0
        out[p] = u
        used += nbytes
    return out


def _leaves(x):
    if isinstance(x, (tuple, list)):
        for y in x:
            yield from _leaves(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _leaves(y)
    else:
        yield x


__all__ = ["UNIT_BYTES", "unit_key", "units"]
