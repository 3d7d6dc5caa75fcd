"""benchmarks/common.py's turn-taking timer: every fn takes every place in a turn equally often
(the square_matmul_ benchmark's ratios rest on it). Runs on the CPU path, which calls the fns
in the same order as the CUDA one; on CUDA, gpu_only leaves the host's time out. Also
bench_rowwise's pass flags."""

import statistics
import time

import pytest
import torch
from helpers import requires_cuda

from benchmarks.common import place_median, time_alternating


@pytest.mark.parametrize("n_fns", [1, 2, 3, 4])
def test_turns_rotate_through_every_place(n_fns):
    calls = []
    fns = [lambda i=i: calls.append(i) for i in range(n_fns)]
    by_fn = time_alternating(fns, warmup_ms=0.0, rep_ms=0.0, device="cpu", min_turns=5)
    turns = -(-5 // n_fns) * n_fns  # whole rounds of places
    timed = calls[-turns * n_fns :]
    for turn in range(turns):
        # Turn t starts with fn t % n and keeps the fns' order.
        assert timed[turn * n_fns : (turn + 1) * n_fns] == [
            (turn + p) % n_fns for p in range(n_fns)
        ]
    assert len(by_fn) == n_fns
    for by_place in by_fn:
        assert [len(at) for at in by_place] == [turns // n_fns] * n_fns
        assert all(t >= 0 for at in by_place for t in at)


def test_place_median_weighs_places_alike():
    # Calls of two places at 1 and 5 (one outlier): the median over all calls would be 5.
    by_place = [[1.0, 1.0, 9.0], [5.0, 5.0, 5.0]]
    assert statistics.median([t for at in by_place for t in at]) == 5.0
    assert place_median(by_place) == 3.0


# A call of 2 ms of host time before a tiny kernel: timed without gpu_only, the GPU waits for
# the host inside the timed span; with it, the span holds the kernel alone.
@requires_cuda
def test_gpu_only_leaves_the_host_time_out():
    x = torch.zeros(1024, device="cuda")

    def slow_host():
        time.sleep(0.002)
        x.add_(1)

    def median_ms(gpu_only):
        by_fn = time_alternating(
            [slow_host], warmup_ms=10.0, rep_ms=20.0, device="cuda", min_turns=5, gpu_only=gpu_only
        )
        return place_median(by_fn[0])

    assert median_ms(gpu_only=False) > 1.5
    assert median_ms(gpu_only=True) < 1.0


def test_rowwise_passes_follow_the_flags():
    from benchmarks import bench_rowwise

    assert bench_rowwise.parse_args([]).passes == ["forward", "backward"]
    assert bench_rowwise.parse_args(["--no-backward"]).passes == ["forward"]
    assert bench_rowwise.parse_args(["--no-forward"]).passes == ["backward"]
    with pytest.raises(SystemExit):
        bench_rowwise.parse_args(["--no-forward", "--no-backward"])
