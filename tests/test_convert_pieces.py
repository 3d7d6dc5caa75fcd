"""The runtime helpers that rewritten graphs call (make_torch_inplace/convert/pieces.py):
square matmuls over a dead x, products written over their left operand, and attention a few
matrices at a time. Each against an fp64 reference, with the op it replaces as the yardstick."""

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    assert_accurate,
    examples,
    lead_shapes,
    randn,
    ref_log_softmax,
    ref_softmax,
    seeds,
)
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

import make_torch_inplace as mti
from benchmarks.live_tensors import LiveTensors


@settings(max_examples=examples(40), deadline=None)
@given(
    batch=lead_shapes(max_dims=2, max_size=3),
    k=st.integers(1, 12),
    form=st.sampled_from(["linear", "matmul", "addmm"]),
    x_bytes_over_limit=st.booleans(),
    seed=seeds,
)
def test_square_matmul_over_dead(batch, k, form, x_bytes_over_limit, seed):
    """A dead x's square product is written over x where x is larger than the workspace
    limit, and allocated afresh (as the original op does) where it fits: equal to the
    original op within its error either way."""
    if form == "addmm":  # addmm's x is a matrix
        batch = [math.prod(batch)]
    x = randn((*batch, k), torch.float32, "cpu", seed)
    assume(x.numel() > 0)
    weight = randn((k, k), torch.float32, "cpu", seed + 1, scale=k**-0.5)
    bias = None if form == "matmul" else randn((k,), torch.float32, "cpu", seed + 2)
    original = {
        "linear": lambda x, w, b: F.linear(x, w, b),
        "matmul": lambda x, w, b: torch.matmul(x, w),
        "addmm": lambda x, w, b: torch.addmm(b, x, w),
    }[form]
    ref64 = original(x.double(), weight.double(), None if bias is None else bias.double())
    expected = original(x, weight, bias)
    x_bytes = x.numel() * x.element_size()
    limit = x_bytes - 1 if x_bytes_over_limit else x_bytes
    convert_module = importlib.import_module("make_torch_inplace.convert")
    with mti.workspace_limit(limit):
        out = convert_module.square_matmul_over_dead(x, weight, bias, form == "linear")
    assert_accurate(out, expected, ref64)
    assert (out.data_ptr() == x.data_ptr()) == x_bytes_over_limit


def assert_within_dot_error(out, a64, b64):
    """out is a @ b in fp32 (a64, b64: the fp32 operands in fp64, in which their products are
    exact) up to the rounding error of a length-k dot product summed in any order, with or
    without FMA: |out - a @ b| <= gamma_k (|a| @ |b|) elementwise, gamma_k = k u / (1 - k u),
    u = 2^-24 (Higham, Accuracy and Stability of Numerical Algorithms, 3.1). PyTorch's own
    error is no yardstick here: with k this small it can be far below the bound by luck of
    the order its kernel sums in, which varies with the op and the CPU."""
    k = a64.shape[-1]
    u = torch.finfo(torch.float32).eps / 2
    exact = a64 @ b64
    bound = k * u / (1 - k * u) * (a64.abs() @ b64.abs())
    assert out.dtype == torch.float32 and out.shape == exact.shape
    err = (out.double() - exact).abs()
    assert (err <= bound).all(), f"error {err.max().item():.3e} over the bound somewhere"


@settings(max_examples=examples(40), deadline=None)
@given(
    batch=lead_shapes(max_dims=2, max_size=3),
    m=st.integers(0, 9),
    k=st.integers(1, 12),
    n_less=st.integers(0, 11),
    piece_matrices=st.integers(1, 4),
    seed=seeds,
)
# Tiny products whose error differs many-fold between summation orders, which differ between
# torch.matmul (a BLAS gemm) and the small-matrix bmm on some CPUs: measured against each
# other's error, either fails about one case in a hundred.
@example(batch=(), m=1, k=8, n_less=7, piece_matrices=1, seed=388)
@example(batch=(), m=2, k=9, n_less=8, piece_matrices=1, seed=245)
def test_matmul_over_left(batch, m, k, n_less, piece_matrices, seed, monkeypatch):
    """a @ b over a's memory, a few matrices at a time (pieces shrunk to `piece_matrices`
    matrices): within fp32's rounding error of the exact product, contiguous, at a's first
    element; or, where the product is one piece, in memory of its own."""
    n = max(1, k - n_less)
    a = randn((*batch, m, k), torch.float32, "cpu", seed)
    b = randn((*batch, n, k), torch.float32, "cpu", seed + 1).transpose(-1, -2)  # strided
    a64, b64 = a.double(), b.double()  # before a is written over
    count = math.prod(batch)
    pieces = importlib.import_module("make_torch_inplace.convert.pieces")
    monkeypatch.setattr(pieces, "_OVER_LEFT_PIECE_BYTES", piece_matrices * m * n * 4)
    out = pieces.matmul_over_left(a, b)
    assert_within_dot_error(out, a64, b64)
    assert out.is_contiguous()
    if out.numel():  # (empty tensors may all have data_ptr 0)
        assert (out.data_ptr() == a.data_ptr()) == (count > piece_matrices)


