"""cross_entropy_: the loss and the gradient written over the logits against F.cross_entropy
in fp64 (computed before the op), with PyTorch's own fp32 computation on logits.float() as the
yardstick (helpers.assert_accurate); every reduction, ignore_index, label smoothing, row
layouts; autograd through a Linear against the out-of-place loss; torch.compile.
Bad input: tests/test_bad_input.py (and the CUDA device-side target check here)."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    DEVICES,
    DTYPES,
    GRAD_SEED,
    ROW_STRIDED_LAYOUTS,
    Untouched,
    assert_accurate,
    assert_close64,
    examples,
    lead_shapes,
    randn,
    requires_cuda,
    seeds,
    widths,
    with_layout,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import make_torch_inplace as mti

ALL_DTYPES = (*DTYPES, torch.float64)
REDUCTIONS = ("mean", "sum", "none")


def make_target(lead, v, ignore_index, seed, ignored=0.25):
    """Class indices in [0, v), with about `ignored` of them set to ignore_index."""
    g = torch.Generator().manual_seed(seed + 1)
    target = torch.randint(0, v, lead, generator=g)
    return target.masked_fill(torch.rand(lead, generator=g) < ignored, ignore_index)


def reference(logits, target, reduction, ignore_index, label_smoothing):
    """F.cross_entropy of logits (classes last) and its gradient, both in logits' dtype: the
    loss, and the gradient of its sum (reduction "none": each row's own)."""
    x = logits.detach().clone().requires_grad_(True)
    v = x.shape[-1]
    loss = F.cross_entropy(
        x.reshape(-1, v),
        target.reshape(-1),
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    if reduction == "none":
        loss = loss.reshape(target.shape)
    (grad,) = torch.autograd.grad(loss.sum(), x) if x.numel() else (torch.zeros_like(x),)
    return loss.detach(), grad


def closed_form_grad(logits, target, reduction, ignore_index, label_smoothing):
    """The gradient of the loss's sum as a formula: (softmax - (1 - eps) onehot - eps / V) per
    row, 0 for ignored rows, over the valid rows for "mean". In float64 it is more accurate
    than autograd through F.cross_entropy, whose log_softmax backward sums the V smoothed
    target terms (2e-14 off at V = 50257 where this is 1e-15, measured in long double)."""
    v = logits.shape[-1]
    valid = target != ignore_index
    onehot = F.one_hot(target.clamp(0, v - 1), v).to(logits.dtype)
    grad = logits.softmax(-1) - (1 - label_smoothing) * onehot - label_smoothing / v
    grad = grad * valid.unsqueeze(-1)
    return grad / valid.sum().clamp(min=1) if reduction == "mean" else grad


def check_cross_entropy(x, target, reduction="mean", ignore_index=-100, label_smoothing=0.0):
    """Runs cross_entropy_(x, ...) and checks the loss, the gradient left in x and that nothing
    outside x was written. The references run before the op."""
    kw = dict(ignore_index=ignore_index, label_smoothing=label_smoothing)
    ref_loss, ref_grad = reference(x.double(), target, reduction, **kw)
    # PyTorch as HF runs it: the loss of logits.float(), its gradient cast back to x's dtype.
    torch_loss, torch_grad = reference(x.float(), target, reduction, **kw)
    # float64's yardstick (below): the size of lse and of each logit, max|x| + log V.
    row_terms = (x.abs().max().item() if x.numel() else 0.0) + math.log(x.shape[-1])
    exact_grad = closed_form_grad(x.double(), target, reduction, **kw)
    torch.testing.assert_close(exact_grad, ref_grad, rtol=0, atol=1e-12)
    guard = Untouched(x)
    loss = mti.cross_entropy_(x, target, reduction=reduction, **kw)
    assert guard.outside_unchanged(), "cross_entropy_ wrote memory outside logits"
    assert loss.dtype == (torch.float64 if x.dtype == torch.float64 else torch.float32)
    assert loss.shape == ref_loss.shape
    nan = torch.isnan(ref_loss)
    assert torch.equal(torch.isnan(loss), nan), "NaN losses (the mean of no rows) differ"
    if x.dtype != torch.float64:
        assert_accurate(loss[~nan], torch_loss[~nan], ref_loss[~nan], what="loss")
        assert_accurate(x, torch_grad.to(x.dtype), ref_grad, what="gradient")
        return
    # float64: held to PyTorch's float64 within a few units of eps at the scale of what is
    # computed, times the reduction's scale: row_terms per row summed into the loss; for the
    # gradient, softmax = exp(x - lse) carries the rounding of x - lse (up to row_terms in
    # size) as a relative error.
    valid = int((target != ignore_index).sum())
    scale = 1 / max(valid, 1) if reduction == "mean" else 1.0
    rows = valid if reduction != "none" else 1
    assert_close64(loss[~nan], ref_loss[~nan], "loss", terms=row_terms * rows * scale)
    assert_close64(x, exact_grad, "gradient", terms=row_terms * scale)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=examples(40))
@given(
    lead=lead_shapes(max_dims=2, max_size=5),
    v=widths(),
    dtype=st.sampled_from(ALL_DTYPES),
    reduction=st.sampled_from(REDUCTIONS),
    ignore_index=st.sampled_from((-100, 0)),
    label_smoothing=st.sampled_from((0.0, 0.1)),
    layout=st.sampled_from(ROW_STRIDED_LAYOUTS),
    logit_scale=st.sampled_from((1.0, 10.0)),
    seed=seeds,
)
def test_matches_pytorch(
    device, lead, v, dtype, reduction, ignore_index, label_smoothing, layout, logit_scale, seed
):
    values = randn((*lead, v), dtype, device, seed, scale=logit_scale)
    x = with_layout(values, layout)
    target = make_target(lead, v, ignore_index, seed).to(device)
    check_cross_entropy(x, target, reduction, ignore_index, label_smoothing)


# Vocabulary sizes of real models (GPT-2, Llama 2, Llama 3), a width not a multiple of any
# vector width, and rows that start at every alignment (the padded layout).
@pytest.mark.parametrize("v", [50257, 32000, 128256, 4097])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_vocabulary_sizes(device, dtype, v):
    rows = 6
    x = with_layout(randn((rows, v), dtype, device, seed=v, scale=4.0), "row_padded", pad=3)
    target = make_target((rows,), v, -100, seed=v, ignored=0.2).to(device)
    check_cross_entropy(x, target, "mean", label_smoothing=0.05)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_every_row_ignored(device, reduction):
    """Mean of no rows is NaN (as PyTorch's); every gradient is 0."""
    x = randn((3, 7), torch.float32, device, seed=1)
    check_cross_entropy(x, torch.full((3,), -100, device=device), reduction)
    assert torch.equal(x, torch.zeros_like(x))


@pytest.mark.parametrize("device", DEVICES)
def test_extreme_logits(device):
    """Logits far from 0 and -inf (a banned class) take part as in PyTorch."""
    x = randn((4, 300), torch.float32, device, seed=2, scale=1e3)
    x[:, 5] = float("-inf")
    target = torch.tensor([0, 299, 7, 100], device=device)
    check_cross_entropy(x, target, "sum")


@pytest.mark.parametrize("device", DEVICES)
def test_strided_target_and_logits(device):
    """A transposed target (read through a contiguous copy) with logits whose leading dims are
    permuted in memory."""
    values = randn((5, 3, 40), torch.bfloat16, device, seed=11)
    target = make_target((3, 5), 40, -100, seed=11).to(device).t()
    assert not target.is_contiguous()
    check_cross_entropy(with_layout(values, "lead_permuted"), target, "none")


# --------------------------------------------------------------------------- autograd


def lm_head(dtype, device, hidden=24, vocab=67):
    torch.manual_seed(0)
    return torch.nn.Linear(hidden, vocab, device=device, dtype=dtype)


def train_step(head, h, target, loss_fn, reduction, grad_seed=5):
    """The loss of head(h) and the gradients of head's parameters and of h after backward
    (reduction "none": through a random weighting of the rows)."""
    head.zero_grad()
    h = h.detach().clone().requires_grad_(True)
    loss = loss_fn(head(h), target, reduction)
    if reduction == "none":
        loss.backward(randn(loss.shape, loss.dtype, loss.device, grad_seed))
    else:
        (loss * 1.5).backward()  # an output gradient other than 1
    return loss.detach(), [head.weight.grad, head.bias.grad, h.grad]


def torch_loss(logits, target, reduction):
    v = logits.shape[-1]
    loss = F.cross_entropy(logits.float().reshape(-1, v), target.reshape(-1), reduction=reduction)
    return loss.reshape(target.shape) if reduction == "none" else loss


def our_loss(logits, target, reduction):
    return mti.cross_entropy_(logits, target, reduction=reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_backward_through_linear(device, dtype, reduction):
    """Gradients of a Linear producing the logits, against the out-of-place loss in fp64 (the
    truth) and in dtype with logits.float() (the yardstick)."""
    head = lm_head(dtype, device)
    h = randn((3, 5, 24), dtype, device, seed=3)
    target = make_target((3, 5), 67, -100, seed=3).to(device)
    ref_loss, ref_grads = train_step(
        lm_head(torch.float64, device), h.double(), target, torch_loss, reduction
    )
    t_loss, t_grads = train_step(head, h, target, torch_loss, reduction)
    loss, grads = train_step(head, h, target, our_loss, reduction)
    assert_accurate(loss, t_loss, ref_loss, what="loss")
    for name, g, tg, rg in zip(("weight", "bias", "h"), grads, t_grads, ref_grads):
        assert_accurate(g, tg, rg, what=f"grad of {name}")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_backward_matches_finite_differences(device, reduction):
    """The backward (the saved gradient scaled in place by a random output gradient) against
    central differences of the loss, in float64, with ignored rows and label smoothing.
    (torch.autograd.gradcheck backpropagates each call several times, which the op refuses.)"""
    x = randn((4, 6), torch.float64, device, seed=10)
    target = torch.tensor([1, -100, 5, 0], device=device)

    def loss(x):
        return mti.cross_entropy_(x.clone(), target, reduction=reduction, label_smoothing=0.1)

    out_grad = randn(loss(x.clone()).shape, torch.float64, device, seed=GRAD_SEED)
    leaf = x.clone().requires_grad_()
    loss(leaf).backward(out_grad)
    h = 1e-6
    numeric = torch.zeros_like(x)
    with torch.no_grad():
        for i in range(x.numel()):
            step = torch.zeros_like(x).view(-1)
            step[i] = h
            step = step.view_as(x)
            numeric.view(-1)[i] = ((loss(x + step) - loss(x - step)) * out_grad).sum() / (2 * h)
    torch.testing.assert_close(leaf.grad, numeric, rtol=1e-6, atol=1e-8)


class _Logits(torch.autograd.Function):
    """A copy of `base` that requires grad, as an LM head's output does; its backward drops
    the logits' gradient, as the head's backward would consume it."""

    @staticmethod
    def forward(ctx, base):
        return base.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


@pytest.mark.parametrize("device", DEVICES)
def test_no_logits_sized_memory(device):
    """Forward and backward together allocate the logits themselves (the clone) and, beyond
    them, only the per-row losses and small buffers: no float32 copy, no log_softmax, no
    second gradient (PyTorch's way takes 3 float32 logits-sized tensors more)."""
    from benchmarks.common import peak_extra_bytes

    rows, v = 64, 4096
    base = randn((rows, v), torch.bfloat16, device, seed=12).requires_grad_()
    target = make_target((rows,), v, -100, seed=12).to(device)

    def step():
        loss = mti.cross_entropy_(_Logits.apply(base), target)
        loss.backward()
        return loss.detach()

    step()  # first-call allocations (the CUDA context's, the autograd engine's)
    logits_bytes = rows * v * base.element_size()
    # Beyond the logits: the losses (4 bytes a row), the counter, the scalar loss and its
    # gradient, each rounded up to the CUDA allocator's 512-byte blocks; 8 blocks of margin,
    # far below the smallest logits-sized tensor (512 KiB).
    assert peak_extra_bytes(step, device=device) <= logits_bytes + rows * 4 + 8 * 512


@pytest.mark.parametrize("device", DEVICES)
def test_second_backward_raises(device):
    """The backward scales the saved gradient in place, so a second one through the same call
    (retain_graph) must refuse rather than scale it again."""
    head = lm_head(torch.float32, device)
    h = randn((4, 24), torch.float32, device, seed=4)
    loss = mti.cross_entropy_(head(h), torch.arange(4, device=device))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


@pytest.mark.parametrize("device", DEVICES)
def test_logits_hold_the_gradient_without_autograd(device):
    """Under no_grad and inference_mode alike logits end up holding d(loss)/d(logits)."""
    x = randn((5, 9), torch.float32, device, seed=6)
    target = torch.tensor([1, 2, -100, 8, 0], device=device)
    _, expected = reference(x, target, "mean", -100, 0.0)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            y = x.clone()
            mti.cross_entropy_(y, target)
        torch.testing.assert_close(y, expected)


# --------------------------------------------------------------------------- torch.compile


def head_and_loss(h, weight, target):
    return mti.cross_entropy_(h @ weight, target, label_smoothing=0.1)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_matches_eager(device, backend, grad):
    torch._dynamo.reset()
    h = randn((2, 5, 16), torch.float32, device, seed=8)
    target = make_target((2, 5), 33, -100, seed=8).to(device)
    weights = [randn((16, 33), torch.float32, device, seed=9).requires_grad_(grad) for _ in "ab"]
    compiled = torch.compile(head_and_loss, backend=backend, fullgraph=True)
    with torch.set_grad_enabled(grad):
        expected = head_and_loss(h, weights[0], target)
        got = compiled(h, weights[1], target)
    torch.testing.assert_close(got, expected)
    if grad:
        expected.backward()
        got.backward()
        torch.testing.assert_close(weights[1].grad, weights[0].grad)


# --------------------------------------------------------------------------- CUDA target check

_BAD_TARGET_SCRIPT = """
import torch, make_torch_inplace as mti
x = torch.randn(4, 10, device="cuda")
mti.cross_entropy_(x, torch.tensor([1, 2, 10, 3], device="cuda"))
torch.cuda.synchronize()
print("no error")
"""


@requires_cuda
def test_cuda_target_out_of_bounds_asserts():
    """On CUDA the targets are checked on the device (no host synchronisation): an
    out-of-bounds target fails a device-side assert before the row kernel runs, which ends the
    process's CUDA context, so it runs in a process of its own."""
    result = subprocess.run(
        [sys.executable, "-c", _BAD_TARGET_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )
    out = result.stdout + result.stderr
    assert result.returncode != 0 and "no error" not in out
    assert "target 10 (row 2) is out of bounds for 10 classes" in out
    assert "device-side assert" in out
