"""Mixed-precision upcasts that leave float64 alone."""

from __future__ import annotations

import torch


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least float32: bf16 and fp16 go up, float32 and float64 stay as they are
    (``x.float()`` would round a float64 model's loss and norms to float32)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()
