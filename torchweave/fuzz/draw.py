"""Seeded draws from the whole plan space, and the plans they build.

A :class:`Draw` is plain data (JSON): the model, the world size, a plan spec
and a step spec. Drawing needs no graph; :func:`build_plan` turns the spec
into a Plan on the captured graph, deterministically, using only the public
policies and plan transforms that users call (``pipeline``, ``interlaced``,
``tp``, ``sp``, ``dp``, ``random_plan``, ``with_recompute``, ``with_coshard``,
``with_recycle``). Graph-dependent choices (cut positions, the co-shard chain,
recompute modules) are drawn as fractions and indices and resolved on the
graph, so one draw means the same plan on the full batch and on a micro-batch.

The space covers pp × tp × dp meshes; random SPMD meshes and splits; every
schedule (GPipe, 1F1B, interleaved with virtual stages, ZB, interlaced,
multi-forward); stage cuts; micro-batches; ZeRO 1–3; recompute groups;
co-shard chains; gradient accumulation; bf16; clipping; bucket sizes and
overlap; AdamW and SGD. Some draws break a rule on purpose (ZeRO-3 with a
pipeline, accumulation with a pipeline, micro-batches that do not divide the
batch): those must be rejected before launch with a clear error.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from typing import Any

from torchweave.errors import TorchweaveError
from torchweave.ir.graph import Graph
from torchweave.ops import info
from torchweave.plan.plan import Plan
from torchweave.plan.schedules import BUILTIN
from torchweave.policies.coshard import with_coshard
from torchweave.policies.data import dp as dp_policy
from torchweave.policies.pipeline_policy import interlaced, pipeline, with_recycle
from torchweave.policies.recompute import with_recompute
from torchweave.policies.random import random_plan
from torchweave.policies.tensor import sp as sp_policy
from torchweave.policies.tensor import tp as tp_policy

MODELS: tuple[str, ...] = ("gpt-tiny", "llama-tiny", "moe-tiny", "vit-tiny", "swin-tiny", "t5-tiny",
                           "recycler-tiny", "hf-gpt2-tiny", "hf-llama-tiny")
"""Model families drawn from (bundled factories; the ``hf-`` ones are transformers models)."""
LOOKUPS = ("t5-tiny",)
"""Models with a lookup of a table an earlier op reads too (the decoder embedding), where a
pipeline's ``tied=send`` moves something (``stage_cuts.shared_lookups``)."""
BATCH = 8
"""Every drawn model runs on a global batch of this many rows."""
SCHEDULE_NAMES = BUILTIN


