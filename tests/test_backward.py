"""The backward dispatcher ops (softmax_backward, norm_backward) that autograd runs for
softmax_ / log_softmax_ / layer_norm_ / rms_norm_: gradients against PyTorch's on an fp64
reference over shapes, odd widths, layouts, masks and dtypes; fp64 gradcheck; the ops called
directly (they write only their out arguments); opcheck; bad input refused before anything is
written."""

import pytest
import torch
from helpers import (
    DEVICES,
    DTYPE_PARAMS,
    ODD_WIDTHS,
    ROW_STRIDED_LAYOUTS,
    SENTINEL,
    Untouched,
    assert_accurate,
    bitwise_equal,
    device_params,
    examples,
    lead_shapes,
    output_grad,
    randn,
    ref_layer_norm,
    ref_log_softmax,
    ref_rms_norm,
    ref_softmax,
    requires_cuda,
    seeds,
    widths,
    with_layout,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck

import make_torch_inplace as mti

_ops = torch.ops.make_torch_inplace
F32, F64 = torch.float32, torch.float64

# Widths of the kernels' paths: a few lanes, a warp, a CTA, a cluster of CTAs on sm_90
# (streamed elsewhere; see CLUSTER_WIDTHS).
PATH_WIDTHS = (8, 1024, 4096, 8200, 20000)


def grads_of(fn, x, params, grad_out, **kwargs):
    """d fn(x, *params) / d(x, *params that require grad) for the output gradient grad_out; x
    and the params are leaves here (fn receives x itself; callers clone for in-place ops)."""
    x = x.detach().requires_grad_()
    params = [p.detach().requires_grad_() if isinstance(p, torch.Tensor) else p for p in params]
    out = fn(x, *params, **kwargs)
    wrt = [x] + [p for p in params if isinstance(p, torch.Tensor)]
    return torch.autograd.grad(out, wrt, grad_out)


def check_grads(op, ref, x, params=(), grad_out=None, **kwargs):
    """Our gradients (op on a copy of x with x's layout) against PyTorch's (ref in x's dtype),
    both held to ref's fp64 gradients; params: further tensor arguments that get gradients
    (None entries pass through)."""
    if grad_out is None:
        grad_out = output_grad(x)

    def cast64(t):
        return t.double() if isinstance(t, torch.Tensor) else t

    kw64 = {
        k: cast64(v) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in kwargs.items()
    }
    ref64 = grads_of(ref, x.double(), [cast64(p) for p in params], grad_out.double(), **kw64)
    torch_grads = grads_of(ref, x, params, grad_out, **kwargs)

    def ours(leaf, *rest, **kw):
        # Multiplying by 1 keeps the leaf's layout, which the op then sees as y's.
        return op(leaf * 1, *rest, **kw)

    x_layout = with_layout(x.detach(), "contiguous")
    our_grads = grads_of(ours, x_layout, params, grad_out, **kwargs)
    for i, (g, t, r) in enumerate(zip(our_grads, torch_grads, ref64)):
        assert g.shape == r.shape
        assert_accurate(g, t, r, f"{op.__name__} grad #{i}")


def make_mask(kind, shape, device, dtype, seed, fully_masked_row=False):
    """None, a bool mask (about 70% True; the first row all False if fully_masked_row) or an
    additive one (-inf where the bool mask would be False)."""
    if kind == "none":
        return None
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(shape, generator=g) < 0.7
    if fully_masked_row and keep.dim() >= 2 and keep.shape[-2] > 0:
        keep[..., 0, :] = False
    if kind == "bool":
        return keep.to(device)
    # PyTorch's gradient of a row that an additive mask masks whole is NaN (ours is 0): keep
    # column 0 of additive masks, so the comparison sees no such row.
    keep[..., 0] = True
    additive = torch.randn(shape, generator=g).masked_fill(~keep, float("-inf"))
    return additive.to(device=device, dtype=dtype)


# --------------------------------------------------------------------------- softmax


@settings(max_examples=examples(40))
@given(
    lead=lead_shapes(max_dims=2),
    n=widths(),
    seed=seeds,
    log=st.booleans(),
    scale=st.sampled_from([None, 0.37, 2.0]),
    mask=st.sampled_from(["none", "bool", "additive"]),
    causal=st.booleans(),
)
# A causal row of 2 unmasked elements whose correctly rounded float16 outputs do not sum to
# 1, with grad - sum(grad * y) cancelling: softmax's gradient must divide by sum(y).
@example(lead=(), n=35, seed=668, log=False, scale=None, mask="additive", causal=True)
# A float32 log_softmax row whose stored log-probabilities' exps sum to 1 only up to
# rounding: log_softmax's gradient must divide by sum(exp(y)).
@example(lead=(), n=52, seed=375, log=True, scale=2.0, mask="none", causal=True)
# A float32 log_softmax row whose gradient sum (255 terms, most past the causal limit) cancels
# to 1.66 from terms summing to 200 in magnitude: fp32 accumulation errs by 1e-6 there.
@example(lead=(), n=255, seed=99, log=True, scale=None, mask="additive", causal=True)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
def test_softmax_grads(device, dtype, lead, n, seed, log, scale, mask, causal):
    shape = (*lead, 3, n)  # causal needs two dims
    x = randn(shape, dtype, device, seed)
    m = make_mask(mask, (3, n), device, dtype, seed + 1, fully_masked_row=True)
    op, ref = (mti.log_softmax_, ref_log_softmax) if log else (mti.softmax_, ref_softmax)
    grad_out = output_grad(x)
    if log and mask == "additive":
        # Through x + (-inf), PyTorch passes a masked element's output gradient on to x; the
        # op gives it 0 (the output is constant there). Real losses never weigh a -inf
        # log-probability, so the comparison leaves those gradients at 0.
        grad_out = grad_out.masked_fill(torch.isneginf(m), 0.0)
    check_grads(op, ref, x, grad_out=grad_out, scale=scale, mask=m, causal=causal)


@pytest.mark.parametrize("n", PATH_WIDTHS + ODD_WIDTHS)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
def test_softmax_grads_widths(device, dtype, log, n):
    x = randn((3, n), dtype, device, n, scale=3.0)
    op, ref = (mti.log_softmax_, ref_log_softmax) if log else (mti.softmax_, ref_softmax)
    check_grads(op, ref, x, scale=0.5, mask=make_mask("bool", (n,), device, dtype, 5))


@pytest.mark.parametrize("n", (64, 1024, 4096, 20000))
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
def test_log_softmax_grads_tiny_probabilities(device, dtype, n):
    """Log-probabilities below -87.3, whose exps are subnormal (or 0) in fp32, among ordinary
    ones: the 16-bit CUDA kernels take __expf for the vectors that hold them and one MUFU.EX2
    per element for the others (SoftmaxBackwardOp::with_exp)."""
    x = randn((3, n), dtype, device, n, scale=3.0)
    # The first quarter of each row 95 below the rest (vectors of subnormal exps only), then
    # 5 columns 130 below (exps of 0, in a vector with 3 ordinary ones).
    x[:, : n // 4] -= 95.0
    x[:, n // 4 : n // 4 + 5] -= 130.0
    check_grads(mti.log_softmax_, ref_log_softmax, x)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("device", DEVICES)
def test_softmax_grads_other_dim(device, dim):
    x = randn((6, 5, 7), F32, device, 3)
    check_grads(mti.softmax_, ref_softmax, x, dim=dim)


def test_fully_masked_rows_get_zero_gradient():
    x = randn((2, 4, 6), F32, "cpu", 7)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1] = False
    for op in (mti.softmax_, mti.log_softmax_):
        leaf = x.clone().requires_grad_()
        y = op(leaf * 1, mask=mask)
        (g,) = torch.autograd.grad(y, leaf, torch.randn_like(y))
        assert (g[:, 1] == 0).all() and (g[:, 0] != 0).any()


# --------------------------------------------------------------------------- norms


def norm_case(device, dtype, shape, k, seed, weight, bias):
    """x and its (weight, bias) around 1 and 0 as trained ones are: the backward recovers
    x_hat = (y - bias) / weight, which ops.py documents as imprecise where |weight| is tiny."""
    normalized = shape[len(shape) - k :]
    x = randn(shape, dtype, device, seed, scale=2.0).add_(0.5)
    w = (1.0 + randn(normalized, F32, device, seed + 1, scale=0.1)).to(dtype) if weight else None
    b = randn(normalized, dtype, device, seed + 2, scale=0.1) if bias else None
    return x, normalized, w, b


# Rows of at least 8: the backward recovers x_hat from y, and in rows of a few elements the
# gradient is a cancellation (RMSNorm of one element: rstd * g_hat * (1 - x_hat^2)) in which
# the rounding already in y outweighs PyTorch's error from x (ops.py documents the
# precision of recovering x_hat).
# 70000: streamed rows whose weight and bias gradient sums no longer fit in shared memory
# (on the CPU the same path as 20000: test_norm_grads_widths runs it on CUDA only).
NORM_WIDTHS = tuple(n for n in PATH_WIDTHS + ODD_WIDTHS if n >= 8) + (70000,)


@settings(max_examples=examples(40))
@given(
    lead=lead_shapes(max_dims=2),
    n=st.integers(8, 64) | st.sampled_from(NORM_WIDTHS),
    seed=seeds,
    weight=st.booleans(),
    bias=st.booleans(),
    rms=st.booleans(),
)
# An 8-wide row whose grad_x doubles any extra error in y and rstd: the CUDA norms must
# round rstd correctly (__frsqrt_rn; rsqrtf's 2 ulp fail it).
@example(lead=(), n=8, seed=86, weight=False, bias=False, rms=False)
# An fp32 row whose pivot x[0] = -2.96 is 3.29 from its mean (0.33): a mean kept relative
# to the pivot rounds at ulp(3.29), and y and the weight gradient taken from it fail. The
# sum of x - pivot must be carried exactly as hi + lo (rowwise/norm_forward.cuh's PivotSums).
@example(lead=(), n=62, seed=763, weight=True, bias=False, rms=False)
# An 8-wide fp32 RMSNorm row whose weight gradient, taken from y, fails when
# y = x * rstd * weight is rounded twice: sm_90+ round it once (rowwise/norm_forward.cuh's
# RmsNormOp::output; builds for older GPUs keep the two roundings).
@example(lead=(), n=8, seed=2353, weight=True, bias=False, rms=True)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
def test_norm_grads(device, dtype, lead, n, seed, weight, bias, rms):
    x, normalized, w, b = norm_case(device, dtype, (*lead, n), 1, seed, weight, bias and not rms)
    if rms:
        check_grads(mti.rms_norm_, ref_rms_norm, x, (normalized, w, 1e-6))
    else:
        check_grads(mti.layer_norm_, ref_layer_norm, x, (normalized, w, b, 1e-5))


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device,n", device_params(NORM_WIDTHS, NORM_WIDTHS[:-1]))
def test_norm_grads_widths(device, dtype, rms, n):
    x, normalized, w, b = norm_case(device, dtype, (5, n), 1, n, True, not rms)
    if rms:
        check_grads(mti.rms_norm_, ref_rms_norm, x, (normalized, w, 1e-6))
    else:
        check_grads(mti.layer_norm_, ref_layer_norm, x, (normalized, w, b, 1e-5))


MANY_ROWS = {
    "lanes": (3000, 24),
    "lanes_scalar": (3000, 23),
    "warps": (3001, 1000),
    "warps_uneven": (3001, 1200),
    "cluster": (600, 8200),
    "streamed": (600, 8201),
}


# On the CPU, which sums the parameter gradients over all rows in blocks of 64 columns on one
# path for every shape: rows shorter than a block, and rows of several blocks and part of one.
@pytest.mark.parametrize("device,shape", device_params(MANY_ROWS, [(3000, 23), (3001, 1000)]))
def test_norm_grads_many_rows(device, shape):
    """Many rows: the weight and bias gradients sum partials of many groups of rows (each
    CTA or cluster sums several rows, in registers when resident, in shared memory when
    streamed: 8201 is odd, so its rows take the scalar path, streamed past 2048). Resident
    CTAs hold several rows at once, of a few lanes (24; 23 on the scalar path) or of whole
    warps (1000: 64 threads, 4 rows per CTA; 1200: 96 threads, 2 rows per CTA), and add
    their rows' column sums in shared memory."""
    x, normalized, w, b = norm_case(device, F32, shape, 1, 11, True, True)
    check_grads(mti.layer_norm_, ref_layer_norm, x, (normalized, w, b, 1e-5))


@pytest.mark.parametrize("device", DEVICES)
def test_norm_two_normalized_dims(device):
    x, normalized, w, b = norm_case(device, F32, (4, 3, 10), 2, 12, True, True)
    check_grads(mti.layer_norm_, ref_layer_norm, x, (normalized, w, b, 1e-5))


def test_norm_weight_zero_gives_finite_gradients():
    x, normalized, w, b = norm_case("cpu", F32, (4, 8), 1, 13, True, True)
    w[3] = 0
    leaf, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = mti.layer_norm_(leaf * 1, normalized, wl, b)
    gx, gw = torch.autograd.grad(y, (leaf, wl), torch.randn_like(y))
    assert torch.isfinite(gx).all() and torch.isfinite(gw).all()


# --------------------------------------------------------------------------- clusters

# Vector rows longer than a CTA's registers hold (8192 elements for softmax, 4096 for the
# norms) are held by a cluster of CTAs on sm_90 and streamed elsewhere. Softmax's register
# rows first take a CTA of up to 512 threads (16384 fp32 / 32768 16-bit elements), as do the
# 16-bit norms' rows of up to 8192, and softmax's register clusters CTAs of 512 where those
# of 256 would number enough (kernels/rowwise/tuning.h, kLargeCtaThreads); the norms, and
# 16-bit log_softmax but on those clusters of large CTAs without a mask tensor (131072),
# stage a CTA's share in shared memory (8192 elements for log_softmax, 4096 for the norms).
# Shared-path rows that clusters of 16 such CTAs do not hold take clusters of CTAs of 512
# (131072 for the norms, 131080 for 16-bit log_softmax; the norms stream 131080). Widths on
# both sides of each limit, with full and with mostly idle last CTAs (6144, 12288 and 20480
# fill part of a CTA of 512), clusters of 2 to 16 CTAs, and rows past what clusters of 16
# hold; at least as many rows as fit at once on 132 SMs (264 CTAs), so each CTA strides over
# rows through its staging buffers.
CLUSTER_WIDTHS = (4100, 6144, 8192, 12288, 16448, 20480, 32768, 36864, 61440, 65536, 131072, 131080)
CLUSTER_OPS = ("softmax", "log_softmax_causal", "layer_norm", "rms_norm", "rms_norm_no_weight")


@requires_cuda
@pytest.mark.parametrize("n", CLUSTER_WIDTHS)
@pytest.mark.parametrize("op", CLUSTER_OPS)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_grads_cluster_rows(dtype, op, n):
    shape = (max(20, 1_150_000 // n + 1), n)
    if op.startswith("rms_norm") or op == "layer_norm":
        affine = op != "rms_norm_no_weight"
        x, normalized, w, b = norm_case("cuda", dtype, shape, 1, n, affine, op == "layer_norm")
        if op == "layer_norm":
            check_grads(mti.layer_norm_, ref_layer_norm, x, (normalized, w, b, 1e-5))
        else:
            check_grads(mti.rms_norm_, ref_rms_norm, x, (normalized, w, 1e-6))
    elif op == "softmax":
        x = randn(shape, dtype, "cuda", n, scale=3.0)
        check_grads(
            mti.softmax_, ref_softmax, x, scale=0.5, mask=make_mask("bool", (n,), "cuda", dtype, 5)
        )
    else:
        x = randn(shape, dtype, "cuda", n, scale=3.0)
        check_grads(mti.log_softmax_, ref_log_softmax, x, causal=True)


# One backward kernel is launched with CTAs of several sizes (16-bit softmax's rows of
# 16448-32768 elements take CTAs of 288-512 threads, with shared memory to match): its shared
# memory limit, raised for the largest launch, must not be lowered again by a smaller one, or
# the larger launch, its shape already cached, fails. Widths down, then up again.
@requires_cuda
def test_grads_widths_in_turn():
    for n in (32768, 20480, 16448, 20480, 32768):
        x = randn((24, n), torch.bfloat16, "cuda", n, scale=3.0)
        check_grads(mti.softmax_, ref_softmax, x)


# --------------------------------------------------------------------------- layouts


def direct_softmax(y, grad, dim=-1, scale=1.0, mask=None, causal=False, log=False):
    grad_x = torch.full(y.shape, SENTINEL, dtype=y.dtype, device=y.device)
    _ops.softmax_backward(y, grad, dim, scale, mask, causal, log, grad_x)
    return grad_x


@pytest.mark.parametrize("layout", ROW_STRIDED_LAYOUTS + ("transposed",))
@pytest.mark.parametrize("device", DEVICES)
def test_softmax_backward_layouts(device, layout):
    """y, grad and grad_x each in its own layout (grad expanded too) give the gradient of
    contiguous tensors, and the op writes nothing but grad_x."""
    shape = (3, 4, 9)
    y = torch.softmax(randn(shape, F32, device, 20), -1)
    grad = randn(shape, F32, device, 21)
    mask = make_mask("bool", (4, 9), device, F32, 22)
    expected = direct_softmax(y, grad, mask=mask)
    yl, gl = with_layout(y, layout), with_layout(grad, "lead_permuted")
    guards = [Untouched(yl), Untouched(gl)]
    grad_x = with_layout(torch.zeros_like(y), layout)
    out_guard = Untouched(grad_x)
    _ops.softmax_backward(yl, gl, -1, 1.0, mask, False, False, grad_x)
    assert all(g.x_unchanged() and g.outside_unchanged() for g in guards)
    assert out_guard.outside_unchanged()
    assert bitwise_equal(grad_x.contiguous(), expected)
    expanded = torch.ones(1, 1, 1, device=device).expand(shape)
    assert bitwise_equal(
        direct_softmax(y, expanded, mask=mask), direct_softmax(y, expanded.contiguous(), mask=mask)
    )


@pytest.mark.parametrize("layout", ROW_STRIDED_LAYOUTS)
@pytest.mark.parametrize("device", DEVICES)
def test_norm_backward_layouts(device, layout):
    shape = (3, 4, 24)
    x, normalized, w, b = norm_case(device, F32, shape, 1, 23, True, True)
    rstd = torch.empty(12, dtype=F32, device=device)
    y = x.clone()
    _ops.layer_norm_(y, normalized, w, b, 1e-5, rstd)
    grad = randn(shape, F32, device, 24)

    def run(y_, g_, dx_):
        gw, gb = torch.empty_like(w), torch.empty_like(b)
        _ops.norm_backward(y_, g_, normalized, w, b, rstd, False, dx_, gw, gb)
        return dx_, gw, gb

    expected = run(y, grad, torch.empty_like(y))
    yl, gl = with_layout(y, layout), with_layout(grad, layout)
    guards = [Untouched(yl), Untouched(gl)]
    dx = with_layout(torch.zeros_like(y), layout)
    out_guard = Untouched(dx)
    got = run(yl, gl, dx)
    assert all(g.x_unchanged() and g.outside_unchanged() for g in guards)
    assert out_guard.outside_unchanged()
    # Other layouts may take another kernel path (scalar instead of vector accesses, other
    # partial sums for dweight/dbias) whose fp32 summation order differs: equal up to fp32
    # rounding, not bitwise.
    torch.testing.assert_close(got[0].contiguous(), expected[0])
    torch.testing.assert_close(got[1], expected[1])
    torch.testing.assert_close(got[2], expected[2])
    # An expanded grad (what y.sum().backward() passes) is read in place or copied.
    ones = torch.ones(1, 1, 1, device=device).expand(shape)
    got = run(y, ones, torch.empty_like(y))
    want = run(y, ones.contiguous(), torch.empty_like(y))
    for a, b_ in zip(got, want):
        torch.testing.assert_close(a, b_)


@pytest.mark.parametrize("device", DEVICES)
def test_norm_backward_partial_outputs(device):
    """Each out argument may be left empty (not wanted); zero rows give zero parameter
    gradients."""
    x, normalized, w, b = norm_case(device, F32, (6, 16), 1, 25, True, True)
    rstd = torch.empty(6, dtype=F32, device=device)
    y = x.clone()
    _ops.layer_norm_(y, normalized, w, b, 1e-5, rstd)
    grad = randn(y.shape, F32, device, 26)
    empty = torch.empty(0, device=device)
    full = [torch.empty_like(y), torch.empty_like(w), torch.empty_like(b)]
    _ops.norm_backward(y, grad, normalized, w, b, rstd, False, *full)
    for keep in range(3):
        outs = [t.clone().fill_(SENTINEL) if i == keep else empty for i, t in enumerate(full)]
        _ops.norm_backward(y, grad, normalized, w, b, rstd, False, *outs)
        assert bitwise_equal(outs[keep], full[keep])
    gw, gb = torch.full_like(w, SENTINEL), torch.full_like(b, SENTINEL)
    y0 = y[:0]
    _ops.norm_backward(
        y0, grad[:0], normalized, w, b, rstd[:0], False, torch.empty_like(y0), gw, gb
    )
    assert (gw == 0).all() and (gb == 0).all()


# --------------------------------------------------------------------------- fp64, opcheck


def _out_of_place(op, **kwargs):
    def fn(x, *tensors):
        y = op(x * 1, *tensors, **kwargs)
        return y.masked_fill(torch.isneginf(y), 0.0)  # masked log_softmax outputs: constant

    return fn


GRADCHECK_CASES = {
    "softmax_mask_causal_scale": (
        _out_of_place(
            mti.softmax_,
            causal=True,
            scale=0.7,
            mask=make_mask("bool", (5, 6), "cpu", F64, 30, True),
        ),
        [(2, 5, 6)],
    ),
    "log_softmax_additive_mask": (
        _out_of_place(mti.log_softmax_, mask=make_mask("additive", (4, 7), "cpu", F64, 31)),
        [(3, 4, 7)],
    ),
    "layer_norm_affine_odd": (
        lambda x, w, b: mti.layer_norm_(x * 1, (13,), w, b),
        [(5, 13), (13,), (13,)],
    ),
    "rms_norm_weight": (lambda x, w: mti.rms_norm_(x * 1, (3, 5), w), [(2, 3, 5), (3, 5)]),
}


@pytest.mark.parametrize("case", GRADCHECK_CASES.values(), ids=GRADCHECK_CASES.keys())
def test_gradcheck_fp64(case):
    fn, shapes = case
    inputs = [
        randn(s, F64, "cpu", i).add_(1.0 if i else 0.0).requires_grad_()
        for i, s in enumerate(shapes)
    ]
    assert gradcheck(fn, tuple(inputs))


def opcheck_samples(device):
    def r(*shape, seed=0):
        return randn(shape, F32, device, seed)

    y = torch.softmax(r(2, 6, 6), -1)
    w, b = 1 + 0.1 * r(6, seed=1), r(6, seed=2)
    rstd = torch.rand(12, device=device) + 0.5
    sb, nb = _ops.softmax_backward, _ops.norm_backward
    e = torch.empty(0, device=device)
    return {
        "softmax": (sb, (y, r(2, 6, 6, seed=3), -1, 0.5, None, False, False, torch.empty_like(y))),
        "log_softmax_causal_mask": (
            sb,
            (y.log(), r(2, 6, 6, seed=4), -1, 1.0, r(6, 6) > 0, True, True, torch.empty_like(y)),
        ),
        "layer_norm": (
            nb,
            (
                y,
                r(2, 6, 6, seed=5),
                [6],
                w,
                b,
                rstd,
                False,
                torch.empty_like(y),
                torch.empty_like(w),
                torch.empty_like(b),
            ),
        ),
        "rms_norm_weight_only": (
            nb,
            (y, r(2, 6, 6, seed=6), [6], w, None, rstd, True, e, torch.empty_like(w), e),
        ),
    }


@pytest.mark.parametrize("sample", list(opcheck_samples("cpu")))
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device, sample):
    op, args = opcheck_samples(device)[sample]
    torch.library.opcheck(op, args)


# --------------------------------------------------------------------------- bad input


def _bad_cases(d):
    y = torch.softmax(randn((4, 8), F32, d, 40), -1)
    g = randn((4, 8), F32, d, 41)
    w, b = torch.ones(8, device=d), torch.zeros(8, device=d)
    rstd = torch.ones(4, device=d)
    e = torch.empty(0, device=d)

    def dx():
        return torch.full((4, 8), SENTINEL, device=d)

    sb, nb = _ops.softmax_backward, _ops.norm_backward
    big = dx()
    return {
        "grad_shape": (
            dx(),
            lambda o: sb(y, g[:, :7], -1, 1.0, None, False, False, o),
            RuntimeError,
            "grad must have y's shape",
        ),
        "grad_dtype": (
            dx(),
            lambda o: sb(y, g.double(), -1, 1.0, None, False, False, o),
            RuntimeError,
            "grad must have y's dtype",
        ),
        "grad_x_dtype": (
            dx().half(),
            lambda o: sb(y, g, -1, 1.0, None, False, False, o),
            RuntimeError,
            "grad_x must have y's dtype",
        ),
        "grad_x_shape": (
            torch.full((4, 7), SENTINEL, device=d),
            lambda o: sb(y, g, -1, 1.0, None, False, False, o),
            RuntimeError,
            "grad_x must have y's shape",
        ),
        "grad_x_is_grad": (
            big,
            lambda o: sb(y, o, -1, 1.0, None, False, False, o),
            RuntimeError,
            "grad_x overlaps grad",
        ),
        "grad_x_expanded": (
            torch.full((1, 8), SENTINEL, device=d).expand(4, 8),
            lambda o: sb(y, g, -1, 1.0, None, False, False, o),
            RuntimeError,
            "grad_x has internally overlapping",
        ),
        "mask_shape": (
            dx(),
            lambda o: sb(y, g, -1, 1.0, torch.ones(3, dtype=torch.bool, device=d), False, False, o),
            RuntimeError,
            "broadcast",
        ),
        "causal_1d": (
            torch.full((8,), SENTINEL, device=d),
            lambda o: sb(y[0], g[0], -1, 1.0, None, True, False, o),
            ValueError,
            "causal",
        ),
        "norm_rstd_size": (
            dx(),
            lambda o: nb(y, g, [8], w, b, rstd[:3], False, o, e, e),
            RuntimeError,
            "rstd must be",
        ),
        "norm_shape": (
            dx(),
            lambda o: nb(y, g, [7], w, b, rstd, False, o, e, e),
            RuntimeError,
            "normalized_shape",
        ),
        "norm_grad_weight_without_weight": (
            dx(),
            lambda o: nb(y, g, [8], None, b, rstd, False, o, torch.empty(8, device=d), e),
            RuntimeError,
            "grad_weight is given but weight is None",
        ),
        "norm_grad_weight_shape": (
            dx(),
            lambda o: nb(y, g, [8], w, b, rstd, False, o, torch.empty(7, device=d), e),
            RuntimeError,
            "grad_weight must be a contiguous tensor of shape",
        ),
        "norm_grad_bias_overlaps_grad_x": (
            big,
            lambda o: nb(y, g, [8], w, b, rstd, False, o, e, o[0]),
            RuntimeError,
            "grad_bias overlaps grad_x",
        ),
        "norm_rms_with_bias": (
            dx(),
            lambda o: nb(y, g, [8], w, b, rstd, True, o, e, e),
            ValueError,
            "no bias",
        ),
    }


BAD_CASES = list(_bad_cases("cpu"))


@pytest.mark.parametrize("case", BAD_CASES)
@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_writes_nothing(device, case):
    out, call, error, message = _bad_cases(device)[case]
    guard = Untouched(out)
    with pytest.raises(error, match=message):
        call(out)
    assert guard.x_unchanged()
