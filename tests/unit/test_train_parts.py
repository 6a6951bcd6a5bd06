"""Trainer parts without processes: data, sampler, schedules, builders, the command line."""

from __future__ import annotations

import math

import pytest
import torch

from torchweave.cli import main
from torchweave.commands.train import DEMO
from torchweave.train.build import build_model, lr_multiplier, optimizer_factory
from torchweave.train.config import ConfigError, ModelConfig, OptimConfig, ScheduleConfig
from torchweave.train.loading import load_config
from torchweave.train.data import CharText, Sampler, SyntheticTokens, bundled_text


def test_bundled_text_is_shipped_and_tokenized_by_characters() -> None:
    text = bundled_text()
    assert len(text) > 15_000 and text.isascii()
    ds = CharText(text, seq_len=32)
    x, y = ds[5]
    assert x.shape == y.shape == (32,) and torch.equal(x[1:], y[:-1])
    assert ds.decode(x.tolist()) == text[5 * 16:5 * 16 + 32]
    assert ds.vocab_size == len(set(text))


def test_sampler_is_seeded_covers_each_epoch_and_resumes_from_one_number() -> None:
    ds = SyntheticTokens(seq_len=4, vocab_size=10, size=12)
    a = Sampler(ds, 4, seed=1)
    seen = torch.cat([a.next_batch()[0] for _ in range(3)])
    assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, ds.data[:, :-1].tolist()))
    later = [a.next_batch()[0] for _ in range(2)]  # epoch 2: another order
    b = Sampler(ds, 4, seed=1)
    b.consumed = 12
    assert all(torch.equal(x, b.next_batch()[0]) for x in later)
    assert not torch.equal(Sampler(ds, 4, seed=2).next_batch()[0], Sampler(ds, 4, 1).next_batch()[0])


def test_lr_schedules_warm_up_then_decay_to_the_floor() -> None:
    cos = lr_multiplier(ScheduleConfig(warmup_steps=4, kind="cosine", min_lr_ratio=0.1), 20)
    assert [cos(s) for s in (1, 2, 4)] == [0.25, 0.5, 1.0]
    assert math.isclose(cos(20), 0.1) and math.isclose(cos(12), 0.55)
    lin = lr_multiplier(ScheduleConfig(kind="linear"), 10)
    assert math.isclose(lin(5), 0.5) and lin(10) == 0.0
    user = lr_multiplier(ScheduleConfig(kind="math:pow", kwargs={}), 10)  # pow(step, total)
    assert user(2) == 1024.0


def test_optimizers_by_name_and_by_import_path() -> None:
    p = [torch.nn.Parameter(torch.zeros(3))]
    assert isinstance(optimizer_factory(OptimConfig())(p), torch.optim.AdamW)
    sgd = optimizer_factory(OptimConfig(name="sgd", lr=0.5))(p)
    assert sgd.param_groups[0]["momentum"] == 0.9 and sgd.param_groups[0]["lr"] == 0.5
    adam = optimizer_factory(OptimConfig(name="torch.optim:Adam", kwargs={"amsgrad": True}))(p)
    assert type(adam) is torch.optim.Adam and adam.param_groups[0]["amsgrad"]
    with pytest.raises(ConfigError, match="torch.optim.Optimizer subclass"):
        optimizer_factory(OptimConfig(name="torch.nn:Linear"))
    with pytest.raises(ConfigError, match="importable"):
        optimizer_factory(OptimConfig(name="torch.optim:Nope"))


def test_models_take_their_vocabulary_from_the_data() -> None:
    m = build_model(ModelConfig(factory="gpt", kwargs={"n_layer": 1}), vocab_size=70, seq_len=100)
    assert m.cfg.vocab_size == 70 and m.cfg.block_size == 100 and len(m.blocks) == 1
    m = build_model(ModelConfig(factory="gpt-tiny"), vocab_size=70, seq_len=16)
    assert m.cfg.vocab_size == 256  # a bundled factory is built as it is
    with pytest.raises(ConfigError, match="model.kwargs"):
        build_model(ModelConfig(factory="gpt", kwargs={"n_layers": 2}), vocab_size=70, seq_len=8)
    with pytest.raises(ConfigError, match="model.factory"):
        build_model(ModelConfig(factory="no-such-model"), vocab_size=None, seq_len=8)


def test_bad_names_in_the_config_are_caught_before_launch(tmp_path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["--optim.name=adam", "--schedule.kind=cosne", "--data.kind=video"])
    text = str(info.value)
    assert "3 problems" in text and "optim.name: 'adam'" in text and "schedule.kind" in text
    assert "package.module:callable" in text
    with pytest.raises(ConfigError, match="max_bad_steps: 0"):
        load_config(None, ["--max_bad_steps=0"])


