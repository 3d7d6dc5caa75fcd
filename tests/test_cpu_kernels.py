"""The vectorized CPU kernels at the edges of their loops: rows around the vector widths (8 fp32,
4 fp64, 16 for 16-bit conversions), the 4-vector unrolled sums and the 1024-element chunks of
the sums, with odd sizes between; and the portable kernels (ATEN_CPU_CAPABILITY=default),
which a machine with AVX2 otherwise never runs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_accurate, check_op, randn, ref_log_softmax, ref_rope, ref_softmax
from hypothesis import example, given, settings
from hypothesis import strategies as st

import make_torch_inplace as mti

# fp64 is its own reference (PyTorch's error is 0 there): test_float64 checks it apart.
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Around 8, 16, 32 (one and four vectors), 64, and the chunk boundary of the sums.
EDGE_WIDTHS = st.sampled_from([7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 65, 1023, 1024, 1025, 2049])
widths = EDGE_WIDTHS | st.integers(1, 70)


def _row_case(rows, n, dtype, seed, strided):
    """x (rows, n) in dtype; strided: every other column of a wider buffer (the buffered path)."""
    if strided:
        return randn((rows, 2 * n), dtype, "cpu", seed)[:, ::2]
    return randn((rows, n), dtype, "cpu", seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 5),
    n=widths,
    log=st.booleans(),
    mode=st.sampled_from(["plain", "causal", "bool", "additive"]),
    strided=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_softmax_edges(dtype, rows, n, log, mode, strided, seed):
    x = _row_case(rows, n, dtype, seed, strided)
    kwargs = {"scale": 0.5}
    if mode == "causal":
        kwargs["causal"] = True
    elif mode == "bool":
        kwargs["mask"] = torch.rand(rows, n, generator=torch.Generator().manual_seed(seed)) > 0.3
    elif mode == "additive":
        kwargs["mask"] = randn((1, n), dtype, "cpu", seed + 1)
    op, ref = (mti.log_softmax_, ref_log_softmax) if log else (mti.softmax_, ref_softmax)
    check_op(op, ref, x, -1, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 5),
    n=widths,
    rms=st.booleans(),
    affine=st.booleans(),
    strided=st.booleans(),
    offset=st.sampled_from([0.0, 50.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_norm_edges(dtype, rows, n, rms, affine, strided, offset, seed):
    x = _row_case(rows, n, dtype, seed, strided)
    if offset:
        x.add_(offset)
    w = randn((n,), dtype, "cpu", seed + 1) if affine else None
    if rms:
        check_op(mti.rms_norm_, torch.nn.functional.rms_norm, x, (n,), w, 1e-5)
    else:
        b = randn((n,), dtype, "cpu", seed + 2) if affine else None
        check_op(mti.layer_norm_, torch.nn.functional.layer_norm, x, (n,), w, b, 1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=15, deadline=None)
@given(
    rows=st.integers(1, 4),
    n=widths,
    op=st.sampled_from(["softmax", "log_softmax", "layer_norm", "rms_norm"]),
    seed=st.integers(0, 2**31 - 1),
)
# A 2-wide fp32 LayerNorm row: its gradient all but cancels, and the error of recovering x_hat
# from y is the whole error (twice PyTorch's from x).
@example(rows=1, n=2, op="layer_norm", seed=126)
def test_backward_edges(dtype, rows, n, op, seed):
    """grad_x of ours (from the saved output) against autograd through PyTorch's op, both
    measured against fp64 as check_op measures the forward."""
    x = randn((rows, n), dtype, "cpu", seed)
    dy = randn((rows, n), dtype, "cpu", seed + 7)
    w = randn((n,), dtype, "cpu", seed + 1)
    fns = {
        "softmax": (lambda t, _w: torch.softmax(t, -1), lambda t, _w: mti.softmax_(t, -1)),
        "log_softmax": (
            lambda t, _w: torch.log_softmax(t, -1),
            lambda t, _w: mti.log_softmax_(t, -1),
        ),
        "layer_norm": (
            lambda t, w_: torch.nn.functional.layer_norm(t, (n,), w_),
            lambda t, w_: mti.layer_norm_(t, (n,), w_),
        ),
        "rms_norm": (
            lambda t, w_: torch.nn.functional.rms_norm(t, (n,), w_),
            lambda t, w_: mti.rms_norm_(t, (n,), w_),
        ),
    }
    ref, ours = fns[op]

    def grad(fn, t, w_):
        t = t.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(fn(t if fn is ref else t.clone(), w_), t, dy.to(t.dtype))
        return g

    g64 = grad(ref, x.double(), w.double())
    g_torch = grad(ref, x, w)
    g_ours = grad(ours, x, w)
    err = (g_ours.double() - g64).abs().max().item()
    torch_err = (g_torch.double() - g64).abs().max().item()
    floor = torch.finfo(dtype).eps * g64.abs().max().item()
    if op.endswith("norm"):
        # The norms' backward recovers x_hat = y / w from the saved y (README, Autograd): x_hat
        # carries y's rounding, eps relative, into the term the gradient subtracts,
        # rstd * x_hat * mean(w * dy * x_hat), where PyTorch's, from x, does not. Where the
        # gradient cancels (a 2-wide LayerNorm row's is nearly 0) that is the whole error.
        x64, w64, dy64 = x.double(), w.double(), dy.double()
        if op == "layer_norm":
            x64 = x64 - x64.mean(-1, keepdim=True)
        rstd = x64.pow(2).mean(-1, keepdim=True).add(1e-5).rsqrt()
        x_hat = x64 * rstd
        term = rstd * x_hat.abs() * (w64 * dy64 * x_hat).abs().mean(-1, keepdim=True)
        floor += torch.finfo(dtype).eps * term.max().item()
    assert err <= 2 * torch_err + floor, (err, torch_err)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 5),
    half=st.sampled_from([7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 65]) | st.integers(1, 70),
    strided=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_rope_edges(dtype, rows, half, strided, seed):
    """rope_ with halves around the vector blocks (8 fp32, 16 for 16-bit conversions), forward
    and backward, cos and sin of their own row layouts."""
    n = 2 * half
    x = randn((rows, n + 3 if strided else n), dtype, "cpu", seed)[:, :n]
    cos, sin = randn((rows, n), dtype, "cpu", seed + 1), randn((1, n), dtype, "cpu", seed + 2)
    dy = randn((rows, n), dtype, "cpu", seed + 7)

    def grad(fn, t, c, s, g):
        t = t.clone().requires_grad_(True)
        (out,) = torch.autograd.grad(fn(t * 1, c, s), t, g)
        return out

    to64 = [t.double() for t in (x, cos, sin, dy)]
    g64 = grad(ref_rope, *to64)
    assert_accurate(grad(mti.rope_, x, cos, sin, dy), grad(ref_rope, x, cos, sin, dy), g64)
    check_op(mti.rope_, ref_rope, x, cos, sin)


@settings(max_examples=20, deadline=None)
@given(n=widths, strided=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_float64(n, strided, seed):
    """fp64 rows in fp64 throughout: within a few ulps of PyTorch's fp64 ops."""
    x = _row_case(3, n, torch.float64, seed, strided)
    w, b = randn((n,), torch.float64, "cpu", seed + 1), randn((n,), torch.float64, "cpu", seed + 2)
    cases = [
        (lambda t: mti.softmax_(t, -1, causal=True), lambda t: ref_softmax(t, -1, causal=True)),
        (lambda t: mti.log_softmax_(t, -1), lambda t: torch.log_softmax(t, -1)),
        (
            lambda t: mti.layer_norm_(t, (n,), w, b),
            lambda t: torch.nn.functional.layer_norm(t, (n,), w, b),
        ),
        (
            lambda t: mti.rms_norm_(t, (n,), w),
            lambda t: torch.nn.functional.rms_norm(t, (n,), w),
        ),
    ]
    for ours, ref in cases:
        expected = ref(x.clone())
        torch.testing.assert_close(ours(x.clone()), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() == "DEFAULT", reason="the portable kernels run anyway"
)
def test_portable_kernels():
    """This file again with ATEN_CPU_CAPABILITY=default, which selects the portable kernels."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-x", "-p", "no:xdist"]
    cmd += ["-k", "not portable", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, cwd=root / "tests", env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
