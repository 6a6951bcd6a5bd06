"""Model → :class:`~torchweave.ir.Graph` through torch.export."""

from torchweave.capture.export import capture

__all__ = ["capture"]
