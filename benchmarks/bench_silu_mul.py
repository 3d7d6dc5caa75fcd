"""SwiGLU's backward through its activation, h = silu(g) * u: the gradients of g and u for
h's gradient. mti's silu_mul_backward_ (both written over g and u, one pass) against
PyTorch's (F.silu and aten.silu_backward, new tensors) in eager mode and under torch.compile,
and Liger-Kernel's swiglu_backward (written over g and u; when installed).

g, u and h's gradient: (rows, I) with I = 5632 and 14336 (Llama's intermediate widths), rows
4096 and 16384. Every call reads the three and writes two tensors of that size (the in-place
ones repeat on their own outputs, which changes nothing of the work). The "copy" row clones g
and u: 4 of the 5 tensors' bytes, scaled to 5 for of_copy.

Per case: median GPU ms of each contender, all timed in turns in one run
(common.time_alternating with gpu_only, L2 flushed before each call); of_copy = the copy's
bandwidth share (1.0: as fast as a copy of the same bytes); peak = memory above what was
allocated before the call; max_err = the larger error of the two gradients against float64
autograd.

    python benchmarks/bench_silu_mul.py              # CUDA, bf16 and fp32
    python benchmarks/bench_silu_mul.py --device cpu # a small code-path check

Writes benchmarks/results/<gpu>/silu_mul.json and silu_mul.md.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import make_torch_inplace  # noqa: F401  (registers the ops)
from benchmarks.common import (
    contender_parser,
    contender_records,
    cuda_missing,
    fmt_bytes,
    markdown_table,
    time_and_peak,
    write_results,
)

_op = torch.ops.make_torch_inplace.silu_mul_backward_


def torch_grads(grad, g, u):
    """PyTorch's: the gradients of F.silu(g) * u, as autograd computes them."""
    return torch.ops.aten.silu_backward(grad * u, g), F.silu(g) * grad


def ours(grad, g, u):
    _op(grad, g, u)
    return g, u


def liger() -> Callable | None:
    try:
        from liger_kernel.ops.swiglu import swiglu_backward
    except ImportError:
        return None
    return lambda grad, g, u: swiglu_backward(g, u, grad)


def max_error(fn, grad, g, u) -> float:
    """fn's larger error on fresh copies against float64 autograd."""
    g64, u64 = (t.double().requires_grad_() for t in (g, u))
    truth = torch.autograd.grad(F.silu(g64) * u64, (g64, u64), grad.double())
    out = fn(grad, g.clone(), u.clone())
    return max((a.double() - b).abs().max().item() for a, b in zip(out, truth))


def run_case(rows: int, width: int, dtype, device: str, impls: dict, args) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(rows + width)
    grad, g, u = (
        torch.randn(rows, width, generator=gen, device=device, dtype=dtype) for _ in range(3)
    )
    errors = {name: max_error(fn, grad, g, u) for name, fn in impls.items()}
    g_run, u_run = g.clone(), u.clone()
    calls = {"copy": lambda: (g.clone(), u.clone())}
    for name, fn in impls.items():
        calls[name] = lambda fn=fn: fn(grad, g_run, u_run)
    times, peaks = time_and_peak(calls, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, device=device)
    copy_ms = times["copy"] * 5 / 4  # the copy moves 4 of the 5 tensors
    case = dict(rows=rows, width=width, dtype=str(dtype).removeprefix("torch."))
    return contender_records(case, times, peaks, errors, copy_ms)


def table(records: list[dict]) -> str:
    rows = [dict(r, peak=fmt_bytes(r["peak_extra_bytes"])) for r in records]
    cols = ["rows", "width", "dtype", "impl", "ms", "of_copy", "peak", "max_err"]
    return markdown_table(rows, cols)


def main() -> None:
    args = contender_parser(__doc__.split("\n\n")[0]).parse_args()
    if cuda_missing("bench_silu_mul.py", args.device):
        return
    cpu = args.device == "cpu"
    shapes = [(64, 176)] if cpu else [(r, w) for w in (5632, 14336) for r in (4096, 16384)]
    dtypes = [torch.float32] if cpu else [torch.bfloat16, torch.float32]
    impls: dict[str, Callable] = {"make_torch_inplace": ours, "torch": torch_grads}
    if not args.no_compile:
        impls["torch.compile"] = torch.compile(torch_grads, dynamic=True)
    liger_fn = None if args.no_liger or cpu else liger()
    if liger_fn is not None:
        impls["liger"] = liger_fn
    records = []
    for dtype in dtypes:
        for rows, width in shapes:
            print(f"rows={rows} width={width} {dtype}")
            records += run_case(rows, width, dtype, args.device, impls, args)
    json_path, md_path = write_results("silu_mul", records, table(records))
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
