"""Bad input: each case must raise the error PyTorch would raise (RuntimeError, ValueError,
IndexError) with a message naming the problem, and leave x bit-identical (all checks run
before the first byte of x is written)."""

import pytest
import torch
from helpers import DEVICES, Untouched, check_op, randn, ref_linear, requires_cuda

import make_torch_inplace as mti

_ops = torch.ops.make_torch_inplace
F32 = torch.float32


def rand(*shape, device, dtype=F32, seed=0):
    return randn(shape, dtype, device, seed)


def int_tensor(*shape, device):
    return torch.arange(torch.Size(shape).numel(), device=device).reshape(shape).to(torch.int32)


# Each case builds its inputs on `device` and returns (x, call, expected error, message regex).
# `call` runs the op; x is the tensor it must leave untouched.


def _matmul_nonsquare(d):
    x = rand(4, 8, device=d)
    return x, lambda: mti.square_matmul_(x, rand(8, 4, device=d)), RuntimeError, "square"


def _linear_nonsquare(d):
    x = rand(4, 8, device=d)
    return x, lambda: mti.linear_(x, rand(4, 8, device=d)), RuntimeError, "square"


def _matmul_k_mismatch(d):
    x = rand(4, 8, device=d)
    return x, lambda: mti.square_matmul_(x, rand(16, 16, device=d)), RuntimeError, "last dim"


def _matmul_weight_dtype(d):
    x = rand(4, 8, device=d)
    w = rand(8, 8, device=d, dtype=torch.bfloat16)
    return x, lambda: mti.square_matmul_(x, w), RuntimeError, "weight.*dtype"


def _matmul_bias_dtype(d):
    x = rand(4, 8, device=d, dtype=torch.float16)
    w = rand(8, 8, device=d, dtype=torch.float16)
    b = rand(8, device=d)
    return x, lambda: mti.square_matmul_(x, w, b), RuntimeError, "bias.*dtype"


def _matmul_bias_shape(d):
    x = rand(4, 8, device=d)
    return (
        x,
        lambda: mti.square_matmul_(x, rand(8, 8, device=d), rand(1, 8, device=d)),
        RuntimeError,
        "bias must have shape",
    )


def _matmul_bias_length(d):
    x = rand(4, 8, device=d)
    return (
        x,
        lambda: mti.square_matmul_(x, rand(8, 8, device=d), rand(9, device=d)),
        RuntimeError,
        "bias must have shape",
    )


def _matmul_int(d):
    x = int_tensor(4, 8, device=d)
    return x, lambda: mti.square_matmul_(x, int_tensor(8, 8, device=d)), RuntimeError, "float"


def _matmul_x_is_weight(d):
    w = rand(8, 8, device=d)
    return w, lambda: mti.square_matmul_(w, w), RuntimeError, "overlaps weight"


def _matmul_x_views_weight(d):
    w = rand(8, 8, device=d)
    x = w[2:5]
    return x, lambda: mti.square_matmul_(x, w), RuntimeError, "overlaps weight"


def _matmul_x_overlaps_bias(d):
    big = rand(5, 8, device=d)
    return (
        big,
        lambda: mti.square_matmul_(big, rand(8, 8, device=d), big[2]),
        RuntimeError,
        "overlaps bias",
    )


def _matmul_expanded_x(d):
    x = rand(1, 8, device=d).expand(4, 8)
    return x, lambda: mti.square_matmul_(x, rand(8, 8, device=d)), RuntimeError, "overlapping"


def _matmul_transposed_x(d):
    # Columns strided: refused (rows may be strided, elements within a row may not).
    x = rand(8, 4, device=d).t()
    return x, lambda: mti.square_matmul_(x, rand(8, 8, device=d)), ValueError, "stride 1"


def _matmul_negative_workspace(d):
    x = rand(4, 8, device=d)
    return (
        x,
        lambda: mti.square_matmul_(x, rand(8, 8, device=d), workspace_bytes=-1),
        ValueError,
        "workspace",
    )


def _matmul_scalar_x(d):
    x = rand(device=d)
    return x, lambda: mti.square_matmul_(x, rand(1, 1, device=d)), RuntimeError, "dim"


