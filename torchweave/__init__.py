"""torchweave: single-device PyTorch in, a parallel training program out."""

from torchweave.api import capture
from torchweave.errors import TorchweaveError
from torchweave.ir import Graph
from torchweave.ops import batch_local, register_annotation, register_op
from torchweave.parallel import parallelize
from torchweave.plan.layout import Mesh
from torchweave.plan.plan import Plan
from torchweave.runtime.executor import StepConfig
from torchweave.runtime.launch import LaunchConfig, spawn
from torchweave.runtime.optim import ParallelOptimizer, optimizer
from torchweave.summary import summarize
from torchweave.verify import verify

__all__ = [
    "Graph", "LaunchConfig", "Mesh", "ParallelOptimizer", "Plan", "StepConfig", "TorchweaveError",
    "batch_local", "capture", "launch", "optimizer", "parallelize", "register_annotation", "register_op", "spawn", "summarize", "verify",
]
__version__ = "0.1.0"


def launch(fn, config, *args):  # type: ignore[no-untyped-def]
    """The old name of :func:`spawn` (one process per rank on this machine); use ``spawn``."""
    import warnings

    warnings.warn("torchweave.launch is now torchweave.spawn (the same function)",
                  DeprecationWarning, stacklevel=2)
    return spawn(fn, config, *args)
