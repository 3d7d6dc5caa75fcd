"""Bandwidth of the row-wise ops (softmax_, log_softmax_, layer_norm_, rms_norm_) against
torch.clone (the ceiling), PyTorch eager, torch.compile and Liger-Kernel.

For each row width N the tensor holds 2^26 elements (rows = 2^26 / N), far larger than L2.
TB/s = the bytes the op must move / median time: forward reads x and writes y (plus weight,
bias, a bool mask); backward reads y and dy and writes dx (plus dweight, dbias). The "clone"
row is x.clone() for forward and y + dy (two reads, one write) for backward: a copy that moves
the same bytes with no arithmetic. Backward runs torch.autograd.grad from the saved output
with dy given, and times the backward only. Times are the GPU's alone (common.time_ms with
gpu_only): every call's kernels are queued before its start event runs, so that host work
(autograd's above all) does not count.

    python benchmarks/bench_rowwise.py                    # full sweep, CUDA
    python benchmarks/bench_rowwise.py --quick            # 3 widths, bfloat16
    python benchmarks/bench_rowwise.py --ops softmax rms_norm --dtypes bfloat16 --no-compile
    python benchmarks/bench_rowwise.py --device cpu --quick --numel-log2 16   # code-path check

Writes benchmarks/results/<gpu>/rowwise.json, rowwise.md, rowwise_forward.png, rowwise_backward.png.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
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
    plot_grid,
    results_dir,
    time_ms,
    write_results,
)

# Powers of two, and model widths that whole warps share evenly only at 3, 5, 6 or 7 vectors a
# thread (GPT-2 and BERT's 768, the hidden sizes of 1.5B-13B models).
ALL_N = sorted(
    [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144]
    + [768, 1536, 2560, 3072, 5120]
)
QUICK_N = [1024, 16384, 262144]
ALL_DTYPES = ["float32", "bfloat16", "float16"]
QUICK_DTYPES = ["bfloat16"]
IMPLS = ["clone", "make_torch_inplace", "torch", "torch.compile", "liger"]
ALTERNATIVES = ["torch", "torch.compile", "liger"]
EPS = 1e-5
SCALE = 0.125  # 1 / sqrt(head_dim 64), as attention scores are scaled

Params = dict[str, torch.Tensor]


# --------------------------------------------------------------------------- the ops


@dataclass(frozen=True)
class Spec:
    """One op (and softmax variant): its eager PyTorch form and its in-place form."""

    key: str  # the --ops name
    op: str
    variant: str
    eager: Callable[[torch.Tensor, Params], torch.Tensor]
    inplace: Callable[[torch.Tensor, Params], torch.Tensor]
    weights: tuple[str, ...] = ()  # params that get gradients
    masked: bool = False  # x is (batch, q, N) with a (q, N) mask


def _masked_softmax(x: torch.Tensor, p: Params) -> torch.Tensor:
    return F.softmax(x.masked_fill(p["masked_out"], float("-inf")), -1)


SPECS = [
    Spec(
        "softmax",
        "softmax",
        "plain",
        lambda x, p: F.softmax(x, -1),
        lambda x, p: mti.softmax_(x, -1),
    ),
    Spec(
        "softmax_scale",
        "softmax",
        "scale",
        lambda x, p: F.softmax(x * SCALE, -1),
        lambda x, p: mti.softmax_(x, -1, scale=SCALE),
    ),
    Spec(
        "softmax_causal",
        "softmax",
        "causal",
        _masked_softmax,
        lambda x, p: mti.softmax_(x, -1, causal=True),
        masked=True,
    ),
    Spec(
        "softmax_mask",
        "softmax",
        "mask",
        _masked_softmax,
        lambda x, p: mti.softmax_(x, -1, mask=p["mask"]),
        masked=True,
    ),
    Spec(
        "log_softmax",
        "log_softmax",
        "plain",
        lambda x, p: F.log_softmax(x, -1),
        lambda x, p: mti.log_softmax_(x, -1),
    ),
    Spec(
        "layer_norm",
        "layer_norm",
        "plain",
        lambda x, p: F.layer_norm(x, (x.shape[-1],), p["weight"], p["bias"], EPS),
        lambda x, p: mti.layer_norm_(x, (x.shape[-1],), p["weight"], p["bias"], EPS),
        weights=("weight", "bias"),
    ),
    Spec(
        "rms_norm",
        "rms_norm",
        "plain",
        lambda x, p: F.rms_norm(x, (x.shape[-1],), p["weight"], EPS),
        lambda x, p: mti.rms_norm_(x, (x.shape[-1],), p["weight"], EPS),
        weights=("weight",),
    ),
]
SPEC_BY_KEY = {s.key: s for s in SPECS}


def make_shape(spec: Spec, numel: int, n: int) -> tuple[int, ...]:
    rows = numel // n
    if not spec.masked:
        return (rows, n)
    # Attention scores (batch * heads, q, k): square when the rows allow it, else one batch.
    q = min(rows, n)
    return (rows // q, q, n)


def make_params(spec: Spec, shape: tuple[int, ...], dtype: torch.dtype, device) -> Params:
    n = shape[-1]
    p: Params = {}
    if "weight" in spec.weights:
        p["weight"] = (1 + 0.1 * torch.randn(n, device=device)).to(dtype).requires_grad_()
    if "bias" in spec.weights:
        p["bias"] = (0.1 * torch.randn(n, device=device)).to(dtype).requires_grad_()
    if spec.variant == "causal":
        q = shape[-2]
        keep = torch.ones(q, n, dtype=torch.bool, device=device).tril()
        p["masked_out"] = ~keep
    elif spec.variant == "mask":
        p["mask"] = torch.rand(shape[-2], n, device=device) < 0.5  # True = takes part
        p["masked_out"] = ~p["mask"]
    return p


def bytes_moved(spec: Spec, pass_: str, numel: int, elem: int, p: Params) -> int:
    """The traffic the op cannot avoid, the same for every implementation."""
    weight_bytes = sum(p[w].numel() * elem for w in spec.weights)
    mask_bytes = p["mask"].numel() if "mask" in p else 0
    if pass_ == "forward":
        return 2 * numel * elem + weight_bytes + mask_bytes
    # read y, dy (and weights, mask); write dx and one gradient per weight
    return 3 * numel * elem + 2 * weight_bytes + mask_bytes


# --------------------------------------------------------------------------- implementations


def liger_impl(spec: Spec, n: int, p: Params, dtype, device):
    """(module, its parameters) of Liger-Kernel's version of spec, or None if it has none."""
    try:
        import liger_kernel.transformers as lt
    except Exception:
        return None
    if spec.key == "softmax" and hasattr(lt, "LigerSoftmax"):
        return lt.LigerSoftmax(), []
    if spec.key == "layer_norm":
        module = lt.LigerLayerNorm(n, eps=EPS)
    elif spec.key == "rms_norm":
        # in_place=True would write dx over dy, which the repeated timed backward reuses.
        module = lt.LigerRMSNorm(n, eps=EPS, in_place=False)
    else:
        return None
    module = module.to(device=device, dtype=dtype)
    with torch.no_grad():
        for name in spec.weights:
            getattr(module, name).copy_(p[name])
    return module, [getattr(module, name) for name in spec.weights]


