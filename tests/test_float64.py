"""float64 on CUDA: every op, forward and backward, against PyTorch's own float64 ops on the same
GPU (computed before the op overwrites x), over hypothesis shapes, masks and layouts; the extra
memory each op takes; square_matmul_'s zero-workspace kernel at its K limit. gradcheck on CUDA
runs in test_autograd.py, refusals in test_bad_input.py.

Accuracy: there is no more precise PyTorch to hold both the op and PyTorch's float64 op to, so
the op is held to PyTorch's float64 result within F64_ULPS (helpers.py) units of float64's eps
at the output's scale (the largest reference magnitude). Two accurate float64 computations of a
row differ by a few such units (their sums run in other orders); a step taken in float32 (a
scale, an eps or a saved rstd rounded to float32) would differ by about 2^29 of them. The
matmul is held to the classic bound of any order of summation instead: each of the two results
is within (K + 2) * eps * (|x| @ |W| + |b|) of the exact one, so they are within twice that of
each other.
"""

import pytest
import torch
from helpers import (
    LAYOUTS,
    ODD_WIDTHS,
    ROW_STRIDED_LAYOUTS,
    Untouched,
    assert_close64,
    examples,
    lead_shapes,
    output_grad,
    randn,
    ref_log_softmax,
    ref_softmax,
    requires_cuda,
    seeds,
    widths,
    with_layout,
)
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import make_torch_inplace as mti

pytestmark = requires_cuda

F64 = torch.float64
EPS = torch.finfo(F64).eps
DEV = "cuda"


def run_in_place(op, x, *args, **kwargs):
    """op(x, ...) must return x, keep its storage and write nothing outside it."""
    guard = Untouched(x)
    ptr = x.data_ptr()
    assert op(x, *args, **kwargs) is x
    assert x.data_ptr() == ptr
    assert guard.outside_unchanged(), "the op wrote memory outside x"
    return x


def softmax_mask(kind, shape, seed):
    """None, a bool mask (about 70% True, the first row all False: a row that becomes zeros) or
    an additive one (-inf where the bool mask is False, column 0 always kept: PyTorch's
    gradient of a row that an additive mask masks whole is NaN, the op's 0)."""
    if kind == "none":
        return None
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(shape, generator=g) < 0.7
    if kind == "bool":
        keep[0] = False
        return keep.to(DEV)
    keep[..., 0] = True
    additive = torch.randn(shape, generator=g, dtype=F64).masked_fill(~keep, float("-inf"))
    return additive.to(DEV)


def norm_param(shape, seed):
    """A norm weight or bias as trained ones are, around 1 (see test_autograd.py)."""
    return 1.0 + randn(shape, F64, DEV, seed, scale=0.1)


# --------------------------------------------------------------------------- forward


@settings(max_examples=examples(40))
@given(
    lead=lead_shapes(max_dims=2),
    n=widths(),
    dim=st.sampled_from([-1, -2, 0]),
    log=st.booleans(),
    scale=st.sampled_from([None, 0.37, 2.0]),
    mask=st.sampled_from(["none", "bool", "additive"]),
    causal=st.booleans(),
    layout=st.sampled_from(LAYOUTS),
    seed=seeds,
)
def test_softmax(lead, n, dim, log, scale, mask, causal, layout, seed):
    causal = causal and dim == -1
    values = randn((*lead, 3, n), F64, DEV, seed)
    m = softmax_mask(mask, (3, n), seed + 1)
    op, ref = (mti.log_softmax_, ref_log_softmax) if log else (mti.softmax_, ref_softmax)
    expected = ref(values, dim, scale=scale, mask=m, causal=causal)
    x = run_in_place(op, with_layout(values, layout), dim, scale=scale, mask=m, causal=causal)
    assert_close64(x, expected, op.__name__)


@settings(max_examples=examples(40))
@given(
    lead=lead_shapes(max_dims=2),
    n=widths(),
    rms=st.booleans(),
    weight=st.booleans(),
    bias=st.booleans(),
    eps=st.sampled_from([None, 1e-5, 1e-12]),
    layout=st.sampled_from(LAYOUTS),
    seed=seeds,
)
def test_norms(lead, n, rms, weight, bias, eps, layout, seed):
    values = randn((*lead, n), F64, DEV, seed, scale=3.0).add_(0.5)
    w = norm_param((n,), seed + 1) if weight else None
    b = None if rms or not bias else norm_param((n,), seed + 2) - 1.0
    x = with_layout(values, layout)
    if rms:
        expected = torch.nn.functional.rms_norm(values, (n,), w, eps)
        run_in_place(mti.rms_norm_, x, (n,), w, eps)
    else:
        eps = 1e-5 if eps is None else eps
        expected = torch.nn.functional.layer_norm(values, (n,), w, b, eps)
        run_in_place(mti.layer_norm_, x, (n,), w, b, eps)
    assert_close64(x, expected, "rms_norm_" if rms else "layer_norm_")


