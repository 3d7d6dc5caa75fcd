"""square_matmul_'s tuned parameters (csrc/kernels/square_matmul/tuning.h): the calls that
decide each one, and a check of a call against an fp64 reference."""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F

from ..ops import square_matmul_
from . import Case, Parameter

FAMILY = "square_matmul"
HALF = (torch.float16, torch.bfloat16)
_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _case(
    device: str, dtype: torch.dtype, rows: int, k: int, transpose: bool, workspace_bytes: int | None
) -> Case:
    """x (rows, k) <- x @ W (or W^T) + bias, with the default workspace (None) or the one
    given (0: none, so that the call runs a zero-workspace kernel)."""

    def make():
        g = torch.Generator(device=device).manual_seed(rows * 100003 + k)
        x = torch.randn(rows, k, generator=g, device=device).to(dtype)
        w = (torch.randn(k, k, generator=g, device=device) * k**-0.5).to(dtype)
        b = torch.randn(k, generator=g, device=device).to(dtype)
        return functools.partial(
            square_matmul_, x, w, b, transpose=transpose, workspace_bytes=workspace_bytes
        )

    ws = "" if workspace_bytes is None else f" ws={workspace_bytes}"
    op = "x@W^T" if transpose else "x@W"
    return Case(f"{_NAMES[dtype]} {op} {rows}x{k}{ws}", torch.finfo(dtype).bits // 8, k, make)


def _reference(x, w, b, transpose):
    return F.linear(x, w if transpose else w.t(), b)


def check(case: Case) -> None:
    """One call of the case against fp64, PyTorch's own error in the dtype as the yardstick
    (as tests/helpers.py's assert_accurate): the references first, since the op overwrites x."""
    run = case.make()
    x, w, b = run.args
    transpose = run.keywords["transpose"]
    ref64 = _reference(x.double(), w.double(), b.double(), transpose)
    torch_err = (_reference(x, w, b, transpose).double() - ref64).abs().max().item()
    run()
    err = (x.double() - ref64).abs().max().item()
    allowed = 2 * torch_err + torch.finfo(x.dtype).eps * ref64.abs().max().item()
    if not err <= allowed:
        raise AssertionError(f"{case.label}: max error {err:.3e}, allowed {allowed:.3e}")


def _cases(dtypes, rows, ks, transposes, workspace_bytes=None):
    def cases(device: str) -> list[Case]:
        return [
            _case(device, d, r, k, t, workspace_bytes)
            for d, r, k, t in itertools.product(dtypes, rows, ks, transposes)
        ]

    return cases


def _parameter(name, candidates, cases, doc):
    return Parameter(f"{FAMILY}.{name}", FAMILY, candidates, cases, check, doc)


def _few_rows_parameters() -> list[Parameter]:
    params = []
    for op, transpose in (("xw", False), ("xwt", True)):
        params.append(
            _parameter(
                f"few_rows_first.{op}",
                (0, 8, 16, 32, 64),
                _cases(HALF, (8, 16, 32), (1024, 2048, 4096, 8192), (transpose,)),
                "most rows the few-rows kernel runs before cuBLAS where the workspace holds the "
                "output",
            )
        )
    # Rows up to 8, 16 and 64 (x @ W), 16 and 64 (x @ W^T), without a workspace so that the
    # few-rows kernel runs.
    for op, transpose, bands in (("xw", False, (8, 16, 64)), ("xwt", True, (16, 64))):
        for rows in bands:
            params.append(
                _parameter(
                    f"few_rows_tiles.{op}.{rows}",
                    (1, 2, 4),
                    _cases(HALF, (rows,), (1024, 2048, 4096, 8192), (transpose,), 0),
                    "16-column tiles per block of the few-rows kernel",
                )
            )
    params.append(
        _parameter(
            "few_rows_warps_per_sm",
            (4, 8, 16, 32),
            _cases(HALF, (1, 16, 64), (1024, 4096), (False, True), 0),
            "warps per multiprocessor that the few-rows kernel's blocks add up to",
        )
    )
    return params


PARAMETERS: list[Parameter] = _few_rows_parameters() + [
    _parameter(
        "handshake_cluster",
        (1, 2),
        _cases(HALF, (4096,), (1024, 2048, 4096, 8192), (True,)),
        "CTAs per cluster of the handshake kernel (sm_90a), which share W tiles",
    ),
    # K not a multiple of 8: the staging kernel even on sm_90, where 16-byte rows would take
    # the streaming kernels.
    _parameter(
        "mma_w_cost",
        (8, 16, 32, 64, 128),
        _cases(HALF, (64, 1024, 8192), (1000, 2000, 4000), (False, True), 0),
        "cost of a W tile in rows of mma.sync, in the staging kernel's tile choice",
    ),
    _parameter(
        "fma_w_cost",
        (4, 8, 16, 32, 64),
        _cases((torch.float32,), (64, 1024, 8192), (256, 1024, 2048), (False, True), 0),
        "cost of a W tile in rows of FFMA, in the FMA staging kernel's tile choice",
    ),
    _parameter(
        "stream_load_rows",
        (2, 4, 8, 16, 32),
        _cases(HALF, (4096, 16384), (1024, 4096), (False, True), 0),
        "rows of x and W loaded per row of MMAs, in the streaming kernels' cost",
    ),
    # float32, which no kernel of the family takes from cuBLAS on the default path.
    _parameter(
        "chunk_bytes",
        (8 << 20, 16 << 20, 32 << 20, 64 << 20),
        _cases((torch.float32,), (16384,), (1024, 2048, 4096), (True,)),
        "bytes of output each of cuBLAS's chunks aims at",
    ),
    _parameter(
        "chunk_min_rows",
        (256, 512, 1024, 2048),
        _cases((torch.float32,), (16384,), (1024, 2048, 4096), (True,)),
        "fewest rows each of cuBLAS's chunks aims at",
    ),
]
