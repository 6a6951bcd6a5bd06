"""torchweave.lightning.Strategy against Lightning's own DDP on the same LightningModule,
two CPU processes each (tests/dist/lightning_fit.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _fit(which: str, out: Path, *plan: str) -> dict:
    cmd = [sys.executable, str(ROOT / "tests" / "dist" / "lightning_fit.py"), which, str(out), *plan]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


@pytest.mark.dist
def test_the_strategy_trains_like_ddp_with_schedules_clipping_validation_and_checkpoints(tmp_path) -> None:
    pytest.importorskip("lightning")
    ddp = _fit("ddp", tmp_path / "ddp")
    for plan in ("auto", "zero3"):
        _same(ddp, _fit("torchweave", tmp_path / plan, plan))


def _same(ddp: dict, ours: dict) -> None:
    import torch

    assert len(ours["losses"]) == len(ddp["losses"]) == 8
    assert ours["losses"] == pytest.approx(ddp["losses"], rel=1e-5)
    assert ours["val"] == pytest.approx(ddp["val"], rel=1e-5) and len(ours["val"]) == 2
    assert ours["train_loss"] == pytest.approx(ours["losses"][-1], rel=1e-6)  # self.log'd
    checkpoint = torch.load(ours["checkpoint"], weights_only=True)["state_dict"]
    for name, want in ddp["weights"].items():
        want = torch.tensor(want)
        torch.testing.assert_close(torch.tensor(ours["weights"][name]), want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(checkpoint[name], torch.tensor(ours["weights"][name]))
