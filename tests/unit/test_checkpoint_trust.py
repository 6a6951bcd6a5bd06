"""A crafted checkpoint ``.metadata`` is refused before anything in it runs (one rank, no group)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.dist.train_helpers import regression
from tests.hostile import hostile_pickles, plant
from torchweave.parallel import parallelize
from torchweave.runtime.groups import GroupCache
from torchweave.train.checkpoint import CheckpointError, latest, save
from torchweave.train.restore import load


def _module():
    torch.manual_seed(0)
    groups = GroupCache(rank=0, world_size=1, timeout_s=10.0, device=torch.device("cpu"))
    batch = (torch.randn(4, 8), torch.randn(4))
    return parallelize(regression(), batch, plan="dp", groups=groups), batch


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run's checkpoint folder with two real checkpoints, steps 1 and 2."""
    ckpt = tmp_path_factory.mktemp("run") / "checkpoints"
    module, batch = _module()
    for step in (1, 2):
        module.train_step(*batch)
        save(module, None, step, {"pos": step, "rng": torch.get_rng_state()}, ckpt, keep=3)
    return ckpt


@pytest.mark.parametrize("kind", list(hostile_pickles(Path("m"))))
def test_crafted_metadata_is_refused_and_the_last_good_checkpoint_still_loads(
        run_dir: Path, tmp_path: Path, kind: str) -> None:
    marker = tmp_path / "marker"
    payload, target = hostile_pickles(marker)[kind]
    bad = plant(run_dir / "step-2", 3, payload)
    try:
        assert latest(run_dir) == bad  # complete by its name and its torchweave.json
        module, _ = _module()
        with pytest.raises(CheckpointError) as info:
            load(bad, module)
        text = str(info.value)
        assert f"{bad / '.metadata'} tries to load {target}" in text, text
        assert "refused before anything in it ran" in text
        assert f"load {run_dir / 'step-2'} explicitly" in text
        assert not marker.exists()
        assert load(run_dir / "step-2", module).step == 2
    finally:
        shutil.rmtree(bad)
    assert not marker.exists()

