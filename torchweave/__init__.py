"""torchweave: single-device PyTorch in, a parallel training program out."""

from torchweave.api import capture
from torchweave.errors import TorchweaveError
from torchweave.ir import Graph
from torchweave.ops import register_annotation, register_op
from torchweave.summary import summarize

__all__ = [
    "Graph", "TorchweaveError", "capture", "register_annotation", "register_op", "summarize",
]
__version__ = "0.1.0"
