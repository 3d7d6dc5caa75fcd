"""Shared pieces of the test suite: devices, dtypes, reference implementations of every op,
input layouts, and the one check that every op test goes through (`check_op`).

The accuracy rule is flash-attention's: an op in dtype D may be off the fp64 reference by at
most twice what PyTorch's own computation in D is off it (max abs error), plus eps(D) times
the largest reference magnitude, i.e. one to two units in the last place there: two correct
computations of one value, rounded to D, can land on neighbouring representable numbers,
which matters where PyTorch happens to be exact (a width-1 softmax, a tiny product).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import strategies as st

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_PARAMS = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in DTYPES]

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


def device_params(cases, cpu):
    """(device, case) params for parametrize("device,<name>", ...): every case on CUDA, where
    each takes a kernel path of its own, and on the CPU only the cases in `cpu`, for cases
    that the CPU backend runs on the same path as those. `cases`: values, or a dict of
    id -> value."""
    named = cases if isinstance(cases, dict) else {str(v): v for v in cases}
    return [pytest.param("cpu", v, id=f"cpu-{k}") for k, v in named.items() if v in cpu] + [
        pytest.param("cuda", v, id=f"cuda-{k}", marks=requires_cuda) for k, v in named.items()
    ]


# Row widths the issue names: 1, tiny odd, just under a power of two, not a multiple of any
# vector width, and just over a power of two.
ODD_WIDTHS = (1, 3, 255, 1000, 4097)

# Row widths at the edges of the CUDA kernels' long-row paths (a CTA's registers hold 16384
# elements; past that 16-bit softmax rows keep as much again in shared memory, other rows take
# a cluster of CTAs): a CTA's registers seven eighths and one vector full (16-bit LayerNorm
# takes the cluster path there), full, the first column past them, a stashed step half full, a
# cluster whose last CTA holds one vector, and the same with a cluster of four.
LONG_ROW_WIDTHS = (14344, 16384, 16392, 24576, 32768, 32776, 65544)
# Model widths whose vectors whole warps share evenly only at 3, 5, 6 or 7 vectors a thread (in
# one dtype or another), which the CUDA register path then holds, a step that no vector of
# leaves the row: GPT-2 and BERT (768), and the hidden sizes of 1.5B-13B models.
EVEN_SPLIT_WIDTHS = (640, 768, 1536, 2560, 3072, 3584, 5120, 7168)
# The CPU backend runs rows of any width on one path, a row at a time in parallel tasks of
# 32768 // width rows (at least one): of those widths, one of two rows a task and one of one.
CPU_LONG_ROW_WIDTHS = (14344, 16392)


# Fills the buffer around a strided input, so that a stray write shows up.
SENTINEL = 123.0

_INT_VIEW = {
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float64: torch.int64,
}


# --------------------------------------------------------------------------- references
# Each has the signature of the op it mirrors and is run twice by check_op: once in the
# input's dtype (what PyTorch itself achieves) and once on fp64 copies (the truth).


def ref_square_matmul(x, weight, bias=None, *, transpose=False, workspace_bytes=None):
    # F.linear wants (out, in); y = x @ W is F.linear with W.T, y = x @ W.T with W itself.
    # On x made contiguous, whatever its layout: PyTorch's CPU GEMM errs differently by
    # layout (a view that does not fold into one matrix, such as (2, 4, K) of strides
    # (8K, K, 1), takes another path), and the op runs the contiguous GEMM over the gathered
    # rows, so the contiguous GEMM's error is the yardstick to hold it to.
    return F.linear(x.contiguous(), weight if transpose else weight.t(), bias)


def ref_linear(x, weight, bias=None):
    return F.linear(x, weight, bias)


def _masked_logits(x, dim, scale, mask, causal):
    z = x if scale is None else x * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            z = z.masked_fill(~mask, float("-inf"))
        else:
            z = z + mask.to(z.dtype)
    if causal:
        q, k = z.shape[-2], z.shape[-1]
        keep = torch.ones(q, k, dtype=torch.bool, device=z.device).tril()
        z = z.masked_fill(~keep, float("-inf"))
    # Rows in which nothing takes part: PyTorch gives NaN there, the ops give zeros.
    dead = torch.isneginf(z).all(dim, keepdim=True)
    return z, dead


def ref_softmax(x, dim=-1, *, scale=None, mask=None, causal=False):
    z, dead = _masked_logits(x, dim, scale, mask, causal)
    return F.softmax(z, dim).masked_fill(dead, 0.0)


def ref_log_softmax(x, dim=-1, *, scale=None, mask=None, causal=False):
    z, dead = _masked_logits(x, dim, scale, mask, causal)
    return F.log_softmax(z, dim).masked_fill(dead, 0.0)


# F.layer_norm and F.rms_norm have exactly the signatures of layer_norm_ and rms_norm_.
ref_layer_norm = F.layer_norm
ref_rms_norm = F.rms_norm


def rotate_half(x):
    """Hugging Face Llama's rotate_half: the halves of the last dim as (-x2, x1)."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def ref_rope(x, cos, sin):
    """Hugging Face Llama's apply_rotary_pos_emb for one tensor, written out."""
    return x * cos + rotate_half(x) * sin


