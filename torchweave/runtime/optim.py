"""``torchweave.optimizer``: any ``torch.optim`` class over a parallel module's pieces.

The module keeps up to two optimizers of the class asked for: one over ZeRO's
flat master shard (when the plan shards the optimizer) and one over the pieces
ZeRO does not own. :class:`ParallelOptimizer` is a ``torch.optim.Optimizer``
with one parameter group, as the model's own optimizer would have: a
learning-rate scheduler sets ``group["lr"]`` there, and each ``step`` copies
the group's options into both. ``step``, ``zero_grad``, ``clip_grad_norm_``
(the global norm, each piece counted once) and the state dict go to them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from torchweave.errors import Problem, TorchweaveError
from torchweave.runtime.user import attached


class ParallelOptimizer(torch.optim.Optimizer):
    """A ``torch.optim`` optimizer over one parallel module (see :func:`optimizer`)."""

    def __init__(self, module: Any, cls: type[torch.optim.Optimizer], **kwargs: Any) -> None:
        module = attached(module)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise TorchweaveError(Problem(
                obj="torchweave.optimizer", value=repr(cls),
                rule="the second argument is a torch.optim.Optimizer class",
                fix="e.g. torchweave.optimizer(pm, torch.optim.AdamW, lr=3e-4)"))

        def factory(params: list[torch.Tensor]) -> torch.optim.Optimizer:
            return cls(params, **kwargs)

        try:
            probe = factory([torch.zeros(1, requires_grad=True)])
        except (TypeError, ValueError, RuntimeError) as e:
            raise TorchweaveError(Problem(
                obj=f"torchweave.optimizer({cls.__name__})", value=f"{kwargs}",
                rule=f"{cls.__name__} takes these options: {e}",
                fix=f"pass the keyword arguments {cls.__name__} accepts")) from None
        module.set_optimizer(factory)
        module._optimizer = self
        self.module = module
        self.inners = module.optimizers()
        params = [p for o in self.inners for g in o.param_groups for p in g["params"]]
        super().__init__(params or [torch.zeros(0, requires_grad=True)], dict(probe.defaults))
        self._built = True

    _built = False

    def _check(self) -> None:
        if self.module._optimizer is not self:
            raise TorchweaveError(Problem(
                obj="optimizer", value="built before a newer torchweave.optimizer on the same module",
                rule="one optimizer per parallel module: the newest one holds the module's pieces",
                fix="keep and step the optimizer you built last"))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        self._check()
        if closure is not None:
            raise TorchweaveError(Problem(
                obj="optimizer.step", value="a closure",
                rule="the parallel optimizer steps once per call, without re-evaluating the loss",
                fix="call opt.step() without a closure (LBFGS-style closures are not supported)"))
        self.module.check_synced("optimizer.step()")
        self.push_options()
        m = self.module
        if m.zero_opt is not None:
            m.zero_opt.step(zero_grad=False)
        if m.optimizer is not None:
            m.optimizer.step()

    def push_options(self) -> None:
        """The group's options (``lr``, set by a scheduler, say) into the inner optimizers."""
        options = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        for o in self.inners:
            for g in o.param_groups:
                g.update(options)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._check()
        self.module.zero_grads()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient so that the global norm is at most ``max_norm``; the norm before."""
        self._check()
        self.module.check_synced("optimizer.clip_grad_norm_()")
        return torch.tensor(self.module.clip(float(max_norm)))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not self._built:  # Optimizer.__init__'s own group
            return super().add_param_group(param_group)
        raise TorchweaveError(Problem(
            obj="optimizer.add_param_group", value="a new group",
            rule="the parallel optimizer's parameters are the module's pieces, fixed by the plan",
            fix="build the optimizer with torchweave.optimizer(pm, cls, **options)"))

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (its pieces and its ZeRO shard); per rank, for this plan."""
        self.push_options()
        return {"torchweave": 1, "inners": [o.state_dict() for o in self.inners]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        inners = state_dict.get("inners") if isinstance(state_dict, dict) else None
        if not isinstance(inners, list) or len(inners) != len(self.inners):
            raise TorchweaveError(Problem(
                obj="optimizer.load_state_dict", value=type(state_dict).__name__,
                rule="a state written by this rank's opt.state_dict() under the same plan",
                fix="save and load the optimizer on each rank under one plan, or use "
                    "torchweave.train's checkpoints to change plans"))
        for o, s in zip(self.inners, inners):
            o.load_state_dict(s)
        if self.inners:  # the group's options as saved (a scheduler's lr, say)
            self.param_groups[0].update({k: v for k, v in self.inners[0].param_groups[0].items()
                                         if k != "params"})


def optimizer(module: Any, cls: type[torch.optim.Optimizer], **kwargs: Any) -> ParallelOptimizer:
    """Any ``torch.optim`` class over ``module`` (from :func:`torchweave.parallelize`).

    ZeRO sharding, mixed precision (fp32 masters) and the gradient sync follow the
    plan; ``clip_grad_norm_`` clips the global norm; LR schedulers work on it.
    """
    return ParallelOptimizer(module, cls, **kwargs)
