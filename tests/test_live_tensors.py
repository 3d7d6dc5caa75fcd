"""benchmarks/live_tensors.py: the tracker counts each storage an op allocates while it lives,
not views, in-place results or storages made before it started."""

import torch

from benchmarks.live_tensors import LiveTensors, summary


def test_counts_what_ops_allocate_while_it_lives():
    before = torch.ones(1000)  # made before the mode: not counted, nor its views
    mode = LiveTensors()
    with mode:
        with mode.phase("a"):
            x = before * 2  # 4000 B
            y = x.view(10, 100)  # a view: nothing
            x.add_(1)  # in place: nothing
            z = before[:500].clone()  # 2000 B
            del x, y
            w = z + 1  # x is gone: 4000 B live at most so far, now 2000 + 2000
        with mode.phase("b"):
            big = torch.zeros(3000)  # 12000 B, with z and w: 16000
            del big, z
            alive = mode.alive()
    assert mode.peaks["a"][0] == 6000  # x and z, before x went
    assert mode.peaks["b"][0] == 16000
    assert [(a.nbytes, a.phase) for a in alive] == [(2000, "a")]  # w
    assert w.shape == (500,)
    # Largest first, in bytes per `per`.
    first, second = summary(mode.peaks["a"][2], per=1000)
    assert first.split()[:2] == ["4.0", "x1"] and "aten.mul.Tensor" in first
    assert second.split()[:2] == ["2.0", "x1"] and "aten.clone.default" in second
