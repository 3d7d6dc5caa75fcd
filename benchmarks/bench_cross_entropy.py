"""A training step's loss: time and peak memory of the cross entropy forward + backward, from
the logits to their gradient, for PyTorch as Hugging Face runs it
(F.cross_entropy(logits.float(), target)), mti.cross_entropy_ and Liger-Kernel's
LigerCrossEntropyLoss (when installed).

Each timed call makes the logits anew (a clone of a fixed tensor, the same for every
implementation: the "clone" row times it alone), runs the loss and its backward; the logits'
gradient reaches an autograd node that drops it, as the LM head's backward would consume it.
Peak = the allocator's peak above what was allocated before the call (the clone included);
time = the median GPU time of a call (common.time_ms with gpu_only: autograd's host work left
out), L2 flushed before each.
Targets: uniform class indices, 1 in 16 set to ignore_index.

    python benchmarks/bench_cross_entropy.py                 # V 32000 and 128256, 4096/8192 rows
    python benchmarks/bench_cross_entropy.py --quick         # V 32000, 4096 rows
    python benchmarks/bench_cross_entropy.py --device cpu    # small code-path check

Writes benchmarks/results/<gpu>/cross_entropy.json and cross_entropy.md.
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
    cuda_missing,
    env_info,
    fmt_bytes,
    markdown_table,
    peak_extra_bytes,
    time_ms,
    write_results,
)

IGNORE_INDEX = -100


class _Logits(torch.autograd.Function):
    """A copy of a fixed tensor as logits that require grad; their gradient is dropped."""

    @staticmethod
    def forward(ctx, base):
        return base.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


def torch_step(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    v = logits.shape[-1]
    return F.cross_entropy(logits.float().view(-1, v), target.view(-1), ignore_index=IGNORE_INDEX)


def ours_step(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return mti.cross_entropy_(logits, target, ignore_index=IGNORE_INDEX)


def liger_step() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss
    except ImportError:
        return None
    loss = LigerCrossEntropyLoss(ignore_index=IGNORE_INDEX)
    return lambda logits, target: loss(logits.view(-1, logits.shape[-1]), target.view(-1))


def make_call(step, base: torch.Tensor, target: torch.Tensor) -> Callable[[], torch.Tensor]:
    def call():
        loss = step(_Logits.apply(base), target)
        loss.backward()
        return loss.detach()

    return call


def run_case(v: int, rows: int, dtype: torch.dtype, device: str, impls: dict) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(v + rows)
    # A leaf that requires grad, so that _Logits records; its gradient is never made.
    base = torch.randn(rows, v, generator=g, device=device).mul_(3).to(dtype).requires_grad_()
    target = torch.randint(0, v, (rows,), generator=g, device=device)
    target[::16] = IGNORE_INDEX
    expected = None
    records = []
    calls = {"clone": lambda: base.clone()}
    calls.update({name: make_call(step, base, target) for name, step in impls.items()})
    for name, call in calls.items():
        try:
            loss = call()
            peak = peak_extra_bytes(call, device=device)
            ms = time_ms(call, device=device, gpu_only=True)
        except Exception as e:  # a Liger version that refuses a case is reported, not fatal
            print(f"  {name}: failed ({type(e).__name__}: {e})")
            continue
        if name == "torch":
            expected = loss
        diff = None if name == "clone" or expected is None else (loss - expected).abs().item()
        records.append(
            dict(
                env_info(),
                impl=name,
                vocab=v,
                rows=rows,
                dtype=str(dtype).removeprefix("torch."),
                ms=ms,
                peak_extra_bytes=peak,
                loss_diff_vs_torch=diff,
            )
        )
        print(f"  {name:>10}: {ms:8.3f} ms  peak {fmt_bytes(peak):>10}  |dloss| {diff}")
    return records


def table(records: list[dict]) -> str:
    rows = []
    for r in records:
        ref = next(
            (
                q
                for q in records
                if q["impl"] == "torch" and (q["vocab"], q["rows"]) == (r["vocab"], r["rows"])
            ),
            None,
        )
        rows.append(
            dict(
                r,
                peak=fmt_bytes(r["peak_extra_bytes"]),
                peak_vs_torch=r["peak_extra_bytes"] / ref["peak_extra_bytes"] if ref else None,
                time_vs_torch=r["ms"] / ref["ms"] if ref else None,
            )
        )
    cols = ["vocab", "rows", "dtype", "impl", "ms", "time_vs_torch", "peak", "peak_vs_torch"]
    return markdown_table(rows, cols + ["loss_diff_vs_torch"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="V 32000 and 4096 rows only")
    ap.add_argument("--vocabs", type=int, nargs="+")
    ap.add_argument("--rows", type=int, nargs="+")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--no-liger", action="store_true")
    args = ap.parse_args()
    if cuda_missing("bench_cross_entropy.py", args.device):
        return
    cpu = args.device == "cpu"
    vocabs = args.vocabs or ([4096] if cpu else [32000] if args.quick else [32000, 128256])
    all_rows = args.rows or ([256] if cpu else [4096] if args.quick else [4096, 8192])
    impls = {"torch": torch_step, "make_torch_inplace": ours_step}
    liger = None if args.no_liger or cpu else liger_step()
    if liger is not None:
        impls["liger"] = liger
    dtype = getattr(torch, args.dtype)
    records = []
    for v in vocabs:
        for rows in all_rows:
            print(f"V={v} rows={rows} {args.dtype}")
            records += run_case(v, rows, dtype, args.device, impls)
    json_path, md_path = write_results("cross_entropy", records, table(records))
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