@dataclass(frozen=True, kw_only=True)
class Draw:
    """One drawn case: plain data that round-trips through JSON."""

    seed: int
    model: str
    world_size: int
    plan: dict[str, Any]
    """``kind`` (spmd, pipeline, interlaced) and its options."""
    step: dict[str, Any] = field(default_factory=dict)
    """StepConfig fields."""
    optimizer: str = "adamw"
    """``adamw`` or ``sgd`` (momentum 0.9)."""
    dtype: str = "float64"
    """The model's parameters and float inputs: ``float64`` (rounding about 1e-15, so AdamW
    cannot turn rounding into steps of size lr) or ``float32`` (bf16 runs cast from it)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "Draw":
        d = json.loads(text)
        return Draw(seed=int(d["seed"]), model=str(d["model"]), world_size=int(d["world_size"]),
                    plan=dict(d["plan"]), step=dict(d["step"]), optimizer=str(d["optimizer"]),
                    dtype=str(d.get("dtype", "float64")))

    def features(self) -> list[str]:
        """The features this draw exercises, for the table."""
        p, s = self.plan, self.step
        out = [self.model, f"world {self.world_size}"]
        if p["kind"] == "spmd":
            out.append(f"spmd {p['base']}")
        elif p["kind"] == "interlaced":
            out.append("interlaced")
        else:
            out.append(p["schedule"])
            out += [f"{k}>1" for k in ("pp", "tp", "dp") if p.get(k, 1) > 1]
            if p.get("virtual", 1) > 1:
                out.append("virtual stages")
            if p.get("cuts"):
                out.append("drawn cuts")
            if p.get("tied"):
                out.append(f"tied={p['tied']}")
            if p.get("recycle", 1) > 1:
                out.append("multi-forward")
        if p.get("zero"):
            out.append(f"zero{p['zero']}")
        if p.get("recompute"):
            out.append("recompute")
        if p.get("coshard"):
            out.append("co-shard")
        if s.get("grad_accum", 1) > 1:
            out.append("accumulation")
        out.append("bf16" if s.get("precision") == "bf16" else self.dtype)
        if s.get("clip_grad_norm"):
            out.append("clipping")
        if self.optimizer == "sgd":
            out.append("sgd")
        return out


def _triples(n: int) -> list[tuple[int, int, int]]:
    return [(a, b, n // (a * b)) for a in range(1, n + 1) if n % a == 0
            for b in range(1, n // a + 1) if (n // a) % b == 0]


def draw(seed: int, *, models: tuple[str, ...] = MODELS, world_sizes: tuple[int, ...] = (2, 4, 8)
         ) -> Draw:
    """The draw of ``seed``: the same seed always gives the same case."""
    rng = random.Random(seed)
    model = rng.choice(models)
    ws = rng.choice(world_sizes)
    kind = rng.choices(["spmd", "pipeline", "interlaced"], weights=[4, 5, 1])[0]
    if model == "recycler-tiny" and kind == "interlaced":
        kind = "pipeline"
    plan: dict[str, Any] = {"kind": kind}
    step: dict[str, Any] = {}
    if kind == "spmd":
        base = rng.choice(["dp", "tp", "sp", "random"])
        plan["base"] = base
        dp = ws
        if base in ("tp", "sp"):
            plan["tp"] = rng.choice([t for t in range(2, ws + 1) if ws % t == 0])
            dp = ws // plan["tp"]
        if base == "random":
            plan["seed"] = rng.randrange(10 ** 6)
        if base == "random" or dp > 1:
            plan["zero"] = rng.choice([0, 0, 1, 2, 3])
        accum = [k for k in (1, 2, 4) if BATCH % k == 0 and (BATCH // k) % dp == 0]
        step["grad_accum"] = rng.choice(accum) if rng.random() < 0.4 else 1
    elif kind == "pipeline":
        triples = [t for t in _triples(ws) if t[0] >= 2] or _triples(ws)
        pp, tp, dp = rng.choice(triples)
        schedule = rng.choice(SCHEDULE_NAMES)
        plan.update(schedule=schedule, pp=pp, tp=tp, dp=dp)
        if schedule == "interleaved":
            plan["virtual"] = rng.choice([2, 2, 3])
        micros = [m for m in (1, 2, 4, 8) if BATCH % m == 0 and (BATCH // m) % dp == 0]
        plan["micro"] = rng.choice(micros + [3]) if rng.random() < 0.05 else rng.choice(micros)
        if rng.random() < 0.3:
            plan["cuts"] = sorted(rng.random() for _ in range(pp * plan.get("virtual", 1) - 1))
        if dp > 1 and rng.random() < 0.5:
            plan["zero"] = rng.choice([1, 2, 2, 3]) if rng.random() < 0.9 else 3
        if model == "recycler-tiny" and rng.random() < 0.7:
            plan["recycle"] = rng.choice([2, 3])
        if rng.random() < 0.35:  # on top of the stage's tp and dp splits (policies/coshard.py)
            plan["coshard"] = {"at": rng.random(), "length": rng.choice([1, 2, 3]), "k": 2}
        if rng.random() < 0.05:
            step["grad_accum"] = 2  # pipelines take their micro-batches from the plan: rejected
        if model in LOOKUPS and random.Random(f"tied {seed}").random() < 0.5:
            plan["tied"] = "send"  # its own stream: the other draws of a seed stay as they were
    else:
        plan["micro"] = rng.choice([m for m in (ws, 2 * ws) if BATCH % m == 0] or [ws])
    if rng.random() < 0.3:
        plan["recompute"] = [rng.random() for _ in range(rng.choice([1, 2]))]
    dtype = rng.choices(["float64", "float32", "bf16"], weights=[6, 2, 2])[0]
    if dtype == "bf16":
        step["precision"], dtype = "bf16", "float32"
    if rng.random() < 0.2:
        # below every drawn model's gradient norm, so that every step clips: at a norm near
        # the threshold, rounding decides whether a step clips, and one device and the plan
        # may decide differently (a correct float32 plan then differs by |norm - max| / max)
        step["clip_grad_norm"] = rng.choice([0.01, 0.05])
    if rng.random() < 0.3:
        step["bucket_mb"] = 0.02
    if rng.random() < 0.2:
        step["overlap"] = False
    optimizer = rng.choice(["adamw", "adamw", "sgd"])
    if dtype == "float32":  # AdamW turns float32 rounding in tiny gradients into steps of lr
        optimizer = "sgd"
    return Draw(seed=seed, model=model, world_size=ws, plan=plan, step=step,
                optimizer=optimizer, dtype=dtype)


def build_plan(d: Draw, graph: Graph, world_size: int) -> Plan:
    """The Plan that ``d`` describes, on ``graph``; raises the policies' own errors."""
    p = d.plan
    if p["kind"] == "spmd":
        if p["base"] == "random":
            plan = random_plan(graph, world_size, seed=p["seed"], permute=0.5)
            if p.get("zero") and plan.mesh is not None:
                plan.zero = p["zero"]
                plan.zero_axis = random.Random(p["seed"]).choice(plan.mesh.names())
        elif p["base"] == "dp":
            plan = dp_policy(graph, world_size, zero=p.get("zero", 0))
        else:
            policy = tp_policy if p["base"] == "tp" else sp_policy
            plan = policy(graph, world_size, tp_size=p["tp"])
            if p.get("zero"):
                plan.zero, plan.zero_axis = p["zero"], "dp"
    elif p["kind"] == "interlaced":
        plan = interlaced(graph, world_size, micro=p["micro"])
    else:
        stages = p["pp"] * p.get("virtual", 1)
        cuts = _positions(p["cuts"], len(graph.nodes)) if p.get("cuts") else None
        if cuts is not None and len(cuts) != stages - 1:
            cuts = None  # collisions on a short graph: fall back to the balanced cut
        plan = pipeline(graph, world_size, schedule=p["schedule"], pp=p["pp"], tp=p["tp"],
                        dp=p["dp"], micro=p["micro"], virtual=p.get("virtual"),
                        zero=p.get("zero", 0), cuts=cuts, tied=p.get("tied", "copy"))
        if p.get("recycle", 1) > 1:
            with_recycle(plan, graph, p["recycle"])
        if p.get("coshard"):
            nodes, dim = _chain(graph, plan, **p["coshard"])
            if nodes:
                try:
                    with_coshard(plan, graph, nodes, p["coshard"]["k"], dim)
                except TorchweaveError:  # that dim is split already: another one, or fewer nodes
                    try:
                        with_coshard(plan, graph, nodes, p["coshard"]["k"], trim=True)
                    except TorchweaveError:
                        pass  # no split carries through this chain on these devices
    if p.get("recompute"):
        names = _module_names(graph)
        if names:
            with_recompute(plan, graph, tuple(sorted({names[int(f * len(names))] for f in p["recompute"]})))
    plan.notes["fuzz"] = f"seed {d.seed}"
    return plan