def _softmax_int(d):
    x = int_tensor(4, 5, device=d)
    return x, lambda: mti.softmax_(x), RuntimeError, "float"


def _log_softmax_dim_out_of_range(d):
    x = rand(4, 5, device=d)
    return x, lambda: mti.log_softmax_(x, dim=2), IndexError, "range"


def _softmax_dim_out_of_range_negative(d):
    x = rand(4, 5, device=d)
    return x, lambda: mti.softmax_(x, dim=-3), IndexError, "range"


def _softmax_mask_not_broadcastable(d):
    x = rand(4, 5, device=d)
    return (
        x,
        lambda: mti.softmax_(x, mask=torch.ones(3, dtype=torch.bool, device=d)),
        RuntimeError,
        "broadcast",
    )


def _softmax_mask_more_dims(d):
    x = rand(4, 5, device=d)
    return (
        x,
        lambda: mti.softmax_(x, mask=torch.ones(2, 4, 5, dtype=torch.bool, device=d)),
        RuntimeError,
        "broadcast",
    )


def _softmax_mask_int(d):
    x = rand(4, 5, device=d)
    return x, lambda: mti.softmax_(x, mask=int_tensor(4, 5, device=d)), RuntimeError, "mask"


def _softmax_mask_other_float_dtype(d):
    # A mask is bool or exactly x's dtype, as scaled_dot_product_attention has it: no silent
    # copy of the mask in x's dtype.
    x = rand(4, 5, device=d)
    m = rand(4, 5, device=d, dtype=torch.float16)
    return x, lambda: mti.softmax_(x, mask=m), RuntimeError, "mask must be bool or x's dtype"


def _log_softmax_mask_float64_for_bf16(d):
    x = rand(4, 5, device=d, dtype=torch.bfloat16)
    m = rand(5, device=d, dtype=torch.float64)
    return x, lambda: mti.log_softmax_(x, mask=m), RuntimeError, "mask must be bool or x's dtype"


def _softmax_mask_other_dtype_autograd(d):
    # Through the autograd Function: x is a non-leaf that requires grad.
    x = rand(4, 5, device=d).requires_grad_() * 1
    m = rand(4, 5, device=d, dtype=torch.float64)
    return x, lambda: mti.softmax_(x, mask=m), RuntimeError, "mask must be bool or x's dtype"


def _softmax_mask_other_dtype_compiled(d):
    # Under torch.compile the fake kernel refuses it while tracing, before anything runs.
    x = rand(4, 5, device=d)
    m = rand(4, 5, device=d, dtype=torch.float16)
    fn = torch.compile(lambda x, m: mti.softmax_(x, mask=m), backend="aot_eager", fullgraph=True)
    return x, lambda: fn(x, m), RuntimeError, "mask must be bool or x's dtype"


def _softmax_backward_mask_other_dtype(d):
    y = rand(4, 5, device=d)
    m = rand(5, device=d, dtype=torch.float16)
    grad_x = torch.zeros_like(y)
    return (
        grad_x,
        lambda: _ops.softmax_backward(y, rand(4, 5, device=d), -1, 1.0, m, False, False, grad_x),
        RuntimeError,
        "mask must be bool or y's dtype",
    )


def _softmax_mask_is_x(d):
    x = rand(4, 5, device=d)
    return x, lambda: mti.softmax_(x, mask=x), RuntimeError, "overlaps mask"


def _softmax_mask_views_x(d):
    x = rand(4, 5, device=d)
    return x, lambda: mti.softmax_(x, mask=x[1]), RuntimeError, "overlaps mask"


def _softmax_expanded_x(d):
    x = rand(1, 5, device=d).expand(4, 5)
    return x, lambda: mti.softmax_(x), RuntimeError, "overlapping"


def _softmax_causal_dim0(d):
    x = rand(4, 5, device=d)
    return x, lambda: mti.softmax_(x, dim=0, causal=True), ValueError, "causal"


def _log_softmax_causal_1d(d):
    x = rand(5, device=d)
    return x, lambda: mti.log_softmax_(x, causal=True), ValueError, "causal"


def _softmax_too_many_strided_groups(d):
    # Nine leading dims of size 2 taken from size-3 dims: no two merge, and the row indexer
    # holds at most eight groups.
    x = rand(*([3] * 9), 4, device=d)[(slice(0, 2),) * 9]
    return x, lambda: mti.softmax_(x), ValueError, "contiguous"


