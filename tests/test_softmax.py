"""softmax_ and log_softmax_ against PyTorch on an fp64 reference: any dim, scale, bool and
additive masks with broadcasting, causal (also non-square), fully masked rows, wide rows."""

import pytest
import torch
from helpers import (
    CPU_LONG_ROW_WIDTHS,
    DEVICES,
    DTYPE_PARAMS,
    EVEN_SPLIT_WIDTHS,
    LAYOUTS,
    LONG_ROW_WIDTHS,
    check_op,
    device_params,
    examples,
    lead_shapes,
    randn,
    ref_log_softmax,
    ref_softmax,
    requires_cuda,
    seeds,
    widths,
    with_layout,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import make_torch_inplace as mti

OPS = {False: (mti.softmax_, ref_softmax), True: (mti.log_softmax_, ref_log_softmax)}
LOG_PARAMS = [pytest.param(False, id="softmax"), pytest.param(True, id="log_softmax")]
scales = st.sampled_from([None, 0.125, 0.5, 2.0])


def check_softmax(
    device,
    dtype,
    log,
    shape,
    seed,
    layout="contiguous",
    dim=-1,
    scale=None,
    mask=None,
    causal=False,
):
    op, ref = OPS[log]
    x = with_layout(randn(shape, dtype, device, seed), layout)
    check_op(op, ref, x, dim, scale=scale, mask=mask, causal=causal)


@pytest.mark.parametrize("log", LOG_PARAMS)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=examples(25))
@given(
    lead=lead_shapes(),
    n=widths(),
    layout=st.sampled_from(LAYOUTS),
    scale=scales,
    data=st.data(),
    seed=seeds,
)
def test_any_dim(device, dtype, log, lead, n, layout, scale, data, seed):
    shape = lead + (n,)
    dim = data.draw(st.integers(-len(shape), len(shape) - 1), label="dim")
    check_softmax(device, dtype, log, shape, seed, layout, dim, scale)


@pytest.mark.parametrize("log", LOG_PARAMS)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("layout", ["contiguous", "row_padded", "transposed"])
def test_dim_zero_and_middle(device, dtype, log, dim, layout):
    check_softmax(device, dtype, log, (7, 5, 33), seed=dim + 7, layout=layout, dim=dim)


@pytest.mark.parametrize("log", LOG_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (0, 5), (2, 0, 4)], ids=str)
def test_scalar_and_empty(device, log, shape):
    for dim in range(-max(len(shape), 1), max(len(shape), 1)):
        check_softmax(device, torch.float32, log, shape, seed=1, dim=dim)


