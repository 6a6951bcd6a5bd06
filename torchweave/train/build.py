"""What a config names, built: the model, the optimizer factory and the LR multiplier."""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable

import torch

from torchweave.errors import Problem, TorchweaveError
from torchweave.train.config import ConfigError, ModelConfig, OptimConfig, ScheduleConfig
from torchweave.train.data import _import

# Bundled builders that take keyword arguments (the FACTORIES take none).
_ARCH = ("gpt", "llama")


def _arch(name: str, kwargs: dict[str, Any]) -> torch.nn.Module:
    from torchweave.models import GPT, GPTConfig, Llama, LlamaConfig

    cls, cfg_cls = {"gpt": (GPT, GPTConfig), "llama": (Llama, LlamaConfig)}[name]
    defaults = {"gpt": dict(block_size=64, n_layer=2, n_head=4, d_model=64),
                "llama": dict(block_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=64,
                              ffn_hidden=128)}[name]
    try:
        return cls(cfg_cls(**{**defaults, **kwargs}))
    except (TypeError, ValueError) as e:
        raise ConfigError(Problem(obj="model.kwargs", value=repr(kwargs),
                                  rule=f"valid {cfg_cls.__name__} fields ({e})")) from None


def build_model(cfg: ModelConfig, *, vocab_size: int | None, seq_len: int) -> torch.nn.Module:
    """The model a config names, built under the caller's seed.

    ``hf`` names a transformers causal LM built from ``config``
    (:func:`torchweave.models.hf.hf_causal_lm`). ``gpt`` and ``llama`` take ``kwargs`` (``n_layer``, ``d_model``...), and get
    ``vocab_size`` from the dataset and a ``block_size`` of at least ``seq_len``
    unless given. A bundled factory name (``gpt-tiny``...) or ``module:function``
    may return a module or ``(module, example_inputs)``. The ops of ``batch_local`` are
    declared so (:func:`torchweave.batch_local`) before anything captures the model.
    """
    if cfg.batch_local:
        from torchweave.ops import batch_local

        try:
            batch_local(*cfg.batch_local)
        except TorchweaveError as e:
            raise ConfigError(e.problems) from None
    if cfg.hf is not None:
        from torchweave.models.hf import hf_causal_lm

        config = dict(cfg.config)
        if vocab_size is not None:
            config.setdefault("vocab_size", vocab_size)
        try:
            return hf_causal_lm(cfg.hf, config)
        except TorchweaveError as e:
            raise ConfigError(e.problems) from None
    if cfg.factory in _ARCH:
        kwargs = dict(cfg.kwargs)
        if vocab_size is not None:
            kwargs.setdefault("vocab_size", vocab_size)
        kwargs.setdefault("block_size", max(seq_len, 64))
        return _arch(cfg.factory, kwargs)
    from torchweave.factory import resolve

    try:
        fn = resolve(cfg.factory)
    except TorchweaveError as e:
        raise ConfigError(Problem(obj="model.factory", value=repr(cfg.factory),
                                  rule="'gpt', 'llama', a bundled name or 'module:function'",
                                  fix=e.problems[0].fix if e.problems else "")) from None
    result = fn(**cfg.kwargs)
    model = result[0] if isinstance(result, tuple) else result
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(Problem(obj="model.factory", value=f"returned {type(model).__name__}",
                                  rule="a factory returns an nn.Module or (module, inputs)"))
    return model


def optimizer_factory(cfg: OptimConfig) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    """Params → optimizer, as the runtime asks for one per parameter group it keeps."""
    if cfg.name == "adamw":
        return functools.partial(torch.optim.AdamW, lr=cfg.lr, betas=cfg.betas,
                                 weight_decay=cfg.weight_decay, **cfg.kwargs)
    if cfg.name == "sgd":
        kwargs = {"momentum": 0.9, **cfg.kwargs}
        return functools.partial(torch.optim.SGD, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                 **kwargs)
    cls = _import(cfg.name, "optim.name")
    if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(Problem(obj="optim.name", value=repr(cfg.name),
                                  rule="names a torch.optim.Optimizer subclass"))
    return functools.partial(cls, lr=cfg.lr, **cfg.kwargs)


def lr_multiplier(cfg: ScheduleConfig, total_steps: int) -> Callable[[int], float]:
    """Step (1-based) → multiplier of ``optim.lr``: a pure function, so resuming needs only the step."""
    user = _import(cfg.kind, "schedule.kind") if ":" in cfg.kind else None
    warm, lo = cfg.warmup_steps, cfg.min_lr_ratio

    def factor(step: int) -> float:
        if warm and step <= warm:
            return step / warm
        if user is not None:
            return float(user(step, total_steps, **cfg.kwargs))
        if cfg.kind == "constant":
            return 1.0
        span = max(1, total_steps - warm)
        t = min(1.0, (step - warm) / span)
        if cfg.kind == "linear":
            return lo + (1 - lo) * (1 - t)
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * t))

    return factor


__all__ = ["build_model", "lr_multiplier", "optimizer_factory"]
