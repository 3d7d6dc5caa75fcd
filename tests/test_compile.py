"""The ops as dispatcher ops: torch.library.opcheck on each (schema honesty, FakeTensor,
AOT dispatch), and torch.compile(fullgraph=True) of an attention-like block that uses every op,
against the same block run eagerly."""

import pytest
import torch
from helpers import DEVICES, randn, requires_cuda

import make_torch_inplace as mti

_ops = torch.ops.make_torch_inplace
F32 = torch.float32


def opcheck_samples(device):
    """(op, args) pairs covering each dispatcher op's optional arguments and flags."""

    def r(*shape, seed=0, dtype=F32):
        return randn(shape, dtype, device, seed)

    bool_mask = r(6, 6, seed=1) > -0.5
    bf16 = torch.bfloat16
    sm, sx, ln, rms = _ops.square_matmul_, _ops.softmax_, _ops.layer_norm_, _ops.rms_norm_
    xent = _ops.cross_entropy_
    rope, rope_bwd = _ops.rope_, _ops.rope_backward
    target = torch.tensor([[1, 0, 7], [-100, 2, 3]], device=device)
    return {
        "square_matmul": (sm, (r(2, 6, 8), r(8, 8, seed=2), None, False, 1 << 20)),
        "square_matmul_bias_transpose": (
            sm,
            (r(2, 6, 8), r(8, 8, seed=3), r(8, seed=4), True, 1 << 20),
        ),
        "square_matmul_no_workspace": (sm, (r(5, 8), r(8, 8, seed=5), r(8, seed=6), False, 0)),
        "square_matmul_bf16": (
            sm,
            (r(5, 8, dtype=bf16), r(8, 8, seed=7, dtype=bf16), None, True, 64),
        ),
        "softmax": (sx, (r(2, 6, 6), -1, 1.0, None, False, False)),
        "softmax_dim0_scale": (sx, (r(2, 6, 6), 0, 0.5, None, False, False)),
        "softmax_bool_mask_causal": (sx, (r(2, 6, 6), -1, 0.125, bool_mask, True, False)),
        "log_softmax_additive_mask": (sx, (r(2, 6, 6), -1, 1.0, r(1, 6, seed=8), False, True)),
        "layer_norm": (ln, (r(2, 6, 8), [8], None, None, 1e-5, r(0))),
        "layer_norm_affine_rstd": (
            ln,
            (r(2, 6, 8), [6, 8], r(6, 8, seed=9), r(6, 8, seed=10), 1e-5, r(2)),
        ),
        "rms_norm": (rms, (r(2, 6, 8), [8], None, 1e-6, r(0))),
        "rms_norm_weight_rstd": (rms, (r(2, 6, 8), [8], r(8, seed=11), 1e-6, r(2 * 6))),
        "cross_entropy_mean": (xent, (r(2, 3, 8), target, -100, 1, 0.0, r(2, 3))),
        "cross_entropy_none_smoothed_bf16": (
            xent,
            (r(2, 3, 8, dtype=bf16), target.clamp(min=0), 7, 0, 0.1, r(2, 3)),
        ),
        "rope": (rope, (r(2, 3, 5, 8), r(5, 8, seed=12), r(5, 8, seed=13))),
        "rope_transposed_heads_bf16": (
            rope,
            (
                r(2, 5, 3, 8, dtype=bf16).transpose(1, 2),
                r(2, 1, 5, 8, seed=14, dtype=bf16),
                r(1, 1, 5, 8, seed=15, dtype=bf16),
            ),
        ),
        "rope_backward": (
            rope_bwd,
            (r(2, 3, 5, 8), r(5, 8, seed=16), r(1, 3, 5, 8, seed=17), r(2, 3, 5, 8, seed=18)),
        ),
        "silu_mul_backward": (
            _ops.silu_mul_backward_,
            (r(3, 40, seed=19), r(3, 40, seed=20), r(3, 40, seed=21)),
        ),
        "silu_mul_backward_bf16": (
            _ops.silu_mul_backward_,
            (r(7, dtype=bf16), r(7, seed=22, dtype=bf16), r(7, seed=23, dtype=bf16)),
        ),
    }


SAMPLES = list(opcheck_samples("cpu"))


@pytest.mark.parametrize("sample", SAMPLES)
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device, sample):
    op, args = opcheck_samples(device)[sample]
    torch.library.opcheck(op, args)


