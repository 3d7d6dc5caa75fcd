"""Runs every check of the given modules on each rank of a 2-rank process group and brings
back, per check, None (passed) or the first failing rank's traceback.

One spawn serves all the checks: starting ranks and a process group costs seconds, a check
milliseconds. A check is fn(ctx) with ctx.mesh (1-D, both ranks), ctx.rank and ctx.device; it
raises to fail. Every rank runs every check in the same order, so the checks' collectives
(distribute_tensor, full_tensor) pair up across ranks; a check that fails on one rank only,
before a collective, leaves the other waiting until the process group's timeout.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


@dataclass
class Ctx:
    mesh: object
    rank: int
    device: torch.device


def all_checks(modules: list[str]) -> dict:
    """The CHECKS dicts of `modules`, merged (check names are unique across them)."""
    checks = {}
    for module in modules:
        checks.update(__import__(module).CHECKS)
    return checks


def _rank_main(rank, backend, modules, out_dir):
    from torch.distributed.tensor import init_device_mesh

    device_type = "cuda" if backend == "nccl" else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    # A rank that fails before a collective leaves the other waiting: time out, not hang.
    # Rendezvous through a file in out_dir: no port to pick, so none to collide.
    dist.init_process_group(
        backend,
        init_method=f"file://{Path(out_dir, 'rendezvous')}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    try:
        mesh = init_device_mesh(device_type, (WORLD,))
        device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
        ctx = Ctx(mesh, rank, device)
        lines = []
        for name, fn in all_checks(modules).items():
            try:
                fn(ctx)
                lines.append(f"{name}\tok")
            except Exception:
                err = traceback.format_exc().replace("\n", "\\n")
                lines.append(f"{name}\t{err}")
            dist.barrier()
        Path(out_dir, f"rank{rank}.txt").write_text("\n".join(lines))
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's finalization: gloo's worker threads, torn down there,
    # now and then abort the process ("terminate called without an active exception") after
    # every verdict is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_checks(modules: list[str], backend: str) -> dict[str, str | None]:
    """Spawns WORLD ranks that run every check of `modules` (their CHECKS dicts)."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(
            _rank_main,
            args=(backend, modules, out_dir),
            nprocs=WORLD,
            join=True,
        )
        results: dict[str, str | None] = dict.fromkeys(all_checks(modules))
        for rank in range(WORLD):
            for line in Path(out_dir, f"rank{rank}.txt").read_text().splitlines():
                name, status = line.split("\t", 1)
                if status != "ok" and results[name] is None:
                    results[name] = f"rank {rank}:\n" + status.replace("\\n", "\n")
        return results
