"""Run one rank's generated program: forward, backward, gradient sync, step."""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist

from torchweave.lower.units import read_paths
from torchweave.errors import Problem, TorchweaveError
from torchweave.lower.program import ParamSlot, Program
from torchweave.runtime import train_state
from torchweave.lower.buckets import bucket_caps
from torchweave.runtime.gradsync import GradSync
from torchweave.runtime.regather import forward_hooks
from torchweave.runtime.user import UserLoop
from torchweave.runtime.groups import GroupCache
from torchweave.runtime.zero import ZeroOptimizer

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def default_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)


@dataclass(frozen=True, kw_only=True)
class StepConfig:
    """How each training step runs."""

    grad_accum: int = 1
    """Micro-batches per step; the batch's dim 0 is split into this many parts."""
    clip_grad_norm: float | None = None
    """Clip the global gradient norm (over all shards) to this value."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """bf16: compute in bf16 from fp32 master weights; gradients and updates in fp32."""
    bucket_mb: float | None = None
    """Gradient all-reduce bucket size, MiB. None: DDP's defaults, 25 MiB with a 1 MiB first
    bucket (the last gradients backward produces, so the first sum starts early); a
    number: every bucket that size, as DDP's ``bucket_cap_mb``."""
    overlap: bool = True
    """Start each bucket's all-reduce during backward."""
    p2p_tags: Literal["auto", "tagged", "untagged"] = "auto"
    """Pipeline messages: ``untagged`` sends each with tag 0 (NCCL ignores tags; the message
    order alone matches them), ``tagged`` tags each by what it carries; ``auto`` is
    untagged on NCCL, tagged on gloo."""

    def __post_init__(self) -> None:
        problems = []
        if self.grad_accum < 1:
            problems.append(Problem(obj="StepConfig.grad_accum", value=str(self.grad_accum),
                                    rule="at least 1 micro-batch"))
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            problems.append(Problem(obj="StepConfig.clip_grad_norm", value=str(self.clip_grad_norm),
                                    rule="a positive norm, or None"))
        if self.bucket_mb is not None and not self.bucket_mb > 0:
            problems.append(Problem(obj="StepConfig.bucket_mb", value=repr(self.bucket_mb),
                                    rule="a positive size in MiB, or None for DDP's defaults "
                                         "(25 MiB, the first bucket 1 MiB)",
                                    fix="e.g. bucket_mb=25"))
        if self.precision not in ("fp32", "bf16"):
            problems.append(Problem(obj="StepConfig.precision", value=repr(self.precision),
                                    rule="one of 'fp32', 'bf16'"))
        if self.p2p_tags not in P2P_TAGS:
            problems.append(Problem(obj="StepConfig.p2p_tags", value=repr(self.p2p_tags),
                                    rule="one of " + ", ".join(map(repr, P2P_TAGS)),
                                    fix="'untagged' to run as on NCCL, 'auto' to let the backend choose"))
        if problems:
            raise TorchweaveError(problems)


P2P_TAGS = ("auto", "tagged", "untagged")
"""The values of :attr:`StepConfig.p2p_tags`."""


@dataclass
class Runtime:
    """What generated code sees as ``rt``."""

    rank: int
    device: torch.device
    group_cache: GroupCache
    send_roots: list[torch.Tensor] = field(default_factory=list)
    """Empty results of point-to-point steps on ranks that only send: backward starts from
    them too, so that gradients come back to what was sent (``runtime/p2p.py``)."""


