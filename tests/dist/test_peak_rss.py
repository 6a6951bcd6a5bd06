"""The trainer's "memory per rank" is each rank's own peak, not its launcher's."""

from __future__ import annotations

import resource

import pytest
import torch


def _peaks(ctx):
    from torchweave.train.loop import peak_rss_mib

    return peak_rss_mib(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.dist
def test_a_spawned_ranks_peak_is_its_own() -> None:
    from torchweave.runtime.launch import LaunchConfig, spawn
    from torchweave.train.loop import peak_rss_mib

    big = torch.ones(2**27)  # 512 MiB in the launcher, touched
    big += 1
    launcher = peak_rss_mib()
    got = spawn(_peaks, LaunchConfig(world_size=2, timeout_s=60.0))
    del big
    for own, carried in got:
        assert own < launcher - 400, (own, launcher)  # a fresh interpreter with torch: ~0.2 GiB
        assert carried >= own  # ru_maxrss is the larger where it carries the launcher's peak