class Compiled:
    """torch.compile of a spec's eager function, compiled anew for each group of shapes.

    dynamic: one compilation per op and dtype serves every N (symbolic shapes); static: one
    per N, the fastest kernels but minutes of compiling. Each group starts from
    torch._dynamo.reset() so that the recompile limit never silently falls back to eager.
    """

    def __init__(self, spec: Spec, mode: str):
        self.spec, self.mode, self.fn = spec, mode, None
        self.failed: set[str] = set()  # passes that failed to compile in this group

    def start_group(self) -> None:
        # The timed backward runs many times from one forward (retain_graph=True), which a
        # compiled backward with donated buffers refuses. Donating only lets the backward
        # reuse saved activations' memory; it does not change which kernels run.
        import torch._functorch.config as functorch_config

        if hasattr(functorch_config, "donated_buffer"):  # torch >= 2.6
            functorch_config.donated_buffer = False
        torch._dynamo.reset()
        self.fn = torch.compile(self.spec.eager, dynamic=self.mode == "dynamic")
        self.failed.clear()


# --------------------------------------------------------------------------- measuring


@dataclass
class Result:
    ms: float
    peak: int


def run_forward(fn: Callable[[torch.Tensor], object], x: torch.Tensor, timing: dict) -> Result:
    x.normal_()
    with torch.no_grad():
        ms = time_ms(lambda: fn(x), **timing)
        peak = peak_extra_bytes(lambda: fn(x), device=x.device)
    return Result(ms, peak)


def run_backward(
    fn: Callable[[torch.Tensor], torch.Tensor],
    params: list[torch.Tensor],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device,
    timing: dict,
) -> Result:
    x0 = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    # The in-place ops refuse to overwrite a leaf; the clone's backward passes dy through.
    y = fn(x0.clone())
    dy = torch.randn_like(y)
    inputs = [x0, *params]

    def backward():
        return torch.autograd.grad(y, inputs, dy, retain_graph=True)

    ms = time_ms(backward, **timing)
    peak = peak_extra_bytes(backward, device=device)
    return Result(ms, peak)


