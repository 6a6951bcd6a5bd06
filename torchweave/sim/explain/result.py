"""What one simulated step gives: time per rank, memory per rank, and how it was obtained.

:class:`SimResult` is what :func:`torchweave.sim.simulate` returns; :class:`MemoryUse`
is one rank's memory by kind, :class:`OutOfMemory` a rank over its device's memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 2**30


@dataclass(frozen=True, slots=True)
class Event:
    """One interval of a timeline."""

    rank: int
    stream: str
    """``compute`` or ``comm``."""
    name: str
    start: float
    end: float


@dataclass(frozen=True)
class Replicas:
    """``count`` identical data-parallel replicas of ``size`` consecutive ranks each, one
    simulated for all (:mod:`torchweave.sim.fast.symmetry`)."""

    count: int
    size: int


@dataclass(frozen=True, kw_only=True)
class MemoryUse:
    """Peak bytes on one rank, by contributor."""

    params: int
    grads: int
    optimizer: int
    buffers: int
    activations: int
    temporaries: int

    @property
    def peak(self) -> int:
        return (self.params + self.grads + self.optimizer + self.buffers + self.activations
                + self.temporaries)

    def contributors(self) -> list[tuple[str, int]]:
        """(what, bytes), biggest first."""
        parts = [("parameters", self.params), ("gradients", self.grads),
                 ("optimizer state", self.optimizer), ("buffers", self.buffers),
                 ("activations", self.activations), ("temporary buffers", self.temporaries)]
        return sorted(parts, key=lambda x: -x[1])


@dataclass(frozen=True, kw_only=True)
class OutOfMemory:
    rank: int
    device: str
    peak: int
    capacity: int
    contributors: tuple[tuple[str, int], ...]
    """The biggest contributors, biggest first."""

    def __str__(self) -> str:
        top = ", ".join(f"{what} {n / GiB:.3g} GiB" for what, n in self.contributors[:3])
        return (f"rank {self.rank}: {self.peak / GiB:.3g} GiB > {self.device} "
                f"{self.capacity / GiB:.3g} GiB ({top})")


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """One simulated training step."""

    plan_name: str
    cluster: str
    world_size: int
    step_time: float
    """Seconds: the slowest rank."""
    compute_time: tuple[float, ...]
    """Busy seconds on each rank's compute stream."""
    comm_time: tuple[float, ...]
    """Busy seconds on each rank's communication stream."""
    idle: tuple[float, ...]
    """Fraction of the step each rank's compute stream is idle."""
    memory: tuple[MemoryUse, ...]
    model_flops: float
    """FLOPs of one step of the whole model, forward and backward, counted once."""
    mfu: float
    tokens_per_step: int
    tokens_per_s: float
    usd_per_million_tokens: float
    oom: tuple[OutOfMemory, ...] = ()
    timeline: list[Event] = field(default_factory=list, repr=False)
    notes: tuple[str, ...] = ()
    """How the result was obtained where not every rank and op was simulated."""
    pipeline_bubble: float | None = None
    """Pipelined plans: the schedule's idle fraction (mean over pipeline ranks)."""
    replicas: Replicas | None = None
    """The replica-symmetry fast path: ``replicas.count`` data-parallel replicas of
    ``replicas.size`` ranks, one lowered and simulated for all (None: every rank simulated)."""
    folded_blocks: int | None = None
    """The folding fast path: this many identical blocks, their tasks copied from 4
    lowered (None: every block lowered)."""
    comm_latency: tuple[float, ...] = ()
    """Of each rank's ``comm_time``, the collectives' latency: what they would cost moving
    almost no bytes (empty where not counted: pipelined plans)."""

    @property
    def bubble(self) -> float:
        """The pipeline's idle fraction, or else the mean idle fraction of the compute streams."""
        if self.pipeline_bubble is not None:
            return self.pipeline_bubble
        return sum(self.idle) / len(self.idle) if self.idle else 0.0

    @property
    def peak_memory(self) -> tuple[int, ...]:
        return tuple(m.peak for m in self.memory)

    def to_dict(self) -> dict:
        """The numbers as plain JSON data (no timeline): seconds, bytes, fractions."""
        return {
            "plan": self.plan_name, "cluster": self.cluster, "world_size": self.world_size,
            "step_time_s": self.step_time, "tokens_per_step": self.tokens_per_step,
            "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "model_flops": self.model_flops,
            "usd_per_million_tokens": self.usd_per_million_tokens,
            "bubble": self.bubble, "pipeline": self.pipeline_bubble is not None,
            "compute_s": list(self.compute_time), "comm_s": list(self.comm_time),
            "memory_bytes": [{"params": m.params, "grads": m.grads, "optimizer": m.optimizer,
                              "buffers": m.buffers, "activations": m.activations,
                              "temporaries": m.temporaries, "peak": m.peak} for m in self.memory],
            "out_of_memory_ranks": [o.rank for o in self.oom],
            "replicas": None if self.replicas is None else {"count": self.replicas.count,
                                                             "size": self.replicas.size},
            "folded_blocks": self.folded_blocks, "notes": list(self.notes),
        }

    def summary(self) -> str:
        n = len(self.compute_time)
        lines = [
            f"{self.plan_name} on {self.cluster} ({self.world_size} ranks)",
            f"  step time      {self.step_time * 1e3:.4g} ms",
            f"  compute/rank   {sum(self.compute_time) / n * 1e3:.4g} ms (mean)",
            f"  comm/rank      {sum(self.comm_time) / n * 1e3:.4g} ms (mean)",
            f"  {'bubble' if self.pipeline_bubble is not None else 'idle':15s}{self.bubble:.1%}",
            f"  peak memory    {max(self.peak_memory) / GiB:.3g} GiB (max over ranks)",
            f"  MFU            {self.mfu:.1%}",
            f"  tokens/s       {self.tokens_per_s:,.0f}",
            f"  $/M tokens     {self.usd_per_million_tokens:.4g}",
        ]
        lines += [f"  OUT OF MEMORY  {o}" for o in self.oom[:4]]
        lines += [f"  note           {n}" for n in self.notes]
        return "\n".join(lines)


__all__ = ["Event", "MemoryUse", "OutOfMemory", "Replicas", "SimResult"]
