"""Autograd through the in-place ops: gradcheck in float64 (CPU and CUDA), gradients in
float32/float16/bfloat16 against PyTorch's own on an fp64 reference, and the safety rules:
frozen matmul weights, version counters, leaves that require grad."""

import pytest
import torch
from helpers import (
    DEVICES,
    DTYPE_PARAMS,
    Untouched,
    assert_accurate,
    check_op,
    output_grad,
    randn,
    ref_layer_norm,
    ref_linear,
    ref_log_softmax,
    ref_rms_norm,
    ref_softmax,
    ref_square_matmul,
)
from torch.autograd import gradcheck

import make_torch_inplace as mti

_NAMESPACE = "make_torch_inplace::"

F64 = torch.float64


def out_of_place(op, **kwargs):
    """op made out-of-place for gradcheck: x is cloned first, the other tensors pass through.
    log_softmax's -inf outputs (masked elements, constant in x) become 0 so that finite
    differences stay finite; their gradient is 0 either way."""

    def fn(x, *tensors, **more_kwargs):
        y = op(x.clone(), *tensors, **kwargs, **more_kwargs)
        return y.masked_fill(torch.isneginf(y), 0.0)

    return fn


def leaf(shape, seed, dtype=F64, device="cpu", scale=1.0):
    return randn(shape, dtype, device, seed, scale=scale).requires_grad_()


