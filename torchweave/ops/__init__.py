"""Operator annotations: the grammar, the registry, and what they derive."""

from torchweave.ops import aten as _aten  # noqa: F401 - registers the built-in ops
from torchweave.ops import aten_data as _aten_data  # noqa: F401 - and these
from torchweave.ops import moe as _moe  # noqa: F401 - and the experts of a mixture
from torchweave.ops.annotate import OpInfo, UnannotatedOpWarning, annotate, call_of, info
from torchweave.ops.bind import Bound, Split, bind
from torchweave.ops.grammar import Annotation, parse
from torchweave.ops.registry import REGISTRY, Call, OpSpec, Registry

BUILT_IN: dict[str, OpSpec] = dict(REGISTRY.specs)
"""The ops torchweave itself annotates, as registered at import (before any user's own)."""

__all__ = [
    "BUILT_IN", "REGISTRY", "Annotation", "Bound", "Call", "OpInfo", "OpSpec", "Registry", "Split",
    "UnannotatedOpWarning", "annotate", "bind", "call_of", "info", "parse",
]

from torchweave.ops.custom import batch_local, register_annotation, register_op  # noqa: E402

__all__ += ["batch_local", "register_annotation", "register_op"]
