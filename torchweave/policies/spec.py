"""Plan strings: ``POLICY[:KEY=VALUE,...]``, one grammar for every built-in policy.

``"dp"``, ``"zero3:recompute=full"``, ``"tp:tp=8,zero=1"``,
``"interleaved:tp=8,pp=8,virtual=3,micro=16,recompute=selective"``. The same
string works in the Python API (``plan=``), on the command line (``--plan``) and
in a train config (``parallel.plan``). :class:`PlanSpec` parses and checks it
with no graph at hand, so a bad option is refused before anything is captured,
with the options and values the policy allows; :meth:`PlanSpec.build` makes the
Plan on a graph.

Options (each policy takes those listed in :data:`OPTIONS`):

============  =================================================================
``dp``        data-parallel degree (default: for ``dp`` and ``zero*`` the world size;
              for pipelines given ``pp``, world / (pp × tp); else 1)
``tp``        tensor-parallel degree (``tp``, ``sp``, pipelines)
``ep``        expert-parallel degree (``ep`` and pipelines: experts split over ``ep``
              devices, every device its own tokens; ``dp`` × ``ep`` × ``tp`` = world, or
              per stage with ``pp``; :mod:`torchweave.policies.expert`)
``pp``        pipeline ranks (pipelines; default: world / (dp × tp))
``micro``     micro-batches per step (pipelines; default 2 × pp)
``accum``     micro-batches per step without a pipeline (gradient accumulation: the
              batch in ``accum`` equal slices, one optimizer step; default 1). The
              same as ``StepConfig.grad_accum``, ``--grad-accum`` and the train
              config's ``grad_accum``: give either, or both equal
``virtual``   stages per pipeline rank (``interleaved`` only)
``stages``    total stages, a check: pp × virtual (pipelines)
``zero``      ZeRO stage 0–3 over the data-parallel axis
``recycle``   forward passes per micro-batch (multi-forward pipelines)
``recompute`` ``none``, ``full``, ``selective``, or module names ``mlp+attn``
              (:mod:`torchweave.policies.recompute`)
``coshard``   each device runs its share of a region in K chunks, one after another,
              each recomputed in backward (:mod:`torchweave.policies.coshard`):
              ``K`` for the output head (LM head and loss), ``attn+mlp:K`` for every
              instance of the named modules
``split``     how ops split on ``tp`` (``tp`` and pipelines): ``rule`` (Megatron's
              rules, the default), ``sequence`` (Megatron's rules plus sequence
              parallelism in norms, dropout and residuals: ``tp:split=sequence`` is
              ``sp``, and ``1f1b:tp=8,pp=4,split=sequence`` pipelines it) or
              ``solved`` (each op's split chosen by the search's solver for the
              cluster, :mod:`torchweave.search.intra`)
``tied``      pipelines: how a parameter read on several stages is held: ``copy``
              (the default; each stage a copy, their gradients summed once a step, as
              Megatron-LM holds a tied embedding) or ``send`` (a lookup of it, such as an
              encoder-decoder's decoder embedding, runs on the stage that holds it and sends
              its output: :func:`~torchweave.policies.stage_cuts.send_lookups`)
``cuts``      pipelines: the modules whose first ops start stages 1, 2, … (``+``
              between them: ``encoder.6+encoder.13.ff+decoder.4``), in place of the
              policy's FLOP-balanced cut between whole blocks; a stage may start inside a
              block (``encoder.13.ff``: between attention and the MLP). The search writes
              its cuts balanced by each op's seconds on the cluster this way
``preset``    ``auto`` only: the constraint set the search starts from
              (:mod:`torchweave.search`)
``exhaustive`` ``auto`` only: ``1`` builds and simulates every point of the space,
              estimating none (the baseline the search is judged by; slow)
============  =================================================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from torchweave.errors import Problem, TorchweaveError
from torchweave.ir.graph import Graph
from torchweave.plan.plan import Plan
from torchweave.policies.coshard import parse_coshard, with_coshard_spec
from torchweave.policies.data import dp as dp_policy
from torchweave.policies.expert import ep as ep_policy
from torchweave.policies.pipeline_policy import SCHEDULES, TIED, interlaced, mesh_degrees
from torchweave.policies.pipeline_policy import pipeline as pipeline_policy
from torchweave.policies.random import random_plan
from torchweave.policies.recompute import MODES, with_recompute
from torchweave.policies.tensor import sp as sp_policy
from torchweave.policies.tensor import tp as tp_policy

_PIPE = ("pp", "tp", "dp", "micro", "stages", "zero", "recycle", "recompute", "split", "coshard", "ep",
         "tied", "cuts")
_PIPELINES = (*SCHEDULES, "interlaced")
OPTIONS: dict[str, tuple[str, ...]] = {
    "dp": ("dp", "zero", "recompute", "accum", "coshard"),
    "zero1": ("dp", "recompute", "accum", "coshard"), "zero2": ("dp", "recompute", "accum", "coshard"),
    "zero3": ("dp", "recompute", "accum", "coshard"),
    "tp": ("tp", "dp", "zero", "recompute", "split", "accum", "coshard"),
    "sp": ("tp", "dp", "zero", "recompute", "accum", "coshard"),
    "ep": ("ep", "dp", "tp", "zero", "recompute", "accum"),
    "random": ("recompute",),
    **{name: _PIPE for name in SCHEDULES if name != "interleaved"},
    "interleaved": (*_PIPE, "virtual"),
    "interlaced": ("micro", "recompute"),
    "auto": ("preset", "exhaustive"),
}
"""The options each built-in policy takes."""

SPLITS = ("rule", "solved")
"""How ops split on the tensor-parallel axis: Megatron's rules, or the search's solver
(the constraints' ``split``; sequence parallelism is their ``sp``)."""
SPLIT_OPTIONS = (*SPLITS, "sequence")
"""The plan strings' ``split``: also ``sequence``, Megatron's rules with sequence parallelism."""
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MODULE_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")
"""A module path as plan strings' ``cuts`` write it (``encoder.11.ff``)."""


def _check_value(key: str, value: str) -> tuple[Any, str | None]:
    """(parsed value, None) or (None, the rule it breaks)."""
    if key == "preset":
        return (value, None) if _MODULE.fullmatch(value) else (
            None, "preset is a preset's name (megatron, zero3, dp, nnscaler, alpa, free)")
    if key == "exhaustive":
        return (value == "1", None) if value in ("0", "1") else (
            None, "exhaustive is 1 (build and simulate every point of the space) or 0")
    if key == "split":
        return (value, None) if value in SPLIT_OPTIONS else (
            None, f"split is one of {', '.join(SPLIT_OPTIONS)}")
    if key == "cuts":
        names = value.split("+")
        return (tuple(names), None) if all(MODULE_PATH.fullmatch(n) for n in names) else (
            None, "cuts is the modules where stages 1, 2, ... start, joined by '+' "
                  "(encoder.5+encoder.11.ff+decoder.3)")
    if key == "tied":
        return (value, None) if value in TIED else (
            None, "tied is copy (a parameter read on several stages: a copy on each, their "
                  "gradients summed once a step) or send (a lookup of it runs on its stage and "
                  "sends the result)")
    if key == "coshard":
        return (value, None) if parse_coshard(value) is not None else (
            None, "coshard is K (the output head in K chunks) or module names joined by '+' "
                  "and ':K' (attn+mlp:2), with K at least 2")
    if key == "recompute":
        names = value.split("+")
        if value in MODES or all(_MODULE.fullmatch(n) for n in names):
            return value, None
        return None, f"recompute is one of {', '.join(MODES)}, or module names joined by '+'"
    if not value.isdigit():
        return None, f"{key} is a whole number"
    n = int(value)
    if key == "zero":
        return (n, None) if n <= 3 else (None, "zero is a ZeRO stage: 0, 1, 2 or 3")
    return (n, None) if n >= 1 else (None, f"{key} is at least 1")


@dataclass(frozen=True)
class PlanSpec:
    """A parsed, checked plan string."""

    policy: str
    options: dict[str, Any] = field(default_factory=dict)
    text: str = ""

    @classmethod
    def parse(cls, text: str) -> PlanSpec:
        """Parse ``text``; every problem at once, each naming the option, the rule and a fix."""
        name, _, rest = text.strip().partition(":")
        if name not in OPTIONS:
            raise TorchweaveError(Problem(
                obj="plan", value=repr(text),
                rule=f"POLICY[:KEY=VALUE,...] with POLICY one of {', '.join(OPTIONS)}",
                fix="e.g. 'dp', 'zero3:recompute=full', 'tp:tp=4', '1f1b:tp=2,dp=2,micro=8', "
                    "or a plan.json path"))
        allowed = OPTIONS[name]
        problems, options = [], {}
        for item in (x.strip() for x in rest.split(",")) if rest.strip() else ():
            key, eq, value = (p.strip() for p in item.partition("="))
            if not eq or not key or not value:
                problems.append(Problem(obj=f"plan {text!r}", value=repr(item), rule="options are KEY=VALUE",
                                        fix=f"e.g. '{name}:{allowed[0]}=2'"))
            elif key not in allowed:
                why = (" (only the interleaved schedule runs several stages per rank)"
                       if key == "virtual" and name in SCHEDULES else
                       " (a pipeline's micro-batches are its micro option)"
                       if key == "accum" and name in _PIPELINES else "")
                problems.append(Problem(obj=f"plan {text!r}", value=f"option {key!r}",
                                        rule=f"{name} takes {', '.join(allowed)}{why}",
                                        fix=f"drop {key}, or use a policy that takes it"))
            elif key in options:
                problems.append(Problem(obj=f"plan {text!r}", value=f"option {key!r}",
                                        rule="each option is given once"))
            else:
                parsed, rule = _check_value(key, value)
                if rule:
                    problems.append(Problem(obj=f"plan {text!r}", value=f"{key}={value}", rule=rule))
                else:
                    options[key] = parsed
        if problems:
            raise TorchweaveError(problems)
        return cls(name, options, text.strip())

    def dp(self, world_size: int) -> int:
        """The data-parallel degree: ranks that see different samples."""
        o = self.options
        if self.policy in ("dp", "zero1", "zero2", "zero3", "ep"):
            # ep: the batch splits over dp × ep, every rank but tp's copies
            return o.get("dp", world_size) if self.policy != "ep" else world_size // o.get("tp", 1)
        if self.policy in ("tp", "sp"):
            if "dp" in o:
                return o["dp"]
            return world_size // o["tp"] if "tp" in o and world_size % o["tp"] == 0 else 1
        if self.policy in OPTIONS and self.policy not in ("random", "interlaced"):
            if "dp" in o or "pp" not in o:
                return o.get("dp", 1) * o.get("ep", 1)
            inner = o["pp"] * o.get("tp", 1)
            return world_size // inner if world_size % inner == 0 else 1
        return 1

    @property
    def solved(self) -> bool:
        """Whether the ops' splits on ``tp`` are the search solver's (``split=solved``)."""
        return self.options.get("split") == "solved"

    def build(self, graph: Graph, world_size: int, *,
              dims: dict[str, str | None] | None = None) -> Plan:
        """The Plan on ``graph`` for ``world_size`` ranks (``dims``: each node's split on
        ``tp``, what ``split=solved`` needs: :func:`torchweave.search.resolve` gives it)."""
        o = dict(self.options)
        recompute = o.pop("recompute", None)
        coshard = o.pop("coshard", None)
        accum = o.pop("accum", 1)
        split = o.pop("split", "rule")
        if split in ("rule", "sequence"):
            dims = None
        elif dims is None:
            raise TorchweaveError(Problem(
                obj=f"plan {self.text!r}", value="split=solved",
                rule="a solved split is found by the search's solver, which needs a cluster",
                fix="use torchweave.search.resolve (parallelize, verify, simulate, explain and "
                    "torchweave plan do)"))
        name = self.policy
        if name in ("dp", "zero1", "zero2", "zero3"):
            dp = o.pop("dp", world_size)
            if dp != world_size:
                raise TorchweaveError(Problem(
                    obj=f"plan {self.text!r}", value=f"dp={dp}",
                    rule=f"{name} is data parallel over every rank: dp = world_size ({world_size})",
                    fix=f"drop dp, or split the rest with another axis (e.g. 'tp:tp={world_size // dp}')"
                    if dp and world_size % dp == 0 else "drop dp"))
            zero = o.pop("zero", int(name[-1]) if name.startswith("zero") else 0)
            plan = dp_policy(graph, world_size, zero=zero)
        elif name in ("tp", "sp"):
            tp, dp = o.get("tp"), o.get("dp")
            if tp is None and dp is not None:
                tp = world_size // dp if world_size % dp == 0 else 0
            if tp is not None and (tp < 1 or tp * (dp or world_size // tp) != world_size):
                raise TorchweaveError(Problem(
                    obj=f"plan {self.text!r}", value=f"tp={tp}, dp={dp}",
                    rule=f"the mesh covers the world: tp × dp = world_size ({world_size})",
                    fix=f"choose tp and dp whose product is {world_size}"
                        + (f", or run on {tp * dp} ranks (a cluster of {tp * dp} devices)"
                           if tp and dp and tp * dp > world_size else "")))
            plan = (sp_policy(graph, world_size, tp_size=tp) if name == "sp" or split == "sequence"
                    else tp_policy(graph, world_size, tp_size=tp, dims=dims))
            if o.get("zero"):
                plan.zero, plan.zero_axis = o["zero"], "dp"
                plan.name = f"{plan.name}+zero{o['zero']}"
        elif name == "ep":
            ep, dp, tp = o.get("ep"), o.get("dp"), o.get("tp", 1)
            if ep is None:
                rest = world_size // tp if world_size % tp == 0 else 0
                ep = rest if dp is None else (rest // dp if dp and rest % dp == 0 else 0)
            if ep < 1 or ep * tp * (dp or world_size // (ep * tp) or 1) != world_size:
                raise TorchweaveError(Problem(
                    obj=f"plan {self.text!r}", value=f"ep={ep}, dp={dp}, tp={tp}",
                    rule=f"the mesh covers the world: ep × dp × tp = world_size ({world_size})",
                    fix=f"choose ep, dp and tp whose product is {world_size}"))
            plan = ep_policy(graph, world_size, ep_size=ep, tp_size=tp, zero=o.get("zero", 0))
        elif name == "auto":
            raise TorchweaveError(Problem(
                obj=f"plan {self.text!r}", value="auto",
                rule="auto is found by the search, which needs a cluster",
                fix="use torchweave.search.resolve (parallelize, verify, simulate and "
                    "torchweave plan do)"))
        elif name == "random":
            plan = random_plan(graph, world_size)
        elif name == "interlaced":
            plan = interlaced(graph, world_size, micro=o.get("micro"))
        else:
            if "cuts" in o:
                o["cuts"] = list(o["cuts"])
            plan = pipeline_policy(graph, world_size, schedule=name, dims=dims,
                                   sequence=split == "sequence", **o)
        plan.accum = accum
        if coshard is not None:
            with_coshard_spec(plan, graph, coshard)
        if recompute is not None:
            with_recompute(plan, graph, recompute)
            if recompute != "none":
                plan.notes["recompute"] = recompute
        if self.options:
            plan.notes["spec"] = self.text
        return plan


def is_auto(plan: object) -> bool:
    """Whether ``plan`` is ``auto`` (``auto:preset=NAME``): the search picks the plan."""
    return isinstance(plan, str) and (plan.strip() == "auto" or plan.strip().startswith("auto:"))


def needs_search(plan: object) -> bool:
    """Whether ``plan`` needs the search layer to resolve (:func:`torchweave.search.resolve`):
    ``auto``, or a plan string whose ops' splits the solver chooses (``split=solved``). Here,
    not there, so that a plan that needs no search never imports it."""
    return is_auto(plan) or (isinstance(plan, str) and "split=solved" in plan.replace(" ", ""))


def accum_of(plan: Any) -> int:
    """The micro-batches per step a plan asks for before it is built: its ``accum``
    (a Plan, a plan string, a plan.json path); 1 for a policy function or ``auto``."""
    if isinstance(plan, Plan):
        return plan.accum
    if isinstance(plan, str) and plan.endswith(".json"):
        with open(plan) as f:
            return Plan.from_json(f.read()).accum
    if isinstance(plan, str):
        return PlanSpec.parse(plan).options.get("accum", 1)
    return 1


def micro_of(plan: Any, world_size: int) -> int | None:
    """The micro-batches a pipelined plan string runs, known before capture (its ``micro``,
    else the policy's default: ``2 × pp``, ``pp`` from the mesh as the policy derives it;
    interlaced: ``2 × world_size``); None for anything else. :func:`torchweave.parallel.
    capture_and_resolve` captures one micro-batch at once with it, and checks the plan
    it builds runs that many."""
    if not isinstance(plan, str) or plan.endswith(".json"):
        return None
    spec = PlanSpec.parse(plan)
    if spec.policy not in _PIPELINES:
        return None
    o = spec.options
    if o.get("micro"):
        return int(o["micro"])
    if spec.policy == "interlaced":
        return 2 * world_size
    pp, _ = mesh_degrees(world_size, pp=o.get("pp"), tp=o.get("tp", 1), dp=o.get("dp"),
                         ep=o.get("ep", 1))
    return 2 * pp if pp >= 1 else None


def merged_accum(plan: Any, grad_accum: int, obj: str = "StepConfig.grad_accum") -> int:
    """Micro-batches per step: the plan's ``accum`` and ``grad_accum`` (``obj`` names
    where it came from) are one setting; either may be given, both only if equal."""
    k = accum_of(plan)
    if k != 1 and grad_accum != 1 and k != grad_accum:
        raise TorchweaveError(Problem(
            obj=obj, value=str(grad_accum),
            rule=f"one number of micro-batches per step: the plan says accum={k}",
            fix=f"give it once (the plan's accum or {obj}), or make them equal"))
    return k if k != 1 else grad_accum


__all__ = ["OPTIONS", "PlanSpec", "SPLITS", "SPLIT_OPTIONS", "accum_of", "merged_accum", "micro_of"]
