"""Gradient buckets: how many bytes of gradients one sum carries, DDP's defaults.

One source, read by the runtime (:mod:`torchweave.runtime.gradsync` fills its buckets by
it) and by the simulator and the search (:mod:`torchweave.sim.step.backward`,
:mod:`torchweave.search.estimate`). The simulator closes every bucket at
``BUCKET_BYTES``: the runtime's smaller first bucket (one sum started early in backward)
is not modelled, one collective's latency per group and step.
"""

from __future__ import annotations

FIRST_BUCKET_BYTES = 2**20
"""The first bucket of a group (the last gradients backward produces), by default: 1 MiB,
as DDP's when its ``bucket_cap_mb`` is left out."""

BUCKET_BYTES = 25 * 2**20
"""The other buckets, by default: 25 MiB, as DDP's."""


def bucket_caps(bucket_mb: float | None) -> tuple[int, int]:
    """(first bucket, other buckets) in bytes: DDP's defaults, or ``bucket_mb`` for all."""
    if bucket_mb is None:
        return FIRST_BUCKET_BYTES, BUCKET_BYTES
    return int(bucket_mb * 2**20), int(bucket_mb * 2**20)
