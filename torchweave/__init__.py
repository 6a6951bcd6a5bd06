"""torchweave: single-device PyTorch in, a parallel training program out.

The public names are imported when first used (PEP 562), so that ``import torchweave``
costs almost nothing beyond torch: a process that only launches ranks, or imports one
model file, does not import every layer (the DDP side of ``bench/first_step.py`` is such a
process).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from torchweave.errors import TorchweaveError

_PUBLIC = {
    "Graph": "torchweave.ir",
    "LaunchConfig": "torchweave.runtime.launch",
    "Mesh": "torchweave.plan.layout",
    "ParallelOptimizer": "torchweave.runtime.optim",
    "Plan": "torchweave.plan.plan",
    "StepConfig": "torchweave.runtime.executor",
    "batch_local": "torchweave.ops",
    "capture": "torchweave.api",
    "optimizer": "torchweave.runtime.optim",
    "parallelize": "torchweave.parallel",
    "register_annotation": "torchweave.ops",
    "register_op": "torchweave.ops",
    "spawn": "torchweave.runtime.launch",
    "summarize": "torchweave.summary",
    "verify": "torchweave.verify",
}
"""Each public name → the module that defines it."""

__all__ = sorted([*_PUBLIC, "TorchweaveError", "launch"])
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """A public name, or a subpackage (``torchweave.sim``), imported on first use."""
    where = _PUBLIC.get(name)
    if where is None and not name.startswith("_"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """``capture`` and ``verify`` name both a function and a subpackage. Importing the
    subpackage sets the package's attribute to it; the function keeps the name, as it did
    when this file imported both eagerly."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _PUBLIC and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def launch(fn, config, *args):  # type: ignore[no-untyped-def]
    """The old name of :func:`spawn` (one process per rank on this machine); use ``spawn``."""
    import warnings

    from torchweave.runtime.launch import spawn

    warnings.warn("torchweave.launch is now torchweave.spawn (the same function)",
                  DeprecationWarning, stacklevel=2)
    return spawn(fn, config, *args)
