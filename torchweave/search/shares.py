"""One cut of a model into pipeline stages, as the search prices it (:mod:`~torchweave.search.timed`
makes them): each stage's share of the blocks' and of the rest's seconds, parameters and
parameter-reading ops, and what crosses between stages."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Shares:
    """One cut into stages: each stage's share of the blocks' and of the rest's seconds
    (forward, backward), and the bytes its output sends to the next stage."""

    block_f: np.ndarray
    block_b: np.ndarray
    rest_f: np.ndarray
    rest_b: np.ndarray
    crossing: tuple[tuple[str, int, tuple[int, ...], int, str], ...]
    """The values read on a stage after the one that makes them: ``(value, its stage, the
    later stages that read it, bytes in the compute dtype, kind)``; the kind is ``batch``
    for an op output made from a graph input (split by the micro-batch), ``fixed`` for
    another op output (a relative-position bias, made from parameters alone) and ``weight``
    for a parameter read on several stages (tied). Which boundaries a value crosses depends
    on the ranks the stages are on, and how much of it on the split (:meth:`received`). A
    weight crosses none: each pipeline rank that reads it keeps a copy, summed with the
    others once a step (``Timing._tied_sums``)."""
    block_p: np.ndarray
    rest_p: np.ndarray
    """Each stage's share of the blocks' and of the rest's parameter elements (a parameter
    counted on the stage that reads it first, as the pipeline policy places it; a tied
    weight's copies on later stages are not counted)."""
    params: tuple[tuple[int, ...], ...]
    """Per stage, its parameters' elements in the order backward makes their gradients
    (the reverse of their first reads)."""
    block_n: np.ndarray | None = None
    rest_n: np.ndarray | None = None
    """Each stage's share of the blocks' and of the rest's ops that read a parameter (linears,
    lookups, norms): where tensor parallelism puts its collectives, so where their latency,
    paid whole by each micro-batch, falls (None: as the seconds)."""
    fixed: tuple[tuple[str, int, tuple[int, ...], int], ...] = ()
    """Floating op outputs without the batch dim (a relative-position bias): ``(value, its
    stage, every stage with a batch-split op that reads it, bytes in the compute dtype)``.
    Such a reader's gradient of it is partial over ``dp``. On the pipeline rank that makes
    it, lowering sums it where it is read, once a micro-batch (docs/simulator.md); other
    ranks receive it by transfers, whose backward sends their partials to the maker."""

    def fixed_sums(self, pp: int, shares: dict[str, float], default: float,
                   seconds) -> np.ndarray:
        """Per stage, the seconds of those sums one micro-batch's backward pays: each value's
        ``shares[value]`` of its bytes (``default`` where not given), summed by
        ``seconds(bytes)`` on the first stage of its maker's pipeline rank that reads it. A
        value read on its own stage alone is left out: its sum moves to its parameters."""
        out = np.zeros(len(self.block_f))
        for name, made, readers, nbytes in self.fixed:
            if set(readers) <= {made}:  # read on its own stage alone: lowering moves the sum
                continue  # to its parameters (lower/defer.py), summed with the others
            t = next((t for t in readers if t % pp == made % pp), None)
            if t is not None:
                out[t] += seconds(int(nbytes * shares.get(name, default)))
        return out

    def received(self, pp: int, kind: str, shares: dict[str, float], default: float
                 ) -> np.ndarray:
        """Per stage ``t`` (at index ``t − 1``, the boundary it receives over), the step's
        bytes of ``kind`` one of its ranks receives, each value ``shares[value]`` of its
        bytes (``default`` where not given). As lowering moves them: straight from the
        maker's stage group to each other pipeline rank (stage ``t`` on rank ``t % pp``)
        that reads the value, once, into the first of its stages that does (its later
        stages read the copy it holds)."""
        out = np.zeros(len(self.block_f))
        for name, made, readers, nbytes, k in self.crossing:
            if k != kind:
                continue
            seen = {made % pp}
            for t in readers:
                if t % pp not in seen:
                    seen.add(t % pp)
                    out[t - 1] += nbytes * shares.get(name, default)
        return out


__all__ = ["Shares"]
