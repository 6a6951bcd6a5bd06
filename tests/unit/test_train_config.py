"""The typed training config: YAML, overrides, unknown fields, wrong types, batch arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchweave.train.config import ConfigError, ParallelConfig, TrainConfig
from torchweave.train.loading import load_config

YAML = """
run_dir: runs/x
steps: 20
model: {factory: llama-tiny, kwargs: {n_layer: 2}}
data: {kind: text, seq_len: 32}
optim: {name: adamw, lr: 0.001, betas: [0.9, 0.99]}
schedule: {warmup_steps: 5, kind: cosine}
parallel: {plan: dp, world_size: 2, grad_accum: 2, micro_batch: 2, global_batch: 8}
checkpoint: {every: 10, keep: 2}
"""


def _write(tmp_path: Path, text: str = YAML) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_yaml_and_overrides_build_typed_sections(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path), ["--optim.lr=3e-4", "--steps=7",
                                         "--optim.clip_grad_norm=null", "--data.kind=synthetic"])
    assert isinstance(cfg, TrainConfig)
    assert cfg.steps == 7 and cfg.optim.lr == 3e-4 and cfg.optim.clip_grad_norm is None
    assert cfg.optim.betas == (0.9, 0.99) and cfg.model.kwargs == {"n_layer": 2}
    assert cfg.data.kind == "synthetic" and cfg.schedule.kind == "cosine"
    assert cfg.parallel.dp == 2 and cfg.checkpoint_dir == "runs/x/checkpoints"
    assert load_config(None, []) == TrainConfig()
    with pytest.raises(AttributeError):
        cfg.steps = 3  # frozen


def test_unknown_fields_and_wrong_types_are_all_reported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path), ["--optim.lrr=1", "--data.kind=video", "--steps=ten",
                                       "--parallel.precision=fp16"])
    text = str(info.value)
    assert "4 problems" in text
    assert "optim.lrr" in text and "a field of OptimConfig" in text and "lr" in text
    assert "data.kind: 'video'" in text and "one of 'synthetic', 'text'" in text
    assert "steps: 'ten'" in text and "must be an int" in text
    assert "parallel.precision" in text and "'fp32', 'bf16'" in text


def test_batch_arithmetic_is_shown(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path), ["--parallel.global_batch=16"])
    assert "global_batch(16) != micro_batch(2) * grad_accum(2) * dp(2)" in str(info.value)
    assert "set global_batch to 8" in str(info.value)
    # tp splits each sample over the ranks: dp = 1
    assert ParallelConfig(plan="tp", world_size=2, micro_batch=4, grad_accum=1,
                          global_batch=4).dp == 1


def test_a_saved_plans_data_parallel_degree_comes_from_its_mesh(tmp_path: Path) -> None:
    """A plan.json is read as data (Plan.from_json): its mesh's dp and ep axes are the ranks
    that see different samples; a tensor-parallel plan is not data parallel over the world."""
    from tests.conftest import captured
    from torchweave.policies import resolve

    graph = captured("gpt-tiny")
    for name, text, dp in [("tp", "tp", 1), ("dp", "dp", 2), ("tp-dp", "tp:tp=2,dp=2", 2)]:
        world = 4 if name == "tp-dp" else 2
        path = tmp_path / f"{name}.json"
        path.write_text(resolve(text, graph, world).to_json())
        cfg = ParallelConfig(plan=str(path), world_size=world, micro_batch=2, global_batch=2 * dp)
        assert cfg.dp == dp, name
    with pytest.raises(ConfigError) as info:  # the tp plan: global_batch says dp = 2
        ParallelConfig(plan=str(tmp_path / "tp.json"), world_size=2, micro_batch=2, global_batch=4)
    assert "dp(1)" in str(info.value) and "its mesh dp=1×tp=2 has dp = 1" in str(info.value)
    for bad, rule in [("{", "a plan JSON file"), ('{"version": 99}', "version 99"),
                      ("__import__('os')", "a plan JSON file")]:
        path = tmp_path / "bad.json"
        path.write_text(bad)
        with pytest.raises(ConfigError) as info:
            ParallelConfig(plan=str(path), world_size=2, micro_batch=2, global_batch=4)
        assert "parallel.plan" in str(info.value) and rule in str(info.value), str(info.value)
    with pytest.raises(ConfigError, match="a plan.json that can be read"):
        ParallelConfig(plan=str(tmp_path / "missing.json"), world_size=2)


def test_a_plan_strings_accum_sets_grad_accum() -> None:
    cfg = ParallelConfig(plan="dp:accum=2", world_size=2, micro_batch=2, global_batch=8)
    assert cfg.grad_accum == 2 and cfg.dp == 2
    assert ParallelConfig(plan="dp:accum=2", world_size=2, micro_batch=2, grad_accum=2,
                          global_batch=8).grad_accum == 2
    with pytest.raises(ConfigError) as info:
        ParallelConfig(plan="dp:accum=2", world_size=2, micro_batch=2, grad_accum=4,
                       global_batch=16)
    assert "parallel.grad_accum" in str(info.value) and "says accum=2" in str(info.value)


def test_bad_yaml_and_bad_override_syntax(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="valid YAML"):
        load_config(_write(tmp_path, "steps: [1,"), [])
    with pytest.raises(ConfigError, match="--section.field=value"):
        load_config(None, ["--steps"])
    with pytest.raises(ConfigError, match="a mapping of OptimConfig fields"):
        load_config(None, ["--optim=3"])
    with pytest.raises(ConfigError, match="!!python"):
        load_config(_write(tmp_path, "steps: !!python/object/apply:os.system ['true']"), [])


def test_a_transformers_model_by_class_name(tmp_path: Path) -> None:
    """``model: {hf: LlamaForCausalLM, config: {...}}``: built from its config with fresh
    weights (nothing downloaded), vocab from the data, forward returning the loss on the
    data's next-token targets; only a causal LM class of transformers is looked up."""
    pytest.importorskip("transformers")
    import torch

    from torchweave.models.hf import HFNextToken
    from torchweave.train.build import build_model

    example = Path(__file__).resolve().parents[2] / "examples" / "hf_llama.yaml"
    cfg = load_config(str(example), ["--steps=1"])
    assert cfg.model.hf == "LlamaForCausalLM"
    model = build_model(cfg.model, vocab_size=50, seq_len=cfg.data.seq_len)
    assert isinstance(model, HFNextToken)
    inner = model.model
    assert type(inner).__name__ == "LlamaForCausalLM" and inner.config.vocab_size == 50
    assert inner.config.hidden_size == 128 and inner.config.use_cache is False
    idx = torch.randint(0, 50, (2, 16))
    loss = model(idx, idx)
    assert loss.ndim == 0 and 3.0 < float(loss.detach()) < 5.0  # about log(50) for fresh weights
    for name in ("os", "LlamaModel", "AutoModelForCausalLM", "__import__"):
        with pytest.raises(ConfigError, match="model.hf"):
            build_model(load_config(None, [f"--model.hf={name}"]).model, vocab_size=50, seq_len=16)
    with pytest.raises(ConfigError, match="model.config"):
        load_config(None, ["--model.config={hidden_size: 8}"])  # no hf class named
