"""``torchweave train config.yaml`` and ``torchweave demo``: check, choose the plan, launch, report."""

from __future__ import annotations

import dataclasses
import tempfile
import time
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from torchweave.train import job
from torchweave.train.auto import Choice
from torchweave.train.config import CheckpointConfig, TrainConfig
from torchweave.train.loading import load_config
from torchweave.train.job import Chosen
from torchweave.train.loop import RunResult
from torchweave.train.plot import loss_png
from torchweave.train.sample import sample_text

DEMO = {
    "run_dir": "runs/demo",
    "steps": 300,
    "seed": 0,
    "model": {"factory": "gpt", "kwargs": {"n_layer": 4, "n_head": 4, "d_model": 128}},
    "data": {"kind": "text", "seq_len": 64},
    "optim": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.01, "clip_grad_norm": 1.0},
    "schedule": {"warmup_steps": 20, "kind": "cosine", "min_lr_ratio": 0.1},
    "parallel": {"plan": "auto", "world_size": 4, "micro_batch": 4, "grad_accum": 1,
                 "global_batch": 16},
    "checkpoint": {"every": 100, "keep": 2},
    "log_every": 20,
}
"""The demo: a character-level GPT (0.8M parameters) on the bundled text, 4 CPU ranks:
about 1 to 1.5 minutes on a 2-core machine."""


def show_choice(cfg: TrainConfig, chosen: Chosen, console: Console) -> None:
    """The model, the data and the plan table of the plan a job runs."""
    from torchweave.plan.show import plan_table, replication_note
    from torchweave.search import resolve

    graph = chosen.graph
    model_text = escape(f"{cfg.model.hf} {cfg.model.config or ''}" if cfg.model.hf else
                        f"{cfg.model.factory} {cfg.model.kwargs or ''}")
    console.print(f"[bold]model[/] {model_text}: "
                  f"{chosen.parameters / 1e6:.2f}M parameters, {len(graph.nodes)} ops; "
                  f"[bold]data[/] {escape(str(cfg.data.kind))}, {chosen.samples} samples of "
                  f"{cfg.data.seq_len} tokens", markup=True)
    resolved = resolve(chosen.plan, graph, cfg.parallel.world_size)
    console.print(f"[bold]plan[/] {escape(chosen.plan)} on {cfg.parallel.world_size} ranks"
                  + (f"  ({escape(chosen.reason)})" if chosen.reason else ""), markup=True)
    console.print(plan_table(resolved, graph, limit=12))
    note = replication_note(resolved, graph)
    if note:
        console.print(note, highlight=False, markup=False)
    if len(graph.nodes) > 12:
        console.print(f"... {len(graph.nodes) - 12} more ops; "
                      f"`torchweave plan` shows all of them")


