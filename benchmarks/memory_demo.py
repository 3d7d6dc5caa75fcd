"""Peak memory of each PyTorch op next to its in-place make_torch_inplace counterpart.

With x and the weights already allocated, the PyTorch op needs a second buffer the size of x
for its output; the in-place op writes over x and needs (almost) nothing. square_matmul_ runs
three times: with the default workspace limit (64 MiB), with 1 MiB, and with 0 (the kernel
that needs no workspace).

    python benchmarks/memory_demo.py                 # CUDA if present, else CPU
    python benchmarks/memory_demo.py --device cpu --shape 2048 1024 --dtype float32

Prints its table; with --save it also writes memory_demo.json and .md to
benchmarks/results/<gpu or cpu>/ (or $MTI_RESULTS_DIR).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import make_torch_inplace as mti
from benchmarks.common import (
    best_device,
    env_info,
    fmt_bytes,
    markdown_table,
    peak_extra_bytes,
    write_results,
)

# On a GPU x is 256 MiB of bf16, four times the default workspace, so the default mode shows
# its saving too; on a CPU a shape whose matmul takes well under a second.
DEFAULT_SHAPE = {"cuda": (32768, 4096), "cpu": (2048, 1024)}
DEFAULT_DTYPE = {"cuda": "bfloat16", "cpu": "float32"}


@dataclass
class Case:
    op: str
    torch_op: str
    reference: Callable[[torch.Tensor], torch.Tensor]
    inplace: Callable[[torch.Tensor], torch.Tensor]


def make_cases(k: int, dtype: torch.dtype, device: torch.device) -> list[Case]:
    def param(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype)

    weight = param(k, k, scale=1 / math.sqrt(k))
    bias, gamma, beta = param(k), param(k), param(k)
    return [
        Case(
            "square_matmul_",
            "x @ W",
            lambda x: x @ weight,
            lambda x: mti.square_matmul_(x, weight),
        ),
        Case(
            "square_matmul_ (workspace 0)",
            "x @ W",
            lambda x: x @ weight,
            lambda x: mti.square_matmul_(x, weight, workspace_bytes=0),
        ),
        Case(
            "square_matmul_ (workspace 1 MiB)",
            "x @ W",
            lambda x: x @ weight,
            lambda x: mti.square_matmul_(x, weight, workspace_bytes=1 << 20),
        ),
        Case(
            "linear_",
            "F.linear",
            lambda x: F.linear(x, weight, bias),
            lambda x: mti.linear_(x, weight, bias),
        ),
        Case("softmax_", "F.softmax", lambda x: F.softmax(x, -1), lambda x: mti.softmax_(x, -1)),
        Case(
            "log_softmax_",
            "F.log_softmax",
            lambda x: F.log_softmax(x, -1),
            lambda x: mti.log_softmax_(x, -1),
        ),
        Case(
            "layer_norm_",
            "F.layer_norm",
            lambda x: F.layer_norm(x, (k,), gamma, beta),
            lambda x: mti.layer_norm_(x, (k,), gamma, beta),
        ),
        Case(
            "rms_norm_",
            "F.rms_norm",
            lambda x: F.rms_norm(x, (k,), gamma),
            lambda x: mti.rms_norm_(x, (k,), gamma),
        ),
    ]


def measure(case: Case, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> dict:
    x = torch.randn(*shape, device=device, dtype=dtype)
    # One untimed call of each first: library state created on first use (cuBLAS's workspace
    # comes from the caching allocator and stays) must not be charged to either op.
    case.reference(x)
    case.inplace(x.clone())
    x_inplace = x.clone()  # allocated before the measurement starts, like x itself
    out = {}
    torch_peak = peak_extra_bytes(lambda: out.setdefault("y", case.reference(x)), device=device)
    inplace_peak = peak_extra_bytes(lambda: case.inplace(x_inplace), device=device)
    # A memory saving only counts if the result is the same: report how far apart they are.
    max_diff = (x_inplace.double() - out["y"].double()).abs().max().item()
    return {
        "bench": "memory_demo",
        "op": case.op,
        "torch_op": case.torch_op,
        "shape": list(shape),
        "dtype": str(dtype).removeprefix("torch."),
        "x_bytes": x.numel() * x.element_size(),
        "torch_peak_extra_bytes": torch_peak,
        "inplace_peak_extra_bytes": inplace_peak,
        "saving_bytes": torch_peak - inplace_peak,
        "max_abs_diff": max_diff,
        **env_info(),
    }


def table(records: list[dict], device: torch.device) -> str:
    rows = []
    for r in records:
        saving, torch_peak = r["saving_bytes"], r["torch_peak_extra_bytes"]
        pct = f" ({100 * saving / torch_peak:.0f}%)" if torch_peak else ""
        rows.append(
            {
                "op": r["op"],
                "vs": r["torch_op"],
                "shape": "x".join(map(str, r["shape"])),
                "dtype": r["dtype"],
                "device": device.type,
                "torch peak extra": fmt_bytes(r["torch_peak_extra_bytes"]),
                "in-place peak extra": fmt_bytes(r["inplace_peak_extra_bytes"]),
                "saving": fmt_bytes(saving) + pct,
                "max abs diff": f"{r['max_abs_diff']:.2g}",
            }
        )
    return markdown_table(
        rows,
        [
            "op",
            "vs",
            "shape",
            "dtype",
            "device",
            "torch peak extra",
            "in-place peak extra",
            "saving",
            "max abs diff",
        ],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--shape", type=int, nargs=2, metavar=("ROWS", "K"))
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--save", action="store_true", help="write the results' files too")
    args = parser.parse_args(argv)

    device = best_device() if args.device == "auto" else torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but no CUDA device is available")
    shape = tuple(args.shape) if args.shape else DEFAULT_SHAPE[device.type]
    dtype = getattr(torch, args.dtype or DEFAULT_DTYPE[device.type])

    torch.manual_seed(0)
    with torch.no_grad():
        records = [measure(c, shape, dtype, device) for c in make_cases(shape[1], dtype, device)]
    md = table(records, device)
    device_name = env_info()["device"]
    print(f"{device_name}: peak memory above x and the weights, x {tuple(shape)} {dtype}\n")
    print(md)
    if args.save:
        json_path, md_path = write_results("memory_demo", records, md)
        print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
