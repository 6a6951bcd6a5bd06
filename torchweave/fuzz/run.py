"""Run drawn cases: each is rejected before launch, or verified against one device.

A plan that the library refuses before anything starts, with its own error
(:class:`~torchweave.errors.TorchweaveError`), is *rejected*: that is the
promised behaviour. Everything else must verify. A crash before launch with
any other exception, a rank that raises, a hang (a collective that times
out), or a mismatch with one device is a *failure*; each is saved under
``out_dir/fail-<seed>/`` as ``case.json`` (the draw, replayable by seed or
from the file) plus ``plan.json`` (when the plan was built) and ``error.txt``.

Cases are verified in batches that share one launch per world size; when a
launch as a whole fails (a hang or a dead rank), its cases are re-run one by
one so that the failure is pinned on the case that caused it.
"""

from __future__ import annotations

import functools
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from torchweave.errors import TorchweaveError
from torchweave.fuzz.draw import BATCH, Draw, build_plan
from torchweave.parallel import Compiled, compile_plan
from torchweave.runtime.executor import StepConfig
from torchweave.runtime.launch import LaunchConfig, RankFailedError
from torchweave.verify import Case, Report, cast_model, run_compiled

Status = Literal["rejected", "verified", "failed"]
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 5e-2}
"""Largest relative difference from one device, by the lowest float precision in the graph
(a float64 model may still compute its loss in float32, as transformers models do)."""


@dataclass
class Outcome:
    draw: Draw
    status: Status
    detail: str = ""
    """The rejection's first line, or what failed."""


def adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


OPTIMIZERS = {"adamw": adamw, "sgd": sgd}


@functools.lru_cache(maxsize=None)
def example(name: str, dtype: str = "float32") -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """A bundled model, seeded, on a global batch of :data:`BATCH` rows (rows past the
    factory's own are new data, so that no two data-parallel shards are equal), with its
    parameters and float inputs in ``dtype``."""
    from torchweave.models import FACTORIES

    torch.manual_seed(0)
    model, inputs = FACTORIES[name]()[:2]
    g = torch.Generator().manual_seed(1)
    while inputs[0].shape[0] < BATCH:
        inputs = tuple(torch.cat([x, x.roll(1, dims=-1) if not x.is_floating_point()
                                  else x + 0.5 * torch.randn(x.shape, generator=g)])
                       for x in inputs)
    to = getattr(torch, dtype)
    return cast_model(model, to), tuple((x.to(to) if x.is_floating_point() else x)[:BATCH] for x in inputs)


def case_of(d: Draw, plan: Any = None) -> Case:
    """The verify case of a draw; ``plan`` overrides the drawn plan (a replayed plan.json)."""
    model, inputs = example(d.model, d.dtype)
    builder = plan if plan is not None else functools.partial(build_plan, d)
    return Case(model, inputs, builder, steps=2, optimizer=OPTIMIZERS[d.optimizer], sgd=False,
                config=StepConfig(**d.step), name=f"seed {d.seed}",
                reference="fp32")  # bf16 MoE draws: see verify.BF16_TOLERANCE


