"""Host overhead of calling a converted model: per-call time of a tiny pre-norm attention block
(bench_e2e's "block", SDPA) with shapes so small that Python on the call path is the cost.

Variants, each called under torch.inference_mode() (--no-grad: torch.no_grad()) with the same
inputs every call, so a compiled one stays on its steady-state path:

  eager           the model as is
  compile-noop    torch.compile of a function calling the model, with a backend that returns
                  the graph as is, Dynamo's settings left at their defaults: Dynamo's own
                  entry and guard cost
  convert         mti.convert(model)
  convert-cached  what a converted call with known input layouts runs (convert's run_cached:
                  Dynamo's cached code, entered without torch.compile's Python wrapper),
                  skipping ConvertedModule.forward (convert - convert-cached: its own cost)
  graph-captured  the FX graph Dynamo captured, called directly (no Dynamo, no guards)
  graph-rewritten the same graph as convert's backend rewrote it, called directly: what the
                  rewritten ops cost against the original ones

Median microseconds per call over --rounds rounds of --calls calls each, variants taking turns
so that drift of the host's speed hits each alike. On the CPU by default, with one thread;
with --device cuda, each round ends with a synchronize, and at the default sizes the GPU keeps
up, so the numbers are host time there too. bench_e2e's block (hidden 2048, bf16) keeps the
GPU busy longer than the host at seq 512 in fp32 (all variants alike); with --dtype bfloat16
and a short --seq it shows that block's host time on a GPU.

    python benchmarks/convert_overhead.py [--hidden 64] [--seq 4] [--attn sdpa] [--no-grad]
                                          [--device cpu|cuda] [--dtype float32|bfloat16|float16]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import make_torch_inplace as mti
from benchmarks.bench_e2e import Size, build, make_inputs
from benchmarks.common import env_info


def per_call_us(fn, calls: int, device: torch.device) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4)
    parser.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--no-grad", action="store_true", help="torch.no_grad, not inference_mode")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    torch.set_num_threads(1)  # host-bound shapes: threads add only noise
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    size = Size(hidden=args.hidden, heads=args.heads, layers=1, max_seq=args.seq)
    model = build("block", args.attn, size, device, dtype)
    inputs = make_inputs("block", 1, args.seq, size, device, dtype)
    mode = torch.no_grad if args.no_grad else torch.inference_mode

    converted = mti.convert(model)
    size_hint = importlib.import_module("make_torch_inplace.convert._compat").size_hint
    # The graph each backend was given, and its inputs (the model's inputs and parameters,
    # the same tensors at every call here), to run the graphs without Dynamo: the converted
    # backend rewrites its graph in place, the no-op one keeps it as captured.
    graphs: dict[str, list] = {"rewritten": [], "captured": []}

    def recording(backend, name):
        def compile_graph(gm, example_inputs):
            # a dynamic size's value in the call (reading it as int() would add a guard)
            args = [size_hint(a) if isinstance(a, torch.SymInt) else a for a in example_inputs]
            graphs[name].append((gm, args))
            return backend(gm, example_inputs)

        return compile_graph

    # convert's own compiled call, made again with the graph recorded on its way to the backend.
    converted._compiled_call = torch.compile(
        model.__call__, backend=recording(converted._backend, "rewritten")
    )
    # Compiled through a function of its own, whose frame Dynamo captures with the model's
    # forward inlined: compiling model.__call__ again would add its graph to the cache of the
    # forward's code, which convert's calls share, and the one of them that ran last would be
    # the one convert's run-only calls find first (see ConvertedModule.forward).
    noop = torch.compile(
        lambda *args: model(*args),
        backend=recording(lambda gm, example_inputs: gm.forward, "captured"),
    )

    with mode():
        expected = model(*inputs)
        torch.testing.assert_close(noop(*inputs), expected)  # the same ops
        # in place, in another order or precision (eager attention's float32 softmax)
        diff = (converted(*inputs).float() - expected.float()).abs().max().item()
    if any(len(g) != 1 for g in graphs.values()):
        sys.exit(f"expected one graph per backend, got {graphs}")
    ((rewritten, rewritten_args),) = graphs["rewritten"]
    ((captured, captured_args),) = graphs["captured"]

    run_cached = importlib.import_module("make_torch_inplace.convert._compat").run_cached
    variants = {
        "eager": lambda: model(*inputs),
        "compile-noop": lambda: noop(*inputs),
        "convert": lambda: converted(*inputs),
        "convert-cached": lambda: run_cached(model, inputs, {}, converted._compiled_call),
        "graph-captured": lambda: captured(*captured_args),
        "graph-rewritten": lambda: rewritten(*rewritten_args),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    with mode():
        for fn in variants.values():  # warm-up
            per_call_us(fn, args.calls // 4, device)
        for _ in range(args.rounds):
            for name, fn in variants.items():
                times[name].append(per_call_us(fn, args.calls, device))
    print(
        f"block {args.attn}, hidden {args.hidden}, seq {args.seq}, {args.dtype}, "
        f"{'no_grad' if args.no_grad else 'inference_mode'}, {env_info()['device']}, "
        f"torch {torch.__version__}; convert's max abs difference from eager {diff:.3g}"
    )
    base = statistics.median(times["eager"])
    for name, ts in times.items():
        us = statistics.median(ts)
        print(f"  {name:14s} {us:8.1f} us/call  ({us / base:.2f}x eager)")


if __name__ == "__main__":
    main()