# --------------------------------------------------------------------------- torch.compile

D, HEADS, VOCAB = 16, 2, 16


def make_params(device):
    def w(seed):  # (D, D), scaled to keep activations O(1)
        return randn((D, D), F32, device, seed, scale=D**-0.5)

    def v(seed):
        return randn((D,), F32, device, seed)

    return dict(
        ln_w=v(1),
        ln_b=v(2),
        wq=w(3),
        bq=v(4),
        wk=w(5),
        wv=w(6),
        bv=v(7),
        wo=w(8),
        bo=v(9),
        rms_w=v(10),
        w_out=w(11),
    )


def block(x, pad_mask, p):
    """Pre-norm causal attention and an output head, every intermediate reused in place.
    x: (B, T, D); pad_mask: (B, 1, 1, T) bool, True where a key takes part."""
    b, t, _ = x.shape
    h = mti.layer_norm_(x.clone(), (D,), p["ln_w"], p["ln_b"])
    q = mti.linear_(h.clone(), p["wq"], p["bq"])
    k = mti.square_matmul_(h.clone(), p["wk"], workspace_bytes=0)
    v = mti.linear_(h, p["wv"], p["bv"])  # h is dead after this: its memory becomes v

    def heads(z):
        return z.view(b, t, HEADS, D // HEADS).transpose(1, 2)

    scores = heads(q) @ heads(k).transpose(-1, -2)
    probs = mti.softmax_(scores, scale=(D // HEADS) ** -0.5, mask=pad_mask, causal=True)
    attn = (probs @ heads(v)).transpose(1, 2).reshape(b, t, D)
    out = mti.linear_(attn, p["wo"], p["bo"]) + x
    out = mti.rms_norm_(out, (D,), p["rms_w"])
    logits = mti.square_matmul_(out, p["w_out"], transpose=True)
    return mti.log_softmax_(logits, dim=-1)


def block_inputs(device, t=5):
    x = randn((2, t, D), F32, device, seed=12)
    pad_mask = torch.ones(2, 1, 1, t, dtype=torch.bool, device=device)
    pad_mask[1, ..., t - 2 :] = False  # the second sequence is two tokens shorter
    return x, pad_mask


def check_compiled_block(device, backend):
    torch._dynamo.reset()
    p = make_params(device)
    compiled = torch.compile(block, backend=backend, fullgraph=True)
    with torch.no_grad():
        for t in (5, 7):  # a second length: recompilation or dynamic shapes
            x, pad_mask = block_inputs(device, t)
            x_before = x.clone()
            expected = block(x.clone(), pad_mask, p)
            got = compiled(x, pad_mask, p)
            torch.testing.assert_close(got, expected)
            assert torch.equal(x, x_before), "the block must not write its input"


# Inductor's shape padding (pad_mm) pads the scores' bmm to multiples of 8 where it times
# faster, then hands softmax_ the padded buffer reinterpreted as contiguous (2, 2, 5, 5):
# every output wrong (seen in the generated code). Whether it pads is decided by timing at
# compile time, so the test would fail on some machines only. It is off here so the test
# checks our ops; the strict xfail below keeps it padded, and fails once torch no longer
# mishandles it. README, "Known issues".
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_block_matches_eager(device, backend):
    with torch._inductor.config.patch(shape_padding=False):
        check_compiled_block(device, backend)


@requires_cuda
@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="inductor's shape padding miscompiles a mutating op on a padded bmm",
)
def test_compiled_block_with_inductor_shape_padding():
    with torch._inductor.config.patch(shape_padding=True, force_shape_pad=True):
        check_compiled_block("cuda", "inductor")


def mutate_input(x, w, mask):
    """Writes over its graph inputs: functionalization must copy the results back into x."""
    mti.layer_norm_(x, (D,))
    mti.linear_(x, w)
    mti.softmax_(x, mask=mask)
    return x.sum()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_mutation_of_inputs(device, backend):
    torch._dynamo.reset()
    w = randn((D, D), F32, device, seed=13, scale=D**-0.5)
    mask = randn((D,), F32, device, seed=14) > 0
    x = randn((3, D), F32, device, seed=15)
    eager_x = x.clone()
    with torch.no_grad():
        expected = mutate_input(eager_x, w, mask)
        got = torch.compile(mutate_input, backend=backend, fullgraph=True)(x, w, mask)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(x, eager_x)
