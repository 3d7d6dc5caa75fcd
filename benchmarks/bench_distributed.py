"""FSDP2 training step on two GPUs: per-GPU peak memory and step time, as is and converted.

The Llama of bench_train.py (4 layers, hidden 2048, vocabulary 32000; its build_model, from
seed 0, so that both ranks start from the same weights), sharded with fully_shard on each
decoder layer and then on the whole model, bf16 weights (fp32 on the CPU), AdamW over the
sharded parameters. One step = forward with labels + backward + AdamW step +
zero_grad(set_to_none=True); each rank trains batch 1 on its own random ids (seeded by rank).

Variants: sdpa (the HF SDPA model, unconverted), convert (mti.convert after fully_shard),
convert-nologits and convert-recompute (mti.convert with bench_train's options of those
names) and liger (Liger-Kernel's
patch, applied before fully_shard; skipped where liger_kernel does not import). A variant that
raises on any rank is recorded with "error" on both: after each phase every rank learns every
rank's outcome, and a variant that failed anywhere goes no further.

Fields of each record (pass "fsdp2_step", world_size 2):
- loss: the 3rd step's loss from fresh weights, the mean over ranks;
- peak_extra_bytes: the peak allocated during one step, above what was allocated before it
  (sharded weights and optimizer state: three steps ran before), the max over ranks; CUDA:
  max_memory_allocated; CPU: the profiler's allocation events (common.peak_extra_bytes);
- step_ms: the variants' steps timed in turns (common.time_alternating, --steps turns),
  place_median per rank, the max over ranks.

    python benchmarks/bench_distributed.py                # 2 GPUs: seq 4096 and 8192
    python benchmarks/bench_distributed.py --quick        # seq 4096, 5 timed steps
    python benchmarks/bench_distributed.py --tiny         # code-path check (gloo, CPU)

Launches its own 2 ranks (NCCL with two GPUs, else gloo on the CPU with --tiny). Rank 0
writes benchmarks/results/<gpu>x2/distributed.json and .md (table and the issue's goals).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import statistics
import sys
import tempfile
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import make_torch_inplace as mti
from benchmarks.bench_train import (
    CONVERT_OPTIONS,
    FULL,
    GOAL_MIN_SEQ,
    TINY,
    Size,
    Skipped,
    apply_liger,
    build_model,
    failure_reason,
    goal_line,
    liger_patch,
    ratio_row,
)
from benchmarks.common import (
    env_info,
    markdown_table,
    peak_extra_bytes,
    place_median,
    time_alternating,
    write_results,
)

WORLD = 2
RESULTS_SUFFIX = f"x{WORLD}"  # benchmarks/results/h200x2 on two H200s
NAME = "distributed"
MODEL = "llama"
VARIANTS = ["sdpa", "liger", "convert", "convert-nologits", "convert-recompute"]
REFERENCE = "sdpa"
OURS = ("convert", "convert-nologits", "convert-recompute")
SEQS = [4096, 8192]
TINY_SEQS = [64]
LOSS_STEP = 3  # the loss recorded is this step's; the steps before it warm up
WARMUP_ROUNDS = 2
UNCONVERTED = "mti.convert: a call ran unconverted"
MEASURED = ("peak_extra_bytes", "step_ms", "loss", "unconverted_steps", "error", "skipped")


class DistRun:
    """One variant on one rank: the FSDP2-sharded model, the module its steps call, its
    optimizer over the sharded parameters, and the context its calls run in."""

    def __init__(self, variant: str, size: Size, mesh, device, dtype):
        from torch.distributed.fsdp import fully_shard

        liger = liger_patch(MODEL) if variant == "liger" else None
        self.model = build_model(MODEL, "sdpa", size, device, dtype)
        self.context = apply_liger(liger, self.model) if liger else contextlib.nullcontext
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.call = self.model
        if variant in OURS:
            self.call = mti.convert(self.model, **CONVERT_OPTIONS[variant])
        self.opt = torch.optim.AdamW(self.model.parameters())
        self.unconverted = 0  # steps whose forward ran none of convert's graphs

    def step(self, batch: dict) -> torch.Tensor:
        # convert warns where a call ran the original forward (its guards rejected the
        # graphs): counted, so that a measurement of the unconverted code shows.
        with warnings.catch_warnings(record=True) as caught, self.context():
            warnings.simplefilter("always")
            loss = self.call(**batch).loss
            loss.backward()
        self.unconverted += any(UNCONVERTED in str(w.message) for w in caught)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def _gather(value) -> list:
    """value of every rank, in rank order, on every rank."""
    out = [None] * WORLD
    dist.all_gather_object(out, value)
    return out


def _everywhere(rec: dict, phase: str, fn: Callable):
    """fn() on this rank, then every rank learns whether it raised anywhere: (True, fn's
    value) when it ran on every rank, else (False, None), with rec's "skipped" or "error" set
    from the first rank that raised."""
    outcome, value = None, None
    try:
        value = fn()
    except Skipped as exc:
        outcome = ("skipped", str(exc))
    except Exception as exc:
        outcome = ("error", f"{phase}: {failure_reason(exc)}")
    for rank, other in enumerate(_gather(outcome)):
        if other is not None:
            key, why = other
            rec[key] = why if key == "skipped" else f"rank {rank} {why}"
            if dist.get_rank() == 0:
                print(f"  {rec['variant']}: {rec[key]}", flush=True)
            return False, None
    return True, value


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _train(run: DistRun, batch: dict, steps: int) -> list[torch.Tensor]:
    return [run.step(batch) for _ in range(steps)]


def make_batch(seq: int, size: Size, device) -> dict:
    """This rank's batch of 1: random ids seeded by rank and length, the labels the ids."""
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + seq)
    ids = torch.randint(0, size.vocab, (1, seq), generator=g).to(device)
    return {"input_ids": ids, "labels": ids}


