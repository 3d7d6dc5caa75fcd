"""Speed and memory of square_matmul_ (x[M, N] <- x @ W (+ bias), W (N, N)) against torch.matmul.

Modes of make_torch_inplace: "default" (a 64 MiB workspace: on sm_90a builds, for fp16/bf16 and
enough rows, the handshake kernel with its counters of one int per 128 rows; else cuBLAS a
chunk of rows at a time, copied back) and "zero_workspace" (workspace_bytes=0: the kernel that
needs no memory at all).
torch.matmul is out of place ("out_of_place"; with a bias it is torch.addmm, as in F.linear);
for M <= 64 also "matmul+copy_", which writes the result back over x as our default mode does.
Each of our modes takes turns call by call with the baseline of its goal
(common.time_alternating), so that the GPU's clocks, which drift under its power cap, weigh on
both alike, and each takes every place in a turn equally often; ms is the mean over the places
of the median of its calls at each (common.place_median), over at least MIN_TURNS turns. For
M <= 64 the default mode's turns also hold a second, identical matmul + copy_, the control:
its time (control_ms in the matmul+copy_ record) against matmul + copy_'s shows how far apart
identical calls read (turns of three also keep them closer than turns of two). For M <= 64,
GPU time only: each call is queued behind a GPU wait longer than its host time, since calls
of ~10 us are host-bound and would otherwise take in part of the host time of whichever fn
took longer (host time is not measured). TFLOP/s = 2 M N^2 / ms.
peak_extra_bytes: the caching allocator's peak above what was allocated before the call (the
output for torch.matmul, the workspace for ours).

An in-place op timed repeatedly multiplies x by W again and again, so W is a random orthogonal
matrix (norms stay put up to rounding) and the bias is small; x is refilled before a case's
measurements and checked to be finite after them.

    python benchmarks/bench_square_matmul.py              # the full grid, CUDA
    python benchmarks/bench_square_matmul.py --quick      # a smoke subset
    python benchmarks/bench_square_matmul.py --dtypes bfloat16 --ns 4096 --ms 16384
    python benchmarks/bench_square_matmul.py --device cpu --quick --ms 4 --ns 64  # code paths

Writes benchmarks/results/<gpu>/square_matmul.json, square_matmul.md and square_matmul.png.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import make_torch_inplace as mti
from benchmarks.common import (
    cuda_missing,
    env_info,
    fmt_bytes,
    markdown_table,
    peak_extra_bytes,
    place_median,
    plot_grid,
    results_dir,
    time_alternating,
    write_results,
)

ALL_DTYPES = ["float16", "bfloat16"]
ALL_M = [1, 16, 64, 4096, 16384, 65536]
ALL_N = [1024, 2048, 4096, 8192]
QUICK = {
    "dtypes": ["bfloat16"],
    "ms": [16, 4096],
    "ns": [1024, 4096],
    "transpose": [False, True],
    "bias": [True],
}
OUR_MODES = {"default": 64 << 20, "zero_workspace": 0}
# The longest cases (M = 65536, N = 8192: 12 ms a call) fit only a few turns in the default
# 100 ms; at least this many give each place's median 8 calls.
MIN_TURNS = 24
SMALL_M = 64  # up to here torch.matmul + copy_ is measured too
BIAS_SCALE = 0.01


def orthogonal(n: int, device) -> torch.Tensor:
    """A random orthogonal (n, n) float32 matrix: x @ W keeps the norms of x's rows."""
    q, r = torch.linalg.qr(torch.randn(n, n, device=device, dtype=torch.float32))
    # Haar-distributed. contiguous(): QR returns column-major q, and a model's weights are
    # row-major (the op would otherwise time a flipped transpose).
    return (q * torch.sign(torch.diagonal(r))).contiguous()