@settings(max_examples=examples(60), deadline=None)
@given(
    batch=lead_shapes(max_dims=3, max_size=3).filter(bool),
    t=st.integers(1, 9),
    s=st.integers(1, 9),
    d=st.integers(1, 5),
    dv=st.integers(1, 9),
    piece_matrices=st.integers(1, 4),
    mask_kind=st.sampled_from([None, "additive", "bool"]),
    broadcast=st.integers(0, 15),
    scale=st.sampled_from([None, 0.5]),
    causal=st.booleans(),
    log=st.booleans(),
    over_left=st.booleans(),
    seed=seeds,
)
# The row where PyTorch's product was the more accurate (see `expected`).
@example(
    batch=(1,),
    t=1,
    s=3,
    d=4,
    dv=1,
    piece_matrices=1,
    mask_kind=None,
    broadcast=0,
    scale=None,
    causal=False,
    log=True,
    over_left=False,
    seed=0,
)
def test_attention_in_pieces(
    batch, t, s, d, dv, piece_matrices, mask_kind, broadcast, scale, causal, log, over_left, seed
):
    """softmax(q @ k_t * scale + mask) @ v a few matrices of the last batch dim at a time
    (pieces of `piece_matrices` matrices), with a mask broadcast over any of the dims: equal
    to the unpieced computation within its error against fp64; q, k_t, v and the mask are
    left as they were."""
    if log:  # masked log-probabilities are -inf, which makes a product meaningless
        mask_kind, causal = None, False
    q = randn((*batch, t, d), torch.float32, "cpu", seed)
    k_t = randn((*batch, s, d), torch.float32, "cpu", seed + 1).transpose(-1, -2)  # strided
    v = randn((*batch, s, dv), torch.float32, "cpu", seed + 2)
    kwargs = {"scale": scale, "causal": causal}
    if mask_kind is not None:
        # Size 1 in the dims whose bit is set in `broadcast`; fewer dims than the scores when
        # the leading batch dim is broadcast.
        shape = [1 if broadcast >> i & 1 else n for i, n in enumerate((*batch, t, s))]
        mask = randn(shape, torch.float32, "cpu", seed + 3)
        if mask_kind == "bool":
            mask = mask > -1.0
        kwargs["mask"] = mask[0] if shape[0] == 1 and len(shape) > 3 else mask
    inputs = [q, k_t, v, kwargs.get("mask")]
    before = [None if x is None else x.clone() for x in inputs]
    ref_fn = ref_log_softmax if log else ref_softmax

    def reference(q, k_t, v, mask):
        kw = {**kwargs, "mask": mask}
        return ref_fn(q @ k_t, -1, **kw) @ v

    def unpieced(q, k_t, v, mask):  # the same ops in one piece: the yardstick
        scores = q @ k_t
        (mti.log_softmax_ if log else mti.softmax_)(scores, -1, **{**kwargs, "mask": mask})
        return scores @ v

    ref64 = reference(
        *(None if x is None else x.double() if x.is_floating_point() else x for x in inputs)
    )
    # Not PyTorch's result: log_softmax_'s rounding shifts a row by one constant (its log-sum-
    # exp) where PyTorch's varies per element, and "@ v" weighs a constant shift by sum(v),
    # which can cancel to far less than the terms. Such a row (t = 1, s = 3, seed 0) had
    # log_softmax_ within PyTorch's error per element (1.1e-7 against 1.0-1.3e-7) and the
    # product at 3x PyTorch's (8.8e-8 against 2.9e-8). log_softmax_'s own accuracy is
    # test_softmax.py's; this test checks that the pieces compute the unpieced result.
    expected = unpieced(*inputs)
    convert_module = importlib.import_module("make_torch_inplace.convert")
    with mti.workspace_limit(piece_matrices * t * s * 4):
        out = convert_module.attention_in_pieces(
            q, k_t, v, dim=-1, log=log, over_left=over_left and dv <= s, **kwargs
        )
    assert_accurate(out, expected, ref64)
    assert out.shape == (*batch, t, dv) and out.is_contiguous()
    for x, b in zip(inputs, before, strict=True):
        assert x is None or torch.equal(x, b)


def test_pieces_hold_one_piece_at_a_time():
    """attention_in_pieces allocates its output and one piece of scores at a time, and the
    SwiGLU backward written over its inputs at most a piece of grad's copy (an eighth of the
    workspace limit): never the previous piece's beside the next one's."""
    convert_module = importlib.import_module("make_torch_inplace.convert")
    from make_torch_inplace.convert.pieces import _silu_mul_grads_over

    t, s, d, limit = 16, 24, 8, 2 * 16 * 24 * 4  # two matrices of scores a piece
    q, k, v = (randn((2, 8, n, d), torch.float32, "cpu", i) for i, n in enumerate((t, s, s)))
    tracker = LiveTensors()
    with mti.workspace_limit(limit), tracker:
        out = convert_module.attention_in_pieces(q, k.transpose(-1, -2), v, dim=-1)
    assert out.nbytes + limit // 2 < tracker.peak <= out.nbytes + limit

    # A contiguous grad needs no temporary; a strided one is copied four rows at a time.
    n, limit = 32, 8 * 32 * 4 * 4
    g, u, grad = (randn((64, n), torch.float32, "cpu", i) for i in range(3))
    tracker = LiveTensors()
    with mti.workspace_limit(limit), tracker:
        _silu_mul_grads_over(grad, g, u)
    assert tracker.peak == 0
    strided = randn((n, 64), torch.float32, "cpu", 3).t()
    tracker = LiveTensors()
    with mti.workspace_limit(limit), tracker:
        _silu_mul_grads_over(strided, g, u)
    assert limit // 16 < tracker.peak <= limit // 8


def test_matmul_over_left_refuses_a_narrower_than_the_product():
    convert_module = importlib.import_module("make_torch_inplace.convert")
    a, b = torch.randn(2, 4, 3), torch.randn(2, 3, 5)
    before = a.clone()
    with pytest.raises(ValueError, match="N <= K"):
        convert_module.matmul_over_left(a, b)
    assert torch.equal(a, before)