def run_clone(pass_: str, x: torch.Tensor, timing: dict) -> Result:
    if pass_ == "forward":
        return run_forward(torch.clone, x, timing)
    y, dy = torch.randn_like(x), torch.randn_like(x)
    return Result(
        time_ms(lambda: torch.add(y, dy), **timing),
        peak_extra_bytes(lambda: torch.add(y, dy), device=x.device),
    )


def bench_group(spec, dtype, n, args, device, compiled, clone_cache, records) -> None:
    numel = 1 << args.numel_log2
    shape = make_shape(spec, numel, n)
    p = make_params(spec, shape, dtype, device)
    x = torch.empty(shape, dtype=dtype, device=device)
    # The GPU's time: the backward's autograd host work would otherwise count (see time_ms).
    timing = {
        "warmup_ms": args.warmup_ms,
        "rep_ms": args.rep_ms,
        "device": device,
        "gpu_only": True,
    }
    elem = x.element_size()
    weights = [p[w] for w in spec.weights]
    liger = None
    if not args.no_liger:
        try:
            liger = liger_impl(spec, n, p, dtype, device)
        except Exception as e:
            print(f"  liger unavailable for {spec.key} {dtype} N={n}: {type(e).__name__}: {e}")
    base = {
        "bench": "rowwise",
        "op": spec.op + "_",  # the in-place op's name, e.g. "softmax_"
        "variant": spec.variant,
        "dtype": str(dtype).removeprefix("torch."),
        "M": numel // n,
        "N": n,
        "shape": list(shape),
        **env_info(),
    }
    for pass_ in args.passes:
        moved = bytes_moved(spec, pass_, numel, elem, p)
        results: dict[str, Result] = {}

        key = (pass_, dtype, n)
        if key not in clone_cache:
            clone_cache[key] = run_clone(pass_, x, timing)
        results["clone"] = clone_cache[key]

        impls: dict[str, tuple[Callable, list[torch.Tensor]]] = {
            "make_torch_inplace": (lambda t: spec.inplace(t, p), weights),
            "torch": (lambda t: spec.eager(t, p), weights),
        }
        if compiled is not None and pass_ not in compiled.failed:
            impls["torch.compile"] = (lambda t: compiled.fn(t, p), weights)
        if liger is not None:
            module, liger_params = liger
            impls["liger"] = (module, liger_params)

        for impl, (fn, params) in impls.items():
            try:
                if pass_ == "forward":
                    results[impl] = run_forward(fn, x, timing)
                else:
                    results[impl] = run_backward(fn, params, shape, dtype, device, timing)
            except Exception as e:
                if impl == "make_torch_inplace" or impl == "torch":
                    raise
                print(
                    f"  {impl} failed for {spec.key} {dtype} N={n} {pass_}: "
                    f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                )
                if impl == "torch.compile":
                    compiled.failed.add(pass_)

        clone_moved = (2 if pass_ == "forward" else 3) * numel * elem
        line = []
        for impl, r in results.items():
            nbytes = clone_moved if impl == "clone" else moved
            rec = {
                **base,
                "impl": impl,
                "pass": pass_,
                "ms": r.ms,
                "bytes": nbytes,
                "tb_s": nbytes / (r.ms * 1e-3) / 1e12,
                "peak_extra_bytes": r.peak,
            }
            if impl == "torch.compile":
                rec["compile"] = compiled.mode
            records.append(rec)
            line.append(f"{impl} {rec['tb_s']:.3g}")
        print(
            f"{spec.key:15s} {base['dtype']:8s} N={n:<7d} {pass_:8s} TB/s: " + ", ".join(line),
            flush=True,
        )