def matmul_check(out, x, weight, bias, transpose):
    """A check, to call once the op has run, of out against PyTorch's float64 GEMM of x
    (computed here, where x still holds the input) within the bound of any order of summation
    (module docstring)."""
    w = weight.t() if transpose else weight
    expected = x @ w + (0 if bias is None else bias)
    bound = x.abs() @ w.abs() + (0 if bias is None else bias.abs())
    k = x.shape[-1]
    return lambda: (out - expected).abs().le(2 * (k + 2) * EPS * bound).all().item()


# Workspaces: the default (cuBLAS in one or a few chunks), none (the kernel), two rows (chunks
# of fewer than 8 rows: the kernel too, as cuBLAS is less accurate on so few rows), and 8 rows
# plus a little (chunks of 8 rows on two buffers: cuBLAS with copies on a side stream).
WORKSPACES = ["default", "none", "two_rows", "eight_rows"]


def workspace_bytes(kind, k):
    row = 8 * k
    return {"default": None, "none": 0, "two_rows": 2 * row, "eight_rows": 16 * row + 4096}[kind]


@settings(max_examples=examples(40))
@given(
    lead=lead_shapes(max_dims=2, max_size=5),
    k=st.sampled_from(ODD_WIDTHS[:4]) | st.integers(1, 64),
    transpose=st.booleans(),
    with_bias=st.booleans(),
    workspace=st.sampled_from(WORKSPACES),
    layout=st.sampled_from(ROW_STRIDED_LAYOUTS),
    seed=seeds,
)
def test_square_matmul(lead, k, transpose, with_bias, workspace, layout, seed):
    values = randn((*lead, 7, k), F64, DEV, seed)
    weight = randn((k, k), F64, DEV, seed + 1, scale=k**-0.5)
    bias = randn((k,), F64, DEV, seed + 2) if with_bias else None
    x = with_layout(values, layout)
    check = matmul_check(x, values, weight, bias, transpose)
    run_in_place(
        mti.square_matmul_,
        x,
        weight,
        bias,
        transpose=transpose,
        workspace_bytes=workspace_bytes(workspace, k),
    )
    assert check(), f"square_matmul_ out of bound (K={k}, workspace {workspace})"


@pytest.mark.parametrize("ws", [None, 0])
def test_linear(ws):
    values = randn((5, 33), F64, DEV, 1)
    weight = randn((33, 33), F64, DEV, 2, scale=33**-0.5)
    bias = randn((33,), F64, DEV, 3)
    x = values.clone()
    check = matmul_check(x, values, weight, bias, transpose=True)
    run_in_place(mti.linear_, x, weight, bias, workspace_bytes=ws)
    assert check()


def f64_max_k():
    """The largest K that float64's zero-workspace kernel takes: a row of doubles in the
    shared memory one CTA may opt into."""
    return torch.cuda.get_device_properties(DEV).shared_memory_per_block_optin // 8