def summary(result: RunResult, cfg: TrainConfig, console: Console, took_s: float,
            choice: Choice | None = None) -> None:
    losses = [v for _, v in sorted(result.losses.items())]
    table = Table(title="torchweave train: summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()

    def row(key: str, value: str) -> None:
        table.add_row(key, Text(value))  # paths, plans, reasons: data, never markup

    row("plan", f"{result.plan} on {cfg.parallel.world_size} ranks"
        + (f" ({result.plan_reason})" if result.plan_reason else ""))
    row("steps", f"{result.start_step} -> {result.steps}"
        + (f" (resumed at {result.start_step})" if result.start_step else "")
        + (f", {result.skipped} skipped (non-finite)" if result.skipped else ""))
    if losses:
        head = losses[: max(1, min(10, len(losses) // 10))]
        tail = losses[-max(1, min(10, len(losses) // 10)):]
        row("loss", f"{sum(head) / len(head):.4f} (first steps) -> "
                    f"{sum(tail) / len(tail):.4f} (last steps)")
    row("throughput", f"{result.tokens_per_s:,.0f} tokens/s "
                      f"(median step {result.step_time_s * 1e3:.1f} ms); wall time {took_s:.1f} s")
    if choice is not None and result.plan in choice.predicted_s and result.step_time_s > 0:
        predicted = choice.predicted_s[result.plan]
        row("predicted", f"{predicted * 1e3:.1f} ms a step on {choice.cluster} (the simulator, "
                         f"before launch), measured {result.step_time_s * 1e3:.1f} ms: "
                         f"{predicted / result.step_time_s:.2f} x the measured")
    row("memory per rank", ", ".join(
        f"r{r}: {rss:.0f} MiB RSS / {st:.1f} MiB state"
        for r, (rss, st) in enumerate(zip(result.peak_rss_mib, result.state_mib))))
    row("checkpoint", (result.checkpoint or "none written")
        + (f" ({result.failed_saves} failed writes, logged)" if result.failed_saves else ""))
    if result.weights:
        row("weights", f"{result.weights} (safetensors; loads with strict=True)")
    row("per-rank code", f"{result.code_dir}/rank*.py (plan.json beside them)")
    row("metrics", result.metrics + (f"; TensorBoard: {result.tensorboard}" if result.tensorboard else ""))
    picture = loss_png(result.run_dir)
    row("loss curve", str(picture) if picture else "not drawn (no step logged, or no matplotlib: "
                                                   "pip install torchweave[plot])")
    console.print(table)


def run(cfg: TrainConfig, console: Console, *, timeout_s: float = 300.0) -> RunResult | None:
    """``torchweave train``'s run (:func:`torchweave.train.job.run`) with its plan table and
    summary printed; rank 0 gets the result."""
    return _run(cfg, console, timeout_s=timeout_s)[0]


def _run(cfg: TrainConfig, console: Console, *, timeout_s: float = 300.0
         ) -> tuple[RunResult | None, Choice | None]:
    t0 = time.perf_counter()
    result, chosen = job.run(cfg, timeout_s=timeout_s,
                             on_chosen=lambda c: show_choice(cfg, c, console))
    if result is None:
        return None, chosen.choice
    summary(result, cfg, console, time.perf_counter() - t0, chosen.choice)
    return result, chosen.choice


def _runner_up(cfg: TrainConfig, choice: Choice, result: RunResult, console: Console,
               steps: int = 15) -> None:
    """The search's choice beside its runner-up: predicted, and measured here (the runner-up
    for ``steps`` steps in a scratch directory)."""
    ranked = sorted(choice.predicted_s.items(), key=lambda kv: kv[1])
    if len(ranked) < 2 or job.under_torchrun():
        return
    other = ranked[1][0]
    with tempfile.TemporaryDirectory(prefix="torchweave-runner-up-") as tmp:
        short = dataclasses.replace(cfg, steps=steps, run_dir=tmp, resume=False,
                                    checkpoint=CheckpointConfig(every=0, keep=1))
        measured = job.run_plan(short, other, "runner-up")
    table = Table(title=f"the search's choice and its runner-up on {choice.cluster}",
                  title_justify="left")
    for col in ("plan", "predicted step", "measured step (median)", "predicted / measured"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    for plan, res, note in ((result.plan, result, "chosen"), (other, measured, "runner-up")):
        p, m = choice.predicted_s.get(plan, 0.0), res.step_time_s
        table.add_row(Text(f"{plan} ({note})"), f"{p * 1e3:.1f} ms", f"{m * 1e3:.1f} ms",
                      f"{p / m:.2f}" if m else "-")
    console.print(table)


def train_cmd(config: str | None, overrides: list[str], console: Console) -> int:
    cfg = load_config(config, overrides)
    run(cfg, console)
    return 0


def demo_cmd(overrides: list[str], console: Console) -> int:
    cfg = load_config(None, overrides, base=DEMO)
    console.print("[bold]torchweave demo[/]: a character-level GPT learns the bundled stories "
                  f"on {cfg.parallel.world_size} CPU ranks ({cfg.steps} steps)", markup=True)
    result, choice = _run(cfg, console)
    if result is None or not result.losses:
        return 0
    if choice is not None:
        _runner_up(cfg, choice, result, console)
    if result.weights:
        sample = sample_text(cfg, result.weights)
        if sample is not None:
            prompt, text = sample
            console.print(Text.assemble(("sample ", "bold"), "(the trained model continues the "
                                        "story's first words, temperature 0.8):"))
            console.print(Text.assemble((prompt, "bold"), text), highlight=False)
    console.print(f"resume or extend it: torchweave demo --steps={cfg.steps * 2} "
                  f"(picks up from {result.checkpoint})", highlight=False, markup=False)
    return 0



def train_run(args, console: Console) -> int:
    """``torchweave train CONFIG [--section.field=value ...]``."""
    return train_cmd(args.config, args.extra, console)


def demo_run(args, console: Console) -> int:
    """``torchweave demo [--section.field=value ...]``."""
    return demo_cmd(args.extra, console)


__all__ = ["DEMO", "demo_cmd", "run", "show_choice", "summary", "train_cmd"]
