"""Typed configuration of ``torchweave train``: YAML plus ``--section.field=value`` overrides.

Every section is a frozen, keyword-only dataclass (STYLE.md point 10).
:func:`torchweave.train.loading.load_config` builds them from plain YAML data (through
:func:`torchweave.train.typed.build`), checking every field's
type against its annotation and collecting all problems into one
:class:`TorchweaveError`; each section's ``__post_init__`` then checks the
rules between fields (batch arithmetic, say) and shows the arithmetic.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from torchweave.errors import Problem, TorchweaveError
from torchweave.policies.spec import PlanSpec, is_auto
from torchweave.train.typed import ConfigError


# ---------------------------------------------------------------- sections
@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model to train."""

    factory: str = "gpt-tiny"
    """A bundled model name (``gpt-tiny``, ``llama-tiny``, ...) or an import path
    ``package.module:function`` returning a module (and optionally example inputs)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the factory."""
    hf: str | None = None
    """A ``transformers`` causal LM by class name (``LlamaForCausalLM``), built from
    ``config`` with fresh weights, nothing downloaded; its forward returns the loss. In
    place of ``factory``."""
    config: dict[str, Any] = field(default_factory=dict)
    """The fields of the ``hf`` model's config class (``hidden_size: 256``...);
    ``vocab_size`` defaults to the dataset's."""
    batch_local: tuple[str, ...] = ()
    """Ops whose rows are independent (``aten.kthvalue``...): data parallelism keeps the
    batch split through them (:func:`torchweave.batch_local`)."""

    def __post_init__(self) -> None:
        if not self.factory:
            raise ConfigError(Problem(obj="model.factory", value=repr(self.factory),
                                      rule="a bundled model name or 'module:function'"))
        if self.hf is not None and not (isinstance(self.hf, str) and self.hf.isidentifier()):
            raise ConfigError(Problem(obj="model.hf", value=repr(self.hf),
                                      rule="a transformers class name, e.g. LlamaForCausalLM"))
        if self.config and self.hf is None:
            raise ConfigError(Problem(obj="model.config", value=repr(self.config),
                                      rule="config configures an hf model",
                                      fix="name the class in model.hf, or use model.kwargs"))
        bad = [k for k in self.config if not (isinstance(k, str) and k.isidentifier())]
        if bad:
            raise ConfigError(Problem(obj="model.config", value=repr(bad),
                                      rule="keys are field names of the model's config class"))


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where training batches come from."""

    kind: str = "synthetic"
    """``synthetic``: seeded random tokens; ``text``: a character-tokenized corpus;
    or ``package.module:callable`` returning a map-style dataset whose items are
    tuples of tensors (called with ``kwargs``)."""
    seq_len: int = 16
    """Tokens per sample."""
    vocab_size: int = 256
    """Token ids are drawn below this (synthetic data only)."""
    path: str | None = None
    """Text file for ``kind: text``; ``None`` is the corpus shipped with torchweave."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of a ``module:callable`` dataset."""

    def __post_init__(self) -> None:
        problems = []
        if self.kind not in ("synthetic", "text") and ":" not in self.kind:
            problems.append(Problem(obj="data.kind", value=repr(self.kind),
                                    rule="one of 'synthetic', 'text', or 'package.module:callable'"))
        if self.seq_len < 1:
            problems.append(Problem(obj="data.seq_len", value=str(self.seq_len), rule="at least 1"))
        if self.vocab_size < 1:
            problems.append(Problem(obj="data.vocab_size", value=str(self.vocab_size),
                                    rule="at least 1"))
        if problems:
            raise ConfigError(problems)


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """The optimizer of every parameter piece."""

    name: str = "adamw"
    """``adamw``, ``sgd`` (momentum 0.9), or an optimizer class by import path
    (``torch.optim:Adam``, ``package.module:MyOptimizer``), built with ``lr`` and ``kwargs``."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of the optimizer."""
    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) or L2 penalty (SGD)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's moment decay rates."""
    clip_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this value; ``None`` turns clipping off."""

    def __post_init__(self) -> None:
        problems = []
        if self.name not in ("adamw", "sgd") and ":" not in self.name:
            problems.append(Problem(obj="optim.name", value=repr(self.name),
                                    rule="one of 'adamw', 'sgd', or 'package.module:Class'"))
        if not (math.isfinite(self.lr) and self.lr > 0):
            problems.append(Problem(obj="optim.lr", value=repr(self.lr), rule="a finite number > 0"))
        if not self.weight_decay >= 0:
            problems.append(Problem(obj="optim.weight_decay", value=repr(self.weight_decay),
                                    rule="a number >= 0"))
        if not all(0 <= b < 1 for b in self.betas):
            problems.append(Problem(obj="optim.betas", value=repr(self.betas),
                                    rule="two numbers in [0, 1)"))
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            problems.append(Problem(obj="optim.clip_grad_norm", value=repr(self.clip_grad_norm),
                                    rule="a number > 0, or null to turn clipping off"))
        if problems:
            raise ConfigError(problems)


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """The learning-rate schedule."""

    warmup_steps: int = 0
    """Steps of linear warm-up from 0 to ``optim.lr``."""
    kind: str = "constant"
    """After warm-up: ``constant`` keeps ``optim.lr``; ``cosine`` and ``linear`` decay it
    to ``min_lr_ratio * lr`` by the last step; or ``package.module:callable``, called as
    ``callable(step, total_steps, **kwargs)`` and returning the LR multiplier."""
    min_lr_ratio: float = 0.0
    """Where ``cosine`` and ``linear`` end, as a fraction of ``optim.lr``."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of a ``module:callable`` schedule."""

    def __post_init__(self) -> None:
        problems = []
        if self.warmup_steps < 0:
            problems.append(Problem(obj="schedule.warmup_steps", value=str(self.warmup_steps),
                                    rule="a number of steps >= 0"))
        if self.kind not in ("constant", "cosine", "linear") and ":" not in self.kind:
            problems.append(Problem(obj="schedule.kind", value=repr(self.kind),
                                    rule="one of 'constant', 'cosine', 'linear', or "
                                         "'package.module:callable'"))
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            problems.append(Problem(obj="schedule.min_lr_ratio", value=repr(self.min_lr_ratio),
                                    rule="a number in [0, 1]"))
        if problems:
            raise ConfigError(problems)


