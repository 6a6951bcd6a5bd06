"""What large-scale practice asks of a plan: how often the job fails, how often to checkpoint, what it costs.

- **Failure rate**: with ``N`` devices each failing with probability ``p`` in an
  hour (``Device.failures_per_hour``), the job is hit with probability
  ``1 − (1 − p)^N`` an hour; failures arrive as a Poisson process of rate
  ``λ = −N·ln(1 − p)`` per hour, a mean time between failures ``M = 1/λ``.
- **Checkpoint interval**: writing one takes ``δ`` = the largest rank's model and
  optimizer state / its write bandwidth (``Device.storage_write``; every rank
  writes its shard at once). The interval that loses the least is Daly's
  (2006, "A higher order estimate of the optimum checkpoint interval for
  restart dumps"), which refines Young's (1974) ``√(2δM)``:
  ``τ = √(2δM)·(1 + √(δ/2M)/3 + (δ/2M)/9) − δ`` for ``δ < 2M``, else ``M``.
- **Goodput**: the share of time spent on work that is kept,
  ``1 − δ/(τ + δ) − (τ + δ)/(2M)`` (to first order: time writing checkpoints,
  and half an interval redone after each failure; restart time not counted).
- **Dollars per million tokens**, at the simulated step time and divided by
  the goodput.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchweave.sim.hardware.cluster import Cluster


@dataclass(frozen=True)
class Reliability:
    failure_per_hour: float
    """The chance some device fails in an hour: ``1 − (1 − p)^N``."""
    mtbf_hours: float
    checkpoint_s: float
    """Seconds to write one checkpoint."""
    interval_s: float
    """Daly's optimal time between checkpoints."""
    goodput: float
    usd_per_million_tokens: float
    """Goodput-adjusted."""

    def __str__(self) -> str:
        return (f"P(a failure within an hour) {self.failure_per_hour:.3g} "
                f"(MTBF {self.mtbf_hours:.3g} h); a checkpoint takes {self.checkpoint_s:.3g} s, "
                f"best written every {self.interval_s / 60:.3g} min (Young/Daly); goodput "
                f"{100 * self.goodput:.1f}%; ${self.usd_per_million_tokens:.4g} per million tokens")


def reliability(result, cluster: Cluster) -> Reliability:
    """For a :class:`~torchweave.sim.simulate.SimResult` of a plan on ``cluster``."""
    n = result.world_size
    p = min(cluster.device.failures_per_hour, 1 - 1e-12)
    per_hour = 1 - (1 - p) ** n
    rate = -n * math.log1p(-p)
    mtbf = 1 / rate if rate > 0 else math.inf
    state = max((m.params + m.optimizer for m in result.memory), default=0)
    delta = state / cluster.device.storage_write
    m_s = mtbf * 3600
    if math.isinf(m_s):
        tau, good = math.inf, 1.0
    else:
        x = delta / (2 * m_s)
        tau = (math.sqrt(2 * delta * m_s) * (1 + math.sqrt(x) / 3 + x / 9) - delta
               if delta < 2 * m_s else m_s)
        good = max(0.0, 1 - delta / (tau + delta) - (tau + delta) / (2 * m_s))
    usd = result.usd_per_million_tokens / good if good > 0 else math.inf
    return Reliability(per_hour, mtbf, delta, tau, good, usd)


__all__ = ["Reliability", "reliability"]
