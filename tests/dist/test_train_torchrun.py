"""A rank really killed under ``torchrun --max-restarts``: the job restarts and resumes exactly."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from torchweave.commands.train import run
from torchweave.train.checkpoint import checkpoints
from torchweave.train.loading import load_config

ROOT = Path(__file__).resolve().parents[2]

CONFIG = {
    "steps": 12,
    "model": {"factory": "gpt", "kwargs": {"n_layer": 1, "n_head": 2, "d_model": 32,
                                           "dropout": 0.1}},
    "data": {"kind": "tests.dist.train_helpers:SlowTokens", "kwargs": {"delay_s": 0.0}},
    "optim": {"lr": 0.01},
    "parallel": {"plan": "dp", "world_size": 2, "micro_batch": 2, "global_batch": 4},
    "checkpoint": {"every": 3, "keep": 2},
    "progress": False, "tensorboard": False,
}


@pytest.mark.dist
def test_a_killed_rank_restarts_from_the_last_checkpoint_and_matches(tmp_path: Path) -> None:
    reference = run(load_config(None, [f"--run_dir={tmp_path / 'ref'}"], base=CONFIG),
                    Console(file=io.StringIO()), timeout_s=60)

    cfg = json.loads(json.dumps(CONFIG))
    cfg["run_dir"] = str(tmp_path / "job")
    cfg["data"]["kwargs"]["delay_s"] = 0.05  # 0.2 s a step: time to kill it mid-run
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "1", "-m", "torchweave.cli", "train", str(tmp_path / "job.yaml")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 180
        while not checkpoints(tmp_path / "job" / "checkpoints"):
            assert job.poll() is None, job.stdout.read()[-4000:]
            assert time.time() < deadline, "no checkpoint within 180 s"
            time.sleep(0.05)
        victim = int((tmp_path / "job" / "rank1.pid").read_text())
        os.kill(victim, signal.SIGKILL)
        out, _ = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out[-4000:]
    records = [json.loads(x) for x in (tmp_path / "job" / "metrics.jsonl").read_text().splitlines()]
    resumes = [r for r in records if r.get("event") == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] >= 3, records
    last = {r["step"]: r["loss"] for r in records if "loss" in r}  # a step logged twice: the later
    assert sorted(last) == list(range(1, 13))
    assert last == reference.losses, (last, reference.losses)
    assert "summary" in out