def run_case(seq: int, args, size: Size, mesh, device, dtype, env: dict) -> list[dict]:
    """Every variant at one length, on this rank: builds and trains each LOSS_STEP steps, then
    measures each one's peak, then times them all in turns. Returns the records (the
    same on every rank: every measurement is reduced over ranks)."""
    batch = make_batch(seq, size, device)
    recs = {
        v: dict(
            env,
            bench=NAME,
            world_size=WORLD,
            model=MODEL,
            variant=v,
            seq=seq,
            batch=1,
            dtype=str(dtype).removeprefix("torch."),
            **dict.fromkeys(MEASURED),
            **{"pass": "fsdp2_step"},
        )
        for v in args.variants
    }
    runs: dict[str, DistRun] = {}
    for v, rec in recs.items():
        ok, run = _everywhere(
            rec, "build", functools.partial(DistRun, v, size, mesh, device, dtype)
        )
        if ok:
            train = functools.partial(_train, run, batch, LOSS_STEP)
            ok, losses = _everywhere(rec, "train", train)
        if ok:
            rec["loss"] = statistics.fmean(_gather(losses[-1].item()))
            runs[v] = run
        del run
        _free(device)
    # Each converted model's first calls after another's may miss its graphs (Dynamo's cache
    # holds both captures of the same class) and switch it to torch.compile's own guards:
    # rounds in turns settle that before anything is measured.
    for _ in range(WARMUP_ROUNDS):
        for v in list(runs):
            if not _everywhere(recs[v], "warm-up", functools.partial(runs[v].step, batch))[0]:
                del runs[v]
                _free(device)
    for v in runs:
        runs[v].unconverted = 0
    for v, run in list(runs.items()):
        step = functools.partial(run.step, batch)
        measure = functools.partial(peak_extra_bytes, step, device=device)
        ok, peak = _everywhere(recs[v], "peak", measure)
        if ok:
            recs[v]["peak_extra_bytes"] = max(_gather(peak))
        else:
            del runs[v]
        del run, step, measure
        _free(device)
    names = list(runs)
    fns = [functools.partial(runs[v].step, batch) for v in names]
    timing = functools.partial(
        time_alternating, warmup_ms=0.0, rep_ms=0.0, min_turns=args.steps, device=device
    )
    turns = {"variant": "timing in turns"}
    ok, by_fn = _everywhere(turns, "time", functools.partial(timing, fns))
    for v, by_place in zip(names, by_fn or [None] * len(names)):
        if ok:
            recs[v]["step_ms"] = max(_gather(place_median(by_place)))
        else:
            recs[v]["error"] = turns["error"]
    for v in names:
        recs[v]["unconverted_steps"] = sum(_gather(runs[v].unconverted))
    del runs, fns, batch
    _free(device)
    return list(recs.values())


# --------------------------------------------------------------------------- report


