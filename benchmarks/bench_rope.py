"""The rotary position embedding of a query and a key as Llama applies it: mti.rope_ against
Hugging Face's written-out formula (x * cos + rotate_half(x) * sin) in eager mode and under
torch.compile, and Liger-Kernel's rope (liger_kernel.ops.rope, when installed).

q and k: (1, 32, seq, 128), each the transpose of a (1, seq, 32, 128) projection output (not
contiguous, as Llama makes them); cos and sin: (1, 1, seq, 128) (Liger: (1, seq, 128)), real
rotary tables. Liger rotates q and k in one call, so every contender does the same work: q and
k both (ours: rope_ on each).

- forward: under no_grad. rope_ and Liger rotate q and k in place, again at each call; the
  formula makes new tensors. The "copy" row clones q and k: the bytes an in-place forward
  moves (cos and sin aside), the ceiling a bandwidth-bound op can reach.
- forward+backward: each call makes q and k anew (clones of fixed tensors through an autograd
  node that drops their gradient, the same for every contender), runs the forward and the
  backward with fixed output gradients (q's layout). The "copy" row clones q and k three
  times: the input's clone, the forward and the backward each move as much.

Per case: median GPU ms of each contender, all timed in turns in one run
(common.time_alternating with gpu_only, L2 flushed before each call; common.place_median);
of_copy = the copy row's ms / the contender's (1.0: as fast as a copy of the same bytes);
peak = peak memory above what was allocated before the call (common.peak_extra_bytes);
max_err = the largest error of q's and k's results (or gradients) against the formula in
float64 (the eager formula's own: PyTorch's rounding in the dtype).

    python benchmarks/bench_rope.py                  # seq 4096-32768, bf16 and fp32
    python benchmarks/bench_rope.py --quick          # seq 8192, bf16
    python benchmarks/bench_rope.py --device cpu     # a small code-path check

Writes benchmarks/results/<gpu>/rope.json and rope.md.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import make_torch_inplace as mti
from benchmarks.common import (
    contender_parser,
    contender_records,
    cuda_missing,
    fmt_bytes,
    markdown_table,
    time_and_peak,
    write_results,
)

HEADS, HEAD_DIM = 32, 128
PASSES = ("forward", "forward+backward")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def hf_rope(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb with cos and sin already unsqueezed."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def ours_rope(q, k, cos, sin):
    return mti.rope_(q, cos, sin), mti.rope_(k, cos, sin)


def liger_rope() -> Callable | None:
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except ImportError:
        return None

    def rope(q, k, cos, sin):
        # Liger's tables are (1, seq, D); some versions return cos and sin too.
        out = LigerRopeFunction.apply(q, k, cos[0], sin[0])
        return out[0], out[1]

    return rope


class _Input(torch.autograd.Function):
    """A copy of a fixed tensor (its layout kept) that requires grad; its gradient is dropped."""

    @staticmethod
    def forward(ctx, base):
        return base.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


def tables(seq: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's cos and sin for positions 0..seq-1, (1, 1, seq, HEAD_DIM)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    freqs = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (t.to(device, dtype)[None, None] for t in (emb.cos(), emb.sin()))


def heads_view(seq: int, dtype, device, seed: int) -> torch.Tensor:
    """(1, HEADS, seq, HEAD_DIM), the transpose of a (1, seq, HEADS, HEAD_DIM) tensor."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(1, seq, HEADS, HEAD_DIM, generator=g, device=device, dtype=dtype).transpose(
        1, 2
    )


def forward_calls(impls: dict, q, k, cos, sin) -> dict[str, Callable]:
    calls = {"copy": lambda: (q.clone(), k.clone())}
    for name, fn in impls.items():
        calls[name] = lambda fn=fn: fn(q, k, cos, sin)
    return calls


def backward_calls(impls: dict, q, k, cos, sin, gq, gk) -> dict[str, Callable]:
    qb, kb = q.detach().requires_grad_(), k.detach().requires_grad_()

    def copies():
        for _ in range(3):
            q.clone(), k.clone()

    calls = {"copy": copies}
    for name, fn in impls.items():

        def call(fn=fn):
            qo, ko = fn(_Input.apply(qb), _Input.apply(kb), cos, sin)
            torch.autograd.backward((qo, ko), (gq, gk))

        calls[name] = call
    return calls


