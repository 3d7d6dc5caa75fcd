"""layer_norm_ and rms_norm_ against F.layer_norm / F.rms_norm on an fp64 reference: with and
without weight and bias, several trailing normalized dims, eps values, strided rows, and the
per-row rstd that the backward pass saves."""

import functools

import pytest
import torch
from helpers import (
    CPU_LONG_ROW_WIDTHS,
    DEVICES,
    DTYPE_PARAMS,
    EVEN_SPLIT_WIDTHS,
    LAYOUTS,
    LONG_ROW_WIDTHS,
    ROW_STRIDED_LAYOUTS,
    assert_accurate,
    check_op,
    device_params,
    examples,
    lead_shapes,
    numel,
    randn,
    ref_layer_norm,
    ref_rms_norm,
    seeds,
    widths,
    with_layout,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st

import make_torch_inplace as mti

_ops = torch.ops.make_torch_inplace


@st.composite
def norm_cases(draw):
    """(lead dims, normalized_shape, layout): one to three normalized dims; a transposed
    layout only for a single normalized dim (several must merge into one strided dim)."""
    lead = draw(lead_shapes())
    normalized = tuple(draw(st.lists(st.integers(1, 9), min_size=0, max_size=2))) + (
        draw(widths()),
    )
    layouts = LAYOUTS if len(normalized) == 1 else ROW_STRIDED_LAYOUTS
    return lead, normalized, draw(st.sampled_from(layouts))


def affine_params(normalized, dtype, device, seed, with_weight, with_bias):
    weight = randn(normalized, dtype, device, seed + 1) if with_weight else None
    bias = randn(normalized, dtype, device, seed + 2) if with_bias else None
    return weight, bias


def check_layer_norm(device, dtype, lead, normalized, layout, seed, with_weight, with_bias, eps):
    x = with_layout(randn(lead + normalized, dtype, device, seed), layout, len(normalized))
    weight, bias = affine_params(normalized, dtype, device, seed, with_weight, with_bias)
    check_op(mti.layer_norm_, ref_layer_norm, x, normalized, weight, bias, eps)


def check_rms_norm(device, dtype, lead, normalized, layout, seed, with_weight, eps):
    x = with_layout(randn(lead + normalized, dtype, device, seed), layout, len(normalized))
    weight, _ = affine_params(normalized, dtype, device, seed, with_weight, False)
    check_op(mti.rms_norm_, ref_rms_norm, x, normalized, weight, eps)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=examples(30))
@given(
    case=norm_cases(),
    with_weight=st.booleans(),
    with_bias=st.booleans(),
    eps=st.sampled_from([1e-5, 1e-6, 1e-2]),
    seed=seeds,
)
# An fp32 row whose x - pivot (the row's first element) is itself rounded: the kernel must
# normalize x - mean, not (x - pivot) - (mean - pivot).
@example(case=((), (5, 7, 18), "contiguous"), with_weight=True, with_bias=True, eps=1e-5, seed=3609)
# An fp32 row of 16 whose pivot (x[0] = 1.46) is far from its mean (-0.13): the chunks' sums
# and means, taken around the pivot, must still round at |x - mean|, not at |x - pivot|.
@example(
    case=((), (2, 8, 1), "contiguous"), with_weight=True, with_bias=False, eps=1e-6, seed=70169569
)
# An fp32 row of 3 with a weight, where PyTorch is nearly exact: an rstd computed in fp32 is
# an ulp off and fails, so fp32 rows compute it in double (NormOpBase::rstd_of).
@example(case=((), (3,), "contiguous"), with_weight=True, with_bias=False, eps=1e-5, seed=0)
def test_layer_norm(device, dtype, case, with_weight, with_bias, eps, seed):
    lead, normalized, layout = case
    check_layer_norm(device, dtype, lead, normalized, layout, seed, with_weight, with_bias, eps)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=examples(20))
@given(
    rows=st.integers(1, 8),
    n=widths(),
    offset=st.sampled_from([-300.0, 100.0, 1000.0, 3e4]),
    spread=st.sampled_from([1e-3, 1.0, 30.0]),
    seed=seeds,
)
# Rows of 3 at offset 100: a CPU kernel that rounds the mean to fp32 before subtracting it
# fails; its outputs are computed in double.
@example(rows=3, n=3, offset=100.0, spread=30.0, seed=738)
# A row of 50 at offset 1000: fp32 chunks whose first pass sums x rather than x - pivot
# fail, as the chunks' merges then read each chunk's mean from a sum rounded at |x|.
@example(rows=1, n=50, offset=1000.0, spread=1.0, seed=160531)
def test_layer_norm_with_a_large_common_offset(device, dtype, rows, n, offset, spread, seed):
    """Rows far from 0 relative to their spread: the statistics must not lose the spread to
    the offset's rounding (the fp32 kernels reduce relative to a pivot, the 16-bit ones need
    none as long as their values differ at all)."""
    x = (randn((rows, n), torch.float32, device, seed) * spread + offset).to(dtype)
    weight, bias = affine_params((n,), dtype, device, seed, True, True)
    check_op(mti.layer_norm_, ref_layer_norm, x, (n,), weight, bias, 1e-5)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=examples(30))
