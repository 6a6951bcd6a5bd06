"""A mixture-of-experts layer's experts as one op: ``torchweave.moe_experts``.

transformers' expert modules (Mixtral, Qwen2-MoE and every class built with its
``use_experts_implementation``) sort the routed tokens by expert and multiply them in a
grouped matmul at row offsets that a histogram computes at run time. Traced op by op, that
region cannot split its experts: a split of the experts would split the rows at offsets
known only at run time, so ``ep`` ran such models as data parallelism and every rank ran
every expert on the whole batch.

Capture records such a module as this one op instead (:func:`experts_as_one_op`, which
:func:`torchweave.capture` opens).
Its meaning is the experts' own::

    out[t] = Σ_j  w[t, j] · down[e] (act(gate[e] x[t]) ⊙ up[e] x[t]),   e = index[t, j]

and its annotation follows from it: tokens ``t`` are independent (data parallelism keeps
them split), and the output is a sum over experts ``e``, so splitting the experts leaves
partial sums, like a contraction (``e+``). Under ``ep`` each device holds ``E / ep``
experts and computes only the (token, expert) pairs routed to them, dropless, with no
capacity. The op declares that ``index`` routes tokens to experts (``route``), so lowering
sends each token only to the devices holding its experts and sums their results back (a
routed exchange, :mod:`torchweave.lower.route`); where the layouts do not allow that, it
gathers the tokens within each ep group and reduce-scatters the partial outputs. Hidden and
expert widths stay whole.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from torchweave.ops.registry import Call, op

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
"""The expert activations the op computes, by name (``act``)."""


def experts(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
            gate_up: torch.Tensor, down: torch.Tensor, act: str, transposed: bool,
            e0: int = 0) -> torch.Tensor:
    """The experts' output for ``hidden [t, d]`` routed by ``index [t, k]`` with
    ``weights [t, k]``, from experts ``e0 ..`` ``e0 + len(gate_up) - 1``.

    ``gate_up [e, 2f, d]`` holds each expert's gate then up projection and ``down
    [e, d, f]`` its down projection (``transposed``: ``[e, d, 2f]`` and ``[e, f, d]``).
    Pairs routed to experts outside the range add nothing (the pieces of a split sum to the
    whole). Differentiable in plain torch ops; each expert runs on its own rows only.
    """
    fn = ACTIVATIONS[act]
    t, k = index.shape
    flat = index.reshape(-1)
    ids, order = torch.sort(flat, stable=True)
    edges = torch.arange(e0, e0 + gate_up.shape[0] + 1, device=flat.device, dtype=ids.dtype)
    bounds = torch.searchsorted(ids, edges).tolist()  # one host read: where each expert's pairs lie
    done, ys = [], []
    for e in range(gate_up.shape[0]):  # an expert with no pair runs on no rows: every input
        pairs = order[bounds[e]:bounds[e + 1]]  # keeps a gradient, as every rank's collectives need
        w_in = gate_up[e].transpose(0, 1) if transposed else gate_up[e]
        w_out = down[e].transpose(0, 1) if transposed else down[e]
        gate, up = F.linear(hidden[pairs // k], w_in).chunk(2, dim=-1)
        ys.append(F.linear(fn(gate) * up, w_out) * weights.reshape(-1)[pairs].unsqueeze(-1))
        done.append(pairs)
    # each pair's output in its own row (rows are unique: a deterministic copy), then each
    # token's k rows summed, in the order transformers sums them
    y = torch.cat(ys)
    per_pair = y.new_zeros(t * k, y.shape[-1]).index_copy(0, torch.cat(done), y)
    return per_pair.view(t, k, y.shape[-1]).sum(dim=1).to(hidden.dtype)


@torch.library.custom_op("torchweave::moe_experts", mutates_args=())
def moe_experts(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, act: str, transposed: bool) -> torch.Tensor:
    """:func:`experts` of every expert, as one node that torch.export keeps whole."""
    return experts(hidden, index, weights, gate_up, down, act, transposed)


@moe_experts.register_fake
def _(hidden, index, weights, gate_up, down, act, transposed):
    return torch.empty_like(hidden)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.consts = inputs[5:]
    ctx.save_for_backward(*inputs[:5])


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    """The forward again under autograd. Generated code calls :func:`experts` itself, split
    or whole (``_local``), so this runs only where the op is called directly: capture's
    single-device interpreter and the registry's self-check."""
    args = [t.detach().requires_grad_(t.is_floating_point()) for t in ctx.saved_tensors]
    with torch.enable_grad():
        out = experts(*args, *ctx.consts)
    wrt = [a for a in args if a.requires_grad]
    got = iter(torch.autograd.grad(out, wrt, grad, allow_unused=True))
    return (*(next(got) if a.requires_grad else None for a in args), None, None)


moe_experts.register_autograd(_backward, setup_context=_setup)


