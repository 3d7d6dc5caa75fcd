"""silu_mul_backward_ (the gradients of silu(gate) * up written over gate and up) against the
fp64 gradients autograd gives of the formula: drawn shapes, every dtype, aligned and
misaligned storage, on the CPU and on CUDA. Its refusals are in test_bad_input."""

import pytest
import torch
import torch.nn.functional as F
from helpers import DEVICES, Untouched, assert_accurate, assert_close64, examples, randn, seeds
from hypothesis import given, settings
from hypothesis import strategies as st

import make_torch_inplace  # noqa: F401  (loads the ops)

_op = torch.ops.make_torch_inplace.silu_mul_backward_

ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def autograd_grads(grad, gate, up):
    """(gate's gradient, up's) of silu(gate) * up for grad, by PyTorch's autograd."""
    gate, up = (t.detach().requires_grad_() for t in (gate, up))
    return torch.autograd.grad(F.silu(gate) * up, (gate, up), grad)


def inputs(shape, dtype, device, seed, offset):
    """grad, gate and up of `shape`, each cut `offset` elements into its own buffer (an
    offset of 1 leaves the 16-byte vectors of the CUDA kernel misaligned)."""
    n = max(1, torch.Size(shape).numel())
    out = []
    for i in range(3):
        buffer = randn((n + offset,), dtype, device, seed + i, scale=3.0)
        out.append(buffer[offset:][: torch.Size(shape).numel()].view(shape))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@settings(max_examples=examples(12), deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), max_size=2)
    .map(tuple)
    .flatmap(lambda lead: st.sampled_from((1, 7, 8, 64, 1000, 4097)).map(lambda n: (*lead, n))),
    offset=st.sampled_from((0, 1)),
    seed=seeds,
)
def test_matches_autograd(device, dtype, shape, offset, seed):
    grad, gate, up = inputs(shape, dtype, device, seed, offset)
    ref64 = autograd_grads(grad.double(), gate.double(), up.double())
    torch_out = autograd_grads(grad, gate, up)
    guards = Untouched(gate), Untouched(up)
    grad_before = grad.clone()
    _op(grad, gate, up)
    assert all(g.outside_unchanged() for g in guards), "wrote outside gate and up"
    assert torch.equal(grad, grad_before), "grad was written"
    for out, t, r, name in zip((gate, up), torch_out, ref64, ("gate", "up"), strict=True):
        if dtype == torch.float64:
            assert_close64(out, r, name)
        else:
            assert_accurate(out, t, r, f"{name} {dtype} {shape}")