def _layer_norm_shape_mismatch(d):
    x = rand(4, 6, device=d)
    return x, lambda: mti.layer_norm_(x, (5,)), RuntimeError, "normalized_shape"


def _layer_norm_shape_too_long(d):
    x = rand(4, 6, device=d)
    return x, lambda: mti.layer_norm_(x, (2, 4, 6)), RuntimeError, "normalized_shape"


def _rms_norm_empty_shape(d):
    x = rand(4, 6, device=d)
    return x, lambda: mti.rms_norm_(x, ()), RuntimeError, "normalized_shape"


def _layer_norm_weight_shape(d):
    x = rand(4, 6, device=d)
    return x, lambda: mti.layer_norm_(x, (6,), rand(5, device=d)), RuntimeError, "weight"


def _layer_norm_bias_shape(d):
    x = rand(4, 6, device=d)
    return (
        x,
        lambda: mti.layer_norm_(x, (6,), rand(6, device=d), rand(1, 6, device=d)),
        RuntimeError,
        "bias",
    )


def _rms_norm_weight_shape(d):
    x = rand(2, 4, 6, device=d)
    return x, lambda: mti.rms_norm_(x, (4, 6), rand(24, device=d)), RuntimeError, "weight"


def _layer_norm_weight_dtype(d):
    x = rand(4, 6, device=d, dtype=torch.bfloat16)
    return x, lambda: mti.layer_norm_(x, (6,), rand(6, device=d)), RuntimeError, "dtype"


def _rms_norm_weight_dtype(d):
    x = rand(4, 6, device=d)
    w = rand(6, device=d, dtype=torch.float16)
    return x, lambda: mti.rms_norm_(x, (6,), w), RuntimeError, "dtype"


def _layer_norm_int(d):
    x = int_tensor(4, 6, device=d)
    return x, lambda: mti.layer_norm_(x, (6,)), RuntimeError, "float"


def _rms_norm_int(d):
    x = int_tensor(4, 6, device=d)
    return x, lambda: mti.rms_norm_(x, (6,)), RuntimeError, "float"


def _layer_norm_weight_views_x(d):
    x = rand(4, 6, device=d)
    return x, lambda: mti.layer_norm_(x, (6,), x[0]), RuntimeError, "overlaps weight"


def _rms_norm_expanded_x(d):
    x = rand(1, 6, device=d).expand(4, 6)
    return x, lambda: mti.rms_norm_(x, (6,)), RuntimeError, "overlapping"


def _layer_norm_dims_do_not_merge(d):
    # x is (4, 5, 6) with strides (30, 1, 5): the normalized (5, 6) are not one strided dim.
    x = rand(4, 6, 5, device=d).transpose(1, 2)
    return x, lambda: mti.layer_norm_(x, (5, 6)), ValueError, "merge"


def _layer_norm_rstd_wrong_size(d):
    x = rand(4, 6, device=d)
    rstd = torch.zeros(3, device=d)
    return x, lambda: _ops.layer_norm_(x, [6], None, None, 1e-5, rstd), RuntimeError, "rstd"


def _rms_norm_rstd_wrong_dtype(d):
    x = rand(4, 6, device=d)
    rstd = torch.zeros(4, device=d, dtype=torch.float16)
    return x, lambda: _ops.rms_norm_(x, [6], None, 1e-5, rstd), RuntimeError, "rstd"


def _layer_norm_rstd_overlaps_x(d):
    x = rand(4, 6, device=d)
    rstd = x[0, :4]
    return (
        x,
        lambda: _ops.layer_norm_(x, [6], None, None, 1e-5, rstd),
        RuntimeError,
        "overlaps rstd",
    )


def _xent_target(*shape, device, v=10):
    return torch.arange(torch.Size(shape).numel(), device=device).reshape(shape) % v


def _xent_target_int32(d):
    x = rand(4, 10, device=d)
    t = _xent_target(4, device=d).to(torch.int32)
    return x, lambda: mti.cross_entropy_(x, t), RuntimeError, "target must hold int64"


def _xent_target_probabilities(d):
    x = rand(4, 10, device=d)
    return x, lambda: mti.cross_entropy_(x, rand(4, 10, device=d)), RuntimeError, "int64"