def run(draws: Iterable[Draw], *, out_dir: str | Path, batch: int = 8, timeout_s: float = 30.0,
        plans: dict[int, Any] | None = None, progress: Callable[[Outcome], None] | None = None
        ) -> list[Outcome]:
    """Reject or verify every draw (see the module docstring); failures saved under ``out_dir``."""
    out_dir = Path(out_dir)
    outcomes: list[Outcome] = []
    pending: dict[int, list[tuple[Draw, Case, Compiled]]] = {}
    graphs: dict = {}

    def done(o: Outcome, comp: Compiled | None = None) -> None:
        if o.status == "failed":
            _save(out_dir, o, comp)
        outcomes.append(o)
        if progress:
            progress(o)

    def flush(ws: int) -> None:
        group, pending[ws] = pending.get(ws, []), []
        for o, comp in _verify(group, ws, timeout_s):
            done(o, comp)

    for d in draws:
        try:
            case = case_of(d, (plans or {}).get(d.seed))
            comp = compile_plan(case.model, case.inputs, case.plan, world_size=d.world_size,
                                micro_batches=case.config.grad_accum,
                                precision=case.config.precision, graphs=graphs)
        except TorchweaveError as e:
            done(Outcome(d, "rejected", _first_line(e)))
            continue
        except Exception as e:  # noqa: BLE001 - an unclear error before launch is a bug
            done(Outcome(d, "failed", f"crash before launch: {type(e).__name__}: {_first_line(e)}\n"
                                      f"{traceback.format_exc()}"))
            continue
        pending.setdefault(d.world_size, []).append((d, case, comp))
        if len(pending[d.world_size]) >= batch:
            flush(d.world_size)
    for ws in list(pending):
        flush(ws)
    return outcomes


def _verify(group: list[tuple[Draw, Case, Compiled]], ws: int, timeout_s: float
            ) -> list[tuple[Outcome, Compiled]]:
    if not group:
        return []
    launch = LaunchConfig(world_size=ws, timeout_s=timeout_s, teardown_grace_s=2.0)
    try:
        reports = run_compiled([c for _, c, _ in group], [k for _, _, k in group], launch=launch,
                               tolerance=1.0)
    except RankFailedError as e:
        if len(group) > 1:  # find the case that brought the launch down, by halves
            half = len(group) // 2
            return _verify(group[:half], ws, timeout_s) + _verify(group[half:], ws, timeout_s)
        d, _, comp = group[0]
        return [(Outcome(d, "failed", f"launch failed (crash or hang): {_first_line(e)}\n"
                                      f"{e.traceback}"), comp)]
    return [(_judge(d, r, comp), comp) for (d, _, comp), r in zip(group, reports)]


def tolerance(comp: Compiled) -> float:
    """The tolerance of the lowest float precision that the captured graph computes in."""
    dtypes = {m.dtype for n in comp.graph.nodes for m in comp.graph.output_metas(n)
              if m is not None and m.dtype.is_floating_point}
    return max(TOLERANCE.get(t, TOLERANCE[torch.bfloat16]) for t in dtypes or {torch.float32})


def _judge(d: Draw, r: Report, comp: Compiled) -> Outcome:
    r.tolerance = tolerance(comp)
    if r.ok:
        return Outcome(d, "verified")
    return Outcome(d, "failed", ("rank error: " + r.error) if r.error else f"mismatch\n{r}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _save(out_dir: Path, o: Outcome, comp: Compiled | None) -> None:
    where = out_dir / f"fail-{o.draw.seed}"
    where.mkdir(parents=True, exist_ok=True)
    (where / "case.json").write_text(o.draw.to_json())
    (where / "error.txt").write_text(o.detail)
    if comp is not None:
        (where / "plan.json").write_text(comp.plan.to_json())


def table(outcomes: list[Outcome]) -> str:
    """Markdown: plans drawn, rejected, verified and failed, in all and by feature."""
    rows: dict[str, dict[str, int]] = {}
    for o in outcomes:
        for f in ["all plans", *o.draw.features()]:
            row = rows.setdefault(f, {"drawn": 0, "rejected": 0, "verified": 0, "failed": 0})
            row["drawn"] += 1
            row[o.status] += 1
    order = ["all plans"] + sorted(k for k in rows if k != "all plans")
    lines = ["| feature | drawn | rejected | verified | failed |", "|---|---|---|---|---|"]
    for k in order:
        r = rows[k]
        lines.append(f"| {k} | {r['drawn']} | {r['rejected']} | {r['verified']} | {r['failed']} |")
    return "\n".join(lines)


def elapsed(start: float) -> str:
    return f"{time.monotonic() - start:.0f} s"
