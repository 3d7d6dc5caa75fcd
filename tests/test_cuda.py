"""CUDA-only checks: transformer-sized shapes, 64-bit offsets (inputs of more than 2^31
elements), the current stream, and a device other than the current one. The CPU/CUDA shared
correctness tests live in the per-op files; this file is skipped without a GPU."""

import pytest
import torch
from helpers import (
    HAS_CUDA,
    assert_accurate,
    check_op,
    randn,
    ref_layer_norm,
    ref_log_softmax,
    ref_rms_norm,
    ref_softmax,
    ref_square_matmul,
    to_fp64,
)

import make_torch_inplace as mti

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

BF16 = torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16], ids=str)
def test_transformer_sized_shapes(dtype):
    """One large instance of each op: attention scores (B, H, T, T) with a causal and a padding
    mask, hidden states of (B*T, 4096), a 4096x4096 projection."""
    d = "cuda"
    scores = randn((4, 16, 1024, 1024), dtype, d, seed=1)
    pad = torch.ones(4, 1, 1, 1024, dtype=torch.bool, device=d)
    pad[1:, ..., 900:] = False
    check_op(mti.softmax_, ref_softmax, scores, -1, scale=0.125, mask=pad, causal=True)
    hidden = randn((8192, 4096), dtype, d, seed=2)
    check_op(
        mti.layer_norm_,
        ref_layer_norm,
        hidden,
        (4096,),
        randn((4096,), dtype, d, 3),
        randn((4096,), dtype, d, 4),
    )
    check_op(
        mti.rms_norm_,
        ref_rms_norm,
        randn((8192, 4096), dtype, d, 5),
        (4096,),
        randn((4096,), dtype, d, 6),
    )
    w = randn((4096, 4096), dtype, d, seed=7, scale=4096**-0.5)
    for ws in (None, 0):
        check_op(
            mti.square_matmul_,
            ref_square_matmul,
            randn((4096, 4096), dtype, d, 8),
            w,
            randn((4096,), dtype, d, 9),
            transpose=True,
            workspace_bytes=ws,
        )


# --------------------------------------------------------------------------- 64-bit offsets

BIG_ROWS_OF_4096 = (1 << 31) // 4096 + 2  # 2^31 + 8192 elements: offsets overflow int32


def require_free_bytes(nbytes):
    free, _ = torch.cuda.mem_get_info()
    if free < nbytes:
        pytest.skip(f"needs {nbytes / 2**30:.1f} GiB of free GPU memory, {free / 2**30:.1f} free")


def check_sampled(op, ref, x, take, *args, **kwargs):
    """check_op for inputs too large for a full reference: `take(t)` picks a few rows (a
    copy) from x and from the result, among them the last ones, whose offsets pass 2^31."""
    sample = take(x)
    ref64 = ref(to_fp64(sample), *map(to_fp64, args), **{k: to_fp64(v) for k, v in kwargs.items()})
    torch_out = ref(sample, *args, **kwargs)
    assert op(x, *args, **kwargs) is x
    assert_accurate(take(x), torch_out, ref64, op.__name__)


def first_and_last_rows(t):
    return t[[0, 1, t.shape[0] - 2, t.shape[0] - 1]]


@pytest.mark.large_memory
@pytest.mark.parametrize("name", ["softmax_", "log_softmax_", "layer_norm_", "rms_norm_"])
def test_rowwise_past_2_31_elements(name):
    require_free_bytes(6 << 30)
    x = torch.randn(BIG_ROWS_OF_4096, 4096, dtype=BF16, device="cuda")
    op, ref, args = {
        "softmax_": (mti.softmax_, ref_softmax, (-1,)),
        "log_softmax_": (mti.log_softmax_, ref_log_softmax, (-1,)),
        "layer_norm_": (mti.layer_norm_, ref_layer_norm, ((4096,),)),
        "rms_norm_": (mti.rms_norm_, ref_rms_norm, ((4096,),)),
    }[name]
    check_sampled(op, ref, x, first_and_last_rows, *args)


@pytest.mark.large_memory
def test_softmax_strided_dim_past_2_31_elements():
    """Softmax over dim 0: elements of a row sit BIG apart, so j * col_stride passes 2^31."""
    require_free_bytes(6 << 30)
    x = torch.randn(4096, BIG_ROWS_OF_4096, dtype=BF16, device="cuda")
    check_sampled(mti.softmax_, ref_softmax, x, lambda t: first_and_last_rows(t.t()).t(), 0)


@pytest.mark.large_memory
@pytest.mark.parametrize("workspace_bytes", [None, 0])
def test_square_matmul_past_2_31_elements(workspace_bytes):
    require_free_bytes(6 << 30)
    k = 64
    x = torch.randn((1 << 31) // k + 2, k, dtype=BF16, device="cuda")
    w = randn((k, k), BF16, "cuda", seed=10, scale=k**-0.5)
    check_sampled(
        mti.square_matmul_,
        ref_square_matmul,
        x,
        first_and_last_rows,
        w,
        workspace_bytes=workspace_bytes,
    )


# --------------------------------------------------------------------------- streams, devices


def _op_calls(device):
    """name -> (op applied to x, the same through PyTorch in x's dtype, for any float dtype)."""
    w = randn((256, 256), torch.float32, device, seed=11, scale=1 / 16)
    mask = randn((256,), torch.float32, device, seed=12) > 0
    return {
        "square_matmul_": (
            lambda x: mti.square_matmul_(x, w),
            lambda x: ref_square_matmul(x, w.to(x.dtype)),
        ),
        "square_matmul_no_workspace": (
            lambda x: mti.square_matmul_(x, w, workspace_bytes=0),
            lambda x: ref_square_matmul(x, w.to(x.dtype)),
        ),
        "softmax_": (lambda x: mti.softmax_(x, mask=mask), lambda x: ref_softmax(x, mask=mask)),
        "log_softmax_": (lambda x: mti.log_softmax_(x, dim=0), lambda x: ref_log_softmax(x, 0)),
        "layer_norm_": (lambda x: mti.layer_norm_(x, (256,)), lambda x: ref_layer_norm(x, (256,))),
        "rms_norm_": (lambda x: mti.rms_norm_(x, (256,)), lambda x: ref_rms_norm(x, (256,))),
    }


OP_NAMES = list(_op_calls("cpu"))


@pytest.mark.parametrize("name", OP_NAMES)
def test_runs_on_the_current_stream(name):
    """On a side stream kept busy, x is filled and then the op runs. If the op used any other
    stream it would run before the fill lands and the fill would overwrite its result."""
    op, ref = _op_calls("cuda")[name]
    src = randn((512, 256), torch.float32, "cuda", seed=13)
    ref64, torch_out = ref(src.double()), ref(src)
    x = torch.zeros_like(src)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # tens of ms of GPU time
        x.copy_(src)
        op(x)
    side.synchronize()
    assert_accurate(x, torch_out, ref64, name)


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("name", OP_NAMES)
def test_runs_on_a_device_other_than_the_current(name):
    assert torch.cuda.current_device() == 0
    op, ref = _op_calls("cuda:1")[name]
    x = randn((512, 256), torch.float32, "cuda:1", seed=14)
    ref64 = ref(x.double())
    torch_out = ref(x)
    op(x)
    torch.cuda.synchronize(1)
    assert_accurate(x, torch_out, ref64, name)
    assert torch.cuda.current_device() == 0, "the op must restore the current device"