def _xent_target_shape(d):
    x = rand(2, 3, 10, device=d)
    t = _xent_target(6, device=d)
    return x, lambda: mti.cross_entropy_(x, t), RuntimeError, "target must have logits' shape"


def _xent_target_out_of_bounds(d):
    # CPU only: CUDA checks target values on the device (test_cross_entropy.py).
    x = rand(4, 10, device=d)
    t = torch.tensor([1, 2, 10, 3], device=d)
    return x, lambda: mti.cross_entropy_(x, t), IndexError, "target 10 \\(row 2\\) is out of bounds"


def _xent_target_negative(d):
    x = rand(4, 10, device=d)
    t = torch.tensor([1, -1, 2, 3], device=d)
    return x, lambda: mti.cross_entropy_(x, t), IndexError, "target -1 .*not ignore_index"


def _xent_int_logits(d):
    x = int_tensor(4, 10, device=d)
    return x, lambda: mti.cross_entropy_(x, _xent_target(4, device=d)), RuntimeError, "float"


def _xent_scalar_logits(d):
    x = rand(device=d)
    t = torch.tensor(0, device=d)
    return x, lambda: mti.cross_entropy_(x, t), RuntimeError, "class dim"


def _xent_transposed_logits(d):
    x = rand(10, 4, device=d).t()
    return x, lambda: mti.cross_entropy_(x, _xent_target(4, device=d)), ValueError, "stride 1"


def _xent_expanded_logits(d):
    x = rand(1, 10, device=d).expand(4, 10)
    t = _xent_target(4, device=d)
    return x, lambda: mti.cross_entropy_(x, t), RuntimeError, "overlapping"


def _xent_bad_reduction(d):
    x = rand(4, 10, device=d)
    t = _xent_target(4, device=d)
    return x, lambda: mti.cross_entropy_(x, t, reduction="avg"), ValueError, "reduction"


def _xent_label_smoothing_out_of_range(d):
    x = rand(4, 10, device=d)
    t = _xent_target(4, device=d)
    return (
        x,
        lambda: mti.cross_entropy_(x, t, label_smoothing=1.5),
        RuntimeError,
        "label_smoothing must be between",
    )


def _xent_leaf_requires_grad(d):
    x = rand(4, 10, device=d).requires_grad_()
    t = _xent_target(4, device=d)
    return x, lambda: mti.cross_entropy_(x, t), RuntimeError, "leaf tensor that requires grad"


def _xent_losses_wrong_dtype(d):
    x = rand(4, 10, device=d, dtype=torch.float64)
    t = _xent_target(4, device=d)
    losses = torch.empty(4, device=d)
    return x, lambda: _ops.cross_entropy_(x, t, -100, 1, 0.0, losses), RuntimeError, "losses"


def _xent_losses_overlap_logits(d):
    x = rand(4, 10, device=d)
    t = _xent_target(4, device=d)
    return (
        x,
        lambda: _ops.cross_entropy_(x, t, -100, 1, 0.0, x[0, :4]),
        RuntimeError,
        "losses overlaps logits",
    )


def _xent_empty_classes(d):
    x = rand(4, 0, device=d)
    t = _xent_target(4, device=d)
    return x, lambda: mti.cross_entropy_(x, t), RuntimeError, "class dim must not be empty"


def _rope_tables(*shape, device):
    return rand(*shape, device=device, seed=1), rand(*shape, device=device, seed=2)


def _rope_int(d):
    x = int_tensor(2, 3, 8, device=d)
    c = int_tensor(3, 8, device=d)
    return x, lambda: mti.rope_(x, c, c), RuntimeError, "rope_: x must be float32"


def _rope_scalar_x(d):
    x = rand(device=d)
    return x, lambda: mti.rope_(x, rand(1, device=d), rand(1, device=d)), RuntimeError, "one dim"


def _rope_odd_dim(d):
    x = rand(2, 3, 5, device=d)
    cos, sin = _rope_tables(3, 5, device=d)
    return x, lambda: mti.rope_(x, cos, sin), ValueError, "last dim must be even"


