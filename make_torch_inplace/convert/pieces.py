"""What the rewritten graphs call besides the in-place ops themselves: products written over a
dead operand, and attention computed a few heads at a time."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import ops

# matmul_over_left computes its product this many bytes at a time (whole matrices of the
# batch, at least one) into a temporary, then copies it over `a`: the temporary is all the
# memory it allocates, and each piece costs two launches.
_OVER_LEFT_PIECE_BYTES = 2 << 20


def matmul_over_left(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for a contiguous float (..., M, K) `a` that nothing reads afterwards and a
    (..., K, N) `b` with the same batch dims, N <= K: the product, contiguous, written over
    the first elements of a's memory and returned (a view of that memory). A product that is
    one piece is returned as computed instead: copying it over `a` would allocate as much
    (the piece's temporary) and add a launch (host time, which a small model's forward is
    bound by).

    Each piece of matrices i0 .. i1 - 1 is read whole (into the temporary) before its product
    is written, to elements [i0 * M * N, i1 * M * N) of a: since N <= K, inside matrices
    0 .. i1 - 1 of a, which are read by then, and before the matrices still to be read.
    """
    *batch, m, k = a.shape
    n = b.shape[-1]
    if n > k or not a.is_contiguous() or list(b.shape[:-2]) != batch or b.shape[-2] != k:
        raise ValueError(
            f"matmul_over_left: needs a contiguous (..., M, K) a and a (..., K, N) b with the "
            f"same batch dims and N <= K, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    count = math.prod(batch)
    step = max(1, _OVER_LEFT_PIECE_BYTES // max(1, m * n * a.element_size()))
    if step >= count:
        return torch.matmul(a, b)
    a3, b3 = a.view(count, m, k), b.reshape(count, k, n)
    out = a.as_strided((count, m, n), (m * n, n, 1))
    for i0 in range(0, count, step):
        i1 = min(i0 + step, count)
        out[i0:i1].copy_(torch.bmm(a3[i0:i1], b3[i0:i1]))
    return out.view(*batch, m, n)


def square_matmul_over_dead(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    transpose: bool = False,
) -> torch.Tensor:
    """x @ weight (+ bias; x @ weight.T with transpose, F.linear's layout) for an x that nothing
    reads afterwards: square_matmul_ over x where that allocates less than the out-of-place
    product, else the out-of-place product. square_matmul_ computes chunks of rows into at
    most the workspace limit and copies each back; an output within the limit is one chunk,
    for which it allocates the whole output as the out-of-place op does, and adds a copy (a
    launch, and ~10 us of host time that a small model's forward, bound by its host time,
    pays in full) for nothing.
    """
    if x.numel() * x.element_size() > ops.get_workspace_limit():
        return ops.square_matmul_(x, weight, bias, transpose=transpose)
    if transpose:
        return F.linear(x, weight, bias)
    return torch.matmul(x, weight) if bias is None else torch.addmm(bias, x, weight)


def attention_in_pieces(
    q: torch.Tensor,
    k_t: torch.Tensor,
    v: torch.Tensor,
    *,
    log: bool = False,
    over_left: bool = False,
    **softmax_kwargs,
) -> torch.Tensor:
    """softmax(q @ k_t) @ v (log_softmax with log=True; softmax_kwargs: softmax_'s dim,
    scale, mask, causal) for (..., T, d) q, (..., d, S) k_t and (..., S, dv) v with the same
    batch dims, a few matrices of the batch at a time: each piece's scores are computed,
    normalised in place and multiplied into their rows of the (..., T, dv) product. Besides
    the product, one piece of scores is all it allocates: as many whole T x S matrices of the
    last batch dim (attention's heads) as fit in the workspace limit (mti.get_workspace_limit),
    at least one. over_left: where one piece holds every matrix, write the product over the
    scores (matmul_over_left) instead of allocating it; the caller has checked that this is
    safe (see _Rewriter._over_left_ok).
    """
    *batch, t, _ = q.shape
    s = k_t.shape[-1]
    if not batch or list(k_t.shape[:-2]) != batch or list(v.shape[:-1]) != [*batch, s]:
        raise ValueError(
            f"attention_in_pieces: needs (..., T, d) q, (..., d, S) k_t and (..., S, dv) v with "
            f"the same batch dims, got {tuple(q.shape)}, {tuple(k_t.shape)}, {tuple(v.shape)}"
        )
    softmax = ops.log_softmax_ if log else ops.softmax_
    dim = softmax_kwargs.pop("dim", -1)
    dim = dim - q.dim() if dim >= 0 else dim  # the pieces drop the leading batch dims
    mask = softmax_kwargs.pop("mask", None)
    heads = batch[-1]
    matrix_bytes = max(1, t * s * q.element_size())
    step = max(1, min(heads, ops.get_workspace_limit() // matrix_bytes))
    if step == heads and math.prod(batch) == heads and over_left:
        scores = torch.matmul(q, k_t)
        softmax(scores, dim, mask=mask, **softmax_kwargs)
        return matmul_over_left(scores, v)
    if mask is not None:  # as many dims as the scores, to index like them
        mask = mask[(None,) * (q.dim() - mask.dim())]
    out = torch.empty((*batch, t, v.shape[-1]), dtype=q.dtype, device=q.device)
    for outer in itertools.product(*map(range, batch[:-1])):
        for h0 in range(0, heads, step):
            piece = (*outer, slice(h0, h0 + step))
            scores = torch.matmul(q[piece], k_t[piece])
            if mask is not None:  # the same rows of a broadcast mask, which may have size 1
                at = [i if n > 1 else 0 for i, n in zip(outer, mask.shape)]
                at.append(piece[-1] if mask.shape[len(outer)] > 1 else slice(0, 1))
                softmax_kwargs["mask"] = mask[tuple(at)]
            softmax(scores, dim, **softmax_kwargs)
            torch.matmul(scores, v[piece], out=out[piece])
            del scores  # else it lives on while the next piece is made
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (Hugging Face's rotary position embedding, see fuse.py)
    as one op, into a new tensor of x's layout: rope_ over a copy of x. The rewriter runs
    rope_ over x itself where x is dead."""
    return ops.rope_(x.clone(), cos, sin)


def rope_through_views(base: torch.Tensor, steps: tuple, cos: torch.Tensor, sin: torch.Tensor):
    """rope_ written over x = base viewed by `steps`, (method, args) pairs replayed in order
    (a projection's .view(b, s, heads, d).transpose(1, 2)); returns base, whose views the
    caller takes again. Where base requires grad, autograd records the op on base itself: on
    the view x it would record it through CopySlices, whose backward copies base's whole
    gradient, runs the op's backward on an as_strided view of it and copies back. base:
    contiguous; where it is itself a whole view of a contiguous tensor (F.linear's 3-D output
    with a bias views its 2-D product), the op is recorded on that tensor."""
    grads = torch.is_grad_enabled() and (base.requires_grad, cos.requires_grad, sin.requires_grad)
    if grads == (True, False, False):
        root = base._base
        if (
            root is not None
            and root.is_contiguous()
            and root.numel() == base.numel()
            and root.storage_offset() == base.storage_offset()
        ):
            shape = base.shape
            steps = (("view", (shape,)), *steps)
            return _RopeThroughViews.apply(root, steps, cos, sin).view(shape)
        return _RopeThroughViews.apply(base, steps, cos, sin)
    ops.rope_(_viewed(base, steps), cos, sin)  # refuses cos or sin that require grad
    return base


def _viewed(t: torch.Tensor, steps: tuple) -> torch.Tensor:
    for method, args in steps:
        t = getattr(t, method)(*args)
    return t


class _RopeThroughViews(torch.autograd.Function):
    @staticmethod
    def forward(ctx, base, steps, cos, sin):
        ops.rope_(_viewed(base, steps), cos, sin)
        ctx.mark_dirty(base)
        ctx.save_for_backward(cos, sin)
        ctx.steps = steps
        return base

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        # A fresh gradient (grad may be shared with other consumers), contiguous like base, so
        # that the steps view it as they viewed base.
        grad = grad.contiguous()
        grad_base = torch.empty_like(grad)
        torch.ops.make_torch_inplace.rope_backward(
            _viewed(grad, ctx.steps), cos, sin, _viewed(grad_base, ctx.steps)
        )
        return grad_base, None, None, None


def silu_mul(g: torch.Tensor, u: torch.Tensor, consume: bool = False) -> torch.Tensor:
    """F.silu(g) * u (a SwiGLU MLP's gate times its up projection) for g and u of one shape and
    dtype, saving only g and u for the backward, which computes silu(g) again: autograd would
    save silu(g) too, a third tensor of the MLP's width. consume: nothing but this op reads g
    or u after it, nor saves them (the caller checked), so the backward writes their gradients
    over them."""
    return _SiluMul.apply(consume, g, u)


def _silu_mul_value(g, u):
    return F.silu(g).mul_(u)


def _silu_mul_grads(grad, g, u):
    """The gradients of silu(g) * u for g and u: _silu_mul_grads_over on copies of g and u,
    so that they are the same values; in a recorded backward (create_graph), PyTorch's own
    silu backward, which autograd can differentiate."""
    if torch.is_grad_enabled():
        grad_u = F.silu(g).mul_(grad)
        return torch.ops.aten.silu_backward(grad * u, g), grad_u
    g, u = (t.clone(memory_format=torch.contiguous_format) for t in (g, u))
    return _silu_mul_grads_over(grad, g, u)


def _silu_mul_grads_over(grad, g, u):
    """_silu_mul_grads written over g and u (saved tensors that nothing reads after this
    backward) by silu_mul_backward_, one pass with no temporary. A grad that is not contiguous
    is read a piece of rows at a time through a contiguous copy of at most an eighth of the
    workspace limit. g and u: contiguous, of grad's shape and dtype, not sharing memory."""
    if grad.is_contiguous():
        torch.ops.make_torch_inplace.silu_mul_backward_(grad, g, u)
        return g, u
    n = g.shape[-1]
    step = max(1, ops.get_workspace_limit() // (8 * n * g.element_size()))
    g_rows, u_rows, grad_rows = g.view(-1, n), u.view(-1, n), grad.reshape(-1, n)
    for r0 in range(0, g_rows.shape[0], step):
        rows = slice(r0, r0 + step)
        torch.ops.make_torch_inplace.silu_mul_backward_(
            grad_rows[rows].contiguous(), g_rows[rows], u_rows[rows]
        )
    return g, u


def _can_write_over(grad, inputs) -> bool:
    """The inputs can hold their gradients: not a backward that autograd records
    (create_graph), plain tensors (not a subclass such as DTensor, whose local memory this
    does not see), contiguous, of grad's shape and dtype, and sharing no memory with each
    other."""
    return (
        not torch.is_grad_enabled()
        and all(
            type(t) is torch.Tensor
            and t.is_contiguous()
            and t.shape == grad.shape
            and t.dtype == grad.dtype
            for t in inputs
        )
        and len({t.untyped_storage().data_ptr() for t in inputs}) == len(inputs)
    )


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, consume, g, u):
        ctx.save_for_backward(g, u)
        ctx.consume = consume
        return _silu_mul_value(g, u)

    @staticmethod
    def backward(ctx, grad):
        g, u = ctx.saved_tensors
        if ctx.consume and _can_write_over(grad, (g, u)):
            return None, *_silu_mul_grads_over(grad, g, u)
        return None, *_silu_mul_grads(grad, g, u)


@dataclasses.dataclass(frozen=True)
class _Activation:
    """An activation of one or more tensors as the pieces below compute it: value(*inputs);
    value_over, the same written over the inputs (the caller's own); grads(grad, *inputs),
    the inputs' gradients; grads_over, the same written over the inputs."""

    value: Callable
    value_over: Callable
    grads: Callable
    grads_over: Callable


_SILU_MUL = _Activation(
    _silu_mul_value,
    lambda g, u: F.silu(g, inplace=True).mul_(u),
    _silu_mul_grads,
    _silu_mul_grads_over,
)


@functools.cache
def _gelu(approximate: str) -> _Activation:
    def grads(grad, x):
        return (torch.ops.aten.gelu_backward(grad, x, approximate=approximate),)

    def grads_over(grad, x):  # x's gradient over x: no temporary
        gelu_backward = torch.ops.aten.gelu_backward.grad_input
        return (gelu_backward(grad, x, approximate=approximate, grad_input=x),)

    return _Activation(
        lambda x: F.gelu(x, approximate=approximate),
        lambda x: torch.ops.aten.gelu_(x, approximate=approximate),
        grads,
        grads_over,
    )


def linear_of_silu_mul(g, u, weight, bias=None, consume=False):
    """F.linear(silu(g) * u, weight, bias) (a SwiGLU MLP's down projection), saving g and u
    only: the backward computes silu(g) * u again, which autograd would save for the weight's
    gradient. consume: as silu_mul's."""
    return _LinearOfActivation.apply(_SILU_MUL, consume, weight, bias, g, u)


def linear_of_gelu(x, weight, bias=None, approximate="none", consume=False):
    """F.linear(F.gelu(x, approximate=approximate), weight, bias), saving x only: the backward
    computes the GELU again, which autograd would save for the weight's gradient. consume: as
    silu_mul's, for x."""
    return _LinearOfActivation.apply(_gelu(approximate), consume, weight, bias, x)


def _linear_into_new(act, weight, bias):
    """F.linear(act, weight, bias) into a tensor of its own (F.linear of a 3-d input returns a
    view, which autograd does not let later in-place ops write through)."""
    out = act.new_empty((*act.shape[:-1], weight.shape[0]))
    rows, out_rows = act.reshape(-1, act.shape[-1]), out.view(-1, weight.shape[0])
    if bias is None:
        torch.mm(rows, weight.t(), out=out_rows)
    else:
        torch.addmm(bias, rows, weight.t(), out=out_rows)
    return out


def _linear_of_activation_grads(grad, act, weight, inputs, wants, consume):
    """The backward of F.linear(act.value(*inputs), weight, bias): (weight's gradient, bias's,
    the inputs' gradients), each None where `wants` (weight, bias, any input) says it is not
    wanted. The weight's gradient computes the activation again; consume: the inputs'
    gradients may go over them (the caller checked that nothing else reads them)."""
    want_w, want_b, want_inputs = wants
    grad_w = grad_b = None
    rows = grad.reshape(-1, grad.shape[-1])
    if want_w:
        value = act.value(*inputs)
        grad_w = rows.t() @ value.reshape(-1, value.shape[-1])
        del value
    if want_b:
        grad_b = rows.sum(0)
    grad_inputs = [None] * len(inputs)
    if want_inputs:
        grad_act = grad @ weight
        if consume and _can_write_over(grad_act, inputs):
            grad_inputs = act.grads_over(grad_act, *inputs)
        else:
            grad_inputs = act.grads(grad_act, *inputs)
    return grad_w, grad_b, grad_inputs


class _LinearOfActivation(torch.autograd.Function):
    """F.linear(act.value(*inputs), weight, bias), saving the inputs and not the activation;
    consume: the backward writes the inputs' gradients over them, where the caller has checked
    that nothing else reads or saves them."""

    @staticmethod
    def forward(ctx, act, consume, weight, bias, *inputs):
        ctx.save_for_backward(weight, *inputs)
        ctx.act, ctx.consume = act, consume
        ctx.has_bias = bias is not None
        return _linear_into_new(act.value(*inputs), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        weight, *inputs = ctx.saved_tensors
        want_w, want_b, *want_inputs = ctx.needs_input_grad[2:]
        wants = (want_w, want_b and ctx.has_bias, any(want_inputs))
        grad_w, grad_b, grad_inputs = _linear_of_activation_grads(
            grad, ctx.act, weight, inputs, wants, ctx.consume
        )
        return None, None, grad_w, grad_b, *grad_inputs


def swiglu_recomputed(
    x, gate_weight, up_weight, down_weight, gate_bias=None, up_bias=None, down_bias=None
):
    """A SwiGLU MLP, F.linear(silu(g) * u, down_weight, down_bias) with g = F.linear(x,
    gate_weight, gate_bias) and u = F.linear(x, up_weight, up_bias), saving x and the weights
    alone: the backward computes g and u again (two more products) instead of keeping two
    tensors of the MLP's width per token (convert's ``recompute=("mlp",)``)."""
    inner = (gate_weight, gate_bias, up_weight, up_bias)
    return _RecomputedMLP.apply(_SILU_MUL, x, down_weight, down_bias, *inner)


def gelu_mlp_recomputed(
    x, fc_weight, proj_weight, fc_bias=None, proj_bias=None, approximate="none"
):
    """A GELU MLP, F.linear(F.gelu(h, approximate=approximate), proj_weight, proj_bias) with
    h = F.linear(x, fc_weight, fc_bias), saving x and the weights alone: the backward computes
    h again (one more product) instead of keeping a tensor of the MLP's width per token
    (convert's ``recompute=("mlp",)``)."""
    return _RecomputedMLP.apply(_gelu(approximate), x, proj_weight, proj_bias, fc_weight, fc_bias)


class _RecomputedMLP(torch.autograd.Function):
    """F.linear(act.value(*hs), down_weight, down_bias) with hs the linears of x by the
    (weight, bias) pairs in `inner`, saving x and the weights: the backward computes hs again
    and writes their gradients over them (they are its own)."""

    @staticmethod
    def forward(ctx, act, x, down_weight, down_bias, *inner):
        ctx.save_for_backward(x, down_weight, *inner)
        ctx.act = act
        hs = [F.linear(x, w, b) for w, b in zip(inner[::2], inner[1::2])]
        value = act.value_over(*hs)  # over hs: ours, read by nothing else
        del hs
        return _linear_into_new(value, down_weight, down_bias)

    @staticmethod
    def backward(ctx, grad):
        x, down_weight, *inner = ctx.saved_tensors
        want_x, want_wd, want_bd, *want_inner = ctx.needs_input_grad[1:]
        weights, biases = inner[::2], inner[1::2]
        hs = [F.linear(x, w, b) for w, b in zip(weights, biases)]
        grad_wd, grad_bd, grad_hs = _linear_of_activation_grads(
            grad, ctx.act, down_weight, hs, (want_wd, want_bd, True), consume=True
        )
        del hs
        x_rows = x.reshape(-1, x.shape[-1])
        grad_x, grad_inner = None, []
        for (want_w, want_b), w, grad_h in zip(
            zip(want_inner[::2], want_inner[1::2]), weights, grad_hs
        ):
            h_rows = grad_h.reshape(-1, grad_h.shape[-1])
            if want_x:
                grad_x = h_rows @ w if grad_x is None else grad_x.addmm_(h_rows, w)
            grad_inner += [
                h_rows.t() @ x_rows if want_w else None,
                h_rows.sum(0) if want_b else None,
            ]
        if grad_x is not None:
            grad_x = grad_x.view(x.shape)
        return None, grad_x, grad_wd, grad_bd, *grad_inner


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.cross_entropy(F.linear(h, weight).float(), target, ...) for (..., H) h, a (V, H) weight
    and int64 target (...), "mean" or "sum", without the (..., V) logits: rows of them are made
    a piece at a time (at most the workspace limit of them, at least one row), their loss taken
    by cross_entropy_, which leaves their gradient in place, and that gradient multiplied into
    h's and the weight's gradients at once. What autograd keeps is those two gradients (h's
    size, and the weight's, accumulated in its dtype: one rounding per piece), not the logits.
    `logits`: F.linear(h, weight) where the caller has them anyway (the model returns them):
    each piece is a copy of their rows instead of a product, and the loss passes no gradient
    to them (it reaches h and the weight directly), so autograd keeps no copy of them.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"linear_cross_entropy: reduction must be 'mean' or 'sum', got {reduction}"
        )
    return _LinearCrossEntropy.apply(
        h, weight, target, ignore_index, reduction, label_smoothing, logits
    )


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, target, ignore_index, reduction, label_smoothing, logits=None):
        rows, t = h.reshape(-1, h.shape[-1]), target.reshape(-1)
        given = None if logits is None else logits.reshape(-1, logits.shape[-1])
        vocab = weight.shape[0]
        step = max(1, ops.get_workspace_limit() // max(1, vocab * h.element_size()))
        want_h, want_w = ctx.needs_input_grad[:2]
        grad_h = torch.empty_like(rows) if want_h else None
        grad_w = torch.zeros_like(weight) if want_w else None
        # "mean": the loss's sum over the rows whose target is not ignored, divided by their
        # count, and so is each row's gradient.
        scale = 1 / (t != ignore_index).sum() if reduction == "mean" else None
        loss = torch.zeros((), dtype=torch.float64, device=h.device)
        for r0 in range(0, rows.shape[0], step):
            h_r, t_r = rows[r0 : r0 + step], t[r0 : r0 + step]
            piece = h_r @ weight.t() if given is None else given[r0 : r0 + step].clone()
            loss += ops.cross_entropy_(piece, t_r, ignore_index, "sum", label_smoothing)
            if scale is not None:
                piece.mul_(scale.to(piece.dtype))
            if want_h:
                torch.mm(piece, weight, out=grad_h[r0 : r0 + step])
            if want_w:
                grad_w.addmm_(piece.t(), h_r)
            del piece  # else it lives on while the next one is made: twice the limit
        if scale is not None:
            loss = loss * scale
        ctx.save_for_backward(grad_h, grad_w)
        loss = loss.float()  # as F.cross_entropy of float32 logits
        ctx.shape = h.shape
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        # In place: one backward per forward (retain_graph cannot reuse it), as cross_entropy_.
        if grad_h is not None:
            grad_h = grad_h.mul_(grad_loss.to(grad_h.dtype)).view(ctx.shape)
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_loss.to(grad_w.dtype))
        return grad_h, grad_w, None, None, None, None, None
