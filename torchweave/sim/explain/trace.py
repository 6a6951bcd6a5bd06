"""Timelines of a simulated step: Chrome trace JSON (Perfetto) and a PNG Gantt chart."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from torchweave.errors import Problem, SimError
from torchweave.sim.explain.result import SimResult

_TID = {"compute": 0, "comm": 1}
_COLORS = {"compute": "tab:blue", "F": "tab:blue", "R": "tab:purple", "B": "tab:red",
           "I": "tab:red", "W": "tab:green", "comm": "tab:orange"}
"""Bar colours: a pipeline action by its kind (forward, re-forward, backward, input and weight
gradients), otherwise by stream."""
_LABELS = {"compute": "compute", "F": "forward", "R": "recompute", "B": "backward",
           "I": "input grad", "W": "weight grad", "comm": "communication"}
_ACTION = re.compile(r"^\d+([FRBIW])\d+")


def to_chrome_trace(result: SimResult) -> dict[str, Any]:
    """The timeline as Chrome trace events: one process per rank, one thread per
    stream (0 compute, 1 comm); times in microseconds. ``json.dump`` it and open
    it in https://ui.perfetto.dev or chrome://tracing."""
    events: list[dict[str, Any]] = []
    for rank in sorted({e.rank for e in result.timeline}):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        for stream, tid in _TID.items():
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                           "args": {"name": stream}})
    for e in result.timeline:
        events.append({"ph": "X", "name": e.name, "cat": e.stream, "pid": e.rank,
                       "tid": _TID.get(e.stream, 2), "ts": e.start * 1e6,
                       "dur": (e.end - e.start) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"plan": result.plan_name, "cluster": result.cluster,
                          "step_time_s": result.step_time}}


def _kind(e: Any) -> str:
    """A pipeline action's kind from its name (``0F3``: stage 0, forward, micro-batch 3)."""
    if e.stream == "compute":
        m = _ACTION.match(e.name)
        return m.group(1) if m else "compute"
    return "comm"


def save_gantt_png(result: SimResult, path: str | Path, *, max_ranks: int = 16) -> Path:
    """A Gantt chart of the first ``max_ranks`` ranks (two rows each) as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SimError(Problem(obj="save_gantt_png", value="matplotlib is not installed",
                               rule="the PNG Gantt chart is drawn with matplotlib",
                               fix="pip install matplotlib (or use to_chrome_trace and Perfetto)")) from None
    ranks = sorted({e.rank for e in result.timeline})[:max_ranks]
    streams = [s for s in _TID if any(e.stream == s for e in result.timeline)]  # no empty rows
    row = {(r, s): i for i, (r, s) in enumerate((r, s) for r in ranks for s in streams)}
    fig, ax = plt.subplots(figsize=(12, 0.4 * len(row) + 1.6))
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for e in result.timeline:
        if (e.rank, e.stream) in row:
            bars.setdefault((row[(e.rank, e.stream)], _kind(e)), []).append(
                (e.start * 1e3, (e.end - e.start) * 1e3))
    for (y, kind), spans in bars.items():
        ax.broken_barh(spans, (y - 0.4, 0.8), color=_COLORS[kind], linewidth=0)
    kinds = sorted({k for _, k in bars}, key=list(_COLORS).index)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=_COLORS[k]) for k in kinds],
              labels=[_LABELS[k] for k in kinds], loc="upper center", ncol=len(kinds),
              bbox_to_anchor=(0.5, -0.12 if len(row) > 4 else -0.25), frameon=False)
    ax.set_yticks(list(row.values()), [f"rank {r} {s}" if len(streams) > 1 else f"rank {r}"
                                       for r, s in row])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(f"{result.plan_name} on {result.cluster}: step {result.step_time * 1e3:.4g} ms")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
