"""Sharded checkpoints on real gloo ranks: exact resume, failed writes, wrong model, export."""

from __future__ import annotations

import copy
import os
import resource
import shutil
import signal
from pathlib import Path

import pytest
import torch

from tests.conftest import built, captured
from torchweave.runtime.launch import LaunchConfig, spawn


def _same(a: dict, b: dict) -> list[str]:
    """Keys whose tensors differ (or are missing) between ``a`` and ``b``."""
    bad = [k for k in a.keys() | b.keys() if k not in a or k not in b]
    for k in a.keys() & b.keys():
        x, y = a[k], b[k]
        if isinstance(x, tuple):
            x, y = x[1], y[1]
        if not torch.equal(x, y):
            bad.append(k)
    return sorted(bad)


def _scenario(ctx, tmp: str, model, inputs, other, other_inputs):
    from torchweave.parallel import parallelize
    from torchweave.train.checkpoint import CheckpointError, latest, optimizer_state, save
    from torchweave.train.restore import load, load_latest

    ckpt = Path(tmp) / "ckpt"
    out: dict = {}
    # ---- two steps, a checkpoint after each (keep=1), then the third step uninterrupted
    torch.manual_seed(0)
    a = parallelize(model, inputs, plan="dp", groups=ctx.groups)
    for step in (1, 2):
        a.train_step(*inputs)
        save(a, None, step, {"data_pos": step * 4, "rng": torch.get_rng_state()}, ckpt, keep=1)
    out["kept"] = sorted(p.name for p in ckpt.iterdir())
    saved_pieces = {k: (box, t.clone()) for k, (box, t) in a.state_pieces().items()}
    saved_opt = optimizer_state(a)
    saved_opt.tensors = {k: t.clone() for k, t in saved_opt.tensors.items()}  # steps update in place
    out["loss3"] = a.train_step(*inputs)

    # ---- a fresh module resumes from the checkpoint
    b = parallelize(model, inputs, plan="dp", groups=ctx.groups)
    restored = load_latest(ckpt, b)
    out["step"] = restored.step
    out["extra_pos"] = restored.extra["data_pos"]
    out["rng_ok"] = torch.equal(restored.extra["rng"], torch.get_rng_state())
    out["piece_diff"] = _same(saved_pieces, b.state_pieces())
    opt_b = optimizer_state(b)
    out["opt_diff"] = _same(saved_opt.tensors, opt_b.tensors)
    out["opt_keys"] = len(saved_opt.tensors)
    out["groups_same"] = saved_opt.groups == opt_b.groups
    out["resumed_loss3"] = b.train_step(*inputs)
    out["pieces"] = b.state_pieces()

    # ---- a full disk (really: a file-size limit) fails the write; step-2 stays good
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
    try:
        save(b, None, 3, {}, ckpt, keep=1)
        out["full_disk"] = "no error"
    except CheckpointError as e:
        out["full_disk"] = str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    out["latest_after_full"] = latest(ckpt).name
    c = parallelize(model, inputs, plan="dp", groups=ctx.groups)
    out["reload_after_full"] = load(latest(ckpt), c).step

    # ---- a read-only directory (root ignores permissions: then this part is skipped)
    out["readonly"] = None
    if os.geteuid() != 0:
        ctx.groups  # noqa: B018
        if ctx.rank == 0:
            os.chmod(ckpt, 0o555)
        torch.distributed.barrier()
        try:
            save(b, None, 4, {}, ckpt, keep=1)
            out["readonly"] = "no error"
        except CheckpointError as e:
            out["readonly"] = str(e)
        torch.distributed.barrier()
        if ctx.rank == 0:
            os.chmod(ckpt, 0o755)
        out["latest_after_readonly"] = latest(ckpt).name

    # ---- a corrupt copy: one rank's data file truncated
    if ctx.rank == 0:
        bad = Path(tmp) / "bad"
        shutil.copytree(ckpt, bad)
        data = next((bad / "step-2").glob("*.distcp"))
        data.write_bytes(data.read_bytes()[:100])
    torch.distributed.barrier()
    try:
        load(Path(tmp) / "bad" / "step-2", c)
        out["corrupt"] = "no error"
    except CheckpointError as e:
        out["corrupt"] = str(e)

    # ---- a checkpoint of another model
    d = parallelize(other, other_inputs, plan="dp", groups=ctx.groups)
    a_shapes = {s.path: tuple(s.full_shape) for s in a.program.params}
    out["first_mismatch"] = next(s.path for s in d.program.params
                                 if a_shapes.get(s.path) != tuple(s.full_shape))
    try:
        load(latest(ckpt), d)
        out["other_model"] = "no error"
    except CheckpointError as e:
        out["other_model"] = str(e)
    return out


@pytest.mark.dist
def test_checkpoint_resume_faults_and_export(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from torchweave.train.export import export_safetensors, model_layout

    model, inputs = built("gpt-tiny")[:2]
    other, other_inputs = built("llama-tiny")[:2]
    outs = spawn(_scenario, LaunchConfig(world_size=2, timeout_s=30.0), str(tmp_path),
                 model, inputs, other, other_inputs)
    for r, out in enumerate(outs):
        assert out["kept"] == ["step-2"], out["kept"]
        assert out["step"] == 2 and out["extra_pos"] == 8 and out["rng_ok"]
        assert out["piece_diff"] == [], out["piece_diff"]
        assert out["opt_keys"] > 0 and out["opt_diff"] == [], out["opt_diff"]
        assert out["groups_same"]
        assert out["resumed_loss3"] == out["loss3"], (out["resumed_loss3"], out["loss3"])
        assert "writable, with room for the checkpoint" in out["full_disk"], out["full_disk"]
        assert out["latest_after_full"] == "step-2" and out["reload_after_full"] == 2
        if out["readonly"] is not None:
            assert "writable" in out["readonly"] and out["latest_after_readonly"] == "step-2"
        assert "a complete torchweave checkpoint" in out["corrupt"], out["corrupt"]
        assert f"tensor {out['first_mismatch']}" in out["other_model"], out["other_model"]
        assert "different model" in out["other_model"]
    assert not (tmp_path / "ckpt" / "step-3").exists()

    # ---- export: the merged pieces load into the original model with strict=True
    graph = captured("gpt-tiny")
    target = copy.deepcopy(model)
    shapes, aliases = model_layout(graph, target.state_dict().keys())
    path = tmp_path / "model.safetensors"
    export_safetensors([o["pieces"] for o in outs], shapes, path, aliases=aliases)
    loaded = load_file(str(path))
    target.load_state_dict(loaded, strict=True)
    trained = outs[0]["pieces"]
    for name, (_, piece) in trained.items():
        if name in shapes:
            assert torch.equal(target.state_dict()[name], piece), name
