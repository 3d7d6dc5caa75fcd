"""Functional API: each op writes its result over its first argument and returns it
(cross_entropy_ writes the loss's gradient over the logits and returns the loss).

Everything here sits above the dispatcher ops of ``torch.ops.make_torch_inplace`` (schemas in
csrc/registration.cpp): argument defaults that mirror PyTorch, fake kernels for FakeTensor and
torch.compile, and autograd. PyTorch refuses autograd formulas registered on mutating ops, so
autograd goes through ``torch.autograd.Function`` with ``ctx.mark_dirty``; the backward passes
work from the saved *output*, since the input is gone.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch
from torch.autograd.function import once_differentiable

from . import _C  # noqa: F401  (loading the extension registers the ops)

_ops = torch.ops.make_torch_inplace

DEFAULT_WORKSPACE_LIMIT = 64 << 20
_workspace_limit = DEFAULT_WORKSPACE_LIMIT


# --------------------------------------------------------------------------- workspace limit


def set_workspace_limit(nbytes: int) -> None:
    """Sets how many bytes of scratch memory square_matmul_ may borrow (0: none at all)."""
    global _workspace_limit
    _workspace_limit = _check_workspace_bytes(nbytes)


def get_workspace_limit() -> int:
    return _workspace_limit


@contextlib.contextmanager
def workspace_limit(nbytes: int) -> Iterator[None]:
    """Context manager form of set_workspace_limit; restores the previous limit on exit."""
    previous = _workspace_limit
    set_workspace_limit(nbytes)
    try:
        yield
    finally:
        set_workspace_limit(previous)


def _check_workspace_bytes(nbytes: int) -> int:
    nbytes = int(nbytes)
    if nbytes < 0:
        raise ValueError(f"workspace limit must be >= 0 bytes, got {nbytes}")
    return nbytes


# --------------------------------------------------------------------------- shared helpers


def _needs_autograd(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _check_overwritable(op: str, x: torch.Tensor) -> None:
    # Autograd would refuse this only after the kernel ran, with x already overwritten.
    base = x if x._base is None else x._base
    if torch.is_grad_enabled() and base.is_leaf and base.requires_grad:
        raise RuntimeError(
            f"{op}: x is a leaf tensor that requires grad (or a view of one) and cannot be "
            "overwritten in place; "
            "pass x.clone() or use the out-of-place PyTorch op"
        )


def _normalized_shape(normalized_shape: int | Sequence[int]) -> list[int]:
    if isinstance(normalized_shape, int):
        return [normalized_shape]
    return [int(s) for s in normalized_shape]


def _not_wanted(like: torch.Tensor) -> torch.Tensor:
    """An empty out argument: tells a backward op not to compute that gradient."""
    return _buffers(like).not_wanted(like)


class _PlainBuffers:
    """The tensors an op writes besides x, for plain tensors: a norm's rstd, cross entropy's
    per-row losses and their sum, a backward's gradients (square_matmul_'s: rows_times). A
    tensor subclass whose ops need these as its own kind registers its maker in _BUFFERS
    (make_torch_inplace.distributed: DTensor)."""

    @staticmethod
    def rows_times(rows, w):
        return rows @ w

    @staticmethod
    def not_wanted(like):
        return torch.empty(0, dtype=like.dtype, device=like.device)

    @staticmethod
    def no_rstd(x):
        return torch.empty(0, dtype=torch.float32, device=x.device)

    @staticmethod
    def rstd(x, normalized_shape, dtype):
        n = math.prod(normalized_shape)
        return torch.empty(x.numel() // n if n else 0, dtype=dtype, device=x.device)

    @staticmethod
    def param_grad(y, param):
        return torch.empty_like(param, memory_format=torch.contiguous_format)

    @staticmethod
    def grad_for(y, grad):
        return grad

    @staticmethod
    def losses(target, dtype):
        return torch.empty(target.shape, dtype=dtype, device=target.device)

    @staticmethod
    def total(losses, mean: bool):
        if mean and losses.numel() == 0:
            return torch.full((), float("nan"), dtype=losses.dtype, device=losses.device)
        return losses.sum()


_BUFFERS: dict[type, type] = {}  # tensor subclass -> its buffers' maker


def _buffers(x: torch.Tensor):
    return _BUFFERS.get(type(x), _PlainBuffers)


# --------------------------------------------------------------------------- square matmul


def square_matmul_(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    transpose: bool = False,
    workspace_bytes: int | None = None,
) -> torch.Tensor:
    """x[..., K] <- x @ weight (+ bias); x @ weight.T with transpose=True. weight is (K, K).

    Scratch memory is bounded by workspace_bytes (default: the global workspace limit); with 0,
    with room for chunks of fewer than 8 rows on CUDA (cuBLAS is less accurate on so few), or
    when the workspace cannot be allocated, a kernel that needs none is used. On the CPU that
    kernel copies blocks of at most 128 rows aside before overwriting them: at most 128 x K
    elements per thread (twice that where x's rows are not one strided matrix).
    """
    ws = _workspace_limit if workspace_bytes is None else _check_workspace_bytes(workspace_bytes)
    # _needs_autograd spelled out: for a small x this wrapper's Python work is a noticeable
    # part of the call, and under no_grad/inference_mode one check is all it costs.
    if torch.is_grad_enabled():
        if weight.requires_grad:
            raise RuntimeError(
                "square_matmul_: weight requires grad, but its gradient needs the input x, which "
                "this op overwrites. Freeze the weight (weight.requires_grad_(False)), run under "
                "torch.no_grad()/inference_mode(), or use the out-of-place x @ weight / F.linear"
            )
        if x.requires_grad or (bias is not None and bias.requires_grad):
            _check_overwritable("square_matmul_", x)
            return _SquareMatmul.apply(x, weight, bias, transpose, ws)
    _ops.square_matmul_(x, weight, bias, transpose, ws)
    return x


def linear_(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    workspace_bytes: int | None = None,
) -> torch.Tensor:
    """x <- F.linear(x, weight, bias) for a square weight (nn.Linear's (out, in) layout);
    workspace_bytes as for square_matmul_."""
    return square_matmul_(x, weight, bias, transpose=True, workspace_bytes=workspace_bytes)


class _SquareMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, transpose, workspace_bytes):
        _ops.square_matmul_(x, weight, bias, transpose, workspace_bytes)
        ctx.mark_dirty(x)
        ctx.save_for_backward(weight)
        ctx.transpose = transpose
        return x

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            # y = x @ W  ->  dx = dy @ W.T;   y = x @ W.T  ->  dx = dy @ W
            grad_x = _buffers(grad).rows_times(grad, weight if ctx.transpose else weight.T)
        if ctx.needs_input_grad[2]:
            grad_bias = grad.sum(tuple(range(grad.dim() - 1))) if grad.dim() > 1 else grad
        return grad_x, None, grad_bias, None, None


# --------------------------------------------------------------------------- softmax


def softmax_(
    x: torch.Tensor,
    dim: int = -1,
    *,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """x <- softmax(x * scale + mask) over dim, in place.

    mask: bool (True = takes part, as in scaled_dot_product_attention) or x's dtype (added),
    broadcastable to x; any other dtype raises before x is written (convert it yourself).
    causal=True keeps element (i, j) of the last two dims only where j <= i (dim must be -1).
    A row in which nothing takes part becomes all zeros.
    """
    return _softmax("softmax_", x, dim, scale, mask, causal, log=False)


def log_softmax_(
    x: torch.Tensor,
    dim: int = -1,
    *,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """x <- log_softmax(x * scale + mask) over dim, in place. Masked elements become -inf;
    a row in which nothing takes part becomes all zeros."""
    return _softmax("log_softmax_", x, dim, scale, mask, causal, log=True)


def _softmax(op, x, dim, scale, mask, causal, log):
    scale = 1.0 if scale is None else float(scale)
    if _needs_autograd(x, mask):
        _check_overwritable(op, x)
        return _Softmax.apply(x, dim, scale, mask, causal, log)
    _ops.softmax_(x, dim, scale, mask, causal, log)
    return x


def _active_elements(y: torch.Tensor, mask: torch.Tensor | None, causal: bool):
    """Bool tensor, True where an element took part in the softmax (None: all did)."""
    active = None
    if mask is not None:
        active = mask if mask.dtype == torch.bool else mask != float("-inf")
    if causal:
        q, k = y.shape[-2], y.shape[-1]
        tril = torch.ones(q, k, dtype=torch.bool, device=y.device).tril()
        active = tril if active is None else active & tril
    return active


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, scale, mask, causal, log):
        _ops.softmax_(x, dim, scale, mask, causal, log)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, mask)
        ctx.dim, ctx.scale, ctx.causal, ctx.log = dim, scale, causal, log
        return x

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        y, mask = ctx.saved_tensors
        grad_x = grad_mask = None
        if ctx.needs_input_grad[0]:
            # A fresh tensor: grad may be shared with other consumers and y saved by other ops.
            grad_x = torch.empty_like(y)
            _ops.softmax_backward(y, grad, ctx.dim, ctx.scale, mask, ctx.causal, ctx.log, grad_x)
        if ctx.needs_input_grad[3]:
            grad_mask = _softmax_grad_z(ctx, y, grad, mask).sum_to_size(mask.shape)
            grad_mask = grad_mask.to(mask.dtype)
        return grad_x, None, None, grad_mask, None, None


def _softmax_grad_z(ctx, y, grad, mask):
    """The gradient w.r.t. the logits z = x * scale + mask, in float32 (float64 for float64),
    composed of PyTorch ops (only an additive mask that requires grad needs it;
    softmax_backward computes grad_x)."""
    acc = torch.promote_types(y.dtype, torch.float32)
    ya, ga = y.to(acc), grad.to(acc)
    if ctx.log:
        grad_z = ga - ya.exp() * ga.sum(ctx.dim, keepdim=True)
    else:
        grad_z = ya * (ga - (ga * ya).sum(ctx.dim, keepdim=True))
    active = _active_elements(y, mask, ctx.causal)
    if active is not None:
        # Masked elements (and whole masked rows, which are constant zeros) have no
        # gradient; log_softmax's formula alone would give them one.
        grad_z = grad_z.masked_fill(~active, 0.0)
    return grad_z


# --------------------------------------------------------------------------- norms


def layer_norm_(
    x: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """x <- F.layer_norm(x, normalized_shape, weight, bias, eps), in place.

    The backward pass recovers x_hat = (y - bias) / weight from the output, so gradients lose
    precision where |weight| is tiny (relative error ~ dtype eps * |y - bias| / |weight|) and
    are not defined where weight is exactly 0.
    """
    shape = _normalized_shape(normalized_shape)
    if _needs_autograd(x, weight, bias):
        _check_overwritable("layer_norm_", x)
        return _Norm.apply(x, shape, weight, bias, float(eps), False)
    _ops.layer_norm_(x, shape, weight, bias, float(eps), _no_rstd(x))
    return x


def rms_norm_(
    x: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    """x <- F.rms_norm(x, normalized_shape, weight, eps), in place. eps=None means what it
    means in F.rms_norm: the eps of the type the row is computed in (float32's for float16,
    bfloat16 and float32 inputs, float64's for float64). Backward precision as for
    layer_norm_."""
    shape = _normalized_shape(normalized_shape)
    if eps is None:
        eps = torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps
    if _needs_autograd(x, weight):
        _check_overwritable("rms_norm_", x)
        return _Norm.apply(x, shape, weight, None, float(eps), True)
    _ops.rms_norm_(x, shape, weight, float(eps), _no_rstd(x))
    return x


def _no_rstd(x: torch.Tensor) -> torch.Tensor:
    # An empty rstd tells the kernel not to save row statistics (inference needs none).
    return _buffers(x).no_rstd(x)


def _rstd_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of the rstd the norms save (csrc/common/plans.h: rstd_dtype): float64 for a
    float64 x on CUDA, so that its gradients keep float64's accuracy; float32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 and x.device.type == "cuda" else torch.float32


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shape, weight, bias, eps, rms):
        rstd = _buffers(x).rstd(x, shape, _rstd_dtype(x))
        if rms:
            _ops.rms_norm_(x, shape, weight, eps, rstd)
        else:
            _ops.layer_norm_(x, shape, weight, bias, eps, rstd)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, weight, bias, rstd)
        ctx.shape, ctx.rms = shape, rms
        return x

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        y, weight, bias, rstd = ctx.saved_tensors
        want_x = ctx.needs_input_grad[0]
        want_w = weight is not None and ctx.needs_input_grad[2]
        want_b = bias is not None and ctx.needs_input_grad[3]
        # Fresh tensors, as PyTorch's backward allocates: grad may be shared with other
        # consumers and y saved by other ops.
        buffers = _buffers(y)
        grad = buffers.grad_for(y, grad)
        grad_x = torch.empty_like(y) if want_x else _not_wanted(y)
        grad_w = buffers.param_grad(y, weight) if want_w else _not_wanted(y)
        grad_b = buffers.param_grad(y, bias) if want_b else _not_wanted(y)
        _ops.norm_backward(y, grad, ctx.shape, weight, bias, rstd, ctx.rms, grad_x, grad_w, grad_b)
        return (
            grad_x if want_x else None,
            None,
            grad_w if want_w else None,
            grad_b if want_b else None,
            None,
            None,
        )


# --------------------------------------------------------------------------- cross entropy

_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}  # at::Reduction's values


def cross_entropy_(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """The loss of F.cross_entropy(logits.float(), target, ...) with the classes in the last dim
    of logits (..., V) and int64 class indices target (...); logits is overwritten with the
    gradient of that loss w.r.t. logits, in logits' dtype.

    Math in float32 (float64 for float64 logits); the loss is float32 (float64). reduction
    "none" returns the per-row losses (target's shape) and leaves each row's own gradient
    (softmax - onehot, smoothed); "sum" and "mean" a scalar, and the gradient of that scalar
    ("mean": divided by the number of rows whose target is not ignore_index). Rows with target
    ignore_index get loss 0 and gradient 0. Under autograd the backward multiplies the
    overwritten logits by the output gradient in place (it makes no new logits-sized tensor):
    one backward per forward, retain_graph cannot reuse it. Out-of-range targets raise before
    logits is written (on CUDA, a device-side assert: see docs/design.md).
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{reduction} is not a valid value for reduction")
    code, smoothing = _REDUCTIONS[reduction], float(label_smoothing)
    if _needs_autograd(logits):
        _check_overwritable("cross_entropy_", logits)
        loss, _ = _CrossEntropy.apply(logits, target, int(ignore_index), code, smoothing)
        return loss
    return _cross_entropy(logits, target, int(ignore_index), code, smoothing)


def _cross_entropy(logits, target, ignore_index, code, smoothing):
    # Mean mode scales each row by 1 / (valid rows), so the loss is always the losses' sum.
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    buffers = _buffers(logits)
    losses = buffers.losses(target, dtype)
    _ops.cross_entropy_(logits, target, ignore_index, code, smoothing, losses)
    if code == _REDUCTIONS["none"]:
        return losses
    return buffers.total(losses, code == _REDUCTIONS["mean"])


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, code, smoothing):
        loss = _cross_entropy(logits, target, ignore_index, code, smoothing)
        # logits now holds the gradient: an output (autograd requires dirty tensors to be),
        # but not a differentiable one.
        ctx.mark_dirty(logits)
        ctx.mark_non_differentiable(logits)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits)
        ctx.per_row, ctx.consumed = code == _REDUCTIONS["none"], False
        return loss, logits

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_logits):
        if ctx.consumed:
            raise RuntimeError(
                "cross_entropy_: backward ran twice through one call; its saved gradient was "
                "scaled in place by the first (retain_graph is not supported)"
            )
        ctx.consumed = True
        if grad_loss is None:
            return None, None, None, None, None
        (grad,) = ctx.saved_tensors
        # In place: the forward's gradient times the output gradient, no second logits buffer.
        grad.mul_(grad_loss.unsqueeze(-1) if ctx.per_row else grad_loss)
        return grad, None, None, None, None


# --------------------------------------------------------------------------- rotary embedding


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x <- x * cos + rotate_half(x) * sin (Hugging Face Llama's apply_rotary_pos_emb for one
    tensor), in place: with x1, x2 the two halves of x's last dim D and c1, c2 / s1, s2 those
    of cos / sin, x1 <- x1 * c1 - x2 * s1 and x2 <- x2 * c2 + x1 * s2, computed in float32
    (float64 for float64) and rounded once to x's dtype.

    x: float16, bfloat16, float32 or float64, D even, x.stride(-1) == 1, any other strides (a
    transposed view of q, say, written where it lies, without a copy). cos, sin: x's dtype and
    device, last dim D with stride 1, broadcastable to x's shape ((seq, D), (b, 1, seq, D),
    ...), not overlapping x. Under autograd only cos and sin are saved; the backward makes a
    new gradient tensor (the incoming gradient is left as it is). cos and sin that require
    grad are refused under autograd: their gradients need x, which this op overwrites.
    """
    if torch.is_grad_enabled():
        if cos.requires_grad or sin.requires_grad:
            raise RuntimeError(
                "rope_: cos or sin requires grad, but their gradients need the input x, which "
                "this op overwrites. Detach them (cos.detach()), run under torch.no_grad(), or "
                "use the out-of-place x * cos + rotate_half(x) * sin"
            )
        if x.requires_grad:
            _check_overwritable("rope_", x)
            return _Rope.apply(x, cos, sin)
    _ops.rope_(x, cos, sin)
    return x


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        _ops.rope_(x, cos, sin)
        ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin)
        return x

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        # A fresh tensor: grad may be shared with other consumers. In grad's layout where its
        # rows have stride 1 (as the op wants them; empty_like makes an expanded grad's
        # contiguous), else contiguous.
        if grad.shape[-1] <= 1 or grad.stride(-1) == 1:
            grad_x = torch.empty_like(grad)
        else:
            grad_x = torch.empty_like(grad, memory_format=torch.contiguous_format)
        _ops.rope_backward(grad, cos, sin, grad_x)
        return grad_x, None, None


# --------------------------------------------------------------------------- fake kernels
# The ops return nothing and only write their Tensor(a!) arguments (x and rstd, or the
# gradients), so their fake kernels have nothing to compute; they exist so FakeTensor and
# torch.compile can trace the ops, and they refuse a mask of another dtype as the ops do.


@torch.library.register_fake("make_torch_inplace::square_matmul_")
def _square_matmul_fake(x, weight, bias, transpose, workspace_bytes):
    return None


def _check_mask_dtype(op: str, x_name: str, x: torch.Tensor, mask: torch.Tensor | None) -> None:
    # The rule the C++ checks enforce, for fake tensors, which never reach them.
    if mask is not None and mask.dtype not in (torch.bool, x.dtype):
        raise RuntimeError(
            f"{op}: mask must be bool or {x_name}'s dtype ({x.dtype}), got {mask.dtype}"
        )


@torch.library.register_fake("make_torch_inplace::softmax_")
def _softmax_fake(x, dim, scale, mask, causal, log):
    _check_mask_dtype("log_softmax_" if log else "softmax_", "x", x, mask)
    return None


@torch.library.register_fake("make_torch_inplace::layer_norm_")
def _layer_norm_fake(x, normalized_shape, weight, bias, eps, rstd):
    return None


@torch.library.register_fake("make_torch_inplace::rms_norm_")
def _rms_norm_fake(x, normalized_shape, weight, eps, rstd):
    return None


@torch.library.register_fake("make_torch_inplace::softmax_backward")
def _softmax_backward_fake(y, grad, dim, scale, mask, causal, log, grad_x):
    _check_mask_dtype("softmax_backward", "y", y, mask)
    return None


@torch.library.register_fake("make_torch_inplace::norm_backward")
def _norm_backward_fake(
    y, grad, normalized_shape, weight, bias, rstd, rms, grad_x, grad_weight, grad_bias
):
    return None


@torch.library.register_fake("make_torch_inplace::cross_entropy_")
def _cross_entropy_fake(logits, target, ignore_index, reduction, label_smoothing, losses):
    return None


def _check_rope_tables(op: str, x_name: str, x: torch.Tensor, cos, sin) -> None:
    # The dtype rule the C++ checks enforce, for fake tensors, which never reach them.
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != x.dtype:
            raise RuntimeError(
                f"{op}: {name} must have {x_name}'s dtype ({x.dtype}), got {t.dtype}"
            )


@torch.library.register_fake("make_torch_inplace::rope_")
def _rope_fake(x, cos, sin):
    _check_rope_tables("rope_", "x", x, cos, sin)
    return None


@torch.library.register_fake("make_torch_inplace::rope_backward")
def _rope_backward_fake(grad, cos, sin, grad_x):
    _check_rope_tables("rope_backward", "grad", grad, cos, sin)
    return None


@torch.library.register_fake("make_torch_inplace::silu_mul_backward_")
def _silu_mul_backward_fake(grad, gate, up):
    # The dtype and shape rules the C++ checks enforce, for fake tensors, which never reach them.
    for name, t in (("up", up), ("grad", grad)):
        if t.dtype != gate.dtype or t.shape != gate.shape:
            raise RuntimeError(
                f"silu_mul_backward_: {name} must have gate's dtype and shape "
                f"({gate.dtype}, {tuple(gate.shape)}), got {t.dtype}, {tuple(t.shape)}"
            )
    return None