def bool_mask(shape, seed, device="cpu"):
    """About 70% True, with the first row fully masked (a row that becomes zeros)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(shape, generator=g) < 0.7
    mask[(0,) * (len(shape) - 1)] = False
    return mask.to(device)


# --------------------------------------------------------------------------- gradcheck (fp64)

GRADCHECK_CASES = {
    "softmax": lambda d: (out_of_place(mti.softmax_), leaf((3, 7), 1, device=d)),
    "softmax_dim0": lambda d: (out_of_place(mti.softmax_, dim=0), leaf((4, 5), 2, device=d)),
    "softmax_scale": lambda d: (out_of_place(mti.softmax_, scale=0.37), leaf((3, 7), 3, device=d)),
    "softmax_bool_mask": lambda d: (
        out_of_place(mti.softmax_, mask=bool_mask((2, 4, 6), 4, d)),
        leaf((2, 4, 6), 5, device=d),
    ),
    "softmax_additive_mask": lambda d: (
        lambda x, m: out_of_place(mti.softmax_)(x, mask=m),
        leaf((2, 4, 6), 6, device=d),
        leaf((4, 6), 7, device=d),
    ),
    "softmax_causal": lambda d: (
        out_of_place(mti.softmax_, causal=True),
        leaf((2, 5, 5), 8, device=d),
    ),
    "softmax_causal_q_lt_k": lambda d: (
        out_of_place(mti.softmax_, causal=True, scale=2.0),
        leaf((3, 6), 9, device=d),
    ),
    "softmax_causal_q_gt_k_masked": lambda d: (
        out_of_place(mti.softmax_, causal=True, mask=bool_mask((4,), 10, d)),
        leaf((6, 4), 11, device=d),
    ),
    "log_softmax": lambda d: (out_of_place(mti.log_softmax_), leaf((3, 7), 12, device=d)),
    "log_softmax_dim1": lambda d: (
        out_of_place(mti.log_softmax_, dim=1),
        leaf((2, 5, 3), 13, device=d),
    ),
    "log_softmax_bool_mask": lambda d: (
        out_of_place(mti.log_softmax_, mask=bool_mask((3, 7), 14, d)),
        leaf((3, 7), 15, device=d),
    ),
    "log_softmax_additive_mask": lambda d: (
        lambda x, m: out_of_place(mti.log_softmax_, scale=0.5)(x, mask=m),
        leaf((3, 7), 16, device=d),
        leaf((7,), 17, device=d),
    ),
    "log_softmax_causal": lambda d: (
        out_of_place(mti.log_softmax_, causal=True),
        leaf((2, 4, 6), 18, device=d),
    ),
    "layer_norm": lambda d: (
        out_of_place(mti.layer_norm_, normalized_shape=(9,)),
        leaf((4, 9), 19, device=d),
    ),
    "layer_norm_affine": lambda d: (
        lambda x, w, b: out_of_place(mti.layer_norm_)(x, (9,), w, b),
        leaf((4, 9), 20, device=d),
        leaf((9,), 21, device=d),
        leaf((9,), 22, device=d),
    ),
    "layer_norm_two_dims_weight": lambda d: (
        lambda x, w: out_of_place(mti.layer_norm_, eps=1e-3)(x, (3, 4), w),
        leaf((2, 3, 4), 23, device=d),
        leaf((3, 4), 24, device=d),
    ),
    "layer_norm_bias_only": lambda d: (
        lambda x, b: out_of_place(mti.layer_norm_)(x, (5,), None, b),
        leaf((3, 5), 25, device=d),
        leaf((5,), 26, device=d),
    ),
    "rms_norm": lambda d: (
        out_of_place(mti.rms_norm_, normalized_shape=(9,)),
        leaf((4, 9), 27, device=d),
    ),
    "rms_norm_weight": lambda d: (
        lambda x, w: out_of_place(mti.rms_norm_, eps=1e-6)(x, (2, 5), w),
        leaf((3, 2, 5), 28, device=d),
        leaf((2, 5), 29, device=d),
    ),
    "square_matmul": lambda d: (
        lambda x: out_of_place(mti.square_matmul_)(x, randn((6, 6), F64, d, 30)),
        leaf((2, 3, 6), 31, device=d),
    ),
    "square_matmul_bias_transpose_no_workspace": lambda d: (
        lambda x, b: out_of_place(mti.square_matmul_, transpose=True, workspace_bytes=0)(
            x, randn((6, 6), F64, d, 32), b
        ),
        leaf((5, 6), 33, device=d),
        leaf((6,), 34, device=d),
    ),
    "square_matmul_bias_one_row": lambda d: (
        lambda x, b: out_of_place(mti.square_matmul_)(x, randn((6, 6), F64, d, 38), b),
        leaf((6,), 39, device=d),
        leaf((6,), 40, device=d),
    ),
    "square_matmul_bias_3d": lambda d: (
        lambda x, b: out_of_place(mti.square_matmul_)(x, randn((6, 6), F64, d, 41), b),
        leaf((2, 3, 6), 42, device=d),
        leaf((6,), 43, device=d),
    ),
    "linear_bias": lambda d: (
        lambda x, b: out_of_place(mti.linear_)(x, randn((6, 6), F64, d, 35), b),
        leaf((5, 6), 36, device=d),
        leaf((6,), 37, device=d),
    ),
}


@pytest.mark.parametrize("case", GRADCHECK_CASES.values(), ids=GRADCHECK_CASES.keys())
@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck(device, case):
    fn, *inputs = case(device)
    assert gradcheck(fn, tuple(inputs))


# --------------------------------------------------------------------------- low precision


def check_grads(op, ref, inputs, **kwargs):
    """Gradients of op(inputs[0].clone(), *inputs[1:], **kwargs) for a random output gradient,
    w.r.t. every tensor argument that requires grad, against PyTorch's gradients of ref(...)
    in the inputs' dtype, both held to ref's fp64 gradients."""
    x = inputs[0]
    grad_out = output_grad(x)

    def grads(fn, cast):
        def leaf_copy(a):
            if not isinstance(a, torch.Tensor):
                return a
            return cast(a).detach().requires_grad_(a.requires_grad)

        args = [leaf_copy(a) for a in inputs]
        kw = {k: leaf_copy(v) for k, v in kwargs.items()}
        out = fn(*args, **kw)
        wrt = [
            a for a in args + list(kw.values()) if isinstance(a, torch.Tensor) and a.requires_grad
        ]
        return torch.autograd.grad(out, wrt, cast(grad_out))

    def ours(x, *rest, **kw):
        return op(x.clone(), *rest, **kw)

    ref64 = grads(ref, lambda t: t.double() if t.is_floating_point() else t)
    torch_grads = grads(ref, lambda t: t)
    our_grads = grads(ours, lambda t: t)
    for i, (g, t, r) in enumerate(zip(our_grads, torch_grads, ref64)):
        assert_accurate(g, t, r, f"{op.__name__} grad #{i}")


def _lowp_cases(device, dtype):
    def t(shape, seed, grad=True, scale=1.0):
        return randn(shape, dtype, device, seed, scale=scale).requires_grad_(grad)

    def norm_weight(shape, seed):
        # Norm weights as trained ones are, around 1: the backward pass recovers x_hat =
        # (y - bias) / weight from the output, which ops.py documents as losing precision
        # where |weight| is tiny; that regime is not PyTorch's accuracy and is not tested.
        w = 1.0 + randn(shape, torch.float32, device, seed, scale=0.1)
        return w.to(dtype).requires_grad_()

    k = 24
    w = t((k, k), 40, grad=False, scale=k**-0.5)
    return {
        "softmax": (mti.softmax_, ref_softmax, [t((3, 5, 33), 41)], {"scale": 0.5}),
        "softmax_dim0": (mti.softmax_, ref_softmax, [t((6, 7), 42), 0], {}),
        "softmax_causal_bool_mask": (
            mti.softmax_,
            ref_softmax,
            [t((2, 6, 9), 43)],
            {"causal": True, "mask": bool_mask((6, 9), 44, device)},
        ),
        "softmax_additive_mask": (
            mti.softmax_,
            ref_softmax,
            [t((2, 6, 9), 45)],
            {"mask": t((9,), 46)},
        ),
        "log_softmax": (mti.log_softmax_, ref_log_softmax, [t((3, 5, 33), 47)], {}),
        "log_softmax_causal_bool_mask": (
            mti.log_softmax_,
            ref_log_softmax,
            [t((2, 6, 9), 48)],
            {"causal": True, "mask": bool_mask((6, 9), 49, device)},
        ),
        "layer_norm": (
            mti.layer_norm_,
            ref_layer_norm,
            [t((4, 3, 40), 50), (40,), norm_weight((40,), 51), t((40,), 52)],
            {},
        ),
        "layer_norm_no_affine": (mti.layer_norm_, ref_layer_norm, [t((4, 40), 53), (40,)], {}),
        "rms_norm": (
            mti.rms_norm_,
            ref_rms_norm,
            [t((4, 3, 40), 54), (3, 40), norm_weight((3, 40), 55)],
            {},
        ),
        "square_matmul": (
            mti.square_matmul_,
            ref_square_matmul,
            [t((5, k), 56), w, t((k,), 57)],
            {},
        ),
        "linear_": (mti.linear_, ref_linear, [t((5, k), 58), w, t((k,), 59)], {}),
    }


LOWP_CASES = list(_lowp_cases("cpu", torch.float32))


@pytest.mark.parametrize("case", LOWP_CASES)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
def test_grads_against_pytorch(device, dtype, case):
    op, ref, inputs, kwargs = _lowp_cases(device, dtype)[case]
    check_grads(op, ref, inputs, **kwargs)


# --------------------------------------------------------------------------- safety rules


def _ops_on(device):
    """Every op as f(x) with its other arguments fixed (frozen matmul weight)."""
    w = randn((8, 8), torch.float32, device, 60)
    rope_tables = randn((8,), torch.float32, device, 67), randn((8,), torch.float32, device, 68)
    return {
        "square_matmul_": lambda x: mti.square_matmul_(x, w),
        "linear_": lambda x: mti.linear_(x, w),
        "softmax_": lambda x: mti.softmax_(x, causal=True),
        "log_softmax_": lambda x: mti.log_softmax_(x),
        "layer_norm_": lambda x: mti.layer_norm_(x, (8,)),
        "rms_norm_": lambda x: mti.rms_norm_(x, (8,)),
        "rope_": lambda x: mti.rope_(x, *rope_tables),
    }


OP_NAMES = list(_ops_on("cpu"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transpose", [False, True])
def test_matmul_weight_requiring_grad_is_refused(device, transpose):
    """The weight's gradient needs the x that the op destroys: refused before x is touched;
    under no_grad there is no gradient to compute and the op runs."""
    w = randn((8, 8), torch.float32, device, 61).requires_grad_()
    x = randn((3, 8), torch.float32, device, 62)
    guard = Untouched(x)
    with pytest.raises(RuntimeError, match="weight requires grad"):
        mti.square_matmul_(x, w, transpose=transpose)
    assert guard.x_unchanged()
    with torch.no_grad():
        check_op(mti.square_matmul_, ref_square_matmul, x, w, transpose=transpose)


@pytest.mark.parametrize("no_grad", [False, True], ids=["grad_mode", "no_grad"])
@pytest.mark.parametrize("name", OP_NAMES)
@pytest.mark.parametrize("device", DEVICES)
def test_version_counter_catches_overwritten_saved_tensor(device, name, no_grad):
    """exp saves its output for backward; overwriting that output in place (with or without
    grad mode) must make backward refuse, as it does for PyTorch's in-place ops."""
    x = randn((3, 8, 8), torch.float32, device, 63).requires_grad_()
    a = x.exp()
    op = _ops_on(device)[name]
    if no_grad:
        with torch.no_grad():
            op(a)
    else:
        op(a)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        a.sum().backward()


