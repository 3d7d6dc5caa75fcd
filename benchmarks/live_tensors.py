"""What is alive at a step's peak: every storage the ops allocate, while it lives.

LiveTensors is a TorchDispatchMode: each op's outputs whose storage it has not seen are
recorded (bytes, op, shape, dtype, the phase set by `phase()`); a storage counts as alive
until its last reference goes (a weak reference to the storage, checked before each op). The
peak is the largest sum of alive bytes after an op, and `at_peak` lists what was alive then.
Temporaries inside an op (a kernel's workspace) and storages made before the mode started
(weights, inputs) are not counted. It runs on any device, so a step's activations can be
counted on the CPU.

    python benchmarks/live_tensors.py --model llama-lora --variant convert --seq 512
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass(frozen=True)
class Alloc:
    nbytes: int
    op: str
    shape: tuple
    dtype: torch.dtype
    phase: str
    index: int  # the op's position in the run


class LiveTensors(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, Alloc]] = {}
        self._bytes = 0
        self._ops = 0
        self._phase = ""
        # phase -> (peak bytes, the op after which it was reached, what was alive then)
        self.peaks: dict[str, tuple[int, str, list[Alloc]]] = {}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Lets torch.compile run its compiled code (convert's graphs) with the mode on; the
        # graphs' ops still come through it.
        return True

    @contextlib.contextmanager
    def phase(self, name: str):
        """Tags what the ops inside allocate with `name` (e.g. "forward", "backward")."""
        before, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = before

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            self._bytes -= self._live.pop(key)[1].nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sweep()
        # An output on an input's storage (a view, an in-place op) allocates nothing.
        inputs = {
            t.untyped_storage()._cdata
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **(kwargs or {}))
        self._ops += 1
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self._live or key in inputs or storage.nbytes() == 0:
                continue
            alloc = Alloc(
                storage.nbytes(), str(func), tuple(t.shape), t.dtype, self._phase, self._ops
            )
            self._live[key] = (StorageWeakRef(storage), alloc)
            self._bytes += alloc.nbytes
        if self._bytes > self.peaks.get(self._phase, (-1,))[0]:
            at = f"{func} (op {self._ops})"
            self.peaks[self._phase] = (self._bytes, at, [a for _, a in self._live.values()])
        return out

    @property
    def peak(self) -> int:
        return max((p[0] for p in self.peaks.values()), default=0)

    def alive(self) -> list[Alloc]:
        """What is alive now (after a sweep)."""
        self._sweep()
        return [a for _, a in self._live.values()]


def summary(allocs: list[Alloc], per: int = 1) -> list[str]:
    """One line per (phase, op, shape, dtype): how many, and their bytes divided by `per`
    (the tokens, for bytes per token), largest first."""
    groups: dict[tuple, list[int]] = {}
    for a in allocs:
        groups.setdefault((a.phase, a.op, a.shape, str(a.dtype)), []).append(a.nbytes)
    rows = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    return [
        f"{sum(b) / per:12.1f}  x{len(b):<3d} {ph:8s} {op:55s} {list(sh)} {dt}"
        for (ph, op, sh, dt), b in rows
    ]


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import bench_train as bt

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama")
    p.add_argument("--variant", default="convert")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--scale", type=int, default=4, help="hidden, heads, vocab divided by this")
    p.add_argument("--optimizer", action="store_true", help="count the AdamW step too")
    a = p.parse_args()
    import make_torch_inplace as mti

    f = bt.FULL
    size = bt.Size(
        hidden=f.hidden // a.scale,
        heads=f.heads // a.scale,
        layers=f.layers,
        intermediate=f.intermediate // a.scale,
        vocab=f.vocab // a.scale,
        max_seq=f.max_seq,
    )
    # The workspace limit scales with the model, so that pieces hold as many rows as at full size.
    mti.set_workspace_limit(mti.get_workspace_limit() // a.scale)
    run = bt.Run(a.variant, a.model, size, torch.device("cpu"), torch.bfloat16)
    batch = bt.make_batch(a.model, a.seq, size, "cpu")
    run.step(batch)  # capture and compile outside the mode
    mode = LiveTensors()
    with mode:
        with mode.phase("forward"):
            loss = run.call(**batch).loss
        with mode.phase("backward"):
            loss.backward()
        del loss
        if a.optimizer:
            with mode.phase("optim"):
                run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    for phase, (peak, at, allocs) in mode.peaks.items():
        print(
            f"{a.model} {a.variant} seq {a.seq} scale 1/{a.scale}, {phase}: peak {peak:,} B, "
            f"{peak / a.seq:,.1f} B/token (x{a.scale} at full size), after {at}"
        )
        for line in summary(allocs, per=a.seq):
            print(line)


if __name__ == "__main__":
    main()
