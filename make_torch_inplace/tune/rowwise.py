"""The row-wise kernels' tuned parameters (csrc/kernels/rowwise/tuning.h): softmax_ /
log_softmax_, layer_norm_ and rms_norm_, forward and backward.

Each parameter's cases are the calls whose launch it decides (an op, a dtype and a row length
n; 2^26 elements when timed). Its check runs the op on a few rows of the case's length, the
backward too where the parameter is the backward's, and holds the result to the fp64
reference within twice PyTorch's own error in the dtype (the tests' rule)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import ops
from . import Case, Parameter

_ops = torch.ops.make_torch_inplace

FAMILY = "rowwise"
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
TIMED_ELEMENTS = 1 << 26  # elements per tensor of a timed call
CHECKED_ELEMENTS = 1 << 21  # at most, per tensor of a checked call (at least 3 rows)
EPS = {"layer_norm": 1e-5, "rms_norm": 1e-6}


@dataclass(frozen=True)
class Call:
    """A call of one row-wise op on rows of n elements: `op` is softmax, log_softmax,
    layer_norm or rms_norm; `masked`: softmax with a bool mask over the columns; `backward`:
    the backward pass (with the norms' weight and bias gradients)."""

    op: str
    dtype: torch.dtype
    n: int
    masked: bool = False
    backward: bool = False
    device: str = "cuda"


@dataclass(frozen=True)
class RowCase(Case):
    call: Call | None = None


def _randn(shape, dtype, device, seed, scale=1.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale + shift).to(device=device, dtype=dtype)


def _inputs(call: Call, rows: int):
    """x, and the op's extra arguments: the mask (softmax) or weight and bias (norms)."""
    n = call.n
    if call.op in ("softmax", "log_softmax"):
        x = _randn((rows, n), call.dtype, call.device, n, scale=3.0)
        mask = None
        if call.masked:
            keep = torch.rand(n, generator=torch.Generator().manual_seed(n + 1)) < 0.7
            keep[0] = True  # no row is masked whole
            mask = keep.to(call.device)
        return x, (mask,)
    # Around 1 and 0 as trained ones are: the backward recovers x_hat = (y - bias) / weight.
    x = _randn((rows, n), call.dtype, call.device, n, scale=2.0, shift=0.5)
    w = _randn((n,), F32, call.device, n + 1, scale=0.1, shift=1.0).to(call.dtype)
    b = _randn((n,), call.dtype, call.device, n + 2, scale=0.1) if call.op == "layer_norm" else None
    return x, (w, b)


def _reference(call: Call, x, extra):
    """PyTorch's op on x (any dtype) with the case's arguments."""
    if call.op in ("softmax", "log_softmax"):
        (mask,) = extra
        z = x if mask is None else x.masked_fill(~mask, float("-inf"))
        return F.softmax(z, -1) if call.op == "softmax" else F.log_softmax(z, -1)
    w, b = extra
    w = w.to(x.dtype)
    if call.op == "layer_norm":
        return F.layer_norm(x, (call.n,), w, b.to(x.dtype), EPS["layer_norm"])
    return F.rms_norm(x, (call.n,), w, EPS["rms_norm"])


def _ours(call: Call, x, extra):
    """The in-place op on x (which it overwrites) with the case's arguments."""
    if call.op in ("softmax", "log_softmax"):
        op = ops.softmax_ if call.op == "softmax" else ops.log_softmax_
        return op(x, -1, mask=extra[0])
    w, b = extra
    if call.op == "layer_norm":
        return ops.layer_norm_(x, (call.n,), w, b, EPS["layer_norm"])
    return ops.rms_norm_(x, (call.n,), w, EPS["rms_norm"])


def _grads(fn, x, extra, grad_out):
    """The gradients of fn(x, extra) for grad_out w.r.t. x and the norms' weight and bias."""
    leaves = [
        t.detach().requires_grad_() if t is not None and t.is_floating_point() else t
        for t in (x, *extra)
    ]
    out = fn(leaves[0] * 1, tuple(leaves[1:]))  # * 1: an in-place op may not take a leaf
    wrt = [t for t in leaves if t is not None and t.requires_grad]
    return torch.autograd.grad(out, wrt, grad_out)


def _assert_accurate(ours, torch_out, ref, what):
    finite = torch.isfinite(ref)
    assert torch.equal(ours.double()[~finite], ref[~finite]), f"{what}: non-finite entries differ"
    o, t, r = ours.double()[finite], torch_out.double()[finite], ref[finite]
    if r.numel() == 0:
        return
    err = (o - r).abs().max().item()
    allowed = 2 * (t - r).abs().max().item() + torch.finfo(ours.dtype).eps * r.abs().max().item()
    assert err <= allowed, f"{what}: max error {err:.3e}, allowed {allowed:.3e}"


def check(case: RowCase) -> None:
    """The op (and its backward for a backward case) against the fp64 reference, references
    first: the op overwrites its input."""
    call, what = case.call, case.label
    rows = max(3, CHECKED_ELEMENTS // call.n)
    x, extra = _inputs(call, rows)
    wide = tuple(t.double() if t is not None and t.is_floating_point() else t for t in extra)
    if not call.backward:
        ref64 = _reference(call, x.double(), wide)
        torch_out = _reference(call, x, extra)
        _assert_accurate(_ours(call, x.clone(), extra), torch_out, ref64, what)
        return
    grad_out = _randn(x.shape, call.dtype, call.device, call.n + 3)
    ref64 = _grads(lambda v, e: _reference(call, v, e), x.double(), wide, grad_out.double())
    torch_grads = _grads(lambda v, e: _reference(call, v, e), x, extra, grad_out)
    ours = _grads(lambda v, e: _ours(call, v, e), x, extra, grad_out)
    for i, (g, t, r) in enumerate(zip(ours, torch_grads, ref64)):
        _assert_accurate(g, t, r, f"{what} grad #{i}")


def _timed(call: Call):
    """A callable running the case's call once on 2^26-element tensors."""
    x, extra = _inputs(call, TIMED_ELEMENTS // call.n)
    if call.op in ("softmax", "log_softmax"):
        log = call.op == "log_softmax"
        (mask,) = extra
        if not call.backward:
            return lambda: _ops.softmax_(x, -1, 1.0, mask, False, log)
        _ops.softmax_(x, -1, 1.0, mask, False, log)
        grad, grad_x = torch.randn_like(x), torch.empty_like(x)
        return lambda: _ops.softmax_backward(x, grad, -1, 1.0, mask, False, log, grad_x)
    w, b = extra
    rms, shape, eps = call.op == "rms_norm", [call.n], EPS[call.op]
    rstd = torch.empty(x.shape[0] if call.backward else 0, dtype=F32, device=x.device)

    def forward():
        if rms:
            _ops.rms_norm_(x, shape, w, eps, rstd)
        else:
            _ops.layer_norm_(x, shape, w, b, eps, rstd)

    if not call.backward:
        return forward
    forward()
    grad, grad_x, grad_w = torch.randn_like(x), torch.empty_like(x), torch.empty_like(w)
    grad_b = torch.empty_like(b) if b is not None else torch.empty(0, device=x.device)
    return lambda: _ops.norm_backward(x, grad, shape, w, b, rstd, rms, grad_x, grad_w, grad_b)


def _case(call: Call) -> RowCase:
    label = (
        f"{call.op}{' masked' if call.masked else ''} "
        f"{str(call.dtype).removeprefix('torch.')} n={call.n}"
        f"{' backward' if call.backward else ''}"
    )
    return RowCase(label, call.dtype.itemsize, call.n, functools.partial(_timed, call), call)


def _cases(*specs, backward=False):
    """cases(device) for `specs`: (op, dtype, n) or (op, dtype, n, masked)."""
    return lambda device: [_case(Call(*s, backward=backward, device=device)) for s in specs]


def _param(name, candidates, cases, doc):
    return Parameter(f"rowwise.{name}", FAMILY, candidates, cases, check, doc)


PARAMETERS = [
    _param(
        "max_cluster",
        (1, 2, 4, 8, 16),
        lambda device: (
            _cases(
                ("softmax", BF16, 65536),
                ("softmax", BF16, 262144),
                ("softmax", F32, 262144),
                ("rms_norm", BF16, 131072),
            )(device)
            + _cases(("layer_norm", BF16, 65536), ("softmax", F32, 131072), backward=True)(device)
        ),
        "the most CTAs of a cluster that holds a row, forward and backward",
    ),
    # Forward.
    _param(
        "forward.stash_max_cluster",
        (0, 1, 2, 4, 8, 16),
        _cases(
            ("softmax", F32, 65536),
            ("softmax", F32, 131072),
            ("log_softmax", F32, 262144),
            ("softmax", BF16, 65536),
            ("softmax", BF16, 262144),
            ("rms_norm", BF16, 32768),
        ),
        "the largest cluster a stashed row takes",
    ),
    _param(
        "forward.softmax_cta_row_values",
        (16, 32, 64),
        _cases(
            ("softmax", BF16, 4096),
            ("softmax", BF16, 8192),
            ("softmax", F16, 12288),
            ("log_softmax", BF16, 12288),
            ("softmax", BF16, 8192, True),
            ("softmax", BF16, 2560),
            ("softmax", F32, 4096),
        ),
        "values a thread holds of a row that a CTA holds in registers (softmax)",
    ),
    _param(
        "forward.rms_norm_cta_row_values",
        (16, 32, 64),
        _cases(
            ("rms_norm", BF16, 2048),
            ("rms_norm", BF16, 4096),
            ("rms_norm", BF16, 8192),
            ("rms_norm", F16, 12288),
            ("rms_norm", BF16, 5120),
            ("rms_norm", F32, 8192),
        ),
        "values a thread holds of a row that a CTA holds in registers (RMSNorm)",
    ),
    _param(
        "forward.layer_norm_cta_row_values",
        (16, 32, 64),
        _cases(
            ("layer_norm", BF16, 2048),
            ("layer_norm", BF16, 4096),
            ("layer_norm", BF16, 8192),
            ("layer_norm", F16, 8192),
            ("layer_norm", BF16, 3072),
            ("layer_norm", BF16, 5120),
            ("layer_norm", F32, 4096),
            ("layer_norm", F32, 8192),
        ),
        "values a thread holds of a row that a CTA holds in registers (LayerNorm)",
    ),
    _param(
        "forward.params_cta_row_threads",
        (160, 192, 224, 256),
        _cases(
            ("layer_norm", BF16, 12288), ("layer_norm", BF16, 14336), ("layer_norm", F16, 16384)
        ),
        "the longest rows of an op with params on the CTA-per-row register path",
    ),
    _param(
        "forward.softmax_rows_per_cta",
        (0, 1, 2, 4),
        _cases(
            ("softmax", F32, 256),
            ("softmax", F32, 1024),
            ("softmax", F32, 4096),
            ("softmax", BF16, 1024),
            ("softmax", BF16, 4096),
            ("log_softmax", BF16, 8192),
            ("softmax", BF16, 2048, True),
            ("softmax", BF16, 16384),
        ),
        "row groups per CTA of single-CTA launches, softmax (0: resident CTAs striding)",
    ),
    _param(
        "forward.rms_norm_rows_per_cta",
        (0, 1, 2, 4),
        _cases(("rms_norm", BF16, 1024), ("rms_norm", BF16, 4096), ("rms_norm", F32, 16384)),
        "row groups per CTA of single-CTA launches, RMSNorm (0: resident CTAs striding)",
    ),
    _param(
        "forward.layer_norm_rows_per_cta",
        (0, 1, 2, 4),
        _cases(
            ("layer_norm", BF16, 256),
            ("layer_norm", BF16, 1024),
            ("layer_norm", BF16, 4096),
            ("layer_norm", F16, 8192),
            ("layer_norm", F32, 1024),
            ("layer_norm", F32, 4096),
        ),
        "row groups per CTA of single-CTA launches, LayerNorm (0: resident CTAs striding)",
    ),
    _param(
        "forward.rows_per_pair",
        (0, 1, 2, 4),
        _cases(("softmax", F32, 65536), ("softmax", BF16, 65536), ("log_softmax", F16, 65536)),
        "rows per cluster of two CTAs that cache nothing (0: resident clusters striding)",
    ),
    _param(
        "forward.cta_cached_params",
        (0, 1, 2),
        _cases(("layer_norm", F32, 16384), ("layer_norm", BF16, 16384), ("rms_norm", BF16, 16384)),
        "the most params a row held by one CTA caches in shared memory",
    ),
    # Backward.
    _param(
        "backward.threads_per_sm",
        (1024, 2048, 4096),
        _cases(("layer_norm", BF16, 131080), ("softmax", F32, 8191), backward=True),
        "threads per SM that a streamed grid is sized for",
    ),
    _param(
        "backward.softmax_cluster_registers",
        (0, 1, 2),
        _cases(
            ("softmax", F32, 32768),
            ("softmax", F32, 131072),
            ("softmax", BF16, 65536),
            ("softmax", BF16, 131072),
            ("softmax", BF16, 262144),
            backward=True,
        ),
        "softmax's rows past a CTA's registers: 0 staged, 1 registers on large CTAs, 2 all",
    ),
    _param(
        "backward.log_softmax_cluster_registers",
        (0, 1, 2),
        _cases(
            ("log_softmax", F32, 16384),
            ("log_softmax", F32, 32768),
            ("log_softmax", F32, 65536),
            ("log_softmax", F32, 131072),
            ("log_softmax", BF16, 65536),
            ("log_softmax", BF16, 131072),
            ("log_softmax", F16, 262144),
            backward=True,
        ),
        "log_softmax's, without a mask tensor",
    ),
    _param(
        "backward.masked_log_softmax_cluster_registers",
        (0, 1, 2),
        _cases(
            ("log_softmax", F32, 32768, True),
            ("log_softmax", BF16, 65536, True),
            ("log_softmax", BF16, 131072, True),
            backward=True,
        ),
        "log_softmax's, with a mask tensor",
    ),
    _param(
        "backward.softmax_row_per_cta",
        (0, 1),
        _cases(
            ("softmax", BF16, 2048),
            ("softmax", BF16, 8192),
            ("log_softmax", F16, 4096),
            ("softmax", F32, 4096),
            backward=True,
        ),
        "whether softmax's register rows of more than a warp take a CTA each",
    ),
    _param(
        "backward.large_cluster_min",
        (2, 4, 9, 17),
        _cases(
            ("softmax", F32, 32768),
            ("softmax", F32, 131072),
            ("softmax", BF16, 65536),
            ("softmax", BF16, 131072),
            ("log_softmax", BF16, 131072),
            backward=True,
        ),
        "the fewest CTAs of a register cluster for it to take large CTAs",
    ),
    _param(
        "backward.grouped_rows_past_cluster",
        (1, 4, 8, 16),
        _cases(
            ("layer_norm", BF16, 16384),
            ("layer_norm", BF16, 32768),
            ("layer_norm", BF16, 65536),
            ("rms_norm", BF16, 32768),
            ("rms_norm", F16, 65536),
            backward=True,
        ),
        "shared-path clusters past this take 16-bit norm rows two at a time",
    ),
    _param(
        "backward.shared_waves",
        (1, 2, 4, 8),
        _cases(
            ("log_softmax", BF16, 65536),
            ("log_softmax", F16, 65536, True),
            ("log_softmax", BF16, 40960, True),
            backward=True,
        ),
        "grid waves of shared-path clusters that neither sum nor cache",
    ),
    _param(
        "backward.shared_waves_max_cluster",
        (0, 4, 8, 16),
        _cases(
            ("log_softmax", BF16, 65536, True), ("log_softmax", BF16, 131072, True), backward=True
        ),
        "the largest such clusters that take shared_waves",
    ),
    _param(
        "backward.wide_waves",
        (0, 1, 2, 4),
        _cases(("log_softmax", BF16, 32768), ("log_softmax", BF16, 16384, True), backward=True),
        "grid waves of softmax's wide rows that do not take a CTA each",
    ),
    _param(
        "backward.column_sums_ctas_per_sm",
        (2, 4, 8, 16),
        _cases(
            ("layer_norm", F32, 131080),
            ("layer_norm", BF16, 131080),
            ("rms_norm", F32, 70001),
            backward=True,
        ),
        "CTAs per SM of the column pass of the parameter gradient sums",
    ),
    _param(
        "backward.sum_max_slices",
        (4, 8, 16, 32, 64, 256),
        _cases(
            ("layer_norm", BF16, 256),
            ("layer_norm", BF16, 1024),
            ("layer_norm", BF16, 4096),
            ("layer_norm", F32, 16384),
            ("rms_norm", F32, 256),
            backward=True,
        ),
        "the most slices of a CTA that share the partial rows of the parameter gradients",
    ),
]
