"""A Lightning strategy: an unmodified ``LightningModule`` trained under a torchweave plan.

::

    trainer = lightning.Trainer(strategy=torchweave.lightning.Strategy(plan="auto"),
                                accelerator="cpu", devices=2)
    trainer.fit(module, datamodule)

What the plan runs is the module's ``training_step``: it is captured on the
first batch (``self.log`` calls are recorded, not run), planned and lowered on
every rank, and from then on each training step is ``pm(*batch)`` and
``loss.backward()`` of :mod:`torchweave.runtime.user`. Every rank reads the
whole batch (the plan splits it), so the dataloader's batch size is the
global batch: a DDP run with ``batch_size=B`` on N processes corresponds to
``batch_size=N*B`` here.

The module's own ``configure_optimizers`` is kept: its optimizer class and
options build a :func:`torchweave.optimizer` over the plan's pieces, and its
optimizer stays the one the schedulers drive (each step copies its group's
options, ``lr`` first, into the parallel optimizer). Lightning's gradient
clipping by norm clips the global norm.

Checkpoints hold the model's whole weights under its own names (gathered from
the pieces) and the schedule; the parallel optimizer's moments are per rank
and plan, and are not in them. Validation, testing and the module after
``fit`` see the trained weights, copied back into the module.

The loss is logged under the name the module logged it with (the returned
loss, logged with ``self.log``); other values logged in ``training_step`` are
not computed by the plan, and a warning names them.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer import call
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError("torchweave.lightning needs Lightning: pip install 'torchweave[lightning]'") from e

from torchweave.errors import Problem, TorchweaveError
from torchweave.parallel import parallelize
from torchweave.runtime.executor import StepConfig
from torchweave.runtime.optim import ParallelOptimizer, optimizer as build_optimizer

PREFIX = "lm."
"""The LightningModule's place inside the captured wrapper (stripped from state names)."""


class _TrainingStep(torch.nn.Module):
    """The module's ``training_step`` as a forward over the batch's flat tensors."""

    def __init__(self, lm: "pl.LightningModule", spec: Any) -> None:
        super().__init__()
        self.lm, self.spec = lm, spec
        self.logged: list[tuple[str, Any, dict[str, Any]]] = []

    def forward(self, *leaves: torch.Tensor) -> torch.Tensor:
        batch = tree_unflatten(list(leaves), self.spec)
        lm = self.lm
        record: Callable[..., None] = lambda name, value, **kw: self.logged.append((name, value, kw))
        record_dict: Callable[..., None] = lambda values, **kw: self.logged.extend(
            (k, v, kw) for k, v in values.items())
        lm.log, lm.log_dict = record, record_dict  # instance attributes shadow the methods
        try:
            out = lm.training_step(batch, 0)
        finally:
            del lm.log, lm.log_dict
        loss = out["loss"] if isinstance(out, dict) else out
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TorchweaveError(Problem(
                obj=f"{type(lm).__name__}.training_step", value=type(out).__name__,
                rule="training_step returns the loss, a scalar tensor (or a dict with 'loss')",
                fix="return the loss"))
        self.loss_names = [(name, kw) for name, value, kw in self.logged if value is loss]
        return loss