def _rope_transposed_x(d):
    x = rand(2, 8, 4, device=d).transpose(1, 2)
    cos, sin = _rope_tables(4, 8, device=d)
    return x, lambda: mti.rope_(x, cos, sin), ValueError, "x's last dim must have stride 1"


def _rope_expanded_x(d):
    x = rand(1, 3, 8, device=d).expand(2, 3, 8)
    cos, sin = _rope_tables(3, 8, device=d)
    return x, lambda: mti.rope_(x, cos, sin), RuntimeError, "overlapping"


def _rope_cos_dtype(d):
    x = rand(2, 3, 8, device=d)
    cos = rand(3, 8, device=d, dtype=torch.bfloat16)
    sin = rand(3, 8, device=d)
    return x, lambda: mti.rope_(x, cos, sin), RuntimeError, "cos must have x's dtype"


def _rope_sin_dtype(d):
    x = rand(2, 3, 8, device=d, dtype=torch.float16)
    cos = rand(3, 8, device=d, dtype=torch.float16)
    sin = rand(3, 8, device=d, dtype=torch.float64)
    return x, lambda: mti.rope_(x, cos, sin), RuntimeError, "sin must have x's dtype"


def _rope_cos_last_dim(d):
    x = rand(2, 3, 8, device=d)
    cos, sin = rand(3, 4, device=d), rand(3, 8, device=d)
    return x, lambda: mti.rope_(x, cos, sin), RuntimeError, "cos's last dim must equal x's \\(8\\)"


def _rope_sin_broadcast_last_dim(d):
    # A size-1 last dim does not broadcast either: each column has its own angle.
    x = rand(2, 3, 8, device=d)
    cos, sin = rand(3, 8, device=d), rand(3, 1, device=d)
    return x, lambda: mti.rope_(x, cos, sin), RuntimeError, "sin's last dim must equal x's"


def _rope_cos_not_broadcastable(d):
    x = rand(2, 4, 3, 8, device=d)
    cos, sin = _rope_tables(4, 8, device=d)  # (s, D) with s != 3
    return x, lambda: mti.rope_(x, cos, sin), RuntimeError, "cos of shape .* does not broadcast"


def _rope_cos_more_dims(d):
    x = rand(3, 8, device=d)
    cos, sin = _rope_tables(2, 3, 8, device=d)
    return x, lambda: mti.rope_(x, cos, sin), RuntimeError, "does not broadcast to x's shape"


def _rope_cos_strided_last_dim(d):
    x = rand(2, 3, 8, device=d)
    cos = rand(3, 16, device=d)[:, ::2]
    sin = rand(3, 8, device=d)
    return x, lambda: mti.rope_(x, cos, sin), ValueError, "cos's last dim must have stride 1"


def _rope_cos_is_x(d):
    x = rand(3, 8, device=d)
    return x, lambda: mti.rope_(x, x, rand(3, 8, device=d)), RuntimeError, "x overlaps cos"


def _rope_sin_views_x(d):
    x = rand(2, 3, 8, device=d)
    return x, lambda: mti.rope_(x, rand(3, 8, device=d), x[0]), RuntimeError, "x overlaps sin"


def _rope_too_many_strided_groups(d):
    x = rand(*([3] * 9), 4, device=d)[(slice(0, 2),) * 9]
    cos, sin = _rope_tables(4, device=d)
    return x, lambda: mti.rope_(x, cos, sin), ValueError, "contiguous"


def _rope_leaf_requires_grad(d):
    x = rand(2, 3, 8, device=d).requires_grad_()
    cos, sin = _rope_tables(3, 8, device=d)
    return x, lambda: mti.rope_(x, cos, sin), RuntimeError, "leaf tensor that requires grad"


def _rope_cos_requires_grad(d):
    x = rand(2, 3, 8, device=d)
    cos, sin = _rope_tables(3, 8, device=d)
    cos.requires_grad_()
    return x, lambda: mti.rope_(x, cos, sin), RuntimeError, "cos or sin requires grad"


def _rope_sin_requires_grad_x_too(d):
    x = rand(2, 3, 8, device=d).requires_grad_() * 1
    cos, sin = _rope_tables(3, 8, device=d)
    sin.requires_grad_()
    return x, lambda: mti.rope_(x, cos, sin), RuntimeError, "cos or sin requires grad"