def max_errors(impls: dict, q, k, cos, sin, grad: bool, gq, gk) -> dict[str, float]:
    """Each contender's largest error on q's and k's results (gradients), on fresh copies,
    against the formula in float64."""

    def run(fn, q, k, cos, sin, gq, gk):
        qi, ki = (t.detach().clone().requires_grad_(grad) for t in (q, k))
        with torch.set_grad_enabled(grad):
            qo, ko = fn(qi * 1 if grad else qi, ki * 1 if grad else ki, cos, sin)
        if not grad:
            return qo.detach().double(), ko.detach().double()
        torch.autograd.backward((qo, ko), (gq.clone(), gk.clone()))
        return qi.grad.double(), ki.grad.double()

    f64 = [t.double() for t in (q, k, cos, sin, gq, gk)]
    truth = run(hf_rope, *f64)
    return {
        name: max(
            (a - b).abs().max().item() for a, b in zip(run(fn, q, k, cos, sin, gq, gk), truth)
        )
        for name, fn in impls.items()
    }


def run_case(seq: int, dtype, device: str, impls: dict, args) -> list[dict]:
    q, k = heads_view(seq, dtype, device, 1), heads_view(seq, dtype, device, 2)
    cos, sin = tables(seq, dtype, device)
    gq, gk = heads_view(seq, dtype, device, 3), heads_view(seq, dtype, device, 4)
    records = []
    for pass_ in PASSES:
        grad = pass_ != "forward"
        if "hf_compile" in impls:
            torch._dynamo.reset()  # a fresh compilation per case: never the recompile limit
            impls["hf_compile"] = torch.compile(hf_rope)
        errors = max_errors(impls, q, k, cos, sin, grad, gq, gk)
        if grad:
            calls = backward_calls(impls, q, k, cos, sin, gq, gk)
        else:
            calls = forward_calls(impls, q, k, cos, sin)
        with torch.set_grad_enabled(grad):
            times, peaks = time_and_peak(
                calls, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, device=device
            )
        case = dict(seq=seq, dtype=str(dtype).removeprefix("torch."), pass_=pass_)
        records += contender_records(case, times, peaks, errors, times["copy"], f"{pass_:>16} ")
        # The in-place contenders rotated q and k: draw them anew for the next pass.
        q, k = heads_view(seq, dtype, device, 1), heads_view(seq, dtype, device, 2)
    return records


def table(records: list[dict]) -> str:
    rows = [dict(r, peak=fmt_bytes(r["peak_extra_bytes"])) for r in records]
    cols = ["seq", "dtype", "pass_", "impl", "ms", "of_copy", "peak", "max_err"]
    return markdown_table(rows, cols)


def main() -> None:
    ap = contender_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="seq 8192, bf16 only")
    ap.add_argument("--seqs", type=int, nargs="+")
    ap.add_argument("--dtypes", nargs="+", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    if cuda_missing("bench_rope.py", args.device):
        return
    cpu = args.device == "cpu"
    seqs = args.seqs or ([128] if cpu else [8192] if args.quick else [4096, 8192, 16384, 32768])
    dtypes = args.dtypes or (["bfloat16"] if args.quick or cpu else ["bfloat16", "float32"])
    impls: dict[str, Callable] = {"make_torch_inplace": ours_rope, "hf_eager": hf_rope}
    if not args.no_compile:
        impls["hf_compile"] = hf_rope  # compiled per case in run_case
    liger = None if args.no_liger or cpu else liger_rope()
    if liger is not None:
        impls["liger"] = liger
    records = []
    for dtype in dtypes:
        for seq in seqs:
            print(f"seq={seq} {dtype}")
            records += run_case(seq, getattr(torch, dtype), args.device, impls, args)
    json_path, md_path = write_results("rope", records, table(records))
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