@given(
    case=norm_cases(),
    with_weight=st.booleans(),
    eps=st.sampled_from([None, 1e-6, 1e-5, 1e-2]),
    seed=seeds,
)
def test_rms_norm(device, dtype, case, with_weight, eps, seed):
    lead, normalized, layout = case
    check_rms_norm(device, dtype, lead, normalized, layout, seed, with_weight, eps)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_default_eps_is_F_rms_norms(device, dtype):
    """eps=None means what it means in F.rms_norm: float32's eps for float32, float16 and
    bfloat16 inputs (the type PyTorch computes the row in), not the input dtype's eps. Values
    of 1e-3 make mean(x^2) ~ 1e-6 comparable to either, so a different default would show."""
    eps = torch.finfo(torch.float32).eps
    values = randn((4, 33), dtype, device, seed=20, scale=1e-3)
    assert torch.equal(ref_rms_norm(values, (33,)), ref_rms_norm(values, (33,), eps=eps))
    x = values.clone()
    check_op(mti.rms_norm_, functools.partial(ref_rms_norm, eps=eps), x, (33,))
    explicit = values.clone()
    mti.rms_norm_(explicit, (33,), eps=eps)
    assert torch.equal(x, explicit)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "shape,normalized", [((0, 7), (7,)), ((3, 0), (0,)), ((2, 0, 4), (0, 4)), ((0,), (0,))], ids=str
)
def test_empty(device, op, shape, normalized):
    if op == "layer_norm":
        check_layer_norm(
            device,
            torch.float32,
            shape[: len(shape) - len(normalized)],
            normalized,
            "contiguous",
            21,
            True,
            True,
            1e-5,
        )
    else:
        check_rms_norm(
            device,
            torch.float32,
            shape[: len(shape) - len(normalized)],
            normalized,
            "contiguous",
            21,
            True,
            1e-5,
        )


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
def test_wide_rows(device, dtype):
    rows = 2 if device == "cpu" else 16
    for layout in ("contiguous", "row_padded"):
        check_layer_norm(device, dtype, (rows,), (262144,), layout, 22, True, True, 1e-5)
        check_rms_norm(device, dtype, (rows,), (262144,), layout, 23, True, None)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device,n", device_params(LONG_ROW_WIDTHS, CPU_LONG_ROW_WIDTHS))
def test_long_row_paths(device, dtype, n):
    """Rows at the edges of the long-row paths, where a CTA's last step, stashed or in
    registers, is empty or partly full, with each param cached or not."""
    for seed, (with_weight, with_bias) in enumerate([(True, True), (False, True)]):
        check_layer_norm(
            device, dtype, (3,), (n,), "contiguous", 50 + seed, with_weight, with_bias, 1e-5
        )
    check_rms_norm(device, dtype, (3,), (n,), "contiguous", 52, True, None)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device,n", device_params(EVEN_SPLIT_WIDTHS, (768,)))
def test_rows_that_warps_share_evenly(device, dtype, n):
    """Model widths whose rows whole warps hold exactly at 3, 5, 6 or 7 vectors a thread,
    more rows than a wave of CTAs takes."""
    rows = 3 if device == "cpu" else 1001
    check_layer_norm(device, dtype, (rows,), (n,), "contiguous", 60, True, True, 1e-5)
    check_rms_norm(device, dtype, (rows,), (n,), "contiguous", 61, True, None)


# The CPU runs every width on one path: one width there (test_wide_rows has rows that span
# several parallel tasks).
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device,n", device_params((2048, 8192, 16384, 40960, 262144), (2048,)))
def test_params_over_many_rows(device, dtype, n):
    """Rows that a CTA or a cluster of CTAs holds, more of them than run at once: on CUDA a
    thread then reads the weight and bias of its columns once (into shared memory, those up
    to the last one given) and applies them to every row it handles; on rows of one CTA
    (N = 16384) it caches a weight given alone, and reads the params from L1 in every row
    when a bias is given."""
    rows = 2 if device == "cpu" else (1 << 23) // n
    for seed, (with_weight, with_bias) in enumerate(
        [(True, True), (True, False), (False, True), (False, False)]
    ):
        check_layer_norm(
            device, dtype, (rows,), (n,), "contiguous", 30 + seed, with_weight, with_bias, 1e-5
        )
        check_rms_norm(device, dtype, (rows,), (n,), "contiguous", 40 + seed, with_weight, None)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "row_padded", "lead_permuted"])
def test_saved_rstd(device, dtype, rms, layout):
    """With a non-empty rstd the dispatcher op writes each row's 1/sqrt(var + eps) (LayerNorm)
    or 1/sqrt(mean(x^2) + eps) (RMSNorm) as float32, in x.reshape(-1, n)'s row order."""
    eps = 1e-5
    normalized = (3, 37)
    x = with_layout(randn((2, 5) + normalized, dtype, device, seed=24), layout, len(normalized))
    rows = x.reshape(-1, numel(normalized))

    def rstd_of(r):
        centred = r if rms else r - r.mean(-1, keepdim=True)
        return (centred.pow(2).mean(-1) + eps).rsqrt()

    ref = rstd_of(rows.double())
    yardstick = rstd_of(rows.float())  # PyTorch computing the same in float32
    rstd = torch.full((rows.shape[0],), float("nan"), device=device)
    if rms:
        _ops.rms_norm_(x, list(normalized), None, eps, rstd)
    else:
        _ops.layer_norm_(x, list(normalized), None, None, eps, rstd)
    assert_accurate(rstd, yardstick, ref, "rstd")