def _rope_backward_grad_x_is_grad(d):
    g = rand(2, 3, 8, device=d)
    cos, sin = _rope_tables(3, 8, device=d)
    return g, lambda: _ops.rope_backward(g, cos, sin, g), RuntimeError, "grad_x overlaps grad"


def _rope_backward_grad_x_overlaps_cos(d):
    cos, sin = _rope_tables(3, 8, device=d)
    grad_x = cos
    g = rand(3, 8, device=d)
    return (
        grad_x,
        lambda: _ops.rope_backward(g, cos, sin, grad_x),
        RuntimeError,
        "grad_x overlaps cos",
    )


def _rope_backward_grad_x_shape(d):
    g = rand(2, 3, 8, device=d)
    cos, sin = _rope_tables(3, 8, device=d)
    grad_x = torch.zeros(3, 8, device=d)
    return (
        grad_x,
        lambda: _ops.rope_backward(g, cos, sin, grad_x),
        RuntimeError,
        "grad_x must have grad's shape",
    )


def _rope_backward_grad_x_dtype(d):
    g = rand(2, 3, 8, device=d)
    cos, sin = _rope_tables(3, 8, device=d)
    grad_x = torch.zeros(2, 3, 8, device=d, dtype=torch.float64)
    return (
        grad_x,
        lambda: _ops.rope_backward(g, cos, sin, grad_x),
        RuntimeError,
        "grad_x must have grad's dtype",
    )


def _rope_backward_grad_x_strided(d):
    g = rand(2, 3, 8, device=d)
    cos, sin = _rope_tables(3, 8, device=d)
    grad_x = torch.zeros(2, 8, 3, device=d).transpose(1, 2)
    return (
        grad_x,
        lambda: _ops.rope_backward(g, cos, sin, grad_x),
        ValueError,
        "grad_x's last dim must have stride 1",
    )


def _rope_backward_odd_dim(d):
    g = rand(2, 3, 6, device=d)[..., :5]
    cos, sin = _rope_tables(3, 5, device=d)
    grad_x = torch.zeros(2, 3, 5, device=d)
    return (
        grad_x,
        lambda: _ops.rope_backward(g, cos, sin, grad_x),
        ValueError,
        "grad's last dim must be even",
    )


def _silu_mul(d, **change):
    """grad, gate and up of one shape, then `change` applied: {name: tensor}."""
    t = dict(grad=rand(3, 8, device=d), gate=rand(3, 8, device=d), up=rand(3, 8, device=d))
    t.update(change)
    return t["grad"], t["gate"], t["up"]


def _silu_mul_case(guarded, change, error, message):
    def case(d):
        grad, gate, up = _silu_mul(d, **{k: v(d) for k, v in change.items()})
        x = {"gate": gate, "up": up}[guarded]
        return x, lambda: _ops.silu_mul_backward_(grad, gate, up), error, message

    return case


_silu_mul_int = _silu_mul_case(
    "up",
    {"gate": lambda d: torch.ones(3, 8, dtype=torch.int32, device=d)},
    RuntimeError,
    "gate must be float32",
)
_silu_mul_up_shape = _silu_mul_case(
    "gate", {"up": lambda d: rand(8, 3, device=d)}, RuntimeError, "up must have gate's shape"
)
_silu_mul_grad_dtype = _silu_mul_case(
    "gate",
    {"grad": lambda d: rand(3, 8, device=d).double()},
    RuntimeError,
    "grad must have gate's dtype",
)
_silu_mul_up_strided = _silu_mul_case(
    "gate", {"up": lambda d: rand(8, 3, device=d).t()}, ValueError, "up must be contiguous"
)
_silu_mul_grad_strided = _silu_mul_case(
    "up", {"grad": lambda d: rand(3, 16, device=d)[:, ::2]}, ValueError, "grad must be contiguous"
)


def _silu_mul_up_is_gate(d):
    grad, gate, _ = _silu_mul(d)
    return gate, lambda: _ops.silu_mul_backward_(grad, gate, gate), RuntimeError, "gate overlaps up"


def _silu_mul_grad_views_up(d):
    _, gate, up = _silu_mul(d)
    return (
        up,
        lambda: _ops.silu_mul_backward_(up.view(8, 3), gate.view(8, 3), up.view(8, 3)),
        RuntimeError,
        "overlaps",
    )


