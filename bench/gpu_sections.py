"""The sections of bench/gpu_check.py; each runs in its own process (``run_section``).

A section writes markdown lines to its file as it goes, so what finished is in
the report even when the section is killed at its budget. Each part of a
section catches its own failure (``Ctx.part``) and the next part runs.
"""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("numpy", "rich", "yaml", "safetensors", "tensorboard", "transformers", "matplotlib",
            "pytest", "importlinter")


@dataclass
class Ctx:
    """What a section sees: where to write, which device, how long it has."""

    out: Path
    smoke: bool
    deadline: float
    failed: list[str] = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.smoke else torch.device("cuda", 0)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, *lines: str) -> None:
        with open(self.out, "a") as f:
            f.write("".join(line + "\n" for line in lines))

    @contextlib.contextmanager
    def part(self, title: str) -> Iterator[None]:
        t0 = time.perf_counter()
        self.log(f"- {title}")
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - recorded; the next part runs
            self.failed.append(title)
            tb = traceback.format_exc().strip().splitlines()
            self.log(f"  - **FAILED** ({time.perf_counter() - t0:.1f} s): "
                     f"`{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}`",
                     "    ```", *[f"    {x}" for x in tb[-8:]], "    ```")
        else:
            self.log(f"  - ok ({time.perf_counter() - t0:.1f} s)")


def run_section(name: str, out: Path, *, smoke: bool, budget_s: float) -> int:
    ctx = Ctx(out, smoke, time.monotonic() + budget_s - 3)
    if smoke and name != "env":
        ctx.log(f"CUDA part skipped: no CUDA. CPU stand-in on `{ctx.device}`:", "")
    try:
        sections()[name](ctx)
    except Exception as exc:  # noqa: BLE001 - outside any part: the section itself failed
        ctx.failed.append(f"section {name}")
        ctx.log(f"- **section {name} FAILED**: `{type(exc).__name__}: {str(exc)[:300]}`", "```",
                *traceback.format_exc().strip().splitlines()[-8:], "```")
    status = "ok" if not ctx.failed else f"failed: {', '.join(ctx.failed)}"
    if smoke and name != "env":
        status = f"skipped: no CUDA (CPU stand-in: {status})"
    ctx.log(f"STATUS {status}")
    return 0


def _grad_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest norm-wise relative difference over parameters; a gradient whose true
    value is rounding noise (a key bias before softmax: zero) is measured against the
    largest gradient instead, as verify does."""
    norms = {k: float(w.double().norm()) for k, w in want.items()}
    scale = max(max(norms.values()), 1e-12)
    return max(float((got[k].double() - w.double()).norm())
               / (scale if norms[k] < scale * 1e-6 else norms[k]) for k, w in want.items())


def _built(name: str):
    from torchweave.models import FACTORIES

    torch.manual_seed(0)
    return FACTORIES[name]()[:2]


def _to(tree: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)


# ---------------------------------------------------------------- env
def env(ctx: Ctx) -> None:
    import importlib
    import platform

    ctx.log(f"- python {platform.python_version()} on {platform.platform()}",
            f"- torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"cuDNN {torch.backends.cudnn.version()}",
            f"- CUDA available: {torch.cuda.is_available()}, devices: {torch.cuda.device_count()}")
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        ctx.log(f"  - cuda:{i} {p.name}, compute capability {p.major}.{p.minor}, "
                f"{p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, "
                f"bf16 supported: {torch.cuda.is_bf16_supported()}")
    if torch.cuda.is_available():
        ctx.log(f"- NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
                f"TF32 matmul allowed: {torch.backends.cuda.matmul.allow_tf32}")
    ctx.log(f"- torch.distributed: gloo {torch.distributed.is_gloo_available()}, "
            f"nccl {torch.distributed.is_nccl_available()}")
    for mod in PACKAGES:
        try:
            version = getattr(importlib.import_module(mod), "__version__", "installed")
        except Exception as exc:  # noqa: BLE001 - absent or broken: both are worth a line
            version = f"missing ({type(exc).__name__})"
        ctx.log(f"- {mod}: {version}")
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h %s"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        head = ""
    ctx.log(f"- torchweave commit: {head or 'unknown (no git here)'}")
    with ctx.part("import torchweave"):
        import torchweave

        ctx.log(f"  - from {Path(torchweave.__file__).parent}")


# ---------------------------------------------------------------- tensors
def tensors(ctx: Ctx) -> None:
    """Capture, replay, the codegen round trip and the registry's split checks on the device."""
    dev = ctx.device
    names = ["gpt-tiny"] if ctx.smoke else ["gpt-tiny", "llama-tiny"]
    for name in names:
        with ctx.part(f"capture {name} on {dev.type} tensors, replay with run_graph"):
            _capture_replay(ctx, name, dev)
        with ctx.part(f"codegen round trip of {name} (dp, 1 rank) on {dev.type}"):
            _round_trip(ctx, name, dev)
    with ctx.part(f"registry split checks on {dev.type} tensors"):
        _split_checks(ctx, dev)