@pytest.mark.parametrize("no_grad", [False, True], ids=["grad_mode", "no_grad"])
@pytest.mark.parametrize("name", OP_NAMES)
@pytest.mark.parametrize("device", DEVICES)
def test_version_counter_bumped(device, name, no_grad):
    """Like every in-place op, each records its write in x's version counter, also when no
    autograd graph is involved (x does not require grad, or grad mode is off)."""
    x = randn((3, 8, 8), torch.float32, device, 66)
    version = x._version
    op = _ops_on(device)[name]
    with torch.set_grad_enabled(not no_grad):
        op(x)
    assert x._version > version


@pytest.mark.parametrize("name", OP_NAMES)
@pytest.mark.parametrize("device", DEVICES)
def test_leaf_requiring_grad_is_refused(device, name):
    x = randn((3, 8, 8), torch.float32, device, 64).requires_grad_()
    guard = Untouched(x.detach())
    op = _ops_on(device)[name]
    with pytest.raises(RuntimeError, match="leaf"):
        op(x)
    assert guard.x_unchanged()
    with torch.no_grad():  # as for x.mul_(2): allowed where no graph is recorded
        assert op(x) is x


@pytest.mark.parametrize("device", DEVICES)
def test_output_carries_the_graph(device):
    """The returned tensor is x, now the op's output in the graph (grad_fn set, version bumped);
    gradients flow back to the leaf it was cloned from."""
    leaf_ = randn((4, 8), torch.float32, device, 65).requires_grad_()
    x = leaf_ * 1.0
    version = x._version
    y = mti.softmax_(x)
    assert y is x and x.grad_fn is not None and x._version > version
    y[:, 0].sum().backward()
    assert leaf_.grad is not None and torch.isfinite(leaf_.grad).all()


@pytest.mark.parametrize("name", OP_NAMES)
@pytest.mark.parametrize("device", DEVICES)
def test_inference_mode(device, name):
    """Serving code runs under inference_mode, where tensors have no version counter."""
    op = _ops_on(device)[name]
    with torch.inference_mode():
        x = randn((3, 8, 8), torch.float32, device, 67)
        assert op(x) is x


def test_every_writing_op_bumps_versions():
    """Every op of the library that writes an argument has the ADInplaceOrView kernel that
    bumps the written tensors' versions (csrc/common/version_counter.cpp): without it a
    write under no_grad (or by the raw op) is invisible to autograd's saved-tensor check."""
    schemas = [s for s in torch._C._jit_get_all_schemas() if s.name.startswith(_NAMESPACE)]
    assert schemas, "no op of the library is registered"
    for s in schemas:
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in s.arguments)
        has = torch._C._dispatch_has_kernel_for_dispatch_key(s.name, "ADInplaceOrView")
        assert has == writes, f"{s.name}: writes an argument: {writes}, bumps versions: {has}"