def _rope_compiled_cos_dtype(d):
    # Under torch.compile the fake kernel refuses it while tracing, before anything runs.
    x = rand(2, 3, 8, device=d)
    cos = rand(3, 8, device=d, dtype=torch.float16)
    sin = rand(3, 8, device=d)
    fn = torch.compile(mti.rope_, backend="aot_eager", fullgraph=True)
    return x, lambda: fn(x, cos, sin), RuntimeError, "cos must have x's dtype"


CASES = [
    _matmul_nonsquare,
    _linear_nonsquare,
    _matmul_k_mismatch,
    _matmul_weight_dtype,
    _matmul_bias_dtype,
    _matmul_bias_shape,
    _matmul_bias_length,
    _matmul_int,
    _matmul_x_is_weight,
    _matmul_x_views_weight,
    _matmul_x_overlaps_bias,
    _matmul_expanded_x,
    _matmul_transposed_x,
    _matmul_negative_workspace,
    _matmul_scalar_x,
    _softmax_int,
    _log_softmax_dim_out_of_range,
    _softmax_dim_out_of_range_negative,
    _softmax_mask_not_broadcastable,
    _softmax_mask_more_dims,
    _softmax_mask_int,
    _softmax_mask_other_float_dtype,
    _log_softmax_mask_float64_for_bf16,
    _softmax_mask_other_dtype_autograd,
    _softmax_mask_other_dtype_compiled,
    _softmax_backward_mask_other_dtype,
    _softmax_mask_is_x,
    _softmax_mask_views_x,
    _softmax_expanded_x,
    _softmax_causal_dim0,
    _log_softmax_causal_1d,
    _softmax_too_many_strided_groups,
    _layer_norm_shape_mismatch,
    _layer_norm_shape_too_long,
    _rms_norm_empty_shape,
    _layer_norm_weight_shape,
    _layer_norm_bias_shape,
    _rms_norm_weight_shape,
    _layer_norm_weight_dtype,
    _rms_norm_weight_dtype,
    _layer_norm_int,
    _rms_norm_int,
    _layer_norm_weight_views_x,
    _rms_norm_expanded_x,
    _layer_norm_dims_do_not_merge,
    _layer_norm_rstd_wrong_size,
    _rms_norm_rstd_wrong_dtype,
    _layer_norm_rstd_overlaps_x,
    _xent_target_int32,
    _xent_target_probabilities,
    _xent_target_shape,
    _xent_int_logits,
    _xent_scalar_logits,
    _xent_transposed_logits,
    _xent_expanded_logits,
    _xent_bad_reduction,
    _xent_label_smoothing_out_of_range,
    _xent_leaf_requires_grad,
    _xent_losses_wrong_dtype,
    _xent_losses_overlap_logits,
    _xent_empty_classes,
    _rope_int,
    _rope_scalar_x,
    _rope_odd_dim,
    _rope_transposed_x,
    _rope_expanded_x,
    _rope_cos_dtype,
    _rope_sin_dtype,
    _rope_cos_last_dim,
    _rope_sin_broadcast_last_dim,
    _rope_cos_not_broadcastable,
    _rope_cos_more_dims,
    _rope_cos_strided_last_dim,
    _rope_cos_is_x,
    _rope_sin_views_x,
    _rope_too_many_strided_groups,
    _rope_leaf_requires_grad,
    _rope_cos_requires_grad,
    _rope_sin_requires_grad_x_too,
    _rope_backward_grad_x_is_grad,
    _rope_backward_grad_x_overlaps_cos,
    _rope_backward_grad_x_shape,
    _rope_backward_grad_x_dtype,
    _rope_backward_grad_x_strided,
    _rope_backward_odd_dim,
    _rope_compiled_cos_dtype,
    _silu_mul_int,
    _silu_mul_up_shape,
    _silu_mul_grad_dtype,
    _silu_mul_up_strided,
    _silu_mul_grad_strided,
    _silu_mul_up_is_gate,
    _silu_mul_grad_views_up,
]

# Target values are checked on the host only by the CPU backend.
CPU_CASES = [_xent_target_out_of_bounds, _xent_target_negative]


