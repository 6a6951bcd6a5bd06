"""The same plan under torchrun: the losses match a spawn-launched verify run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.dist
def test_torchrun_two_ranks_trains_like_one_device(tmp_path) -> None:
    """The example's own loop (AdamW, a cosine schedule, clipping) against the same loop on
    one device; its DCP checkpoint loads into a plain model."""
    import torch
    import torch.distributed.checkpoint as dcp

    from torchweave.models import FACTORIES

    sys.path.insert(0, str(ROOT / "examples"))
    from torchrun_train import cosine

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "torchrun_train.py"), "--world-size", "2", "--plan", "tp",
           "--steps", "3", "--timeout", "30", "--save", str(tmp_path / "weights")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", out.stdout)]
    assert len(losses) == 3
    torch.manual_seed(0)
    model, inputs = FACTORIES["gpt-tiny"]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine(3))
    want = []
    for _ in range(3):
        loss = model(*inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        want.append(loss.item())
    for got, ref in zip(losses, want):
        assert abs(got - ref) < 1e-5 * abs(ref) + 1e-6, (losses, want)
    saved = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(saved, checkpoint_id=str(tmp_path / "weights"), no_dist=True)
    for name, t in model.state_dict().items():
        # a key bias's gradient is zero but for rounding (softmax ignores a per-row shift), and
        # Adam scales that rounding up to a full step: there, bound by 3 steps of lr 1e-3
        atol = 3e-3 if name.endswith("k_proj.bias") else 1e-5
        torch.testing.assert_close(saved[name], t, rtol=1e-4, atol=atol, msg=name)
