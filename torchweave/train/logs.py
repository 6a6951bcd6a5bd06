"""What rank 0 shows and writes while training: progress, JSON lines, TensorBoard."""

from __future__ import annotations

import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
)


class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl`` (and TensorBoard scalars).

    A resumed run appends to the same file, after a ``{"event": "resume"}``
    line; for a step logged twice, the later line is the one that counts.
    TensorBoard gets every ``tb_every``-th step (building its records costs
    about 60 µs a scalar, a percent of a small model's step).
    """

    def __init__(self, run_dir: Path, *, tensorboard: bool, tb_every: int = 1) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.tb_every = tb_every
        self.file = open(self.path, "a", encoding="utf-8")
        self.tb = None
        self.tb_dir: Path | None = None
        if tensorboard:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self.event("warning", message="tensorboard is not installed; metrics go to "
                                              "metrics.jsonl only (pip install tensorboard)")
            else:
                self.tb_dir = run_dir / "tensorboard"
                self.tb = SummaryWriter(log_dir=str(self.tb_dir))

    def event(self, kind: str, **fields: Any) -> None:
        self._write({"event": kind, "time": time.time(), **fields})

    def step(self, step: int, metrics: dict[str, float]) -> None:
        self._write({"step": step, **metrics})
        if self.tb is not None and step % self.tb_every == 0:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(f"train/{k}", v, step)

    def _write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record, allow_nan=True) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()


class ProgressView:
    """A bar with loss, tokens/s and ETA on a terminal; a log line every few steps elsewhere."""

    def __init__(self, console: Console, total: int, start: int, *, enabled: bool,
                 log_every: int) -> None:
        self.console, self.log_every = console, log_every
        self.live = enabled and console.is_terminal
        self.quiet = not enabled
        self.progress: Progress | None = None
        if self.live:
            self.progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                console=console, transient=False)
            self.task = self.progress.add_task("train", total=total, completed=start,
                                               loss="-", tps="-")
            self.progress.start()

    def update(self, step: int, total: int, loss: float, tps: float, eta_s: float,
               note: str = "") -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step, loss=f"{loss:.4f}", tps=f"{tps:,.0f}")
            if note:
                self.progress.console.print(note)
            return
        if self.quiet:
            return
        if step % self.log_every == 0 or step == total or note:
            line = (f"step {step}/{total}  loss {loss:.4f}  {tps:,.0f} tok/s  "
                    f"ETA {eta_s:,.0f} s" + (f"  {note}" if note else ""))
            self.console.print(line, highlight=False, markup=False)
            sys.stdout.flush()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


__all__ = ["MetricsLog", "ProgressView"]