def check_raises_untouched(x, call, error, message):
    guard = Untouched(x)
    with pytest.raises(error, match=message):
        call()
    assert guard.x_unchanged(), "x changed although the op raised"
    assert guard.outside_unchanged(), "memory around x changed although the op raised"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.lstrip("_"))
@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(device, case):
    check_raises_untouched(*case(device))


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.__name__.lstrip("_"))
def test_bad_input_cpu(case):
    check_raises_untouched(*case("cpu"))


# --------------------------------------------------------------------------- CUDA only


def _weight_on_cpu(d):
    x = rand(4, 8, device=d)
    return x, lambda: mti.square_matmul_(x, rand(8, 8, device="cpu")), RuntimeError, "device"


def _bias_on_cpu(d):
    x = rand(4, 8, device=d)
    return (
        x,
        lambda: mti.linear_(x, rand(8, 8, device=d), rand(8, device="cpu")),
        RuntimeError,
        "device",
    )


def _mask_on_cpu(d):
    x = rand(4, 5, device=d)
    return x, lambda: mti.softmax_(x, mask=torch.ones(5, dtype=torch.bool)), RuntimeError, "device"


def _norm_weight_on_cpu(d):
    x = rand(4, 6, device=d)
    return x, lambda: mti.layer_norm_(x, (6,), rand(6, device="cpu")), RuntimeError, "device"


def _rms_weight_on_cpu(d):
    x = rand(4, 6, device=d)
    return x, lambda: mti.rms_norm_(x, (6,), rand(6, device="cpu")), RuntimeError, "device"


def _float64_matmul_k_too_large_without_workspace(d):
    # float64's zero-workspace kernel holds a row of x in shared memory.
    k = torch.cuda.get_device_properties(d).shared_memory_per_block_optin // 8 + 1
    x = rand(2, k, device=d, dtype=torch.float64)
    w = torch.zeros(k, k, device=d, dtype=torch.float64)
    return (
        x,
        lambda: mti.square_matmul_(x, w, workspace_bytes=0),
        RuntimeError,
        f"K={k} is too large for the zero-workspace kernel \\(max {k - 1} for Double",
    )


def _xent_target_on_cpu(d):
    x = rand(4, 10, device=d)
    t = torch.tensor([1, 2, 3, 4])
    return x, lambda: mti.cross_entropy_(x, t), RuntimeError, "target must be on logits' device"


def _rope_cos_on_cpu(d):
    x = rand(2, 3, 8, device=d)
    cos, sin = rand(3, 8, device="cpu"), rand(3, 8, device=d)
    return x, lambda: mti.rope_(x, cos, sin), RuntimeError, "cos must be on x's device"


def _float64_norm_rstd_float32(d):
    # On CUDA a float64 x saves its rstd in float64.
    x = rand(4, 6, device=d, dtype=torch.float64)
    rstd = torch.zeros(4, device=d)
    return x, lambda: _ops.rms_norm_(x, [6], None, 1e-5, rstd), RuntimeError, "rstd must be.*Double"


@requires_cuda
@pytest.mark.parametrize(
    "case",
    [
        _weight_on_cpu,
        _bias_on_cpu,
        _mask_on_cpu,
        _norm_weight_on_cpu,
        _rms_weight_on_cpu,
        _float64_matmul_k_too_large_without_workspace,
        _float64_norm_rstd_float32,
        _xent_target_on_cpu,
        _rope_cos_on_cpu,
    ],
    ids=lambda c: c.__name__.lstrip("_"),
)
def test_bad_input_cuda(case):
    check_raises_untouched(*case("cuda"))


@requires_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_weight_on_other_gpu():
    x = rand(4, 8, device="cuda:0")
    check_raises_untouched(
        x, lambda: mti.square_matmul_(x, rand(8, 8, device="cuda:1")), RuntimeError, "device"
    )


# --------------------------------------------------------------------------- what does work


@pytest.mark.parametrize("device", DEVICES)
def test_disjoint_views_of_one_buffer_are_accepted(device):
    """Sharing a storage is not overlap: x and bias from disjoint rows of one buffer work."""
    big = rand(5, 8, device=device)
    x, bias = big[1:], big[0]
    check_op(mti.linear_, ref_linear, x, rand(8, 8, device=device), bias)