def goals(records: list[dict]) -> list[str]:
    """The issue's goal per length >= GOAL_MIN_SEQ and variant of ours: per-GPU peak <=
    PEAK_GOAL x the lowest peer's, step <= STEP_GOAL x the fastest peer's (peers: sdpa and
    liger where it ran)."""
    lines = []
    for seq in dict.fromkeys(r["seq"] for r in records):
        case = {r["variant"]: r for r in records if r["seq"] == seq}
        peers = [r for v, r in case.items() if v not in OURS]
        for v in OURS:
            r = case.get(v)
            if r is None or seq < GOAL_MIN_SEQ:
                continue
            if r["error"]:
                lines.append(f"FAIL T={seq} {v}: {r['error'][:120]}")
                continue
            if r["unconverted_steps"]:
                lines.append(
                    f"FAIL T={seq} {v}: {r['unconverted_steps']} measured steps ran unconverted"
                )
            line = goal_line(f"{MODEL} T={seq} {v}", r, peers, "per-GPU peak")
            if line:
                lines.append(line)
    return lines


def report(records: list[dict]) -> None:
    reference = {r["seq"]: r for r in records if r["variant"] == REFERENCE}
    rows = [ratio_row(r, reference.get(r["seq"], {}), "loss") for r in records]
    columns = ["model", "seq", "variant", "step_ms", "ms_ratio", "peak", "peak_ratio", "loss"]
    columns += ["loss_diff", "unconverted_steps", "note"]
    md = (
        f"FSDP2 (fully_shard per decoder layer and on the model), {WORLD} ranks, batch 1 per "
        f"rank. Per GPU: peak is the max over ranks, step_ms the max over ranks of each "
        f"rank's median; loss is the {LOSS_STEP}rd step's, the mean over ranks. Ratios are "
        f"to sdpa's.\n\n" + markdown_table(rows, columns)
    )
    goal_lines = goals(records)
    if goal_lines:
        md += "\nGoals:\n\n" + "".join(f"- {g}\n" for g in goal_lines)
    print("\n" + md, flush=True)
    json_path, md_path = write_results(NAME, records, md, suffix=RESULTS_SUFFIX)
    print(f"wrote {json_path}, {md_path}", flush=True)


# --------------------------------------------------------------------------- ranks


def _rank_main(rank: int, backend: str, args, rendezvous: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)  # the tiny model's matmuls are too small to share
    # A rank stuck in a collective its peer never joins (a failure inside a step, on one
    # rank only) times out rather than hangs; the limit is well above a peer's longest wait
    # for the other (a convert capture on a loaded CPU).
    dist.init_process_group(
        backend,
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=300 if cuda else 180),
    )
    try:
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        mesh = init_device_mesh(device.type, (WORLD,))
        size = TINY if args.tiny else FULL
        dtype = torch.bfloat16 if cuda else torch.float32
        env = _gather(env_info() if rank == 0 else None)[0]  # rank 0's, in every record
        if rank == 0:
            print(f"{env['device']} x{WORLD} ({backend}), torch {env['torch']}, ", end="")
            print(f"commit {env['commit']}")
        records = []
        for seq in args.seq:
            records += run_case(seq, args, size, mesh, device, dtype, env)
            if rank == 0:
                report(records)  # after each length: a sweep cut short keeps what it measured
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # As tests/distributed/launch.py: leave without the interpreter's finalization, where
    # gloo's worker threads now and then abort the process after everything is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS)
    parser.add_argument("--seq", nargs="+", type=int, default=None, help="default 4096 8192")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="2 layers, hidden 64, vocab 256, seq 64: a code-path check (forced without 2 GPUs)",
    )
    parser.add_argument("--quick", action="store_true", help="seq 4096, 5 timed steps")
    args = parser.parse_args(argv)

    backend = "nccl" if torch.cuda.device_count() >= WORLD else "gloo"
    if backend == "gloo" and not args.tiny:
        print(f"fewer than {WORLD} GPUs: gloo on the CPU, tiny configs (--tiny)")
        args.tiny = True
    if args.quick:
        args.steps = 5
    args.seq = args.seq or (TINY_SEQS if args.tiny else [4096] if args.quick else SEQS)
    size = TINY if args.tiny else FULL
    if max(args.seq) > size.max_seq:
        parser.error(f"seq {max(args.seq)} exceeds the config's positions, {size.max_seq}")
    if REFERENCE not in args.variants:
        args.variants = [REFERENCE, *args.variants]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            _rank_main,
            args=(backend, args, str(Path(tmp, "rendezvous"))),
            nprocs=WORLD,
            join=True,
        )


if __name__ == "__main__":
    main()
