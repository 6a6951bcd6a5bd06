"""What practice asks of a plan: failure rate, Young/Daly checkpoint interval, goodput, $ per token."""

from __future__ import annotations

import dataclasses
import math

import pytest

from torchweave.cli import main
from torchweave.sim import parse_cluster
from torchweave.sim.hardware.reliability import reliability


class _Mem:
    def __init__(self, params: int, optimizer: int) -> None:
        self.params, self.optimizer = params, optimizer


class _Result:
    def __init__(self, n: int, state: int, usd: float) -> None:
        self.world_size, self.usd_per_million_tokens = n, usd
        self.memory = [_Mem(state // 2, state - state // 2)] * n


def test_failure_rate_interval_and_goodput_follow_the_formulas() -> None:
    c = parse_cluster("1024xA100-80GB-SXM@8")
    c = dataclasses.replace(c, device=dataclasses.replace(c.device, failures_per_hour=1e-4,
                                                          storage_write=1e9))
    rel = reliability(_Result(1024, 10 * 10**9, 2.0), c)
    assert rel.failure_per_hour == pytest.approx(1 - (1 - 1e-4) ** 1024)
    m = 3600 / (-1024 * math.log1p(-1e-4))
    assert rel.mtbf_hours * 3600 == pytest.approx(m)
    delta = 10.0  # 10 GB at 1 GB/s
    young = math.sqrt(2 * delta * m)
    assert rel.checkpoint_s == pytest.approx(delta)
    assert young - delta < rel.interval_s < young * 1.1  # Daly refines Young by a little
    good = 1 - delta / (rel.interval_s + delta) - (rel.interval_s + delta) / (2 * m)
    assert rel.goodput == pytest.approx(good) and 0.9 < rel.goodput < 1
    assert rel.usd_per_million_tokens == pytest.approx(2.0 / good)
    # more devices fail more often and checkpoint more often
    more = reliability(_Result(8192, 10 * 10**9, 2.0), c)
    assert more.failure_per_hour > rel.failure_per_hour and more.interval_s < rel.interval_s


def test_plan_auto_prints_the_winners_reliability_and_ranks_clusters_by_cost(capsys) -> None:
    assert main(["plan", "gpt-tiny", "--plan", "auto:preset=megatron", "--cluster",
                 "8xA100-80GB-SXM@8", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "Young/Daly" in out and "per million tokens" in out
    assert main(["plan", "gpt-tiny", "--plan", "auto:preset=dp", "--clusters",
                 "4xA100-80GB-SXM@4,4xRTX3090@4"]) == 0
    out = capsys.readouterr().out
    assert "cheapest per token" in out and "4xA100-80GB-SXM@4" in out and "4xRTX3090@4" in out
    rows = [line for line in out.splitlines() if line.startswith("│") and "x" in line.split("│")[1]]
    costs = [float(r.split("│")[5]) for r in rows]
    assert len(costs) == 2
    assert costs == sorted(costs)
