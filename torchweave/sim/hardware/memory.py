"""Model-state memory per device: parameters, gradients and AdamW state, per ZeRO stage.

Bytes per parameter, after Rajbhandari et al., "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models" (SC 2020), section 3.1:

============  ======  =========  =============================================
precision     params  gradients  AdamW state
============  ======  =========  =============================================
fp32          4       4          8   (exp_avg, exp_avg_sq)
bf16-mixed    2       2          12  (fp32 master copy, exp_avg, exp_avg_sq)
============  ======  =========  =============================================

Over ``dp`` data-parallel ranks, stage 1 shards the optimizer state, stage 2
also the gradients, stage 3 also the parameters. (PyTorch autocast with fp32
parameters is ``fp32`` here: it keeps no bf16 copy of the weights.)
Activations, recompute and temporary buffers are the simulator's part.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass
from typing import Literal, Mapping

from torchweave.errors import Problem, SimError

Precision = Literal["fp32", "bf16-mixed"]
ZeroStage = Literal[0, 1, 2, 3]

_BYTES: Mapping[str, tuple[int, int, int]] = types.MappingProxyType(
    {"fp32": (4, 4, 8), "bf16-mixed": (2, 2, 12)})
"""(params, grads, optimizer) bytes per parameter."""


@dataclass(frozen=True, kw_only=True)
class ModelStateMemory:
    """Bytes one device holds for the model's state."""

    params: int
    grads: int
    optimizer: int
    stage: ZeroStage
    dp: int
    precision: Precision

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def contributors(self) -> list[tuple[str, int]]:
        """(what, bytes), biggest first (for out-of-memory reports)."""
        parts = [("parameters", self.params), ("gradients", self.grads),
                 ("optimizer state", self.optimizer)]
        return sorted(parts, key=lambda x: -x[1])

    def __str__(self) -> str:
        gib = 2**30
        return (f"ZeRO-{self.stage} {self.precision} dp={self.dp}: params {self.params / gib:.3g} GiB"
                f" + grads {self.grads / gib:.3g} GiB + optimizer {self.optimizer / gib:.3g} GiB"
                f" = {self.total / gib:.3g} GiB per device")


def model_state_memory(num_params: int, *, dp: int = 1, stage: ZeroStage = 0,
                       precision: Precision = "fp32") -> ModelStateMemory:
    """Per-device bytes for ``num_params`` parameters trained with AdamW."""
    problems = []
    if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 0:
        problems.append(Problem(obj="num_params", value=repr(num_params), rule="must be an integer >= 0",
                                fix="pass graph.num_params() or a parameter count"))
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        problems.append(Problem(obj="dp", value=repr(dp), rule="must be an integer >= 1",
                                fix="pass the data-parallel group size"))
    if stage not in (0, 1, 2, 3):
        problems.append(Problem(obj="stage", value=repr(stage), rule="ZeRO stage is 0, 1, 2 or 3",
                                fix="0: replicate all; 1: shard optimizer; 2: + grads; 3: + params"))
    if precision not in _BYTES:
        problems.append(Problem(obj="precision", value=repr(precision),
                                rule=f"must be one of: {', '.join(_BYTES)}",
                                fix="bf16-mixed keeps fp32 master weights in the optimizer"))
    if problems:
        raise SimError(problems, header="bad model-state memory query")
    p, g, o = (num_params * b for b in _BYTES[precision])

    def shard(nbytes: int, sharded: bool) -> int:
        return math.ceil(nbytes / dp) if sharded else nbytes

    return ModelStateMemory(params=shard(p, stage >= 3), grads=shard(g, stage >= 2),
                            optimizer=shard(o, stage >= 1), stage=stage, dp=dp, precision=precision)
