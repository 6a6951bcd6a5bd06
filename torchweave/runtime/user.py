"""The user's own training loop: a parallel module that behaves like the model.

::

    pm = torchweave.parallelize(model, example_batch, plan="zero2")
    opt = torchweave.optimizer(pm, torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: ...)
    for batch in data:
        loss = pm(*batch)           # the global loss, autograd intact
        loss.backward()             # the plan's backward, then its gradient sync
        opt.clip_grad_norm_(1.0)
        opt.step(); sched.step(); opt.zero_grad()

``pm(*batch)`` runs this rank's generated forward and returns the loss of the
whole batch (the same value on every rank) through one autograd node,
:class:`_Loss`. Its backward hands the local loss term the incoming gradient
(and the point-to-point tokens theirs), and queues the gradient sync to run
when the autograd engine has finished the whole backward pass, as DDP does.

Gradients accumulate as in PyTorch: several backward passes before a step add
up. Under :meth:`UserLoop.no_sync` the sum over ranks is skipped (gradients
stay local) until the next backward outside it. Gradients already summed over
ranks are set aside before the next pass and added back after its sum, so a
sum is never summed again.

A batch of another shape (another sequence length, a last short batch) runs the
same plan, compiled again for that shape once and kept (:meth:`UserLoop._select`):
the plan's splits must divide it, and its parameters must be laid out as before.

Pipelined plans keep a step API, as ``torch.distributed.pipelining`` does:
``pm.step(*batch)`` runs every micro-batch's forward and backward and returns
the loss; the same optimizer applies.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

import torch

from torchweave.lower.units import read_paths
from torchweave.errors import ModelReleased, Problem, TorchweaveError
from torchweave.runtime.statedict import StateLayout, full_state, load_full, sharded_state

if TYPE_CHECKING:
    from torchweave.runtime.executor import RankModule


class _Loss(torch.autograd.Function):
    """Local loss term (and tokens) → the global loss; backward passes the gradient through."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, module: "UserLoop", anchor: torch.Tensor,
                local: torch.Tensor | None, *tokens: torch.Tensor) -> torch.Tensor:
        ctx.module, ctx.done, ctx.sync = module, False, not module._no_sync
        ctx.local = None if local is None else (local.shape, local.dtype)
        ctx.tokens = [(t.shape, t.dtype, t.device) for t in tokens]
        return value.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        module: UserLoop = ctx.module
        if ctx.done:
            raise TorchweaveError(Problem(
                obj="loss.backward()", value="called a second time on the same loss",
                rule="each forward's backward runs once: its gradient sync (and, under ZeRO-3, "
                     "its reduce-scatters) have already run",
                fix="call pm(*batch) again for another backward pass"))
        ctx.done = True
        # the root of the pass: it runs before any gradient reaches a parameter
        module._begin_backward(ctx.sync)
        torch.autograd.Variable._execution_engine.queue_callback(module._after_backward)
        local = None if ctx.local is None else grad.to(ctx.local[1]).expand(ctx.local[0])
        tokens = [torch.ones(s, dtype=d, device=v) if s.numel() else torch.zeros(s, dtype=d, device=v)
                  for s, d, v in ctx.tokens]
        return (None, None, None, local, *tokens)


