"""The picture of a run: loss and tokens/s per step, from its ``metrics.jsonl``."""

from __future__ import annotations

import json
import math
from pathlib import Path


def steps_of(metrics: Path) -> dict[int, dict[str, float]]:
    """Each step's last record (a resumed run logs the steps it redoes again). The file
    is JSON lines this package wrote; a line that is not a step record is skipped."""
    out: dict[int, dict[str, float]] = {}
    for line in metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and "loss" in rec:
            out[rec["step"]] = rec
    return dict(sorted(out.items()))


def loss_png(run_dir: str | Path) -> Path | None:
    """Write ``run_dir/loss.png``: the loss (left axis) and tokens/s (right axis) per step.
    None when matplotlib is not installed (``pip install torchweave[plot]``) or the run
    logged no step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return None
    steps = steps_of(metrics)
    if not steps:
        return None
    xs = list(steps)

    def series(key: str) -> list[float]:
        return [float(r[key]) if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
                else math.nan for r in steps.values()]

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ax.plot(xs, series("loss"), color="tab:blue", label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss", color="tab:blue")
    ax.grid(alpha=0.3)
    right = ax.twinx()
    right.plot(xs, series("tokens_per_s"), color="tab:orange", alpha=0.8, label="tokens/s")
    right.set_ylabel("tokens/s", color="tab:orange")
    right.set_ylim(bottom=0)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    lines = ax.get_lines() + right.get_lines()
    ax.legend(lines, [ln.get_label() for ln in lines], loc="upper right", frameon=False)
    ax.set_title(f"{run_dir.name}: loss and throughput per step")
    fig.tight_layout()
    out = run_dir / "loss.png"
    fig.savefig(out)
    plt.close(fig)
    return out


__all__ = ["loss_png", "steps_of"]