def random_mask(kind, shape, device, dtype, seed):
    """A bool mask (True: takes part, about 70%) or an additive one (normal, about 20% -inf)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(shape, generator=g)
    if kind == "bool":
        return (u < 0.7).to(device)
    add = torch.randn(shape, generator=g).masked_fill(u < 0.2, float("-inf"))
    return add.to(device=device, dtype=dtype)


@st.composite
def masked_cases(draw):
    """(x shape, mask shape or None, mask kind, causal, dim): x is (..., q_len, k_len) and the
    mask any shape that broadcasts to it (dims of 1, leading dims left out)."""
    lead = draw(st.lists(st.integers(1, 3), max_size=2))
    shape = tuple(lead) + (draw(st.integers(1, 9)), draw(widths(40)))
    causal = draw(st.booleans())
    kind = draw(st.sampled_from(["bool", "additive", None]))
    mask_shape = None
    if kind is not None:
        kept = [s if draw(st.booleans()) else 1 for s in shape]
        mask_shape = tuple(kept[draw(st.integers(0, len(shape))) :])
    dim = -1 if causal else draw(st.integers(-len(shape), len(shape) - 1))
    return shape, mask_shape, kind, causal, dim


@pytest.mark.parametrize("log", LOG_PARAMS)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=examples(30))
@given(case=masked_cases(), layout=st.sampled_from(LAYOUTS), scale=scales, seed=seeds)
def test_masks_and_causal(device, dtype, log, case, layout, scale, seed):
    shape, mask_shape, kind, causal, dim = case
    mask = None if kind is None else random_mask(kind, mask_shape, device, dtype, seed + 1)
    check_softmax(device, dtype, log, shape, seed, layout, dim, scale, mask, causal)


# Attention's usual masks: (T, T) shared by every batch and head, and (B, 1, 1, T) padding.
ATTENTION_MASKS = {
    "shared_TT": (5, 5),
    "padding_B11T": (2, 1, 1, 5),
    "per_head_1HTT": (1, 3, 5, 5),
    "full": (2, 3, 5, 5),
}


@pytest.mark.parametrize("log", LOG_PARAMS)
@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("mask_shape", ATTENTION_MASKS.values(), ids=ATTENTION_MASKS.keys())
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
def test_attention_masks(device, dtype, mask_shape, kind, log):
    mask = random_mask(kind, mask_shape, device, dtype, seed=3)
    for causal in (False, True):
        check_softmax(
            device, dtype, log, (2, 3, 5, 5), seed=4, scale=0.125, mask=mask, causal=causal
        )


@pytest.mark.parametrize("log", LOG_PARAMS)
@pytest.mark.parametrize("q_len,k_len", [(5, 3), (3, 7), (1, 9), (9, 1), (64, 255)])
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
def test_causal_is_top_left_aligned(device, dtype, q_len, k_len, log):
    """causal keeps (i, j) with j <= i whatever q_len and k_len: the references apply a tril
    bool mask of (q_len, k_len), and every element above the diagonal is masked out."""
    check_softmax(device, dtype, log, (2, q_len, k_len), seed=5, causal=True)
    x = randn((2, q_len, k_len), dtype, device, seed=5)
    OPS[log][0](x, causal=True)
    above = ~torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril()
    assert (x[:, above] == (float("-inf") if log else 0.0)).all()
    assert torch.isfinite(x[:, ~above]).all()


@pytest.mark.parametrize("log", LOG_PARAMS)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
def test_fully_masked_rows_become_zeros(device, dtype, log):
    op, _ = OPS[log]
    keep = torch.ones(4, 6, dtype=torch.bool, device=device)
    keep[1] = False  # row 1: nothing takes part
    keep[2, ::2] = False  # row 2: half of it
    additive = torch.zeros(4, 6, dtype=dtype, device=device).masked_fill(~keep, float("-inf"))
    for mask in (keep, additive):
        x = randn((4, 6), dtype, device, seed=6)
        op(x, mask=mask)
        assert torch.equal(x[1], torch.zeros_like(x[1])), "a fully masked row must be zeros"
        masked_value = float("-inf") if log else 0.0
        assert (x[2, ::2] == masked_value).all()
        assert torch.isfinite(x[2, 1::2]).all()
    # Causal with column 0 masked leaves row 0 with nothing: zeros too.
    col0 = torch.ones(6, dtype=torch.bool, device=device)
    col0[0] = False
    x = randn((3, 6), dtype, device, seed=7)
    op(x, mask=col0, causal=True)
    assert torch.equal(x[0], torch.zeros_like(x[0]))
    check_softmax(device, dtype, log, (3, 6), seed=7, mask=col0, causal=True)


@requires_cuda
@pytest.mark.parametrize("log", LOG_PARAMS)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_cluster_rows_many_per_cluster(dtype, log):
    """Rows that a cluster of CTAs holds on sm_90, many more rows than clusters run at once:
    each cluster strides over rows whose loaded lengths differ (causal limits, a last CTA's
    partial share), reusing its reduction buffers from row to row. (The CPU backend runs
    these rows and masks on the paths of test_long_row_paths and test_masks_and_causal.)"""
    check_softmax("cuda", dtype, log, (2, 300, 40960), seed=14, causal=True)
    mask = random_mask("additive", (40960,), "cuda", dtype, seed=15)
    check_softmax("cuda", dtype, log, (700, 40960), seed=16, scale=0.5, mask=mask)
    mask = random_mask("bool", (700, 32776), "cuda", dtype, seed=17)
    check_softmax("cuda", dtype, log, (700, 32776), seed=18, mask=mask, causal=True)


@pytest.mark.parametrize("log", LOG_PARAMS)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device,n", device_params(LONG_ROW_WIDTHS, CPU_LONG_ROW_WIDTHS))
def test_long_row_paths(device, dtype, log, n):
    """Rows at the edges of the long-row paths, where a CTA's last step, stashed or in
    registers, is empty or partly full; causal rows end inside either step."""
    check_softmax(device, dtype, log, (3, n), seed=19, scale=0.5)
    check_softmax(device, dtype, log, (2, 3, n), seed=20, causal=True)
    mask = random_mask("bool", (3, n), device, dtype, seed=21)
    check_softmax(device, dtype, log, (3, n), seed=22, mask=mask)


@pytest.mark.parametrize("log", LOG_PARAMS)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device,n", device_params(EVEN_SPLIT_WIDTHS, (768,)))
def test_rows_that_warps_share_evenly(device, dtype, log, n):
    """Model widths whose rows whole warps hold exactly at 3, 5, 6 or 7 vectors a thread,
    more rows than a wave of CTAs takes; with a mask, and causal rows that end mid-row."""
    rows = 3 if device == "cpu" else 1001
    check_softmax(device, dtype, log, (rows, n), seed=23, scale=0.5)
    check_softmax(device, dtype, log, (2, 5, n), seed=24, causal=True)
    mask = random_mask("bool", (rows, n), device, dtype, seed=25)
    check_softmax(device, dtype, log, (rows, n), seed=26, mask=mask)


@pytest.mark.parametrize("log", LOG_PARAMS)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
def test_wide_rows(device, dtype, log):
    """Rows of 262144: no per-thread array sized by the row may overflow. A few rows on the
    CPU (CI has 2 cores), more on CUDA, with and without a mask."""
    rows = 2 if device == "cpu" else 16
    check_softmax(device, dtype, log, (rows, 262144), seed=10, scale=0.5)
    if device != "cpu":
        mask = random_mask("bool", (262144,), device, dtype, seed=11)
        check_softmax(device, dtype, log, (rows, 262144), seed=12, mask=mask)
        check_softmax(device, dtype, log, (rows, 65537), seed=13, layout="row_padded")