def _options(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's constructor options, read from its one parameter group."""
    if len(opt.param_groups) != 1:
        raise TorchweaveError(Problem(
            obj=f"configure_optimizers ({type(opt).__name__})", value=f"{len(opt.param_groups)} groups",
            rule="the parallel optimizer has one parameter group (the plan owns the pieces)",
            fix="return one optimizer with one parameter group"))
    accepted = inspect.signature(type(opt).__init__).parameters
    group = opt.param_groups[0]
    return {k: v for k, v in group.items() if k in accepted and k not in ("self", "params")}


class Strategy(DDPStrategy):
    """Train a ``LightningModule`` under a torchweave plan (``"auto"``, a plan string, a Plan)."""

    strategy_name = "torchweave"

    def __init__(self, plan: Any = "auto", *, config: StepConfig | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.plan, self.step_config = plan, config or StepConfig()
        self.pm: Any = None
        self.popt: ParallelOptimizer | None = None
        self._wrapper: _TrainingStep | None = None
        self._stale = False
        """The module's own weights are older than the plan's pieces."""

    # ------------------------------------------------------------ data and wrapping
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}  # every rank reads the whole batch

    def configure_ddp(self) -> None:
        """No DDP wrapper: the plan's own gradient sync runs instead."""

    def setup(self, trainer: "pl.Trainer") -> None:
        if str(trainer.precision) not in ("32-true", "32", "64-true", "64"):
            raise TorchweaveError(Problem(
                obj="Trainer(precision=...)", value=repr(trainer.precision),
                rule="the plan's generated code sets the compute dtype, not Lightning's autocast",
                fix="use precision='32-true' and Strategy(config=StepConfig(precision='bf16'))"))
        if not trainer.lightning_module.automatic_optimization:
            raise TorchweaveError(Problem(
                obj=f"{type(trainer.lightning_module).__name__}.automatic_optimization",
                value="False", rule="the strategy runs the optimizer step itself, after the "
                                    "plan's backward and gradient sync",
                fix="use automatic optimization, or torchweave.parallelize in your own loop"))
        super().setup(trainer)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning's gradient accumulation: no sum over ranks but on the last micro-batch."""
        if self.pm is None:
            yield None
        else:
            with self.pm.no_sync():
                yield None

    # ------------------------------------------------------------ training
    def _build(self, leaves: list[torch.Tensor], spec: Any) -> None:
        lm = self.lightning_module
        if dist.is_initialized() and dist.get_world_size() > 1:
            with torch.no_grad():  # as DDP starts: every rank from rank 0's weights
                for t in lm.state_dict().values():
                    dist.broadcast(t, src=0)
        self._wrapper = _TrainingStep(lm, spec)
        # every rank captures: the capture is where the wrapper learns which logged value is
        # the loss (its forward runs nowhere else)
        self.pm = parallelize(self._wrapper, tuple(leaves), plan=self.plan, config=self.step_config,
                              share_capture=False)
        user = self.optimizers[0] if self.optimizers else None
        if user is None:
            raise TorchweaveError(Problem(
                obj=f"{type(lm).__name__}.configure_optimizers", value="no optimizer",
                rule="training needs an optimizer", fix="return one from configure_optimizers"))
        self.popt = build_optimizer(self.pm, type(user), **_options(user))
        names = {name for name, _ in self._wrapper.loss_names}
        others = sorted({name for name, _, _ in self._wrapper.logged} - names)
        if others:
            warnings.warn(f"torchweave.lightning logs the loss only; training_step's {others} "
                          "are not computed by the plan", stacklevel=2)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs["batch"]
        leaves, spec = tree_flatten(batch)
        if not all(isinstance(x, torch.Tensor) for x in leaves):
            raise TorchweaveError(Problem(
                obj="batch", value=str([type(x).__name__ for x in leaves]),
                rule="a batch of tensors (in tuples, lists or dicts)",
                fix="return tensors from the dataloader's collate_fn"))
        if self.pm is None:
            self._build(leaves, spec)
        want = self.pm.example_shapes
        got = tuple(tuple(x.shape) for x in leaves)
        if got != want:
            raise TorchweaveError(Problem(
                obj=f"batch {args[1] if len(args) > 1 else ''}".strip(), value=f"shapes {got}",
                rule=f"the plan was captured on the first batch's shapes {want} and runs only those",
                fix="DataLoader(..., drop_last=True), and a batch size the dataset length divides "
                    "if you want every sample"))
        loss = self.pm(*leaves)
        self._stale = True
        lm = self.lightning_module
        for name, kw in self._wrapper.loss_names:
            lm.log(name, loss.detach(), **kw)
        return loss

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None,
                       **kwargs: Any) -> Any:
        out = closure()  # training_step and backward (the plan's gradient sync included)
        if out is None or self.popt is None:
            return out
        user = getattr(optimizer, "_optimizer", optimizer)
        self.popt.param_groups[0].update(_options(user))  # what the schedulers set
        trainer = self.lightning_module.trainer
        call._call_callback_hooks(trainer, "on_before_optimizer_step", user)
        call._call_lightning_module_hook(trainer, "on_before_optimizer_step", user)
        clip = trainer.gradient_clip_val
        if clip:
            algo = self.lightning_module.trainer.gradient_clip_algorithm or "norm"
            if algo != "norm":
                raise TorchweaveError(Problem(
                    obj="Trainer(gradient_clip_algorithm=...)", value=repr(algo),
                    rule="the plan clips the global gradient norm", fix="use 'norm'"))
            self.popt.clip_grad_norm_(float(clip))
        self.popt.step()
        self.popt.zero_grad()
        user._opt_called = True  # the schedulers' check that the optimizer stepped
        return out

    # ------------------------------------------------------------ weights
    def _weights(self) -> dict[str, torch.Tensor]:
        """What the plan trains, under the module's names (state the training step never reads,
        an EMA copy say, is the module's own and is left as it is)."""
        full = self.pm.state_dict(full=True)
        trained = self.pm.layout.keys
        return {k[len(PREFIX):]: v for k, v in full.items() if k in trained and k.startswith(PREFIX)}

    def _copy_back(self) -> None:
        """The plan's trained weights into the module (every rank)."""
        if self.pm is not None and self._stale:
            self.lightning_module.load_state_dict(self._weights(), strict=False)
            self._stale = False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.pm is None:
            return super().lightning_module_state_dict()
        return {**self.lightning_module.state_dict(), **self._weights()}

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        if self.pm is not None:
            self.pm.load_state_dict({PREFIX + k: v for k, v in checkpoint["state_dict"].items()},
                                    strict=False)

    def on_validation_start(self) -> None:
        self._copy_back()

    def on_test_start(self) -> None:
        self._copy_back()

    def on_predict_start(self) -> None:
        self._copy_back()

    def on_train_end(self) -> None:
        self._copy_back()