def test_the_demo_config_is_valid_and_command_line_overrides_reach_it(capsys) -> None:
    cfg = load_config(None, ["--steps=7"], base=DEMO)
    assert cfg.steps == 7 and cfg.parallel.world_size == 4 and cfg.data.kind == "text"
    assert main(["demo", "--parallel.global_batch=5"]) == 2  # rejected before launch
    out = capsys.readouterr().out
    assert "global_batch / (micro_batch * grad_accum) = 5 / 4" in out
    assert "set global_batch to 16" in out
    # Under auto the batch sizes give dp; the search splits the rest of the ranks.
    cfg = load_config(None, ["--parallel.global_batch=8"], base=DEMO)
    assert cfg.parallel.dp == 2
    with pytest.raises(SystemExit):
        main(["inspect", "gpt-tiny", "--optim.lr=1"])  # overrides belong to train and demo


def test_the_summary_prints_the_prediction_beside_the_measured_step() -> None:
    import io

    from rich.console import Console

    from torchweave.commands.train import summary
    from torchweave.train.auto import Choice
    from torchweave.train.loop import RunResult

    cfg = load_config(None, [], base=DEMO)
    result = RunResult(run_dir="r", plan="zero2", plan_reason="auto", start_step=0, steps=3,
                       losses={1: 2.0, 2: 1.5, 3: 1.0}, step_time_s=0.080)
    choice = Choice("zero2", {"zero2": 0.056, "dp": 0.059}, "fastest", "4xCPU-2core@4")
    out = io.StringIO()
    summary(result, cfg, Console(file=out, width=300), 1.0, choice)
    assert "56.0 ms a step on 4xCPU-2core@4" in out.getvalue()
    assert "measured 80.0 ms: 0.70 x the measured" in out.getvalue()
    out = io.StringIO()
    summary(result, cfg, Console(file=out, width=300), 1.0)  # a plan the config names
    assert "predicted" not in out.getvalue()


def test_user_strings_print_as_text_never_as_markup() -> None:
    """Error text and paths with square brackets (``[/tmp/x]``, ``x[0]``) once crashed rich's
    markup parser, so the user never saw the error."""
    import copy
    import dataclasses
    import io

    from rich.console import Console

    from tests.conftest import captured
    from torchweave.commands.train import summary
    from torchweave.plan.show import plan_table
    from torchweave.policies import resolve
    from torchweave.train.loop import RunResult

    hostile = "a [/tmp/x] and [bold]not bold[/bold] x[0]"
    cfg = load_config(None, [], base=DEMO)
    result = RunResult(run_dir=hostile, plan="dp", plan_reason=hostile, start_step=0, steps=1,
                       code_dir=hostile, metrics=hostile)
    out = io.StringIO()
    summary(result, cfg, Console(file=out, width=400), 1.0)
    assert hostile in out.getvalue()
    graph = copy.copy(captured("gpt-tiny"))  # the cached capture stays as it was
    graph.nodes = [dataclasses.replace(graph.nodes[0], source=hostile), *graph.nodes[1:]]
    plan = resolve("dp", graph, 2)
    plan.name = "dp"
    out = io.StringIO()
    Console(file=out, width=400).print(plan_table(plan, graph, limit=3))
    assert hostile in out.getvalue()


def test_the_loss_picture_reads_each_steps_last_record(tmp_path) -> None:
    """loss.png from metrics.jsonl: a resumed run's redone steps count once (the last
    record), events and broken lines are skipped; no steps, no picture."""
    import json

    pytest.importorskip("matplotlib")
    from torchweave.train.plot import loss_png, steps_of

    lines = [{"event": "start", "step": 0}, {"step": 1, "loss": 4.0, "tokens_per_s": 100.0},
             {"step": 2, "loss": 3.5, "tokens_per_s": 120.0}, {"event": "resume", "step": 1},
             {"step": 2, "loss": 3.4, "tokens_per_s": 110.0}, {"step": 3, "loss": float("nan")}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n{broken\n")
    steps = steps_of(tmp_path / "metrics.jsonl")
    assert list(steps) == [1, 2, 3] and steps[2]["loss"] == 3.4
    out = loss_png(tmp_path)
    assert out == tmp_path / "loss.png" and out.read_bytes()[:4] == b"\x89PNG"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text(json.dumps({"event": "start", "step": 0}) + "\n")
    assert loss_png(empty) is None and loss_png(tmp_path / "missing") is None