def _moe_experts(call: Call) -> str:
    """Tokens ``t`` split freely; the experts ``e`` split into partial sums; widths whole.
    Other ranks than transformers' ``[t, d]`` tokens and ``[e, ·, ·]`` weights stay whole."""
    if [len(m.shape) for m in call.inputs] != [2, 2, 2, 3, 3]:
        return f"{', '.join(['?'] * len(call.inputs))} -> t^ d^"
    transposed = call.arg(6, "transposed", False)
    up, dn = ("e+ d^ g^", "e+ f^ d^") if transposed else ("e+ g^ d^", "e+ d^ f^")
    return f"t d^, t k^, t k^, {up}, {dn} -> t d^"


def _flops(call: Call, bound) -> float:
    """Each (token, expert) pair: the gate and up projections (``d → 2f``) and the down
    one (``f → d``)."""
    (t, d), (_, k) = call.inputs[0].shape, call.inputs[1].shape
    two_f = call.inputs[3].shape[2 if call.arg(6, "transposed", False) else 1]
    return 2.0 * t * k * d * (two_f + two_f // 2)


def _local(args: tuple[Any, ...], kwargs: dict[str, Any], split: Any, index: int,
           sizes: dict[str, int]):
    """Every piece, and the whole op, calls :func:`experts` itself (native autograd, no
    forward run again in backward); split on the experts, with the first expert it holds."""
    e0 = kwargs.get("e0", 0)
    if split.dim == "e":
        e0 += index * (sizes["e"] // split.parts)
    return experts, tuple(args[:7]), {**kwargs, "e0": e0}


op("torchweave.moe_experts.default", _moe_experts, flops=_flops, local=_local, route=(1, "e"),
   doc="mixture-of-experts experts (torchweave.ops.moe): tokens split, experts sum")


def _activation(fn: Any) -> str | None:
    """The name in :data:`ACTIVATIONS` of the function ``fn`` computes, judged on probe
    values (transformers wraps each in its own class); ``None`` when none matches."""
    # small and large values: an activation that clips (relu6, gelu_10) differs only there
    x = torch.cat([torch.linspace(-8.0, 8.0, 65, dtype=torch.float64),
                   torch.tensor([-1e3, -50.0, -12.5, 12.5, 50.0, 1e3], dtype=torch.float64)])
    try:
        with torch.no_grad():
            y = fn(x)
    except Exception:  # noqa: BLE001 - an activation that cannot run on a probe is not matched
        return None
    for name, ref in ACTIVATIONS.items():
        if isinstance(y, torch.Tensor) and y.shape == x.shape \
                and torch.allclose(y, ref(x), rtol=0.0, atol=1e-12):
            return name
    return None


def recognized(module: torch.nn.Module) -> str | None:
    """The activation of a transformers experts module that :func:`experts` computes
    exactly, else ``None``: gated (``act(gate) ⊙ up``, gate and up concatenated), no
    biases, no norm after the experts, the default gate, weights ``[e, ·, ·]``, the class's
    own forward, and not already in transformers' own expert parallelism."""
    if not hasattr(module, "_is_expert_parallel") or module._is_expert_parallel \
            or "forward" in vars(module):  # a forward of the instance's own: not the class's maths
        return None
    if not (getattr(module, "has_gate", False) and getattr(module, "is_concatenated", False)) \
            or getattr(module, "has_bias", True) or getattr(module, "has_post_expert_norm", True):
        return None
    impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if impl not in _IMPLEMENTATIONS or not _wrapped_by_transformers(type(module)):
        return None  # someone's own implementation or forward: not known to be these maths
    gate = getattr(type(module), "_apply_gate", None)
    if gate is None or gate.__module__ != "transformers.integrations.moe" \
            or gate.__name__ != "_default_apply_gate":
        return None
    up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not all(isinstance(p, torch.nn.Parameter) and p.dim() == 3 for p in (up, down)):
        return None
    return _activation(getattr(module, "act_fn", None))


_IMPLEMENTATIONS = (None, "eager", "grouped_mm", "batched_mm")
"""transformers' own experts implementations, each the same maths (the class's loop, the
grouped matmul, the batched matmul); another (a kernel from a hub, a user's) is not known."""


def _wrapped_by_transformers(cls: type) -> bool:
    """Whether ``cls.forward`` is the dispatcher that transformers' ``use_experts_implementation``
    installs (a subclass's own forward is not)."""
    code = getattr(getattr(cls, "forward", None), "__code__", None)
    path = getattr(code, "co_filename", "").replace("\\", "/")
    return path.endswith("transformers/integrations/moe.py")


@contextlib.contextmanager
def experts_as_one_op(model: torch.nn.Module) -> Iterator[list[str]]:
    """While open, each :func:`recognized` experts module of ``model`` runs as one
    ``torchweave.moe_experts`` call (capture records it as one node); yields their paths.
    Left as it was afterwards: the model's own forward is what one device runs."""
    patched = []
    for path, module in model.named_modules():
        act = recognized(module)
        if act is not None:
            module.forward = functools.partial(_forward, module, act)
            patched.append((path, module))
    try:
        yield [p for p, _ in patched]
    finally:
        for _, module in patched:
            del module.forward


def _forward(module: torch.nn.Module, act: str, hidden_states: torch.Tensor,
             top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    return torch.ops.torchweave.moe_experts(hidden_states, top_k_index, top_k_weights,
                                            module.gate_up_proj, module.down_proj, act,
                                            bool(getattr(module, "is_transposed", False)))