def bench_case(dtype, m, n, transpose, bias, w32, args, device, records) -> None:
    w = w32.to(dtype)
    wv = w.t() if transpose else w
    b = (BIAS_SCALE * torch.randn(n, device=device)).to(dtype) if bias else None
    x = torch.randn(m, n, device=device).to(dtype)
    flops = 2 * m * n * n
    base = {
        "bench": "square_matmul",
        "op": "square_matmul_",
        "dtype": str(dtype).removeprefix("torch."),
        "M": m,
        "N": n,
        "transpose": transpose,
        "bias": bias,
        **env_info(),
    }

    def add(impl: str, mode: str, ms: float | None, peak: int | None, **extra) -> dict:
        rec = {
            **base,
            "impl": impl,
            "mode": mode,
            "ms": ms,
            "tflops": None if ms is None else flops / (ms * 1e-3) / 1e12,
            "peak_extra_bytes": peak,
            **extra,
        }
        records.append(rec)
        return rec

    # (impl, mode) -> the call timed
    fns: dict[tuple[str, str], object] = {}
    line = []
    for mode, ws in OUR_MODES.items():
        if mode not in args.modes:
            continue
        fn = functools.partial(mti.square_matmul_, x, w, b, transpose=transpose, workspace_bytes=ws)
        try:
            fn()
        except RuntimeError as e:  # zero_workspace beyond its largest K: recorded, not fatal
            if mode != "zero_workspace" or "too large" not in str(e):
                raise
            add("make_torch_inplace", mode, None, None, error=str(e).splitlines()[0])
            line.append(f"{mode} unsupported")
            continue
        fns["make_torch_inplace", mode] = fn
    if bias:

        def out_of_place():
            return torch.addmm(b, x, wv)
    else:

        def out_of_place():
            return torch.matmul(x, wv)

    fns["torch.matmul", "out_of_place"] = out_of_place
    if m <= SMALL_M:
        fns["torch.matmul", "matmul+copy_"] = lambda: x.copy_(out_of_place())

    # Each of our modes is timed in turns with the baseline its goal names (matmul + copy_ for
    # the small-M default mode, else torch.matmul), two fns at a time (with the control, see
    # the module docstring, three for the small-M default mode): what else shares the turns
    # moves a call's time too, even between calls of the same kernels. A baseline no mode was
    # paired with takes turns with torch.matmul (torch.matmul itself, when no mode runs, is
    # timed alone). W is orthogonal: the calls of every mode keep x's scale.
    oop = ("torch.matmul", "out_of_place")
    goal = ("torch.matmul", "matmul+copy_") if m <= SMALL_M else oop
    control = ("torch.matmul", "control")  # matmul + copy_ again (see the module docstring)
    times: dict[tuple[str, str], list[list[float]]] = {}

    def in_turns(*keys: tuple[str, str]) -> None:
        res = time_alternating(
            [fns[goal if k == control else k] for k in keys],
            warmup_ms=args.warmup_ms,
            rep_ms=args.rep_ms,
            device=device,
            min_turns=MIN_TURNS,
            gpu_only=m <= SMALL_M,
        )
        for k, ts in zip(keys, res):
            times.setdefault(k, ts)

    for key in [k for k in fns if k[0] == "make_torch_inplace"]:
        if key[1] != "default":
            in_turns(key, oop)
        else:
            in_turns(key, goal, *((control,) if goal != oop else ()))
    for key in [k for k in fns if k not in times]:
        in_turns(*((key,) if key == oop else (key, oop)))
    finite = bool(torch.isfinite(x).all())
    for (impl, mode), fn in fns.items():
        ts = times[impl, mode]
        peak = peak_extra_bytes(fn, device=device)
        extra = {}
        if mode == "matmul+copy_":
            extra["control_ms"] = place_median(times[control]) if control in times else None
        rec = add(
            impl, mode, place_median(ts), peak, calls=sum(map(len, ts)), finite=finite, **extra
        )
        label = mode if impl == "make_torch_inplace" else f"torch {mode}"
        line.append(f"{label} {rec['tflops']:.3g}")
    if not finite:
        line.append("(x not finite!)")
    print(
        f"{base['dtype']:8s} M={m:<6d} N={n:<5d} T={int(transpose)} bias={int(bias)} TFLOP/s: "
        + ", ".join(line),
        flush=True,
    )


# --------------------------------------------------------------------------- report


def _find(by: dict, impl: str, mode: str) -> dict | None:
    rec = by.get((impl, mode))
    return rec if rec is not None and rec["ms"] is not None else None