def median_records(runs: list[list[dict]]) -> list[dict]:
    """Per (op, variant, dtype, pass, N, impl), the record with the median time over the runs
    (the lower middle one of an even count), against a cell that one sweep measured in a bad
    moment."""
    by_key: dict[tuple, list[dict]] = {}
    for run in runs:
        for r in run:
            key = (r["op"], r["variant"], r["dtype"], r["pass"], r["N"], r["impl"])
            by_key.setdefault(key, []).append(r)
    return [sorted(rs, key=lambda r: r["ms"])[(len(rs) - 1) // 2] for rs in by_key.values()]


# --------------------------------------------------------------------------- report


def tables(records: list[dict]) -> str:
    groups: dict[tuple, dict[int, dict[str, dict]]] = {}
    for r in records:
        key = (r["op"], r["variant"], r["dtype"], r["pass"])
        groups.setdefault(key, {}).setdefault(r["N"], {})[r["impl"]] = r
    out = []
    for (op, variant, dtype, pass_), by_n in groups.items():
        title = op if variant == "plain" else f"{op} ({variant})"
        rows = []
        for n, by_impl in sorted(by_n.items()):
            row = {"N": n, "rows": next(iter(by_impl.values()))["M"]}
            for impl in IMPLS:
                if impl in by_impl:
                    row[impl] = by_impl[impl]["tb_s"]
            ours = by_impl.get("make_torch_inplace")
            if ours is not None:
                if "clone" in by_impl:
                    row["ours/clone"] = ours["tb_s"] / by_impl["clone"]["tb_s"]
                alternatives = [by_impl[a]["tb_s"] for a in ALTERNATIVES if a in by_impl]
                if alternatives:
                    row["ours/best alt"] = ours["tb_s"] / max(alternatives)
                row["ours peak"] = fmt_bytes(ours["peak_extra_bytes"])
            if "torch" in by_impl:
                row["torch peak"] = fmt_bytes(by_impl["torch"]["peak_extra_bytes"])
            rows.append(row)
        columns = ["N", "rows", *IMPLS, "ours/clone", "ours/best alt", "ours peak", "torch peak"]
        out.append(f"## {title}, {dtype}, {pass_} (TB/s)\n\n" + markdown_table(rows, columns))
    return "\n".join(out)


def plots(records: list[dict], out_dir: Path) -> list[Path]:
    paths = []
    for pass_ in sorted({r["pass"] for r in records}):
        dtypes = list(dict.fromkeys(r["dtype"] for r in records if r["pass"] == pass_))
        panels: dict[tuple, dict[str, list]] = {}
        for r in records:
            if r["pass"] == pass_:
                plain = r["variant"] == "plain"
                title = r["op"].rstrip("_") if plain else f"{r['op']} ({r['variant']})"
                panel = panels.setdefault((title, r["dtype"]), {})
                panel.setdefault(r["impl"], []).append((r["N"], r["tb_s"]))
        path = out_dir / f"rowwise_{pass_}.png"
        plot_grid(
            path,
            [(f"{title}, {dtype}, {pass_}", series) for (title, dtype), series in panels.items()],
            xlabel="N (row width)",
            ylabel="TB/s",
            ncols=len(dtypes),
        )
        paths.append(path)
    return paths


# --------------------------------------------------------------------------- main


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"N in {QUICK_N}, {QUICK_DTYPES[0]} only"
    )
    parser.add_argument("--ops", nargs="+", choices=list(SPEC_BY_KEY), default=list(SPEC_BY_KEY))
    parser.add_argument("--dtypes", nargs="+", choices=ALL_DTYPES)
    parser.add_argument("--sizes", nargs="+", type=int, help="row widths N (default: the sweep)")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument(
        "--compile-static",
        action="store_true",
        help="compile once per N (dynamic=False) instead of once per op and dtype",
    )
    parser.add_argument("--no-liger", action="store_true")
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument("--no-forward", action="store_true")
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu only checks the code paths; its numbers mean little",
    )
    parser.add_argument("--numel-log2", type=int, default=26, help="elements per tensor: 2^this")
    parser.add_argument("--warmup-ms", type=float, default=10.0)
    parser.add_argument("--rep-ms", type=float, default=40.0)
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="sweeps to run; each record is the one with the median time",
    )
    args = parser.parse_args(argv)
    args.sizes = args.sizes or (QUICK_N if args.quick else ALL_N)
    args.dtypes = args.dtypes or (QUICK_DTYPES if args.quick else ALL_DTYPES)
    args.passes = [
        p for p, skip in (("forward", args.no_forward), ("backward", args.no_backward)) if not skip
    ]
    if not args.passes:
        parser.error("--no-forward and --no-backward leave nothing to run")
    too_wide = [n for n in args.sizes if n > 1 << args.numel_log2]
    if too_wide:
        parser.error(f"N {too_wide} wider than 2^{args.numel_log2} elements")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if cuda_missing("bench_rowwise", args.device):
        return 0
    device = torch.device(args.device)
    torch.manual_seed(0)
    start = time.perf_counter()
    runs: list[list[dict]] = []
    mode = "static" if args.compile_static else "dynamic"
    for _ in range(args.runs):
        runs.append([])
        clone_cache: dict = {}
        for key in args.ops:
            spec = SPEC_BY_KEY[key]
            for dtype_name in args.dtypes:
                dtype = getattr(torch, dtype_name)
                compiled = None if args.no_compile else Compiled(spec, mode)
                for i, n in enumerate(args.sizes):
                    if compiled is not None and (i == 0 or mode == "static"):
                        compiled.start_group()
                    bench_group(spec, dtype, n, args, device, compiled, clone_cache, runs[-1])
            # After each op: a sweep cut short keeps what it measured.
            records = median_records(runs)
            md = tables(records)
            json_path, md_path = write_results("rowwise", records, md)
    print()
    print(md)
    pngs = plots(records, results_dir())
    print(f"wrote {json_path}, {md_path}, " + ", ".join(map(str, pngs)))
    print(f"{env_info()['device']}: {len(records)} records in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