# --------------------------------------------------------------------------- inputs


def randn(shape, dtype, device, seed, *, scale=1.0):
    """Normal values drawn on the CPU from `seed` (same on every device), rounded to dtype."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tuple(shape), generator=g) * scale).to(device=device, dtype=dtype)


LAYOUTS = ("contiguous", "row_padded", "every_other_row", "lead_permuted", "transposed")
# The layouts whose rows are contiguous (stride(-1) == 1), which every op accepts.
ROW_STRIDED_LAYOUTS = LAYOUTS[:4]


def with_layout(values, layout, row_dims=1, pad=5):
    """A tensor equal to `values` laid out in memory as `layout`, carved out of a larger buffer
    (x._base) whose other elements hold SENTINEL. The last `row_dims` dims form one row:

    contiguous       plain copy
    row_padded       dim -row_dims is `pad` longer in memory: rows sit (odd) gaps apart, so
                     most row starts are unaligned
    every_other_row  the first leading dim takes every second slot of the buffer
    lead_permuted    the leading dims are stored in reverse order (x is a permuted view)
    transposed       the last two dims are swapped in memory, so stride(-1) != 1 (row_dims 1)

    Where a layout needs dims that `values` does not have, it falls back to a plain copy.
    """
    shape = tuple(values.shape)
    lead = len(shape) - row_dims
    full = dict(dtype=values.dtype, device=values.device)
    if layout == "row_padded" and len(shape) > 0:
        big_shape = list(shape)
        big_shape[lead] += pad
        x = torch.full(big_shape, SENTINEL, **full).narrow(lead, 0, shape[lead])
    elif layout == "every_other_row" and lead > 0:
        big = torch.full((2 * shape[0],) + shape[1:], SENTINEL, **full)
        x = big[::2]
    elif layout == "lead_permuted" and lead > 1:
        order = list(range(lead))[::-1] + list(range(lead, len(shape)))
        x = torch.full([shape[i] for i in order], SENTINEL, **full).permute(order)
    elif layout == "transposed" and len(shape) > 1:
        assert row_dims == 1, "a transposed row of several dims is not one strided row"
        x = torch.full(shape[:-2] + (shape[-1], shape[-2]), SENTINEL, **full).transpose(-1, -2)
    elif layout in LAYOUTS:
        return values.clone()
    else:
        raise ValueError(layout)
    x.copy_(values)
    return x


def bitwise_equal(a, b):
    """Exact equality of two float tensors, NaN payloads and signed zeros included."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype in _INT_VIEW:
        return torch.equal(
            a.contiguous().view(_INT_VIEW[a.dtype]), b.contiguous().view(_INT_VIEW[b.dtype])
        )
    return torch.equal(a, b)


class Untouched:
    """Snapshot of x and of the buffer it was cut from; `x_unchanged` / `outside_unchanged`
    say afterwards whether x, or everything in the buffer except x, is still bit-identical."""

    def __init__(self, x):
        self.x = x
        self.base = x._base if x._base is not None else x
        assert self.base.is_contiguous()
        self.before = self.base.clone()
        self.x_before = x.clone()

    def x_unchanged(self):
        return bitwise_equal(self.x, self.x_before)

    def outside_unchanged(self):
        # Buffer positions that x covers, found by viewing an index buffer as x is viewed
        # (x may be expanded, so its elements are read, never written, here).
        positions = torch.arange(self.base.numel(), device=self.base.device).as_strided(
            self.x.size(), self.x.stride(), self.x.storage_offset() - self.base.storage_offset()
        )
        outside = torch.ones(self.base.numel(), dtype=torch.bool, device=self.base.device)
        outside[positions.reshape(-1)] = False
        return bitwise_equal(self.base.reshape(-1)[outside], self.before.reshape(-1)[outside])


