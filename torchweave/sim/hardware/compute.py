"""Compute time of one op: a roofline from its FLOPs and bytes.

``time = max(flops / (peak · e_flops), bytes / (bandwidth · e_bytes))``

- ``peak`` is the device's rate for the op's precision. Ops that contract a
  dimension (matmul, attention, reductions: a name in the inputs that no output
  has) use the matrix rate of their dtype; other ops use the FP32 rate.
- ``e_flops`` and ``e_bytes`` are the fractions of peak that real kernels
  reach, each device's as published measurements give them
  (``Device.matmul_efficiency``, ``Device.bandwidth_efficiency``: large BF16
  matmuls, BabelStream's Triad; the sources are in the catalog and
  docs/simulator.md). Ops that contract no dimension are charged at the FP32
  peak itself (no measurement of theirs was found, and they are bound by memory
  in every model here). A device whose rates were measured
  (``rates="measured"``) gets 1 throughout.
- Views (``view``, ``transpose``, …) move no data and cost nothing.
- Backward: ``bwd_flops`` at the same rate, and twice the forward's bytes
  (it reads the output gradient and the inputs, and writes input gradients).

Profiled timings, cached by op, shape, dtype and device, are a later source of
numbers; they will replace the roofline where present.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Literal, Mapping

import torch

from torchweave.errors import Problem, SimError
from torchweave.ir.graph import Graph, Node
from torchweave.ops import OpInfo
from torchweave.sim.hardware.devices import Device, Precision


@dataclass(frozen=True, kw_only=True)
class ComputeModel:
    """Efficiency factors and switches of the roofline."""

    matmul: float = 1.0
    """Fraction of peak FLOP/s reached by ops that contract a dimension
    (:meth:`for_device`: the device's ``matmul_efficiency``)."""
    vector: float = 1.0
    """Fraction of the FP32 peak reached by other ops (rarely the bound)."""
    bandwidth: float = 1.0
    """Fraction of peak memory bandwidth reached (:meth:`for_device`: the device's
    ``bandwidth_efficiency``)."""
    tf32: bool = False
    """fp32 matmuls run on TF32 tensor cores (``torch.backends.cuda.matmul.allow_tf32``;
    off by default in PyTorch)."""
    bwd_bytes: float = 2.0
    """Backward bytes as a multiple of forward bytes."""
    free_ops: frozenset[str] = field(default_factory=lambda: frozenset({
        "aten.view", "aten._unsafe_view", "aten.reshape", "aten.transpose", "aten.t",
        "aten.permute", "aten.expand", "aten.unsqueeze", "aten.squeeze", "aten.slice",
        "aten.select", "aten.split", "aten.split_with_sizes", "aten.unflatten",
        "aten.flatten", "aten.alias", "aten.detach", "aten.as_strided",
    }))
    """Op overload packets that only reinterpret memory (reshape is counted here
    although it copies a non-contiguous input)."""

    def __post_init__(self) -> None:
        problems = [Problem(obj=f"ComputeModel.{name}", value=repr(getattr(self, name)),
                            rule="an efficiency is in (0, 1]", fix="e.g. 0.8")
                    for name in ("matmul", "vector", "bandwidth")
                    if not 0 < getattr(self, name) <= 1]
        if self.bwd_bytes < 0:
            problems.append(Problem(obj="ComputeModel.bwd_bytes", value=repr(self.bwd_bytes),
                                    rule="must be >= 0", fix="e.g. 2.0"))
        if problems:
            raise SimError(problems)

    @staticmethod
    def for_device(device: Device) -> "ComputeModel":
        """The device's published efficiencies; factors of 1 where its rates were measured."""
        if device.rates == "measured":
            return ComputeModel()
        return ComputeModel(matmul=device.matmul_efficiency, bandwidth=device.bandwidth_efficiency)


@dataclass(frozen=True, kw_only=True)
class OpTime:
    """Predicted seconds of one op, forward and backward."""

    fwd: float
    bwd: float
    bound: Literal["compute", "memory", "free"]
    """What limits the forward."""
    precision: Precision
    """The rate used."""


_PRECISION: Mapping[torch.dtype, Precision] = types.MappingProxyType({
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8"})


def dtype_of(graph: Graph, node: Node) -> torch.dtype:
    """The dtype an op computes in: its first floating output (or input)."""
    for meta in graph.output_metas(node) + graph.input_metas(node):
        if meta.dtype.is_floating_point:
            return meta.dtype
    return torch.float32


def contracts(op: OpInfo) -> bool:
    """Whether a dimension of the inputs is absent from every output."""
    ann = op.bound.annotation
    out_names = {n for t in ann.outputs for n in t.names()}
    return any(n not in out_names for t in ann.inputs for n in t.names())


def precision_of(dtype: torch.dtype, device: Device, *, matmul: bool, tf32: bool) -> Precision:
    """The peak an op of ``dtype`` runs at on ``device``."""
    if not matmul or dtype not in _PRECISION:
        return "fp32"
    name = _PRECISION[dtype]
    if name == "fp32":
        return "tf32" if tf32 and device.peak.tf32 else "fp32"
    if device.peak.of(name) is None:
        have = [p for p in ("tf32", "bf16", "fp16", "fp8") if device.peak.of(p)]
        raise SimError(Problem(
            obj=f"device {device.name}", value=f"{dtype} matmul",
            rule=f"the device has no {name} rate; it has fp32" + "".join(f", {h}" for h in have),
            fix=f"train in one of those precisions, or give peak.{name} in a cluster YAML"))
    return name  # type: ignore[return-value]


def roofline(flops: float, nbytes: float, *, peak: float, bandwidth: float) -> float:
    """Seconds: the slower of doing the FLOPs and moving the bytes."""
    return max(flops / peak, nbytes / bandwidth)


def op_time(op: OpInfo, device: Device, *, dtype: torch.dtype = torch.float32,
            model: ComputeModel | None = None) -> OpTime:
    """Forward and backward seconds of ``op`` (a whole op, or one piece's OpInfo)."""
    model = model or ComputeModel.for_device(device)
    matmul = contracts(op)
    precision = precision_of(dtype, device, matmul=matmul, tf32=model.tf32)
    if op.node.target.rsplit(".", 1)[0] in model.free_ops:
        return OpTime(fwd=0.0, bwd=0.0, bound="free", precision=precision)
    peak = device.peak.of(precision) * (model.matmul if matmul else model.vector)
    bandwidth = device.memory_bandwidth * model.bandwidth
    fwd = roofline(op.flops, op.bytes, peak=peak, bandwidth=bandwidth)
    bwd = roofline(op.bwd_flops, op.bytes * model.bwd_bytes, peak=peak, bandwidth=bandwidth)
    bound = "compute" if op.flops / peak >= op.bytes / bandwidth else "memory"
    return OpTime(fwd=fwd, bwd=bwd, bound=bound, precision=precision)
