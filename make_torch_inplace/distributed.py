"""DTensor support: a sharding rule for every op, and the entry points DTensor needs.

``import make_torch_inplace.distributed`` registers, with
``torch.distributed.tensor.experimental.register_sharding``, a rule for each dispatcher op of
``torch.ops.make_torch_inplace`` (forward, backward, cross_entropy_, rope_ and
silu_mul_backward_). Importing needs
no initialised process group; importing ``make_torch_inplace`` alone does not import this
module.

The rules, for every mesh dim:

- a tensor the op overwrites (x, logits, and the backward ops' outputs) may be Replicate or
  Shard on a dim the op does not normalize, reduce or contract; the op then runs on the local
  shard with no communication and x keeps its placements (in place);
- Partial, or Shard on the softmax / normalized / contracted / class / rotated dim, raises
  before anything is written. So does an argument whose placement differs from what the local
  op needs (weight, bias: Replicate; mask, rope's cos and sin: Replicate, or sharded like x
  where they span x's sharded dim; grad like y). Each rule accepts exactly the placements it
  is given, so DTensor never redistributes (gathers) an argument: a layout the op cannot
  serve in place is an error, not a silent all-gather into a temporary that the op would then
  overwrite instead of x (the one collective here: a norm's backward brings an output
  gradient placed unlike y to y's placements, a read-only input). A dim sharded more ways
  than it has elements is refused too (DTensor offers no strategy over empty shards);
- softmax with ``causal`` also refuses a sharded query dim (-2): the causal mask is aligned to
  the local shard's first row; square_matmul_ refuses a sharded weight (column- or
  row-parallel), whose output would need a gather or a reduction that cannot land in x's
  shard; cross_entropy_ with reduction "mean" refuses sharded rows, whose divisor is the
  global number of valid rows ("sum", then dividing by that count, works).

``register_sharding`` expresses these ops in torch 2.13: their schemas return nothing and
mutate x, and DTensor treats a name ending in ``_`` as in place and leaves x's placements as
they are (the backward ops write only arguments whose placements the rules fix). Its
sharding cache keys on the arguments from the first ``int`` on, and ``int[]
normalized_shape`` is not an ``int``; so that no torch version can serve a call that
normalizes a sharded dim from an acceptance cached for another shape, each op's key is set to
every non-tensor argument.

Every op of the package takes DTensors as they are, autograd included: the norms and
cross_entropy_ allocate their row-sized buffers (rstd, losses) and the backward's gradients
through ops._BUFFERS, where this module registers DTensor's (_DTensorBuffers): DTensors of the
local sizes. Weight and bias gradients of row-sharded inputs are Partial (per-rank column
sums), as DTensor's own norms give them.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
from torch.distributed.tensor.experimental import register_sharding

from . import ops

_ops = torch.ops.make_torch_inplace


# --------------------------------------------------------------------------- rule helpers


def _refuse(op: str, message: str) -> None:
    raise ValueError(f"make_torch_inplace.{op} on DTensor: {message}")


def _is_spec(arg) -> bool:
    return arg is not None and hasattr(arg, "placements")


def _check_overwritten(op: str, name: str, spec, kept_dims: set[int], why: str) -> None:
    """The placements of a tensor the op writes (or reads row by row, like it): Replicate, or
    Shard on a dim outside kept_dims."""
    ndim = len(spec.shape)
    for p in spec.placements:
        if p.is_partial():
            _refuse(
                op,
                f"{name} is Partial ({p}): a pending reduction cannot be overwritten in place; "
                "redistribute it to Replicate or Shard first",
            )
        if p.is_shard() and p.dim % ndim in kept_dims:
            _refuse(
                op,
                f"{name} is sharded on dim {p.dim % ndim}, {why}; shard another dim or "
                "Replicate (refused rather than gathered)",
            )


def _check_same(op: str, name: str, spec, ref, ref_name: str) -> None:
    if not _is_spec(spec):
        return
    if math.prod(spec.shape) == 0 and all(p.is_replicate() for p in spec.placements):
        return  # an empty out argument: the gradient is not wanted
    if tuple(spec.placements) != tuple(ref.placements):
        _refuse(
            op,
            f"{name} has placements {tuple(spec.placements)}, {ref_name} has "
            f"{tuple(ref.placements)}; they must match (the op runs on local shards only)",
        )


def _check_replicated(op: str, name: str, spec, hint: str = "") -> None:
    if _is_spec(spec) and not all(p.is_replicate() for p in spec.placements):
        _refuse(op, f"{name} must be Replicate, got {tuple(spec.placements)}{hint}")


def _check_broadcast(op: str, name: str, t, x, x_name: str = "x") -> None:
    """A tensor broadcast against x (a mask, rope's cos and sin): where x is sharded on a dim
    that t spans (size > 1), t must be sharded on the same dim; elsewhere Replicate."""
    if not _is_spec(t):
        return
    ndim, offset = len(x.shape), len(x.shape) - len(t.shape)
    for i, (p, q) in enumerate(zip(x.placements, t.placements, strict=True)):
        d = p.dim % ndim if p.is_shard() else None
        td = None if d is None else d - offset
        if td is not None and td >= 0 and t.shape[td] > 1:
            if not (q.is_shard() and q.dim % len(t.shape) == td):
                _refuse(op, f"{name} must be Shard({td}) on mesh dim {i} as {x_name} is Shard({d})")
        elif not q.is_replicate():
            _refuse(op, f"{name} must be Replicate on mesh dim {i}, got {q}")


def _check_mask(op: str, mask, x) -> None:
    _check_broadcast(op, "mask", mask, x)


def _per_mesh_dim(x, placement_if_sharded) -> list:
    """For each mesh dim: placement_if_sharded where x is sharded there, else Replicate."""
    return [placement_if_sharded if p.is_shard() else Replicate() for p in x.placements]


def _check_derived(op: str, name: str, spec, x, placement_if_sharded, what: str) -> None:
    """A buffer whose placement follows from x's (rstd, losses, the parameter gradients)."""
    if not _is_spec(spec) or math.prod(spec.shape) == 0:
        return
    want = _per_mesh_dim(x, placement_if_sharded)
    if tuple(spec.placements) != tuple(want):
        _refuse(op, f"{name} ({what}) must have placements {tuple(want)}, got {spec.placements}")


def _as_given(op: str, *args) -> list[tuple[list, list]]:
    """The one strategy the rules accept: every argument as it is (outputs: none, the ops
    return nothing). register_sharding takes placements per mesh dim and expands them."""
    specs = [a for a in args if _is_spec(a)]
    for spec in specs:
        # DTensor drops a strategy with a tensor dim smaller than its number of shards.
        for d in {p.dim % len(spec.shape) for p in spec.placements if p.is_shard()}:
            shards = math.prod(
                spec.mesh.size(i) for i, p in enumerate(spec.placements) if p == Shard(d)
            )
            if spec.shape[d] < shards:
                _refuse(op, f"dim {d} of size {spec.shape[d]} is sharded {shards} ways")
    mesh_dims = len(specs[0].placements)
    strategies = []
    for i in range(mesh_dims):
        inputs = [a.placements[i] if _is_spec(a) else None for a in args]
        if ([], inputs) not in strategies:
            strategies.append(([], inputs))
    return strategies


def _rule(op: torch._ops.OpOverload):
    """register_sharding, with a cache key over every non-tensor argument (see the module
    docstring)."""

    def register(fn):
        register_sharding(op)(fn)
        propagator = DTensor._op_dispatcher.sharding_propagator
        propagator.op_to_schema_info[op] = RuntimeSchemaInfo(static_argnum=1, needs_pytree=True)
        return fn

    return register


def _softmax_kept(y, dim: int, causal: bool) -> set[int]:
    ndim = len(y.shape)
    return {dim % ndim} | ({ndim - 2} if causal and ndim >= 2 else set())


_SOFTMAX_WHY = "the softmax dim (or, with causal, the query dim -2)"
_ROPE_WHY = "the rotated dim (each element needs its partner in the other half)"
_NORM_WHY = "one of the normalized dims"
_CLASS_WHY = "the class dim (vocab-parallel logits need a cross-rank max and sum)"


# --------------------------------------------------------------------------- the rules


@_rule(_ops.square_matmul_.default)
def _square_matmul_rule(x, weight, bias, transpose, workspace_bytes):
    op = "square_matmul_"
    _check_overwritten(op, "x", x, {len(x.shape) - 1}, "the contracted dim")
    hint = (
        " (a column- or row-parallel weight needs a gather or a reduction of the output, which "
        "cannot be written over x's shard; use x @ weight on DTensors for those)"
    )
    _check_replicated(op, "weight", weight, hint)
    _check_replicated(op, "bias", bias)
    return _as_given("square_matmul_", x, weight, bias, transpose, workspace_bytes)


@_rule(_ops.softmax_.default)
def _softmax_rule(x, dim, scale, mask, causal, log):
    op = "log_softmax_" if log else "softmax_"
    _check_overwritten(op, "x", x, _softmax_kept(x, dim, causal), _SOFTMAX_WHY)
    _check_mask(op, mask, x)
    return _as_given(op, x, dim, scale, mask, causal, log)


@_rule(_ops.softmax_backward.default)
def _softmax_backward_rule(y, grad, dim, scale, mask, causal, log, grad_x):
    op = "softmax_backward"
    _check_overwritten(op, "y", y, _softmax_kept(y, dim, causal), _SOFTMAX_WHY)
    _check_same(op, "grad", grad, y, "y")
    _check_same(op, "grad_x", grad_x, y, "y")
    _check_mask(op, mask, y)
    return _as_given(op, y, grad, dim, scale, mask, causal, log, grad_x)


def _check_norm(op, x, normalized_shape, weight, bias, rstd) -> None:
    ndim = len(x.shape)
    kept = set(range(ndim - len(normalized_shape), ndim))
    _check_overwritten(op, "x", x, kept, _NORM_WHY)
    _check_replicated(op, "weight", weight)
    _check_replicated(op, "bias", bias)
    _check_derived(op, "rstd", rstd, x, Shard(0), "one value per local row")


@_rule(_ops.layer_norm_.default)
def _layer_norm_rule(x, normalized_shape, weight, bias, eps, rstd):
    _check_norm("layer_norm_", x, normalized_shape, weight, bias, rstd)
    return _as_given("layer_norm_", x, normalized_shape, weight, bias, eps, rstd)


@_rule(_ops.rms_norm_.default)
def _rms_norm_rule(x, normalized_shape, weight, eps, rstd):
    _check_norm("rms_norm_", x, normalized_shape, weight, None, rstd)
    return _as_given("rms_norm_", x, normalized_shape, weight, eps, rstd)


@_rule(_ops.norm_backward.default)
def _norm_backward_rule(
    y, grad, normalized_shape, weight, bias, rstd, rms, grad_x, grad_weight, grad_bias
):
    op = "norm_backward"
    _check_norm(op, y, normalized_shape, weight, bias, rstd)
    _check_same(op, "grad", grad, y, "y")
    _check_same(op, "grad_x", grad_x, y, "y")
    for name, spec in (("grad_weight", grad_weight), ("grad_bias", grad_bias)):
        _check_derived(op, name, spec, y, Partial(), "a column sum over the local rows")
    return _as_given(
        op, y, grad, normalized_shape, weight, bias, rstd, rms, grad_x, grad_weight, grad_bias
    )


@_rule(_ops.cross_entropy_.default)
def _cross_entropy_rule(logits, target, ignore_index, reduction, label_smoothing, losses):
    op = "cross_entropy_"
    _check_overwritten(op, "logits", logits, {len(logits.shape) - 1}, _CLASS_WHY)
    if reduction == ops._REDUCTIONS["mean"] and any(p.is_shard() for p in logits.placements):
        _refuse(
            op,
            'reduction "mean" over sharded rows divides by the global count of valid rows, '
            'which no rank has; use reduction "sum" and divide the loss by that count',
        )
    _check_same(op, "target", target, logits, "logits")
    _check_same(op, "losses", losses, target, "target")
    return _as_given(op, logits, target, ignore_index, reduction, label_smoothing, losses)


@_rule(_ops.rope_.default)
def _rope_rule(x, cos, sin):
    op = "rope_"
    _check_overwritten(op, "x", x, {len(x.shape) - 1}, _ROPE_WHY)
    _check_broadcast(op, "cos", cos, x)
    _check_broadcast(op, "sin", sin, x)
    return _as_given(op, x, cos, sin)


@_rule(_ops.rope_backward.default)
def _rope_backward_rule(grad, cos, sin, grad_x):
    op = "rope_backward"
    _check_overwritten(op, "grad", grad, {len(grad.shape) - 1}, _ROPE_WHY)
    _check_broadcast(op, "cos", cos, grad, "grad")
    _check_broadcast(op, "sin", sin, grad, "grad")
    _check_same(op, "grad_x", grad_x, grad, "grad")
    return _as_given(op, grad, cos, sin, grad_x)


@_rule(_ops.silu_mul_backward_.default)
def _silu_mul_backward_rule(grad, gate, up):
    op = "silu_mul_backward_"
    _check_overwritten(op, "gate", gate, set(), "")
    _check_same(op, "up", up, gate, "gate")
    _check_same(op, "grad", grad, gate, "gate")
    return _as_given(op, grad, gate, up)


# --------------------------------------------------------------------------- buffers


def _local_buffer(x: DTensor, rows: tuple[int, int], dtype, placement_if_sharded) -> DTensor:
    """A 1-D DTensor of rows = (local, global) elements, placed per mesh dim as the rules
    want it."""
    local = torch.empty(rows[0], dtype=dtype, device=x.to_local().device)
    placements = _per_mesh_dim(x, placement_if_sharded)
    return DTensor.from_local(
        local, x.device_mesh, placements, run_check=False, shape=(rows[1],), stride=(1,)
    )


class _DTensorBuffers:
    """ops._PlainBuffers for DTensor: the buffers as DTensors of the local sizes, so that the
    package's norms and cross_entropy_ take DTensors as they are (autograd included). rstd is
    sharded like x's rows; the parameters' gradients of row-sharded inputs are Partial
    (per-rank column sums), as DTensor's own norms give them."""

    @staticmethod
    def rows_times(rows, w):
        # Rows sharded on a dim other than the first cannot be flattened into one matrix
        # without a gather (torch 2.11's DTensor): they are multiplied batched instead.
        if rows.dim() > 2:
            w = w.expand(*rows.shape[:-2], *w.shape)
        return rows @ w

    @staticmethod
    def not_wanted(like):
        return _local_buffer(like, (0, 0), like.dtype, Replicate())

    @staticmethod
    def no_rstd(x):
        return _local_buffer(x, (0, 0), torch.float32, Replicate())

    @staticmethod
    def rstd(x, normalized_shape, dtype):
        n = math.prod(normalized_shape)
        rows = (x.to_local().numel() // n, x.numel() // n) if n else (0, 0)
        return _local_buffer(x, rows, dtype, Shard(0))

    @staticmethod
    def param_grad(y, param):
        local = torch.empty_like(param.to_local(), memory_format=torch.contiguous_format)
        placements = _per_mesh_dim(y, Partial())
        return DTensor.from_local(local, y.device_mesh, placements, run_check=False)

    @staticmethod
    def grad_for(y, grad):
        # The one collective of this module: an output gradient placed unlike y (e.g. Partial
        # from a row-parallel consumer) is brought to y's placements; it is read, not written.
        if tuple(grad.placements) != tuple(y.placements):
            grad = grad.redistribute(y.device_mesh, y.placements)
        return grad

    @staticmethod
    def losses(target, dtype):
        if not isinstance(target, DTensor):
            _refuse("cross_entropy_", "target must be a DTensor placed like logits' rows")
        local = torch.empty(target.to_local().shape, dtype=dtype, device=target.to_local().device)
        return DTensor.from_local(
            local,
            target.device_mesh,
            target.placements,
            run_check=False,
            shape=target.shape,
            stride=target.stride(),
        )

    @staticmethod
    def total(losses, mean: bool):
        local = losses.to_local()
        if mean and local.numel() == 0:
            total = torch.full((), float("nan"), dtype=local.dtype, device=local.device)
        else:
            total = local.sum()
        placements = _per_mesh_dim(losses, Partial())
        return DTensor.from_local(total, losses.device_mesh, placements, run_check=False)


ops._BUFFERS[DTensor] = _DTensorBuffers
