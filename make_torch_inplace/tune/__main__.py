"""python -m make_torch_inplace.tune: time every candidate of every tuned parameter on this
GPU (median of triton.testing.do_bench, candidates alternated within each case) and print
the rows that the parameter's table (csrc/kernels/<family>/tuning.h) would get for it."""

from __future__ import annotations

import argparse

import torch

from . import Parameter, override, parameters


def _time(fn, candidates: list[int], name: str, rounds: int) -> dict[int, float]:
    from triton.testing import do_bench

    times: dict[int, list[float]] = {c: [] for c in candidates}
    for r in range(rounds):
        # Each round starts one candidate later, so drifting clocks weigh on all alike.
        order = candidates[r % len(candidates) :] + candidates[: r % len(candidates)]
        for c in order:
            with override(name, c):
                times[c].append(do_bench(fn, warmup=10, rep=40, return_mode="median"))
    return {c: sorted(t)[len(t) // 2] for c, t in times.items()}


def _rows(p: Parameter, best: list[tuple[int, int, int, str]], gpu: str, cc: int) -> list[str]:
    """Merges consecutive cases (same element size, increasing n) with the same winner."""
    rows, start = [], 0
    for i in range(1, len(best) + 1):
        if i == len(best) or best[i][0] != best[start][0] or best[i][2] != best[start][2]:
            elem, n_min, value, _ = best[start]
            n_max = best[i - 1][1]
            rows.append(
                f"    {{When{{.cc_min = {cc}, .cc_max = {cc}, .elem_bytes = {elem}, "
                f".n_min = {n_min}, .n_max = {n_max}}}, {value}, "
                f'"fastest on {gpu} for n {n_min}-{n_max}"}},'
            )
            start = i
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--family", help="only this kernel family's parameters")
    ap.add_argument("--param", action="append", help="only these parameters (repeatable)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per case")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the tuning command needs a CUDA GPU")
    major, minor = torch.cuda.get_device_capability()
    gpu = torch.cuda.get_device_name()
    for p in parameters(args.family):
        if args.param and p.name not in args.param:
            continue
        print(f"\n# {p.family}: {p.name} (candidates {list(p.candidates)})")
        best = []
        for case in p.cases("cuda"):
            fn = case.make()
            t = _time(fn, list(p.candidates), p.name, args.rounds)
            winner = min(t, key=t.get)
            cells = "  ".join(f"{c}: {t[c] * 1e3:8.1f} us" for c in p.candidates)
            print(f"{case.label:>28}  {cells}  -> {winner}")
            best.append((case.elem_bytes, case.n, winner, case.label))
            del fn
            torch.cuda.empty_cache()
        best.sort()
        print("rows:")
        print("\n".join(_rows(p, best, gpu, 10 * major + minor)))


if __name__ == "__main__":
    main()
