"""Gradient buckets are sized as DDP's: by default a 1 MiB first bucket (the last gradients
backward produces) and 25 MiB after it; a size the user gives applies to every bucket."""

from __future__ import annotations

import pytest
import torch

from torchweave.errors import TorchweaveError
from torchweave.runtime.executor import StepConfig
from torchweave.lower.buckets import bucket_caps
from torchweave.runtime.gradsync import GradSync
from torchweave.train.config import ParallelConfig


def _sizes(bucket_mb: float | None) -> list[int]:
    """Bucket sizes (elements) over 4 MiB of gradients, in the order they start."""
    params = [(torch.zeros(2**16, requires_grad=True), (0, 1)) for _ in range(16)]  # 256 KiB each
    first, rest = bucket_caps(bucket_mb)
    sync = GradSync(None, params, bucket_bytes=rest, first_bucket_bytes=first, overlap=False)
    return [sum(p.numel() for p in b.params) for b in sync.buckets]


def test_the_default_starts_with_a_small_bucket() -> None:
    assert bucket_caps(None) == (2**20, 25 * 2**20)
    assert _sizes(None) == [4 * 2**16, 12 * 2**16]


def test_a_given_size_applies_to_every_bucket() -> None:
    assert _sizes(25.0) == [16 * 2**16]
    assert _sizes(0.5) == [2 * 2**16] * 8


def test_a_bad_size_is_named_before_launch() -> None:
    with pytest.raises(TorchweaveError, match="StepConfig.bucket_mb"):
        StepConfig(bucket_mb=0.0)
    with pytest.raises(TorchweaveError, match="parallel.bucket_mb"):
        ParallelConfig(bucket_mb=-2.0)
    assert ParallelConfig(bucket_mb=8.0).bucket_mb == 8.0 and ParallelConfig().bucket_mb is None


def test_a_train_config_sets_it() -> None:
    from torchweave.train.loading import config_from_dict

    assert config_from_dict({"parallel": {"bucket_mb": 4}}).parallel.bucket_mb == 4.0
    with pytest.raises(TorchweaveError, match="parallel.bucket_mb"):
        config_from_dict({"parallel": {"bucket_mb": "big"}})