def tables(records: list[dict]) -> str:
    groups: dict[tuple, dict[tuple, dict]] = {}
    for r in records:
        key = (r["dtype"], r["N"], r["M"], r["transpose"], r["bias"])
        groups.setdefault(key, {})[(r["impl"], r["mode"])] = r
    by_dtype: dict[str, list[dict]] = {}
    for (dtype, n, m, transpose, bias), by in sorted(groups.items()):
        row = {"N": n, "M": m, "T": int(transpose), "bias": int(bias)}
        torch_rec = _find(by, "torch.matmul", "out_of_place")
        for label, impl, mode in (
            ("default", "make_torch_inplace", "default"),
            ("zero-ws", "make_torch_inplace", "zero_workspace"),
            ("torch", "torch.matmul", "out_of_place"),
            ("mm+copy_", "torch.matmul", "matmul+copy_"),
        ):
            rec = _find(by, impl, mode)
            if rec is None:
                if (impl, mode) in by:
                    row[f"{label} ms"] = "unsupported"
                continue
            row[f"{label} ms"] = rec["ms"]
            row[f"{label} TFLOP/s"] = rec["tflops"]
            if impl == "make_torch_inplace" and torch_rec is not None:
                row[f"{label}/torch"] = torch_rec["ms"] / rec["ms"]
            if mode == "matmul+copy_":
                ours = _find(by, "make_torch_inplace", "default")
                if ours is not None:
                    row["default/mm+copy_"] = rec["ms"] / ours["ms"]
                if rec.get("control_ms"):
                    row["control/mm+copy_"] = rec["ms"] / rec["control_ms"]
            if mode != "matmul+copy_":
                row[f"{label} peak"] = fmt_bytes(rec["peak_extra_bytes"])
        by_dtype.setdefault(dtype, []).append(row)
    columns = ["N", "M", "T", "bias"]
    for label in ("default", "zero-ws", "torch", "mm+copy_"):
        columns += [f"{label} ms", f"{label} TFLOP/s"]
        if label in ("default", "zero-ws"):
            columns.append(f"{label}/torch")
    columns += [
        "default/mm+copy_",
        "control/mm+copy_",
        "default peak",
        "zero-ws peak",
        "torch peak",
    ]
    note = (
        "ratio = torch.matmul time / our time (> 1: faster than torch.matmul); "
        "default/mm+copy_ likewise against matmul + copy_, and control/mm+copy_ that of "
        "an identical matmul + copy_ timed in the same turns (M <= 64); peak = extra "
        "memory allocated during the call. T: transpose (x @ W.T).\n\n"
    )
    return note + "\n".join(
        f"## {dtype}\n\n" + markdown_table(rows, columns) for dtype, rows in by_dtype.items()
    )


def plot(records: list[dict], path: Path) -> None:
    """TFLOP/s against M, one panel per dtype and N, for the nn.Linear case if measured
    (transpose, bias), else whichever case comes first."""
    cases = sorted({(r["transpose"], r["bias"]) for r in records}, reverse=True)
    transpose, bias = cases[0]
    panels: dict[tuple, dict[str, list]] = {}
    for r in records:
        if (r["transpose"], r["bias"]) != (transpose, bias) or r["tflops"] is None:
            continue
        label = r["mode"] if r["impl"] == "make_torch_inplace" else f"torch.matmul {r['mode']}"
        panels.setdefault((r["dtype"], r["N"]), {}).setdefault(label, []).append(
            (r["M"], r["tflops"])
        )
    ncols = len({n for _, n in panels})
    plot_grid(
        path,
        [
            (f"{dtype}, N={n}, transpose={transpose}, bias={bias}", series)
            for (dtype, n), series in sorted(panels.items())
        ],
        xlabel="M (rows)",
        ylabel="TFLOP/s",
        ncols=max(ncols, 1),
    )


# --------------------------------------------------------------------------- main


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help=f"a smoke subset: {QUICK}")
    parser.add_argument("--dtypes", nargs="+", choices=ALL_DTYPES + ["float32"])
    parser.add_argument("--ms", nargs="+", type=int, help="row counts M")
    parser.add_argument("--ns", nargs="+", type=int, help="N = K, the weight's size")
    parser.add_argument("--modes", nargs="+", choices=list(OUR_MODES), default=list(OUR_MODES))
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu only checks the code paths; its numbers mean little",
    )
    parser.add_argument("--warmup-ms", type=float, default=10.0)
    parser.add_argument(
        "--rep-ms",
        type=float,
        default=100.0,
        help="timed calls per case and implementation (at least 7)",
    )
    args = parser.parse_args(argv)
    args.dtypes = args.dtypes or (QUICK["dtypes"] if args.quick else ALL_DTYPES)
    args.ms = args.ms or (QUICK["ms"] if args.quick else ALL_M)
    args.ns = args.ns or (QUICK["ns"] if args.quick else ALL_N)
    args.transpose = QUICK["transpose"] if args.quick else [False, True]
    args.bias = QUICK["bias"] if args.quick else [False, True]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if cuda_missing("bench_square_matmul", args.device):
        return 0
    device = torch.device(args.device)
    torch.manual_seed(0)
    start = time.perf_counter()
    records: list[dict] = []
    with torch.no_grad():
        for n in args.ns:
            w32 = orthogonal(n, device)
            for dtype_name, m, transpose, bias in itertools.product(
                args.dtypes, args.ms, args.transpose, args.bias
            ):
                bench_case(
                    getattr(torch, dtype_name), m, n, transpose, bias, w32, args, device, records
                )
            del w32
    md = tables(records)
    print()
    print(md)
    json_path, md_path = write_results("square_matmul", records, md)
    png = results_dir() / "square_matmul.png"
    plot(records, png)
    print(f"wrote {json_path}, {md_path}, {png}")
    print(f"{env_info()['device']}: {len(records)} records in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