class UserLoop:
    """What :class:`~torchweave.runtime.executor.RankModule` offers the user's own loop."""

    training = True
    layout: StateLayout | None = None
    example_shapes: tuple[tuple[int, ...] | None, ...] | None = None
    recompile: Any = None
    """``shapes → (Program, code path)`` of this rank for a batch of other shapes (set by
    ``parallelize``, which has the model); None: only the example's shapes run."""
    _variants: dict | None = None
    _no_sync = False
    _synced = False
    """The gradients held now are sums over ranks (until the next zero_grad)."""
    _set_aside: dict[int, torch.Tensor] | None = None
    _optimizer: Any = None
    _syncing = False
    _pending = False
    """A grad-enabled forward whose backward has not run yet."""
    _unsynced = False
    """The last backward ran under no_sync: gradients are not summed over ranks yet."""

    # ------------------------------------------------------------ like nn.Module
    def __call__(self: "RankModule", *batch: Any) -> torch.Tensor:
        """The loss of ``batch`` (every rank gets the same value); ``backward()`` on it trains."""
        if self.program.segments:
            raise TorchweaveError(Problem(
                obj=f"plan {self.program.plan_name!r}", value="pm(*batch)",
                rule="a pipelined plan runs all its micro-batches' forwards and backwards in "
                     "one schedule, so its forward cannot return before the backward",
                fix="call loss = pm.step(*batch), then opt.step()"))
        if self.config.grad_accum != 1:
            raise TorchweaveError(Problem(
                obj="plan accum", value=str(self.config.grad_accum),
                rule="pm(*batch) runs one forward; your loop does the accumulation",
                fix="drop accum= from the plan and call backward on each micro-batch under "
                    "pm.no_sync() but the last"))
        self._select(batch)
        if not torch.is_grad_enabled() or not self.training:  # evaluation: no autograd at all
            with torch.no_grad():
                return self._value(self.forward(*batch))
        if self._pending:
            raise TorchweaveError(Problem(
                obj="pm(*batch)", value="a second forward before the first one's backward",
                rule="each forward's backward runs before the next forward (its gradient sync "
                     "and ZeRO-3's gathered parameters belong to it), as under DDP",
                fix="call loss.backward() on each loss before the next pm(*batch); accumulate by "
                    "calling backward per micro-batch; evaluate under torch.no_grad() or pm.eval()"))
        self._pending = True
        local = self.forward(*batch)
        value = self._value(local)
        anchor = torch.zeros((), requires_grad=True)
        tokens = [t for t in self.rt.send_roots if t.requires_grad]
        if local is not None and not local.requires_grad:
            local = None
        return _Loss.apply(value, self, anchor, local, *tokens)

    def step(self: "RankModule", *batch: Any) -> float:
        """Forward and backward over the plan's micro-batches, then the gradient sync; the loss.

        The optimizer step is the caller's (``opt.step()``). This is how pipelined
        plans train in the user's loop; it works for every plan, and always sums the
        gradients over ranks (``no_sync`` does not apply).
        """
        self._select(batch)
        self._begin_backward(True)  # a step always sums over ranks (no_sync does not apply)
        loss = self.backward_step(*batch)
        self._restore_set_aside()
        self._unsynced = False
        return loss

    def _value(self: "RankModule", local: torch.Tensor | None) -> torch.Tensor:
        """The global loss as a tensor: float32 (float64 for a float64 model). Its sum over
        ranks is one asynchronous collective, and nothing is read to the host: on a GPU
        the host goes on to the backward, and meets the value when the loop reads it."""
        dtype = torch.float64 if local is not None and local.dtype == torch.float64 else torch.float32
        return self.loss_start(local if local is not None else 0.0)().to(dtype)

    def train(self, mode: bool = True) -> "UserLoop":
        self.training = mode
        return self

    def eval(self) -> "UserLoop":
        """Evaluation: run ``pm(*batch)`` under ``torch.no_grad()`` (the graph is the one captured)."""
        return self.train(False)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside skip the gradient sum over ranks, as DDP's ``no_sync``.

        The next backward outside sums everything accumulated. Under ZeRO-3 every
        backward reduce-scatters (the full gradients are not kept), so this saves
        nothing there, and changes nothing in the result.
        """
        before, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = before

    # ------------------------------------------------------------ gradients
    def _begin_backward(self: "RankModule", sync: bool) -> None:
        """Start of a backward pass: whether it sums over ranks; summed gradients set aside."""
        self._pending = False
        if self._synced and sync:  # summed gradients: keep them out of the next sum
            # copies: a summed gradient is a view into its bucket, which the next sum reuses
            self._set_aside = {id(p): p.grad.clone() for b in self.sync.buckets for p in b.params
                               if p.grad is not None}
            for b in self.sync.buckets:
                for p in b.params:
                    p.grad = None
            self._synced = False
        self._syncing = sync
        self.sync.enabled = sync

    def _after_backward(self: "RankModule") -> None:
        """End of a backward pass (queued on the autograd engine): the gradient sync."""
        if not self._syncing:
            if self.zero_opt is not None and self.zero_opt.stage3 is not None:
                self.zero_opt.stage3.finish_grads()  # its reduce-scatters ran anyway: wait for them
            self._unsynced = True
            return
        self.sync.finish()
        if self.zero_opt is not None:
            self.zero_opt.finish_grads()
        self._restore_set_aside()
        self._unsynced = False

    def check_synced(self, what: str) -> None:
        """Refuse ``what`` (a step, a clip) when the last backward skipped the sum over ranks."""
        if self._unsynced:
            raise TorchweaveError(Problem(
                obj=what, value="after a backward under pm.no_sync()",
                rule="the gradients are summed over ranks by the first backward outside "
                     "no_sync; until then each rank holds only its own part",
                fix="run the last micro-batch's backward outside pm.no_sync()"))

    def _restore_set_aside(self: "RankModule") -> None:
        if self._set_aside:
            for b in self.sync.buckets:
                for p in b.params:
                    old = self._set_aside.get(id(p))
                    if old is not None:
                        p.grad = old if p.grad is None else p.grad.add_(old)
        self._set_aside = None
        self._synced = True

    def zero_grads(self: "RankModule") -> None:
        """Drop every gradient this rank holds (pieces, and ZeRO's master shard)."""
        for p in self.params.values():
            p.grad = None
        if self.zero_opt is not None:
            self.zero_opt.drop_grads()
        self._synced, self._set_aside, self._unsynced = False, None, False

    # ------------------------------------------------------------ checks
    def _select(self: "RankModule", batch: tuple[Any, ...]) -> None:
        """Run ``batch``'s shapes: the program compiled for them (once), or the example's."""
        shapes = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in batch)
        if self.recompile is None or shapes == self.example_shapes or self.program.segments \
                or len(shapes) != len(self.example_shapes or ()):
            return self._check_shapes(batch)
        variants = self._variants = self._variants or {
            self.example_shapes: (self.program, self.code)}
        if shapes not in variants:
            try:
                program, path = self.recompile(batch)
            except ModelReleased:
                raise
            except TorchweaveError as e:
                why = " ".join(line.strip() for line in str(e).splitlines()[:3])
                raise TorchweaveError(Problem(
                    obj="pm(*batch)", value=f"input shapes {shapes}",
                    rule=f"the plan made for shapes {self.example_shapes} runs other shapes where "
                         f"its splits divide them; at these it does not ({why[:300]})",
                    fix=f"pad or batch the data to shapes the plan divides (such as "
                        f"{self.example_shapes}), or parallelize with an example of these")) from None
            from torchweave.runtime.executor import load_module

            mine = [(s.path, s.box) for s in self.program.params]
            if [(s.path, s.box) for s in program.params] != mine or (
                    self.zero_opt is not None and read_paths(program) != read_paths(self.program)):
                raise TorchweaveError(Problem(
                    obj=f"plan {self.program.plan_name!r}", value=f"batch shapes {shapes}",
                    rule="a batch of other shapes runs the same plan with its parameters laid "
                         "out as for the example batch; at these shapes they are not",
                    fix="pad the batch to the example's shapes, or parallelize with this shape"))
            variants[shapes] = (program, load_module(path, f"torchweave_rank{program.rank}_{id(self)}_"
                                                           f"{len(variants)}"))
        self.program, self.code = variants[shapes]
        self.rt.group_cache.create_all(self.program.groups)
        self.example_shapes = shapes

    def _check_shapes(self, batch: tuple[Any, ...]) -> None:
        want = self.example_shapes
        if want is None:
            return
        if len(batch) != len(want):
            raise TorchweaveError(Problem(
                obj="pm(*batch)", value=f"{len(batch)} inputs",
                rule=f"the batch has the example's {len(want)} inputs",
                fix="pass the inputs the model was parallelized with"))
        for i, (x, shape) in enumerate(zip(batch, want)):
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else None
            if got != shape:
                raise TorchweaveError(Problem(
                    obj=f"input {i}", value=f"shape {got}",
                    rule=f"the plan was captured and split for shape {shape}; it runs that shape only",
                    fix=f"parallelize with an example batch of shape {got}, or pad or batch the "
                        f"data to {shape}"))

    # ------------------------------------------------------------ state
    def state_dict(self: "RankModule", *, full: bool = False) -> dict[str, Any]:
        """The model's state under its own parameter names (a collective: call on every rank).

        ``full=True``: whole tensors, on every rank. Otherwise each entry is a
        ``ShardedTensor`` of the pieces this rank holds (each piece once over the
        world), which ``torch.distributed.checkpoint`` saves and loads directly,
        also into a plain model's full ``state_dict()``.
        """
        layout = self._layout()
        pieces = {path: t for path, (_, t) in self.state_pieces().items()}
        if full:
            return full_state(layout, pieces, self.rt.group_cache.rank, self.rt.device)
        return sharded_state(layout, pieces, self.rt.group_cache.rank, self.rt.device)

    def load_state_dict(self: "RankModule", state: dict[str, Any], strict: bool = True) -> None:
        """Load whole tensors, or the ``ShardedTensor`` entries of :meth:`state_dict`."""
        layout = self._layout()
        fulls = load_full(layout, state, strict=strict, rank=self.rt.group_cache.rank, device=self.rt.device)
        self.load_pieces(fulls)

    def _layout(self) -> StateLayout:
        if self.layout is None:
            raise TorchweaveError(Problem(
                obj="state_dict", value="a module built without its plan's layout",
                rule="the state under the model's names needs every rank's pieces",
                fix="build the module with torchweave.parallelize"))
        return self.layout

    def __repr__(self) -> str:
        return f"{type(self).__name__}(plan={self.program.plan_name!r}, rank={self.program.rank})"


def attached(module: Any) -> "RankModule":
    """``module`` if it is a parallel module; a clear error otherwise."""
    from torchweave.runtime.executor import RankModule

    if not isinstance(module, RankModule):
        raise TorchweaveError(Problem(
            obj="torchweave.optimizer", value=f"a {type(module).__name__}",
            rule="the optimizer is built on the module torchweave.parallelize returned",
            fix="pm = torchweave.parallelize(model, batch, plan=...); "
                "opt = torchweave.optimizer(pm, torch.optim.AdamW, lr=...)"))
    return module
