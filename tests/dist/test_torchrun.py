"""The same plan under torchrun: the losses match a spawn-launched verify run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.dist
def test_torchrun_two_ranks_trains_like_one_device() -> None:
    import torch

    from torchweave.models import FACTORIES

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "torchrun_train.py"), "--world-size", "2", "--plan", "tp",
           "--steps", "3", "--timeout", "30"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", out.stdout)]
    assert len(losses) == 3
    torch.manual_seed(0)
    model, inputs = FACTORIES["gpt-tiny"]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    want = []
    for _ in range(3):
        loss = model(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    for got, ref in zip(losses, want):
        assert abs(got - ref) < 1e-5 * abs(ref) + 1e-6, (losses, want)
