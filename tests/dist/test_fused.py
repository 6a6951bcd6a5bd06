"""A model with fused projections, its attention split by heads under ``tp`` (the ranks hold
parts of each fused weight): trained like one device, and its state under the model's own
names and shapes, whole, through DCP, into another plan and into a plain model."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.unit.test_unfuse import _example
from torchweave.runtime.launch import LaunchConfig, spawn


def _train_and_save(ctx, model, inputs, directory):
    import torch.distributed.checkpoint as dcp

    import torchweave

    pm = torchweave.parallelize(copy.deepcopy(model), inputs, plan="tp", groups=ctx.groups)
    held = sorted(s.path for s in pm.program.params if s.part is not None)
    opt = torchweave.optimizer(pm, torch.optim.SGD, lr=0.1)
    pm(*inputs).backward()
    opt.step()
    full = pm.state_dict(full=True)
    dcp.save(pm.state_dict(), checkpoint_id=directory)
    other = copy.deepcopy(model)
    for p in other.parameters():
        p.data.normal_()
    pm2 = torchweave.parallelize(other, inputs, plan="zero3", groups=ctx.groups)
    state = pm2.state_dict()
    dcp.load(state, checkpoint_id=directory)
    pm2.load_state_dict(state)
    with torch.no_grad():
        loss = pm2(*inputs).item()
    return held, full, pm2.state_dict(full=True), loss


@pytest.mark.dist
def test_fused_weights_train_and_save_under_the_models_names(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    model, inputs = _example()
    outs = spawn(_train_and_save, LaunchConfig(world_size=2), model, inputs, str(tmp_path / "ck"))
    ref = copy.deepcopy(model)
    ref(*inputs).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
        want_loss = ref(*inputs).item()
    want = ref.state_dict()
    for held, full, reloaded, loss in outs:
        assert "qkv.weight[32:48]" in held and "gate_up.weight[0:64]" in held  # parts, by heads
        assert full.keys() == want.keys()
        for name, t in want.items():
            assert full[name].shape == t.shape, name
            torch.testing.assert_close(full[name], t, rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(reloaded[name], full[name], rtol=0, atol=0)
        assert loss == pytest.approx(want_loss, rel=1e-9)
    plain = copy.deepcopy(model).state_dict()  # the sharded checkpoint, into a plain model
    dcp.load(plain, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    for name in want:
        torch.testing.assert_close(plain[name], outs[0][1][name], rtol=0, atol=0)


@pytest.mark.dist
def test_a_transformers_gpt2_trained_under_tp_exports_its_own_fused_weights(tmp_path) -> None:
    """``torchweave train`` of a transformers GPT-2 (fused ``c_attn``) under ``tp``, whose ranks
    hold parts of each ``c_attn``: the exported weights load into a fresh GPT-2 with
    ``strict=True`` and are those of the same run under ``dp``."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file
    from rich.console import Console
    import io

    from torchweave.commands.train import run
    from torchweave.models.hf import _transformers
    from torchweave.train.loading import load_config

    config = {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 32, "vocab_size": 256}
    weights = {}
    for plan in ("tp", "dp"):
        (tmp_path / plan).mkdir()
        path = tmp_path / plan / "run.yaml"
        path.write_text(
            "steps: 3\nmodel: {hf: GPT2LMHeadModel, config: {n_embd: 64, n_layer: 2, n_head: 4, "
            "n_positions: 32, bos_token_id: 0, eos_token_id: 0, resid_pdrop: 0.0, embd_pdrop: 0.0, "
            "attn_pdrop: 0.0}}\ndata: {kind: text, seq_len: 32}\noptim: {name: sgd, lr: 0.1}\n"
            f"parallel: {{plan: {plan}, world_size: 2, micro_batch: 4, global_batch: 8, "
            f"grad_accum: {2 if plan == 'tp' else 1}}}\n"
            "checkpoint: {every: 3, keep: 1}\n")
        cfg = load_config(str(path), [f"--run_dir={tmp_path / plan}", "--progress=false",
                                      "--tensorboard=false"])
        result = run(cfg, Console(file=io.StringIO(), width=200), timeout_s=120)
        assert result.weights, plan
        weights[plan] = {k.removeprefix("model."): t for k, t in load_file(result.weights).items()}
    tf = _transformers()
    fresh = tf.GPT2LMHeadModel(tf.GPT2Config(**{**config, "vocab_size": weights["tp"]["transformer.wte.weight"].shape[0]}))
    fresh.load_state_dict(weights["tp"], strict=True)
    assert weights["tp"]["transformer.h.0.attn.c_attn.weight"].shape == (64, 192)
    assert weights["tp"].keys() == weights["dp"].keys()
    for name, t in weights["tp"].items():
        torch.testing.assert_close(t, weights["dp"][name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