def _capture_replay(ctx: Ctx, name: str, dev: torch.device) -> None:
    import torchweave
    from torchweave.ir import check_graph, run_graph

    model, inputs = _built(name)
    model, inputs = model.to(dev), _to(inputs, dev)
    graph = torchweave.capture(model, inputs, name=name)
    check_graph(graph)
    loss = model(*inputs)
    loss.backward()
    state = {k: v.detach().clone().requires_grad_(v.requires_grad)
             for k, v in [*model.named_parameters(), *model.named_buffers()]}
    outs = run_graph(graph, state, inputs, device=dev)
    got = outs[graph.outputs.index(graph.loss)]
    got.backward()
    params = dict(model.named_parameters())
    worst = _grad_diff({v.target: state[v.target].grad for v in graph.params()},
                       {v.target: params[v.target].grad for v in graph.params()})
    want, got = float(loss.detach()), float(got.detach())
    ctx.log(f"  - {len(graph.nodes)} nodes; loss {want:.6f} replayed {got:.6f}; "
            f"largest relative gradient difference {worst:.2e} (tolerance 1e-4)")
    assert abs(got - want) <= 1e-5 * abs(want) and worst <= 1e-4


def _round_trip(ctx: Ctx, name: str, dev: torch.device) -> None:
    import torchweave
    from torchweave.codegen.render import write
    from torchweave.lower.lower import lower
    from torchweave.policies import resolve
    from torchweave.runtime.executor import RankModule
    from torchweave.runtime.groups import GroupCache

    model, inputs = _built(name)
    graph = torchweave.capture(model, inputs, name=name)  # compiled on the CPU, run on the device
    programs = lower(graph, resolve("dp", graph, 1))
    with tempfile.TemporaryDirectory() as tmp:
        (path,) = write(programs, tmp)
        state = {k: v.detach() for k, v in [*model.named_parameters(), *model.named_buffers()]}
        group_cache = GroupCache(rank=0, world_size=1, timeout_s=30.0, device=dev)
        module = RankModule(programs[0], path, state, group_cache)
        loss = module.backward_step(*inputs)
    ref = model.to(dev)
    out = ref(*_to(inputs, dev))
    out.backward()
    want = float(out.detach())
    devices = {p.device.type for p in module.params.values()}
    worst = _grad_diff({p: module.params[p].grad for p, _ in ref.named_parameters()},
                       {p: t.grad for p, t in ref.named_parameters()})
    ctx.log(f"  - parameters on {sorted(devices)}; loss {loss:.6f} vs eager {want:.6f}; "
            f"largest relative gradient difference {worst:.2e} (tolerance 1e-4)")
    assert devices == {dev.type} and abs(loss - want) <= 1e-5 * abs(want) and worst <= 1e-4


def _split_checks(ctx: Ctx, dev: torch.device) -> None:
    # pieces are compared with the whole op at 1e-4-ish: TF32 convolutions (cuDNN's default)
    # differ from fp32 by about 1e-3, in the kernel and not in the split
    torch.backends.cudnn.allow_tf32 = False
    import torchweave
    from torchweave.ir.interp import on_device
    from torchweave.ops import REGISTRY
    from torchweave.ops.selfcheck import Case, check_case, dedupe, graph_cases

    names = ["gpt-tiny"] if ctx.smoke else ["gpt-tiny", "llama-tiny", "vit-tiny", "swin-tiny",
                                            "t5-tiny", "moe-tiny"]
    cases: list[Case] = []
    for name in names:
        model, inputs = _built(name)
        graph = torchweave.capture(model, inputs, name=name)
        state = {k: v.detach().to(dev) for k, v in [*model.named_parameters(), *model.named_buffers()]}
        cases += graph_cases(graph, state, _to(inputs, dev), name, device=dev)
    if not ctx.smoke:
        import sys

        sys.path.insert(0, str(ROOT))
        from tests.unit.opzoo import zoo_cases

        cases += [Case(c.target, c.fn, *on_device(_to((c.args, c.kwargs), dev), dev), c.where)
                  for c in zoo_cases()]
    by_op: dict[str, list[Case]] = {}
    for c in dedupe(iter(cases)):
        spec = REGISTRY.lookup(c.target)
        if spec is not None:
            by_op.setdefault(spec.name, []).append(c)
    per_op = 2 if ctx.smoke else 12
    checked, failures, stopped = 0, [], False
    for op, calls in sorted(by_op.items()):
        if ctx.left() < 8:
            stopped = True
            break
        for c in calls[:per_op]:
            failures += [f"{c.where}: {f}" for f in check_case(c)]
            checked += 1
    built_in = sorted(n for n in REGISTRY.specs if n.startswith("aten."))
    unseen = [n for n in built_in if n not in by_op]
    ctx.log(f"  - {checked} calls of {len(by_op)} registered ops checked on {dev.type} "
            f"(every legal split into 2 and 4 pieces); {len(failures)} failures"
            + ("; stopped early: section budget" if stopped else ""),
            f"  - built-in ops with no call in these graphs: {len(unseen)}")
    ctx.log(*[f"  - `{f[:300]}`" for f in failures[:15]])
    assert not failures and not stopped


def sections() -> dict[str, Callable[[Ctx], None]]:
    """Section name → function (those that launch ranks or time steps: bench/gpu_runs.py;
    eager PyTorch against torchweave: bench/gpu_eager.py)."""
    from gpu_eager import eager
    from gpu_runs import bf16, gloo_cuda, nccl_policies, sim

    return {"env": env, "tensors": tensors, "nccl-policies": nccl_policies,
            "gloo-cuda": gloo_cuda, "bf16": bf16, "sim": sim, "eager": eager}


__all__ = ["Ctx", "run_section", "sections"]
