"""The CPU kernels against PyTorch's out-of-place ops: time ratio (ours / PyTorch) per op, shape,
dtype and thread count.

Each pair (ours, PyTorch's) is timed with common.time_alternating: the two are called in
alternating turns (ours first in half of them), each call timed with perf_counter, about
--rep-ms of calls of each after --warmup-ms of warm-up, and each one's time is the mean over
the two places of its median there (common.place_median). Ours runs over the same x again and
again, which its output keeps finite (the matmul's weight is orthogonal).

Forward: softmax_ / log_softmax_ (plain; with scale and causal; with scale and a bool mask)
against F.softmax / F.log_softmax of what PyTorch needs to compute the same thing
(x * scale, masked_fill), layer_norm_ (weight, bias), rms_norm_ (weight) against F.layer_norm
/ F.rms_norm; square_matmul_ with workspace_bytes=0 (both layouts, with bias) against
torch.addmm (fp32 only). Backward: the softmax_backward / norm_backward ops (grad_x, and the
weight and bias gradients) against torch.autograd.grad of PyTorch's op with the graph kept,
so that only the backward runs.

    python benchmarks/bench_cpu.py                # the full sweep (a few minutes)
    python benchmarks/bench_cpu.py --quick        # fp32 only, one thread count

Writes benchmarks/results/cpu/cpu_ops.json and cpu_ops.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import make_torch_inplace as mti
from benchmarks.common import (
    env_info,
    markdown_table,
    place_median,
    time_alternating,
    write_results,
)

ROWWISE_SHAPES = [(2048, 1024), (64, 65536)]
MATMUL_SHAPES = [(2048, 1024), (64, 4096)]  # (rows, K): W is K x K, so K stays moderate
SCALE = 0.125
EPS = 1e-5
Pair = tuple[Callable[[], object], Callable[[], object]]


def rowwise_forward(op: str, x: torch.Tensor) -> Pair:
    """(ours, PyTorch's) for one forward case on x (rows, n); ours overwrites x."""
    n = x.shape[-1]
    g = torch.Generator().manual_seed(1)
    w = torch.randn(n, generator=g).to(x.dtype)
    b = torch.randn(n, generator=g).to(x.dtype)
    rows = x.shape[0]
    causal = torch.ones(rows, n, dtype=torch.bool).tril()
    mask = torch.rand(rows, n, generator=g) > 0.2
    mask[:, 0] = True
    soft = {"softmax": (mti.softmax_, F.softmax), "log_softmax": (mti.log_softmax_, F.log_softmax)}
    if op in soft:
        ours, ref = soft[op]
        return (lambda: ours(x, -1), lambda: ref(x, -1))
    if op.endswith("+causal"):
        ours, ref = soft[op.split("+")[0]]
        return (
            lambda: ours(x, -1, scale=SCALE, causal=True),
            lambda: ref((x * SCALE).masked_fill_(~causal, float("-inf")), -1),
        )
    if op.endswith("+mask"):
        ours, ref = soft[op.split("+")[0]]
        return (
            lambda: ours(x, -1, scale=SCALE, mask=mask),
            lambda: ref((x * SCALE).masked_fill_(~mask, float("-inf")), -1),
        )
    if op == "layer_norm":
        return (
            lambda: mti.layer_norm_(x, (n,), w, b, EPS),
            lambda: F.layer_norm(x, (n,), w, b, EPS),
        )
    if op == "rms_norm":
        return (lambda: mti.rms_norm_(x, (n,), w, EPS), lambda: F.rms_norm(x, (n,), w, EPS))
    raise ValueError(op)


def rowwise_backward(op: str, x: torch.Tensor) -> Pair:
    """(ours, PyTorch's) backward of one op at x: our backward op from the saved output
    against autograd.grad through PyTorch's op (graph kept)."""
    n = x.shape[-1]
    g = torch.Generator().manual_seed(2)
    dy = torch.randn(x.shape, generator=g).to(x.dtype)
    w = torch.randn(n, generator=g).to(x.dtype)
    b = torch.randn(n, generator=g).to(x.dtype)
    ops = torch.ops.make_torch_inplace
    xr = x.clone().requires_grad_(True)
    if op in ("softmax", "log_softmax"):
        log = op == "log_softmax"
        y = (F.log_softmax if log else F.softmax)(x, -1)
        out = (F.log_softmax if log else F.softmax)(xr, -1)
        ours = lambda: ops.softmax_backward(y, dy, -1, 1.0, None, False, log, torch.empty_like(y))
        return ours, lambda: torch.autograd.grad(out, xr, dy, retain_graph=True)
    rms = op == "rms_norm"
    wr, br = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    y = x.clone()
    rstd = torch.empty(x.shape[0], dtype=torch.float32)
    if rms:
        ops.rms_norm_(y, (n,), w, EPS, rstd)
        out, inputs, bias = F.rms_norm(xr, (n,), wr, EPS), (xr, wr), None
    else:
        ops.layer_norm_(y, (n,), w, b, EPS, rstd)
        out, inputs, bias = F.layer_norm(xr, (n,), wr, br, EPS), (xr, wr, br), b

    def ours():
        grad_b = torch.empty_like(b) if bias is not None else torch.empty(0, dtype=x.dtype)
        ops.norm_backward(
            y, dy, (n,), w, bias, rstd, rms, torch.empty_like(y), torch.empty_like(w), grad_b
        )

    return ours, lambda: torch.autograd.grad(out, inputs, dy, retain_graph=True)


def matmul_case(shape: tuple[int, int], dtype: torch.dtype, transpose: bool) -> Pair:
    rows, k = shape
    g = torch.Generator().manual_seed(3)
    w = torch.linalg.qr(torch.randn(k, k, generator=g, dtype=torch.float64))[0].to(dtype)
    bias = (torch.randn(k, generator=g) * 1e-3).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    wt = w.t() if transpose else w
    return (
        lambda: mti.square_matmul_(x, w, bias, transpose=transpose, workspace_bytes=0),
        lambda: torch.addmm(bias, x, wt),
    )


def measure(pair: Pair, warmup_ms: float, rep_ms: float) -> tuple[float, float]:
    reads = time_alternating(list(pair), warmup_ms=warmup_ms, rep_ms=rep_ms, device="cpu")
    return place_median(reads[0]), place_median(reads[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fp32 only, one thread")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--warmup-ms", type=float, default=50.0)
    ap.add_argument("--rep-ms", type=float, default=300.0)
    args = ap.parse_args()
    dtypes = [torch.float32] if args.quick else [torch.float32, torch.bfloat16]
    threads = args.threads[:1] if args.quick else args.threads
    forward_ops = ["softmax", "log_softmax", "softmax+causal", "log_softmax+mask"]
    forward_ops += ["layer_norm", "rms_norm"]
    backward_ops = ["softmax", "log_softmax", "layer_norm", "rms_norm"]

    cases: list[tuple[dict, Callable[[], Pair]]] = []
    for dtype in dtypes:
        dt = str(dtype).removeprefix("torch.")
        for shape in ROWWISE_SHAPES:
            x = torch.randn(shape).to(dtype)
            for op in forward_ops:
                cases.append(
                    (
                        {"op": op + "_", "pass": "forward", "dtype": dt, "shape": shape},
                        lambda op=op, x=x: rowwise_forward(op, x),
                    )
                )
            if dtype == torch.float32:
                for op in backward_ops:
                    cases.append(
                        (
                            {"op": op, "pass": "backward", "dtype": dt, "shape": shape},
                            lambda op=op, x=x: rowwise_backward(op, x),
                        )
                    )
        # bf16 GEMMs take seconds on CPUs without bf16 matrix instructions: fp32 only.
        for shape in MATMUL_SHAPES if dtype == torch.float32 else []:
            for transpose in (False, True):
                name = "square_matmul_ (W.T, bias)" if transpose else "square_matmul_ (W, bias)"
                cases.append(
                    (
                        {"op": name, "pass": "forward", "dtype": dt, "shape": shape},
                        lambda s=shape, d=dtype, t=transpose: matmul_case(s, d, t),
                    )
                )

    records = []
    previous = torch.get_num_threads()
    try:
        for nt in threads:
            torch.set_num_threads(nt)
            env = env_info()
            for info, make in cases:
                with torch.no_grad() if info["pass"] == "forward" else torch.enable_grad():
                    ours_ms, torch_ms = measure(make(), args.warmup_ms, args.rep_ms)
                rec = {
                    **env,
                    **info,
                    "shape": "x".join(map(str, info["shape"])),
                    "threads": nt,
                    "ours_ms": ours_ms,
                    "torch_ms": torch_ms,
                    "ratio": ours_ms / torch_ms,
                }
                records.append(rec)
                print(
                    f"{nt} thr {rec['op']:28s} {rec['pass']:8s} {rec['dtype']:8s} "
                    f"{rec['shape']:>10s}  ours {ours_ms:8.3f} ms  torch {torch_ms:8.3f} ms  "
                    f"ratio {rec['ratio']:.2f}",
                    flush=True,
                )
    finally:
        torch.set_num_threads(previous)
    columns = ["op", "pass", "dtype", "shape", "threads", "ours_ms", "torch_ms", "ratio"]
    note = (
        "ratio = ours / PyTorch's (median ms of alternating calls); below 1: ours is faster. "
        "Matmul: square_matmul_ with workspace_bytes=0 against torch.addmm.\n\n"
    )
    json_path, md_path = write_results("cpu_ops", records, note + markdown_table(records, columns))
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