def load_module(path: str, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def slice_box(t: torch.Tensor, box) -> torch.Tensor:
    return t[tuple(slice(a, b) for a, b in box)]


class RankModule(UserLoop):
    """One rank's share of the parallel model: ``train_step(*batch)``, or the user's own loop
    (``pm(*batch)``, ``loss.backward()``; :mod:`torchweave.runtime.user`).

    Two optimizers at most: ``zero_opt``, ZeRO's over the pieces it shards (``None``
    without ZeRO), and ``optimizer``, the torch optimizer of every other trainable piece
    (``None`` if there is none). Callers use :meth:`optimizers`, :meth:`optimizer_step`,
    :meth:`zero_grads` and the checkpoint methods below, not either one directly."""

    loss_rides: bool = True
    """Whether the step's loss may be summed in a gradient bucket (``GradSync``'s rider);
    a pipeline sends it by message instead (:class:`~torchweave.runtime.schedule_runner.PipelineModule`)."""

    def __init__(self, program: Program, code_path: str, state: dict[str, torch.Tensor],
                 group_cache: GroupCache, *, optimizer: OptimizerFactory = default_optimizer,
                 config: StepConfig = StepConfig(), zero: int = 0,
                 zero_group: tuple[int, ...] | None = None) -> None:
        self.program, self.config = program, config
        self.rt = Runtime(program.rank, group_cache.device, group_cache)
        group_cache.create_all(program.groups + ([zero_group] if zero_group else []))
        self.code = load_module(code_path, f"torchweave_rank{program.rank}_{id(self)}")
        self.regather = program.regathers()
        """Whether a forward all-gather keeps its shard for backward (runtime/regather.py)."""
        self.params: dict[str, torch.Tensor] = {}
        self.slots: dict[str, ParamSlot] = {}
        for slot in program.params:
            if slot.path not in state:
                raise TorchweaveError(Problem(obj=f"parameter {slot.path}", value="missing",
                                              rule="the state holds every parameter of the graph"))
            piece = slice_box(state[slot.path].detach(), slot.box).clone().to(group_cache.device)
            if slot.requires_grad and not slot.is_buffer:
                piece.requires_grad_(True)
            self.params[slot.path] = piece
            self.slots[slot.path] = slot
        trainable = [(self.params[s.path], s) for s in program.params
                     if s.requires_grad and not s.is_buffer]
        synced = [(p, s.grad_groups[0]) for p, s in trainable if s.grad_groups]
        self.zero_opt = None
        if zero:
            self.zero_opt = ZeroOptimizer(group_cache, trainable, zero_group, stage=zero, factory=optimizer,
                                     order=read_paths(program))
            synced = [(p, g) for p, g in synced if not self.zero_opt.owns(p)]
        rest = [p for p, _ in trainable if self.zero_opt is None or not self.zero_opt.owns(p)]
        self.optimizer = optimizer(rest) if rest else None
        first, rest_bytes = bucket_caps(config.bucket_mb)
        rider = None
        self._rider_slots = (program.loss_group, program.loss_partial)
        """The loss's group and slots the rider was sized for (a program compiled for a new
        batch shape that differed would sum its loss by itself)."""
        if program.loss_group is not None and self.loss_rides:
            rider = (program.loss_group, 2 * program.loss_partial[1])
        self.sync = GradSync(group_cache, synced, bucket_bytes=rest_bytes, first_bucket_bytes=first,
                             overlap=config.overlap, rider=rider)
        self.trainable = trainable

    # ------------------------------------------------------------ one step
    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        if self.config.precision == "bf16" and t.is_floating_point():
            return t.to(torch.bfloat16)
        return t

    def param_view(self) -> Any:
        """What generated code reads as ``p``: path → piece, cast (ZeRO-3: gathered on use)."""
        if self.zero_opt is None:
            return {k: self._cast(v) for k, v in self.params.items()}
        return self.zero_opt.view(self.params, self._cast)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | None:
        """This rank's forward pass; its local loss term (or None)."""
        inputs = tuple(self._cast(x.to(self.rt.device)) for x in inputs)
        self.rt.send_roots = []
        params = self.param_view()
        if self.zero_opt is None or self.zero_opt.stage < 3:
            with forward_hooks(self.regather) as call:
                out = self.code.forward(self.rt, params, *inputs)
        else:
            try:
                with forward_hooks(self.regather, self.zero_opt.packer()) as call:
                    out = self.code.forward(self.rt, params, *inputs)
            finally:
                self.zero_opt.end_forward()
        call.at_backward(out)
        return out

    def train_step(self, *batch: torch.Tensor) -> float:
        """Forward, backward, gradient sync, clipping and optimizer step; the loss.

        The loss is summed over ranks in a gradient bucket where one spans its group;
        otherwise its sum runs while the optimizer steps, and is read after."""
        loss = self.backward_async(*batch)
        self.optimizer_step()
        return loss()

    def backward_step(self, *batch: torch.Tensor) -> float:
        """Forward and backward over the micro-batches, then gradient sync and clipping; the loss."""
        return self.backward_async(*batch)()

    def backward_async(self, *batch: torch.Tensor) -> Callable[[], float]:
        """:meth:`backward_step` with the loss's sum over ranks done in a gradient bucket (see
        ``GradSync``'s rider), or else started, not waited for: calling the result waits and
        gives the loss."""
        k = self.config.grad_accum
        rider = self.sync.rider if (self.program.loss_group, self.program.loss_partial) \
            == self._rider_slots else None
        micro = [torch.chunk(x, k, dim=0) for x in batch]
        total: torch.Tensor | float = 0.0
        dtype = torch.float32
        for i in range(k):
            last = i == k - 1
            self.sync.enabled = last
            loss = self.forward(*[m[i] for m in micro])
            if loss is not None:  # kept on the device: no wait for the value here
                total = total + loss.detach().double()
                dtype = torch.float64 if loss.dtype == torch.float64 else torch.float32
            if last and rider is not None:  # before backward starts its bucket's sum
                self._loss_slots(rider.tail, total / k)
            roots = ([loss.float() / k] if loss is not None else []) + self.rt.send_roots
            if roots and any(r.requires_grad for r in roots):
                grads = [torch.ones_like(r) if r.numel() else torch.zeros_like(r) for r in roots]
                torch.autograd.backward(roots, grads)
        self.sync.finish()
        if self.zero_opt is not None:
            self.zero_opt.finish_grads()
        if self.config.clip_grad_norm is not None:
            self.clip(self.config.clip_grad_norm)
        # summed with the gradients, already there; not for a float64 loss in a float32 bucket
        if rider is not None and (dtype != torch.float64 or rider.tail.dtype == torch.float64):
            tail = rider.tail.double()
            half = tail.numel() // 2
            value = (tail[:half] / tail[half:]).sum()
            rider.tail.zero_()  # a later sum that does not write it (the user's loop) adds zeros
            return lambda: float(value.to(dtype))
        summed = self.loss_start(total / k)
        # the terms are summed in float64; the loss is a number of the model's loss dtype, as
        # the user loop's pm(*batch) returns it (float32, or float64 for a float64 model)
        return lambda: float(summed().to(dtype))

    def set_optimizer(self, factory: OptimizerFactory) -> None:
        """Build this rank's optimizers anew with ``factory`` (ZeRO's shard and the other pieces)."""
        if self.zero_opt is not None:
            self.zero_opt.inner = factory([self.zero_opt.master])
        rest = [p for p, _ in self.trainable if self.zero_opt is None or not self.zero_opt.owns(p)]
        self.optimizer = factory(rest) if rest else None

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.zero_opt.inner if self.zero_opt is not None else None, self.optimizer)
                if o is not None]

    def memory(self) -> int:
        """Bytes of training state this rank holds: parameter pieces and their gradients (the
        summed ones live in the gradient buckets, held between steps), ZeRO's master shard
        and its gradient (ZeRO-1/2: the gradients waiting for their sum, while backward runs),
        and every optimizer's state (each storage counted once)."""
        seen: set[int] = set()
        tensors = [t for p in self.params.values() for t in (p, p.grad)]
        tensors += [b.flat for b in self.sync.buckets]  # kept between steps, grads or not
        if self.zero_opt is not None:
            tensors += [self.zero_opt.master, self.zero_opt.master.grad, self.zero_opt.pending_grads]
        tensors += [v for opt in self.optimizers() for st in opt.state.values() for v in st.values()]
        total = 0
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
        return total

    def optimizer_step(self) -> None:
        if self.zero_opt is not None:
            self.zero_opt.step()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def loss_value(self, local: float | torch.Tensor) -> float:
        """The loss on every rank: each partial term counted once, however many ranks hold it."""
        return float(self.loss_start(local)())

    def _loss_slots(self, tail: torch.Tensor, local: float | torch.Tensor) -> None:
        """This rank's loss term and its count in ``tail`` (the slots :meth:`loss_start`'s
        buffer has), for a sum that rides in a gradient bucket."""
        index, count = self.program.loss_partial
        tail.zero_()
        tail[index] = local
        tail[count + index] = 1.0

    def loss_start(self, local: float | torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start summing this rank's loss term over the loss group; the result waits for the
        sum and gives it as a float64 tensor on the device. Nothing here reads a value to the
        host: on a GPU the wait orders the device's stream behind the sum, and the host
        meets the value only when the caller reads it (``float``, ``.item()``)."""
        prog = self.program
        local = (local.detach().to(self.rt.device, torch.float64) if isinstance(local, torch.Tensor)
                 else torch.tensor(local, dtype=torch.float64, device=self.rt.device))
        if prog.loss_group is None:
            return lambda: local
        index, count = prog.loss_partial
        buf = torch.zeros(2 * count, dtype=torch.float64, device=self.rt.device)
        buf[index], buf[count + index] = local, 1.0
        work = dist.all_reduce(buf, group=self.rt.group_cache.get(prog.loss_group), async_op=True)

        def value() -> torch.Tensor:
            work.wait()
            return (buf[:count] / buf[count:]).sum()
        return value

    def grad_norm(self) -> float:
        """The global gradient norm: each distinct piece counted once."""
        sq = torch.zeros((), dtype=torch.float64, device=self.rt.device)
        if self.zero_opt is not None:
            sq += self.zero_opt.grad_sq_norm()
        for p, slot in self.trainable:
            if p.grad is not None and (self.zero_opt is None or not self.zero_opt.owns(p)):
                sq += p.grad.double().pow(2).sum() / slot.replicas
        if self.program.world_size > 1:
            dist.all_reduce(sq)
        return math.sqrt(float(sq))

    def clip(self, max_norm: float) -> float:
        norm = self.grad_norm()
        scale = max_norm / (norm + 1e-6)
        if scale < 1.0:
            for p, _ in self.trainable:
                if p.grad is not None:
                    p.grad.mul_(scale)
            if self.zero_opt is not None:
                self.zero_opt.scale_grads(scale)
        return norm

    # ------------------------------------------------------------ checkpoint state
    # by (parameter path, box) key: runtime/train_state.py
    def optimizer_state(self) -> train_state.OptimizerState:
        return train_state.optimizer_state(self)

    def zero_spans(self) -> dict[str, Any] | None:
        return train_state.zero_spans(self)

    def held_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return train_state.held_shapes(self)

    def load_held(self, tensors: dict[str, torch.Tensor], groups: dict[str, list]) -> None:
        train_state.load_held(self, tensors, groups)

    def load_full(self, full: dict[str, torch.Tensor], state: dict[str, dict[str, torch.Tensor]]) -> None:
        train_state.load_full(self, full, state)

    def state_pieces(self) -> dict[str, tuple[Any, torch.Tensor]]:
        """Path → (box, current local piece), with ZeRO shards gathered."""
        params = self.zero_opt.full_params(self.params) if self.zero_opt is not None else self.params
        return {path: (self.slots[path].box, t.detach()) for path, t in params.items()}

    def grad_pieces(self) -> dict[str, tuple[Any, torch.Tensor | None]]:
        """Path → (box, a copy of the current local gradient): a summed gradient is a view into
        its bucket, which the next step's sum overwrites."""
        grads = self.zero_opt.full_grads(self.params) if self.zero_opt is not None else {
            k: v.grad for k, v in self.params.items()}
        return {path: (self.slots[path].box, None if g is None else g.detach().clone())
                for path, g in grads.items()}

    def load_pieces(self, fulls: dict[str, torch.Tensor]) -> None:
        """Set each piece this rank holds from whole tensors by path (absent paths stay)."""
        with torch.no_grad():
            for path, t in self.params.items():
                if path in fulls and (self.zero_opt is None or not self.zero_opt.owns(t)):
                    t.copy_(slice_box(fulls[path], self.slots[path].box))
            if self.zero_opt is not None:
                boxes = {path: self.slots[path].box for path in self.params}
                self.zero_opt.load_pieces(self.params, {
                    path: slice_box(full, boxes[path]) for path, full in fulls.items() if path in boxes})