def test_square_matmul_zero_workspace_at_its_limit():
    """K at the kernel's limit runs without workspace; one more runs through cuBLAS when a
    workspace may be had (the refusal without one is in test_bad_input.py)."""
    for k, ws in ((f64_max_k(), 0), (f64_max_k() + 1, None)):
        values = randn((3, k), F64, DEV, k)
        # A sparse weight keeps the bound's check cheap to build at this size.
        weight = torch.zeros(k, k, dtype=F64, device=DEV)
        weight[:, :: max(1, k // 64)] = 1.0
        weight.diagonal().copy_(randn((k,), F64, DEV, 1))
        x = values.clone()
        check = matmul_check(x, values, weight, None, transpose=False)
        run_in_place(mti.square_matmul_, x, weight, workspace_bytes=ws)
        assert check(), f"K={k}"
        del weight, check


# --------------------------------------------------------------------------- memory


def extra_bytes(fn):
    """Peak allocated device memory during fn() beyond what was allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


@pytest.mark.parametrize("ws", [0, 3 * 8 * 512 + 1024, 1 << 20])
def test_square_matmul_memory_within_workspace(ws):
    x = randn((300, 512), F64, DEV, 1)
    weight = randn((512, 512), F64, DEV, 2, scale=512**-0.5)
    mti.square_matmul_(x.clone(), weight, workspace_bytes=ws)  # the first call's set-up
    assert extra_bytes(lambda: mti.square_matmul_(x, weight, workspace_bytes=ws)) <= ws


def test_rowwise_forward_takes_no_memory():
    x = randn((64, 1000), F64, DEV, 1)
    mask = softmax_mask("additive", (64, 1000), 2)
    w, b = norm_param((1000,), 3), norm_param((1000,), 4)
    for call in (
        lambda: mti.softmax_(x, scale=0.5, mask=mask),
        lambda: mti.log_softmax_(x, causal=True),
        lambda: mti.layer_norm_(x, (1000,), w, b),
        lambda: mti.rms_norm_(x, (1000,), w),
    ):
        call()  # the first call's set-up
        assert extra_bytes(call) == 0


# --------------------------------------------------------------------------- backward


def grads(fn, inputs, grad_out):
    """d fn(*inputs) / d(every input that requires grad), for the output gradient grad_out."""
    leaves = [
        t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
        for t in inputs
    ]
    out = fn(*leaves)
    wrt = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    return torch.autograd.grad(out, wrt, grad_out)


def assert_grads_close(ours, ref, inputs, grad_out, what, terms):
    """terms: for each gradient, the magnitude of the terms it sums (see assert_close64)."""
    ours, theirs = grads(ours, inputs, grad_out), grads(ref, inputs, grad_out)
    for i, (g, r, t) in enumerate(zip(ours, theirs, terms, strict=True)):
        assert_close64(g, r, f"{what} grad #{i}", t)


@settings(max_examples=examples(30))
@given(
    lead=lead_shapes(max_dims=2),
    n=widths(),
    log=st.booleans(),
    scale=st.sampled_from([None, 0.37, 2.0]),
    mask=st.sampled_from(["none", "bool", "additive", "additive_grad"]),
    causal=st.booleans(),
    seed=seeds,
)
def test_softmax_grads(lead, n, log, scale, mask, causal, seed):
    x = randn((*lead, 3, n), F64, DEV, seed).requires_grad_()
    m = softmax_mask(mask.removesuffix("_grad"), (3, n), seed + 1)
    if mask == "additive_grad":
        m.requires_grad_()
    op, ref = (mti.log_softmax_, ref_log_softmax) if log else (mti.softmax_, ref_softmax)
    grad_out = output_grad(x)
    if m is not None and m.dtype == F64:
        # Through x + (-inf), PyTorch passes a masked element's output gradient on; the op
        # gives 0 (its output is constant there). Those gradients are left at 0.
        grad_out = grad_out.masked_fill(torch.isneginf(m), 0.0)

    def ours(x, m):
        return op(x * 1, scale=scale, mask=m, causal=causal)

    def theirs(x, m):
        return ref(x, scale=scale, mask=m, causal=causal)

    # Each row's gradient is g - (a sum over the row) * p, times the scale: terms of up to
    # max|g| + sum |g| * p (sum |g| for log_softmax, whose p = exp(y) sums to 1 too). A mask's
    # gradient sums the rows it is broadcast over.
    with torch.no_grad():
        p = ref(x, scale=scale, mask=m, causal=causal)
        p = p.exp() if log else p
        g = grad_out.abs()
        row = (g.sum(-1) if log else (g * p).sum(-1)).max().item() if g.numel() else 0.0
        z_terms = g.max().item() + row if g.numel() else 0.0
    terms = [z_terms * abs(1.0 if scale is None else scale)]
    if m is not None and m.requires_grad:
        terms.append(z_terms * max(1, x.numel() // max(1, m.numel())))
    assert_grads_close(ours, theirs, [x, m], grad_out, op.__name__, terms)


@settings(max_examples=examples(30))
@given(
    lead=lead_shapes(max_dims=2, max_size=5),
    n=widths(),
    rms=st.booleans(),
    weight=st.sampled_from(["none", "frozen", "grad"]),
    bias=st.sampled_from(["none", "frozen", "grad"]),
    seed=seeds,
)
def test_norm_grads(lead, n, rms, weight, bias, seed):
    # Rows of one element are degenerate: LayerNorm's is exactly 0 (tested below); RMSNorm's
    # gradient is x's rstd * (1 - x_hat^2), a cancellation of order eps that the output, from
    # which the backward recovers x_hat, does not hold to float64's accuracy (README: Autograd).
    assume(n > 1)
    x = randn((*lead, n), F64, DEV, seed, scale=2.0).requires_grad_()
    w = None if weight == "none" else norm_param((n,), seed + 1).requires_grad_(weight == "grad")
    b = None
    if not rms and bias != "none":
        b = (norm_param((n,), seed + 2) - 1.0).requires_grad_(bias == "grad")
    grad_out = output_grad(x)
    if rms:

        def ours(x, w, b):
            return mti.rms_norm_(x * 1, (n,), w)

        def theirs(x, w, b):
            return torch.nn.functional.rms_norm(x, (n,), w)
    else:

        def ours(x, w, b):
            return mti.layer_norm_(x * 1, (n,), w, b)

        def theirs(x, w, b):
            return torch.nn.functional.layer_norm(x, (n,), w, b)

    # grad_x = rstd * (g_hat - mean(g_hat) - x_hat * mean(g_hat * x_hat)), g_hat = g * w;
    # grad_w and grad_b sum g * x_hat and g over the rows.
    with torch.no_grad():
        centred = x if rms else x - x.mean(-1, keepdim=True)
        rstd = (centred.pow(2).mean(-1, keepdim=True) + (EPS if rms else 1e-5)).rsqrt()
        x_hat, g = (centred * rstd).abs(), grad_out.abs()
        g_hat = g if w is None else g * w.abs()
        terms = [
            (rstd * (2 * g_hat.amax(-1, keepdim=True) + x_hat * (g_hat * x_hat).mean(-1, True)))
            .max()
            .item()
            if x.numel()
            else 0.0
        ]
        flat_g, flat_x_hat = g.reshape(-1, n), x_hat.reshape(-1, n)
        if w is not None and w.requires_grad:
            terms.append((flat_g * flat_x_hat).sum(0).max().item())
        if b is not None and b.requires_grad:
            terms.append(flat_g.sum(0).max().item())
    what = "rms_norm_" if rms else "layer_norm_"
    assert_grads_close(ours, theirs, [x, w, b], grad_out, what, terms)


def test_layer_norm_grads_of_one_element():
    """x_hat of a row of one element is exactly 0: so are the gradients of x and weight, where
    PyTorch's are the rounding error of x - mean times 1 / sqrt(eps)."""
    x = randn((5, 1), F64, DEV, 1).requires_grad_()
    w, b = norm_param((1,), 2).requires_grad_(), norm_param((1,), 3).requires_grad_()
    grad_out = output_grad(x)
    out = mti.layer_norm_(x * 1, (1,), w, b)
    assert torch.equal(out, b.detach().expand(5, 1))
    gx, gw, gb = torch.autograd.grad(out, [x, w, b], grad_out)
    assert torch.equal(gx, torch.zeros_like(gx)) and torch.equal(gw, torch.zeros_like(gw))
    assert_close64(gb, grad_out.sum(0), "grad_bias")


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("ws", [None, 0])
def test_square_matmul_grads(transpose, ws):
    x = randn((4, 6, 40), F64, DEV, 1).requires_grad_()
    weight = randn((40, 40), F64, DEV, 2, scale=40**-0.5)
    bias = randn((40,), F64, DEV, 3).requires_grad_()

    def ours(x, b):
        return mti.square_matmul_(x * 1, weight, b, transpose=transpose, workspace_bytes=ws)

    def theirs(x, b):
        return x @ (weight.t() if transpose else weight) + b

    g = output_grad(x)
    w = weight.t() if transpose else weight
    terms = [(g.abs() @ w.t().abs()).max().item(), g.abs().reshape(-1, 40).sum(0).max().item()]
    assert_grads_close(ours, theirs, [x, bias], g, "square_matmul_", terms)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_saved_rstd_is_float64(rms):
    """The norms save each row's rstd in float64 on CUDA (float32 would cost the gradients
    their float64 accuracy)."""
    rows = randn((6, 37), F64, DEV, 5)
    centred = rows if rms else rows - rows.mean(-1, keepdim=True)
    expected = (centred.pow(2).mean(-1) + 1e-5).rsqrt()
    rstd = torch.full((6,), float("nan"), dtype=F64, device=DEV)
    ops = torch.ops.make_torch_inplace
    if rms:
        ops.rms_norm_(rows, [37], None, 1e-5, rstd)
    else:
        ops.layer_norm_(rows, [37], None, None, 1e-5, rstd)
    assert_close64(rstd, expected, "rstd")