def _plan_dp(plan: str, world_size: int) -> tuple[int, str]:
    """The data-parallel degree a plan string or plan.json implies, and how (for error
    messages); a bad plan string or file is a :class:`ConfigError` on ``parallel.plan``."""
    if plan.endswith(".json"):
        return _saved_plan_dp(plan, world_size)
    try:
        spec = PlanSpec.parse(plan)
    except TorchweaveError as e:
        raise _on_plan(e) from None
    return spec.dp(world_size), f"plan {plan!r}: dp = {spec.dp(world_size)}"


def _on_plan(e: TorchweaveError) -> ConfigError:
    """``e``'s problems as problems of ``parallel.plan``."""
    return ConfigError([dataclasses.replace(p, obj=f"parallel.plan: {p.obj}") for p in e.problems])


def _saved_plan_dp(path: str, world_size: int) -> tuple[int, str]:
    """A saved plan's data-parallel degree: the product of its mesh's ``dp`` and ``ep`` axes
    (the ranks that see different samples); a plan without a mesh, ``world_size``."""
    from torchweave.plan.plan import Plan

    try:
        saved = Plan.from_json(Path(path).read_text())
    except OSError as e:
        raise ConfigError(Problem(
            obj="parallel.plan", value=repr(path), rule=f"a plan.json that can be read ({e.strerror})",
            fix="check the path, or write one: torchweave plan MODEL --plan tp --out plan.json")) from None
    except TorchweaveError as e:
        raise _on_plan(e) from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(Problem(
            obj="parallel.plan", value=repr(path), rule=f"a plan JSON file ({type(e).__name__}: {e})",
            fix="write it with torchweave plan ... --out, or Plan.to_json()")) from None
    if saved.mesh is None:
        return world_size, f"plan {path!r} has no mesh: dp = world_size"
    axes = dict(saved.mesh.axes)
    dp = axes.get("dp", 1) * axes.get("ep", 1)
    return dp, f"plan {path!r}: its mesh {saved.mesh} has dp = {dp}"


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the work is split over ranks."""

    plan: str = "dp"
    """A plan string: a built-in policy (``dp``, ``zero1``-``zero3``, ``tp``, ``sp``, or a
    pipeline: ``gpipe``, ``1f1b``, ``interleaved``, ``zb``, ``interlaced``) with options,
    such as ``zero3:recompute=full``, ``tp:tp=2,zero=1`` or
    ``1f1b:micro=8,dp=2,tp=2,recompute=selective`` (all of them:
    ``torchweave.policies.spec``; a pipeline cuts each ``micro_batch`` batch into its
    micro-batches), a plan.json path (its data-parallel degree read from its mesh's ``dp`` and ``ep``
    axes, world_size if it has no mesh; the file is read when the config is checked, on
    every rank, as the config file itself is),
    or ``auto`` (``auto:preset=megatron``): the plan the search (``torchweave.search``)
    predicts fastest on this machine among those that fit, with the data-parallel
    degree the batch sizes give and the rest of the ranks split by tensor and
    pipeline parallelism."""
    world_size: int = 2
    """Number of ranks."""
    grad_accum: int = 1
    """Micro-batches per optimizer step on each data-parallel rank; a plan string's
    ``accum`` (``dp:accum=4``) sets it too."""
    micro_batch: int = 2
    """Samples per micro-batch on each data-parallel rank."""
    global_batch: int = 4
    """Samples per optimizer step over all ranks: ``micro_batch * grad_accum * dp``."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """bf16: compute in bf16 from fp32 master weights."""
    p2p_tags: Literal["auto", "tagged", "untagged"] = "auto"
    """Pipeline messages: ``untagged`` (tag 0, matched by order alone, as on NCCL),
    ``tagged``, or ``auto`` (untagged on NCCL, tagged on gloo)."""
    bucket_mb: float | None = None
    """Gradient all-reduce bucket size, MiB: left out, DDP's defaults (25 MiB, the first
    bucket 1 MiB); given, every bucket that size (DDP's ``bucket_cap_mb``)."""

    @property
    def dp(self) -> int:
        """Data-parallel degree: groups of ranks that see different samples (``auto``: what
        the batch sizes say, ``global_batch / (micro_batch · grad_accum)``)."""
        if is_auto(self.plan):
            return max(1, self.global_batch // max(1, self.micro_batch * self.grad_accum))
        return _plan_dp(self.plan, self.world_size)[0]

    def __post_init__(self) -> None:
        problems = []
        accum = 1
        if not self.plan.endswith(".json") and not is_auto(self.plan):
            _plan_dp(self.plan, self.world_size)  # a bad plan string is a ConfigError
            accum = PlanSpec.parse(self.plan).options.get("accum", 1)
        if accum != 1 and self.grad_accum == 1:  # "dp:accum=4" is grad_accum: 4
            object.__setattr__(self, "grad_accum", accum)
        elif accum != 1 and self.grad_accum != accum:
            problems.append(Problem(obj="parallel.grad_accum", value=str(self.grad_accum),
                                    rule=f"one number of micro-batches per step: the plan "
                                         f"{self.plan!r} says accum={accum}",
                                    fix="give it once (grad_accum or the plan's accum), or "
                                        "make them equal"))
        for name in ("world_size", "grad_accum", "micro_batch", "global_batch"):
            if getattr(self, name) < 1:
                problems.append(Problem(obj=f"parallel.{name}", value=str(getattr(self, name)),
                                        rule="at least 1"))
        if self.bucket_mb is not None and not self.bucket_mb > 0:
            problems.append(Problem(obj="parallel.bucket_mb", value=repr(self.bucket_mb),
                                    rule="a positive size in MiB",
                                    fix="leave it out for DDP's defaults, or e.g. bucket_mb: 25"))
        if not problems and is_auto(self.plan):
            _plan_dp(self.plan, self.world_size)  # the plan string itself is checked
            each = self.micro_batch * self.grad_accum
            if self.global_batch % each or self.world_size % (self.global_batch // each):
                problems.append(Problem(
                    obj="parallel.global_batch", value=str(self.global_batch),
                    rule=f"under {self.plan!r} the data-parallel degree is global_batch / "
                         f"(micro_batch * grad_accum) = {self.global_batch} / {each}, a whole "
                         f"number that divides world_size ({self.world_size}); the search "
                         f"splits the rest of the ranks with tensor and pipeline parallelism",
                    fix=f"set global_batch to {each * self.world_size} (dp = world_size) or "
                        f"another multiple of {each} whose quotient divides {self.world_size}"))
        elif not problems and self.global_batch != self.micro_batch * self.grad_accum * self.dp:
            problems.append(Problem(
                obj="parallel.global_batch", value=str(self.global_batch),
                rule=f"global_batch({self.global_batch}) != micro_batch({self.micro_batch}) * "
                     f"grad_accum({self.grad_accum}) * dp({self.dp})"
                     f" ({_plan_dp(self.plan, self.world_size)[1]})",
                fix=f"set global_batch to {self.micro_batch * self.grad_accum * self.dp}, "
                    "or change micro_batch or grad_accum"))
        if problems:
            raise ConfigError(problems)


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """When and where checkpoints are written."""

    dir: str | None = None
    """Checkpoint folder; ``None`` is ``<run_dir>/checkpoints``."""
    every: int = 100
    """Save every this many steps (and at the end); 0 saves only at the end."""
    keep: int = 3
    """Keep the newest this many checkpoints; older ones are deleted after a good save."""

    def __post_init__(self) -> None:
        problems = []
        if self.every < 0:
            problems.append(Problem(obj="checkpoint.every", value=str(self.every),
                                    rule="a number of steps >= 0"))
        if self.keep < 1:
            problems.append(Problem(obj="checkpoint.keep", value=str(self.keep), rule="at least 1"))
        if problems:
            raise ConfigError(problems)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run."""

    run_dir: str = "runs/default"
    """Everything the run writes goes under here: logs, generated code, checkpoints."""
    steps: int = 100
    """Optimizer steps to run."""
    seed: int = 0
    """Seed of the model's initialization, the data and every rank's RNG."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    data: DataConfig = field(default_factory=DataConfig)
    """The data."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """The learning-rate schedule."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Ranks, plan and batch sizes."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""
    log_every: int = 10
    """Print a log line (when not on a terminal) and write TensorBoard scalars every this
    many steps; ``metrics.jsonl`` gets every step."""
    max_bad_steps: int = 3
    """A step whose loss or gradient norm is NaN or inf is skipped (and counted);
    this many in a row abort the run."""
    resume: bool = True
    """Resume from the newest complete checkpoint in the checkpoint folder, if any. One
    that cannot be loaded (refused metadata, another model, damaged files) stops the run
    with an error naming it: resume never skips to an older checkpoint silently."""
    tensorboard: bool = True
    """Also write metrics as TensorBoard events under ``<run_dir>/tensorboard``."""
    progress: bool = True
    """Show a progress bar on rank 0 (log lines instead when not on a terminal)."""
    threads_per_rank: int = 1
    """Intra-op threads of each local rank (CPU)."""
    export: bool = True
    """At the end, write the merged single-device weights to ``<run_dir>/model.safetensors``
    (they load into the original model with ``load_state_dict(strict=True)``)."""

    def __post_init__(self) -> None:
        problems = []
        for name in ("steps", "log_every", "max_bad_steps", "threads_per_rank"):
            if getattr(self, name) < 1:
                problems.append(Problem(obj=name, value=str(getattr(self, name)),
                                        rule="at least 1"))
        if problems:
            raise ConfigError(problems)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or str(Path(self.run_dir) / "checkpoints")


__all__ = [
    "CheckpointConfig", "ConfigError", "DataConfig", "ModelConfig", "OptimConfig",
    "ParallelConfig", "ScheduleConfig", "TrainConfig",
]