# --------------------------------------------------------------------------- accuracy


def to_fp64(v):
    if isinstance(v, torch.Tensor) and v.is_floating_point():
        return v.double()
    return v


def assert_accurate(out, torch_out, ref, what=""):
    """out (ours) against ref (fp64) with PyTorch's torch_out as the yardstick (module doc)."""
    assert out.shape == ref.shape and out.dtype == torch_out.dtype, what
    if out.numel() == 0:
        return
    ref = ref.to(out.device)
    finite = torch.isfinite(ref)
    # -inf (log_softmax's masked elements) must be exactly -inf.
    assert torch.equal(out.double()[~finite], ref[~finite]), f"{what}: non-finite entries differ"
    o, t, r = out.double()[finite], torch_out.double()[finite], ref[finite]
    if r.numel() == 0:
        return
    assert torch.isfinite(o).all(), f"{what}: non-finite output where the reference is finite"
    err = (o - r).abs().max().item()
    torch_err = (t - r).abs().max().item()
    floor = torch.finfo(out.dtype).eps * r.abs().max().item()
    assert err <= 2 * torch_err + floor, (
        f"{what}: max error {err:.3e} vs PyTorch's {torch_err:.3e} in {out.dtype} "
        f"(allowed {2 * torch_err + floor:.3e})"
    )


# float64 has no more precise PyTorch to measure against: an op's float64 result is held to
# PyTorch's within F64_ULPS units of eps at the output's scale (test_float64.py says why).
F64_ULPS = 32


def assert_close64(out, ref, what, terms=0.0):
    """out within F64_ULPS * eps * max(max|ref|, terms) of ref; non-finite entries (-inf) equal.
    terms: the magnitude of what a result sums, where the sum cancels to far less."""
    assert out.dtype == torch.float64 and out.shape == ref.shape, what
    finite = torch.isfinite(ref)
    assert torch.equal(out[~finite], ref[~finite]), f"{what}: non-finite entries differ"
    if not finite.any():
        return
    err = (out[finite] - ref[finite]).abs().max().item()
    eps = torch.finfo(torch.float64).eps
    allowed = F64_ULPS * eps * max(ref[finite].abs().max().item(), terms)
    assert err <= allowed, f"{what}: max error {err:.3e}, allowed {allowed:.3e}"


def check_op(op, ref, x, *args, **kwargs):
    """The contract every op test checks: op(x, *args, **kwargs) returns x itself, keeps its
    storage, writes nothing outside x, and is as accurate as `ref` (same signature) is in x's
    dtype. Both references are computed before the op, which destroys x."""
    ref64 = ref(to_fp64(x), *map(to_fp64, args), **{k: to_fp64(v) for k, v in kwargs.items()})
    torch_out = ref(x, *args, **kwargs)
    guard = Untouched(x)
    ptr = x.data_ptr()
    out = op(x, *args, **kwargs)
    assert out is x, "the op must return its input"
    assert x.data_ptr() == ptr
    assert guard.outside_unchanged(), "the op wrote memory outside x"
    assert_accurate(x, torch_out, ref64, what=getattr(op, "__name__", str(op)))


# --------------------------------------------------------------------------- strategies


def lead_shapes(max_dims=3, max_size=4):
    """Leading (batch) dims, including none and including zero-size ones (empty inputs)."""
    return st.lists(st.integers(0, max_size), min_size=0, max_size=max_dims).map(tuple)


def widths(max_small=64):
    return st.sampled_from(ODD_WIDTHS) | st.integers(1, max_small)


seeds = st.integers(0, 2**31 - 1)
# The seed of the output gradients that backward tests draw: outside `seeds`, so that it is
# never an input's seed too. With the same seed, dy is x up to an affine map, and a norm's
# exact gradient for such a dy is 0, a cancellation that a backward from the saved 16-bit
# output cannot match to PyTorch's error (see README, Autograd).
GRAD_SEED = 2**31 + 99


def output_grad(x):
    """The output gradient that backward tests feed an op whose output is shaped like x."""
    return randn(x.shape, x.dtype, x.device, GRAD_SEED)


def examples(n):
    """Hypothesis example count: n (CI has 2 cores), times MTI_EXAMPLES_SCALE for a deeper
    local search."""
    return n * int(os.environ.get("MTI_EXAMPLES_SCALE", "1"))


def numel(shape):
    return math.prod(shape)
