"""python -m make_torch_inplace.tune: time every candidate of every tuned parameter on this
GPU, next to the value the table picks today, and print the rows that the parameter's table
(csrc/kernels/<family>/tuning.h) should get: one per run of row lengths where a candidate
beats the table's choice by more than the margin (2% by default).

Each case is timed with triton.testing.do_bench (median), the candidates alternated within
each round. The tables are keyed by element size, not dtype, so cases of one element size
and row length (fp16 and bf16) are judged by their summed time."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from . import override, parameters

TABLE = None  # the "candidate" that leaves the choice to the table


def _time(fn, candidates: list, name: str, rounds: int) -> dict:
    from triton.testing import do_bench

    times: dict = {c: [] for c in candidates}
    for r in range(rounds):
        # Each round starts one candidate later, so drifting clocks weigh on all alike.
        order = candidates[r % len(candidates) :] + candidates[: r % len(candidates)]
        for c in order:
            with override(name, c):
                times[c].append(do_bench(fn, warmup=10, rep=40, return_mode="median"))
    return {c: sorted(t)[len(t) // 2] for c, t in times.items()}


def proposed_rows(
    timings: Sequence[tuple[int, int, dict]], margin: float
) -> list[tuple[int, int, int, int, float]]:
    """From (elem_bytes, n, {candidate or TABLE: ms}) per case, the rows to add:
    (elem_bytes, n_min, n_max, value, gain), where gain is the table's time over the value's.
    Cases of one (elem_bytes, n) are summed; a length keeps the table's choice unless a
    candidate is faster by more than `margin`; neighbouring lengths with the same proposal
    make one row."""
    summed: dict[tuple[int, int], dict] = {}
    for elem, n, t in timings:
        acc = summed.setdefault((elem, n), {})
        for c, ms in t.items():
            acc[c] = acc.get(c, 0.0) + ms
    best = []
    for (elem, n), t in sorted(summed.items()):
        value = min((c for c in t if c is not TABLE), key=t.get)
        gain = t[TABLE] / t[value]
        best.append((elem, n, value if gain > 1 + margin else TABLE, gain))
    rows, start = [], 0
    for i in range(1, len(best) + 1):
        if i == len(best) or best[i][0] != best[start][0] or best[i][2] != best[start][2]:
            elem, n_min, value, _ = best[start]
            if value is not TABLE:
                gain = min(b[3] for b in best[start:i])
                rows.append((elem, n_min, best[i - 1][1], value, gain))
            start = i
    return rows


def memory_gbps(props) -> int:
    """A GPU's peak memory bandwidth in GB/s, as the C++ key computes it (common.cuh), rounded
    down to 100 GB/s: the bound that tells this GPU's rows from a slower one's of the same
    compute capability (an H200's from an H100's)."""
    gbps = 2 * props.memory_clock_rate * (props.memory_bus_width // 8) // 1_000_000
    return gbps // 100 * 100


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--family", help="only this kernel family's parameters")
    ap.add_argument("--param", action="append", help="only these parameters (repeatable)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per case")
    ap.add_argument("--margin", type=float, default=0.02, help="least gain that makes a row")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the tuning command needs a CUDA GPU")
    major, minor = torch.cuda.get_device_capability()
    cc, gpu = 10 * major + minor, torch.cuda.get_device_name()
    gbps = memory_gbps(torch.cuda.get_device_properties())
    for p in parameters(args.family):
        if args.param and p.name not in args.param:
            continue
        candidates = [TABLE, *p.candidates]
        print(f"\n# {p.family}: {p.name}: {p.doc} (candidates {list(p.candidates)})")
        timings = []
        for case in p.cases("cuda"):
            fn = case.make()
            t = _time(fn, candidates, p.name, args.rounds)
            cells = "  ".join(
                f"{'table' if c is TABLE else c}: {t[c] * 1e3:8.1f} us" for c in candidates
            )
            print(f"{case.label:>32}  {cells}")
            timings.append((case.elem_bytes, case.n, t))
            del fn
            torch.cuda.empty_cache()
        rows = proposed_rows(timings, args.margin)
        if not rows:
            print(f"rows: none (the table's choice is within {args.margin:.0%} of the best)")
        for elem, n_min, n_max, value, gain in rows:
            print(
                f"    {{When{{.cc_min = {cc}, .cc_max = {cc}, .gbps_min = {gbps}, "
                f".elem_bytes = {elem}, .n_min = {n_min}, .n_max = {n_max}}}, {value}, "
                f'"{gain - 1:.0%} faster than the table on {gpu}"}},'
            )


if __name__ == "__main__":
    main()