def _positions(fractions: list[float], n: int) -> list[int]:
    return sorted({min(n - 1, max(1, int(f * n))) for f in fractions})


def _module_names(graph: Graph) -> list[str]:
    """Module path components that name a module kind (``attn``, ``mlp``, ``ln_1``)."""
    return sorted({part for node in graph.nodes for part in node.module.split(".")
                   if part and not part.isdigit()})


def _chain(graph: Graph, plan: Plan, *, at: float, length: int, k: int) -> tuple[list[str], str]:
    """The co-shard chain at ``at`` (a fraction of the graph): consecutive nodes of one stage,
    the first one with a spatial dim that divides by ``k``; ``([], "")`` if none fits there."""
    nodes = graph.nodes
    stage_of = plan.pipeline.stage_of if plan.pipeline is not None else {}
    start = int(at * len(nodes))
    for i in list(range(start, len(nodes))) + list(range(0, start)):
        bound = info(graph, nodes[i]).bound
        kinds = bound.annotation.dims()
        dims = [dm for dm in bound.splittable() if kinds[dm].kind == "spatial"
                and bound.sizes[dm] % k == 0]
        if not dims:
            continue
        chain = [nodes[i].name]
        for j in range(i + 1, min(i + length, len(nodes))):
            if stage_of.get(nodes[j].name) != stage_of.get(nodes[i].name):
                break
            chain.append(nodes[j].name)
        return chain, dims[0]
    return [], ""

