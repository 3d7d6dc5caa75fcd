"""The DTensor checks that test_dtensor.py runs on each rank of a 2-rank mesh (launch.py).

Every value check computes its references first, on the full tensor in this process: the op
in fp64 (the truth) and PyTorch's op in the input's dtype (the yardstick of assert_accurate).
Then the op runs on a DTensor under CommDebugMode, and the check asserts: no collective, the
returned tensor is x with x's placements, x's local storage holds the local part of the
result, and the gathered result is accurate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from helpers import (
    assert_accurate,
    examples,
    lead_shapes,
    randn,
    ref_layer_norm,
    ref_log_softmax,
    ref_rms_norm,
    ref_rope,
    ref_softmax,
    ref_square_matmul,
    seeds,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import make_torch_inplace as mti
import make_torch_inplace.distributed  # registers the DTensor rules and buffers

F32 = torch.float32
F64 = torch.float64
CHECKS = {}  # name -> fn(ctx), run in this order on every rank


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def dt(ctx, full, placements):
    return distribute_tensor(full.to(ctx.device), ctx.mesh, placements)


def references(ref, x, *args, **kwargs):
    """(fp64 truth, PyTorch's result in x's dtype) of ref on the full tensors."""
    f64 = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    kw64 = {
        k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in kwargs.items()
    }
    return ref(x.double(), *f64, **kw64), ref(x, *args, **kwargs)


def run_in_place(op, x, *args, **kwargs):
    """op(x, ...) on a DTensor x: asserts no collective, the result is x with its placements,
    written over x's local storage. Returns the result's full tensor."""
    placements, local = x.placements, x.to_local()
    before = local.clone()
    with CommDebugMode() as comm:
        out = op(x, *args, **kwargs)
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    assert out is x and out.placements == placements
    assert out.to_local().data_ptr() == local.data_ptr()
    assert local.numel() == 0 or not torch.equal(local, before), "x's shard was not written"
    return out.full_tensor().cpu()


def refused(ctx, op, x, *args, match, **kwargs):
    """op on DTensor x raises an error naming `match`, and x's shard is as it was."""
    before = x.to_local().clone()
    try:
        op(x, *args, **kwargs)
    except (RuntimeError, ValueError) as e:
        assert match in str(e), f"expected {match!r} in: {e}"
    else:
        raise AssertionError(f"{getattr(op, '__name__', op)} accepted {x.placements}")
    assert torch.equal(x.to_local(), before), "refused, but the shard was written"


ROWS_3D = [[Shard(0)], [Shard(1)], [Replicate()]]


# --------------------------------------------------------------------------- values


@check
def square_matmul_values(ctx):
    for transpose, with_bias in ((False, False), (True, True)):
        x = randn((5, 3, 8), F32, "cpu", 1)  # 5 rows on 2 ranks: uneven shards
        w, b = randn((8, 8), F32, "cpu", 2), randn((8,), F32, "cpu", 3) if with_bias else None
        truth, torch_out = references(ref_square_matmul, x, w, b, transpose=transpose)
        wd = dt(ctx, w, [Replicate()])
        bd = None if b is None else dt(ctx, b, [Replicate()])
        for placements in ROWS_3D:
            out = run_in_place(
                mti.square_matmul_, dt(ctx, x, placements), wd, bd, transpose=transpose
            )
            assert_accurate(out, torch_out, truth, f"square_matmul_ {placements}")
    x, w = randn((4, 8), F32, "cpu", 4), randn((8, 8), F32, "cpu", 5)
    truth, torch_out = references(F.linear, x, w)
    out = run_in_place(mti.linear_, dt(ctx, x, [Shard(0)]), dt(ctx, w, [Replicate()]))
    assert_accurate(out, torch_out, truth, "linear_")


def _softmax_cases():
    """(placements of x (B, H, Q, K), kwargs without mask, mask shape or None, mask
    placements)."""
    return [
        ([Shard(0)], {"scale": 0.5}, None, None),
        ([Shard(1)], {"causal": True}, (1, 1, 6, 10), [Replicate()]),
        ([Shard(2)], {}, None, None),
        ([Shard(2)], {"scale": 0.25}, (6, 10), [Shard(0)]),  # the mask spans the query dim
        ([Replicate()], {"causal": True}, (3, 1, 6, 10), [Replicate()]),
        ([Shard(1)], {"dim": 2}, None, None),
    ]


@check
def softmax_values(ctx):
    x = randn((3, 4, 6, 10), F32, "cpu", 10)
    for placements, kwargs, mask_shape, mask_placements in _softmax_cases():
        mask = None
        if mask_shape is not None:
            mask = randn(mask_shape, F32, "cpu", 11) > -0.5
        for op, ref in ((mti.softmax_, ref_softmax), (mti.log_softmax_, ref_log_softmax)):
            truth, torch_out = references(ref, x, mask=mask, **kwargs)
            maskd = None if mask is None else dt(ctx, mask, mask_placements)
            out = run_in_place(op, dt(ctx, x, placements), mask=maskd, **kwargs)
            assert_accurate(out, torch_out, truth, f"{op.__name__} {placements} {kwargs}")


@check
def norm_values(ctx):
    x = randn((5, 6, 16), F32, "cpu", 20)
    w, b = randn((16,), F32, "cpu", 21), randn((16,), F32, "cpu", 22)
    wd, bd = dt(ctx, w, [Replicate()]), dt(ctx, b, [Replicate()])
    for placements in ROWS_3D:
        truth, torch_out = references(ref_layer_norm, x, (16,), w, b)
        out = run_in_place(mti.layer_norm_, dt(ctx, x, placements), (16,), wd, bd)
        assert_accurate(out, torch_out, truth, f"layer_norm_ {placements}")
        truth, torch_out = references(ref_rms_norm, x, (16,), w, 1e-6)
        out = run_in_place(mti.rms_norm_, dt(ctx, x, placements), (16,), wd, 1e-6)
        assert_accurate(out, torch_out, truth, f"rms_norm_ {placements}")
    # Two normalized dims, rows sharded on the batch dim.
    w2 = randn((6, 16), F32, "cpu", 23)
    truth, torch_out = references(ref_rms_norm, x, (6, 16), w2)
    out = run_in_place(mti.rms_norm_, dt(ctx, x, [Shard(0)]), (6, 16), dt(ctx, w2, [Replicate()]))
    assert_accurate(out, torch_out, truth, "rms_norm_ (6, 16)")


def _ref_cross_entropy(logits, target, reduction):
    """(loss, gradient w.r.t. logits) of F.cross_entropy in logits' dtype's autograd."""
    z = logits.detach().requires_grad_()
    loss = F.cross_entropy(z, target, reduction=reduction, ignore_index=-100)
    loss.sum().backward()
    return loss.detach(), z.grad


@check
def cross_entropy_values(ctx):
    logits = randn((7, 12), F32, "cpu", 30)
    target = torch.randint(0, 12, (7,), generator=torch.Generator().manual_seed(31))
    target[3] = -100
    cases = [("none", [Shard(0)]), ("sum", [Shard(0)]), ("mean", [Replicate()])]
    for reduction, placements in cases:
        loss64, grad64 = _ref_cross_entropy(logits.double(), target, reduction)
        loss32, grad32 = _ref_cross_entropy(logits, target, reduction)
        ld, td = dt(ctx, logits, placements), dt(ctx, target, placements)
        local = ld.to_local()
        with CommDebugMode() as comm:
            loss = mti.cross_entropy_(ld, td, reduction=reduction)
        assert comm.get_total_counts() == 0, comm.get_comm_counts()
        assert ld.placements == tuple(placements) and ld.to_local().data_ptr() == local.data_ptr()
        expected = [Partial()] if reduction == "sum" and placements[0].is_shard() else placements
        assert list(loss.placements) == list(expected), loss.placements
        what = f"cross_entropy_ {reduction} {placements}"
        assert_accurate(loss.full_tensor().cpu(), loss32, loss64, what + " loss")
        assert_accurate(ld.full_tensor().cpu(), grad32, grad64, what + " gradient")


@check
def row_ops_drawn_shapes(ctx):
    """softmax_ and rms_norm_ on drawn shapes, sharded on a drawn dim other than the last:
    served where that dim has at least as many elements as ranks (uneven shards included),
    else refused. Derandomized: both ranks draw the same examples, so their collectives pair
    up."""

    @settings(derandomize=True, database=None, deadline=None, max_examples=examples(12))
    @given(lead=lead_shapes(max_size=5).filter(len), width=st.integers(1, 40), seed=seeds)
    def body(lead, width, seed):
        x = randn((*lead, width), F32, "cpu", seed)
        shard = [Shard(seed % len(lead))]
        cases = (
            (mti.softmax_, ref_softmax, (), {}),
            (mti.rms_norm_, ref_rms_norm, ((width,),), {}),
        )
        for op, ref, args, kwargs in cases:
            if lead[shard[0].dim] < 2:
                refused(ctx, op, dt(ctx, x, shard), *args, match="sharded 2 ways", **kwargs)
                continue
            truth, torch_out = references(ref, x, *args, **kwargs)
            out = run_in_place(op, dt(ctx, x, shard), *args, **kwargs)
            assert_accurate(out, torch_out, truth, f"{op.__name__} {tuple(x.shape)} {shard}")

    body()


def _rope_cases():
    """(placements of x (B, H, S, D), shape of cos and sin, their placements): heads sharded
    with the tables replicated (tensor parallel), the sequence sharded with the tables sharded
    on it too (sequence parallel), the batch with per-sequence tables."""
    return [
        ([Shard(1)], (6, 16), [Replicate()]),
        ([Shard(1)], (1, 1, 6, 16), [Replicate()]),
        ([Shard(2)], (6, 16), [Shard(0)]),
        ([Shard(2)], (3, 1, 6, 16), [Shard(2)]),
        ([Shard(0)], (3, 1, 6, 16), [Shard(0)]),
        ([Shard(0)], (6, 16), [Replicate()]),
        ([Replicate()], (3, 1, 6, 16), [Replicate()]),
    ]


@check
def rope_values(ctx):
    x = randn((3, 4, 6, 16), F32, "cpu", 80)
    for placements, shape, table_placements in _rope_cases():
        cos, sin = randn(shape, F32, "cpu", 81), randn(shape, F32, "cpu", 82)
        truth, torch_out = references(ref_rope, x, cos, sin)
        cd, sd = dt(ctx, cos, table_placements), dt(ctx, sin, table_placements)
        out = run_in_place(mti.rope_, dt(ctx, x, placements), cd, sd)
        assert_accurate(out, torch_out, truth, f"rope_ {placements} {shape} {table_placements}")
    # A query as tensor parallelism makes it: the (B, S, H, D) projection sharded on heads,
    # rotated through its transpose, in the projection's memory.
    q = randn((3, 6, 4, 16), F32, "cpu", 83)
    cos, sin = randn((6, 16), F32, "cpu", 84), randn((6, 16), F32, "cpu", 85)
    truth, torch_out = references(ref_rope, q.transpose(1, 2), cos, sin)
    qd = dt(ctx, q, [Shard(2)])
    local = qd.to_local()
    view = qd.transpose(1, 2)
    rep = [Replicate()]
    out = run_in_place(mti.rope_, view, dt(ctx, cos, rep), dt(ctx, sin, rep))
    assert view.to_local().data_ptr() == local.data_ptr(), "the view's shard is not q's"
    assert_accurate(out, torch_out, truth, "rope_ on a transposed query")


@check
def silu_mul_backward_values(ctx):
    """Elementwise: every placement of the three tensors alike runs on the local shards."""
    op = torch.ops.make_torch_inplace.silu_mul_backward_
    grad, gate, up = (randn((4, 6, 16), F32, "cpu", 90 + i) for i in range(3))
    g64, u64 = (t.double().requires_grad_() for t in (gate, up))
    truth = torch.autograd.grad(F.silu(g64) * u64, (g64, u64), grad.double())
    gf, uf = (t.clone().requires_grad_() for t in (gate, up))
    torch_out = torch.autograd.grad(F.silu(gf) * uf, (gf, uf), grad)
    for placements in [*ROWS_3D, [Shard(2)]]:
        # Copies: a replicated DTensor of a CPU tensor may share its storage.
        d, g, u = (dt(ctx, t.clone(), placements) for t in (grad, gate, up))
        ptrs = g.to_local().data_ptr(), u.to_local().data_ptr()
        with CommDebugMode() as comm:
            op(d, g, u)
        assert comm.get_total_counts() == 0, comm.get_comm_counts()
        assert (g.to_local().data_ptr(), u.to_local().data_ptr()) == ptrs, "not in place"
        for out, t, r, name in zip((g, u), torch_out, truth, ("gate", "up"), strict=True):
            assert_accurate(out.full_tensor().cpu(), t, r, f"{name} {placements}")
    d, g, u = dt(ctx, grad, [Shard(0)]), dt(ctx, gate, [Shard(0)]), dt(ctx, up, [Shard(1)])
    refused(ctx, lambda x: op(d, x, u), g, match="up has placements")


# --------------------------------------------------------------------------- refusals


@check
def refusals(ctx):
    x = randn((4, 6, 16), F32, "cpu", 40)
    w = randn((16, 16), F32, "cpu", 41)
    wd = dt(ctx, w, [Replicate()])
    partial = DTensor.from_local(x.to(ctx.device).clone(), ctx.mesh, [Partial()])
    last = [Shard(2)]
    refused(ctx, mti.square_matmul_, dt(ctx, x, last), wd, match="contracted dim")
    refused(ctx, mti.square_matmul_, partial, wd, match="Partial")
    for wp in ([Shard(0)], [Shard(1)]):  # row- and column-parallel weights
        refused(ctx, mti.square_matmul_, dt(ctx, x, [Shard(0)]), dt(ctx, w, wp), match="weight")
    refused(ctx, mti.softmax_, dt(ctx, x, last), match="softmax dim")
    refused(ctx, mti.log_softmax_, dt(ctx, x, [Shard(1)]), dim=1, match="softmax dim")
    refused(ctx, mti.softmax_, dt(ctx, x, [Shard(1)]), causal=True, match="query dim")
    refused(ctx, mti.softmax_, partial, match="Partial")
    mask = torch.ones(6, 16, dtype=torch.bool)
    refused(
        ctx, mti.softmax_, dt(ctx, x, [Shard(1)]), mask=dt(ctx, mask, [Replicate()]), match="mask"
    )
    refused(ctx, mti.softmax_, dt(ctx, x, [Shard(0)]), mask=dt(ctx, mask, [Shard(0)]), match="mask")
    n = randn((16,), F32, "cpu", 42)
    nd = dt(ctx, n, [Replicate()])
    for norm in (mti.layer_norm_, mti.rms_norm_):
        refused(ctx, norm, dt(ctx, x, last), (16,), nd, match="normalized dims")
        refused(ctx, norm, dt(ctx, x, [Shard(1)]), (6, 16), match="normalized dims")
        refused(ctx, norm, partial, (16,), nd, match="Partial")
        refused(ctx, norm, dt(ctx, x, [Shard(0)]), (16,), dt(ctx, n, [Shard(0)]), match="weight")
    target = torch.zeros(4, 6, dtype=torch.long)
    td = dt(ctx, target, [Shard(0)])
    ce = mti.cross_entropy_
    refused(ctx, ce, dt(ctx, x, last), dt(ctx, target, [Replicate()]), match="class dim")
    refused(ctx, ce, dt(ctx, x, [Shard(0)]), td, match='"mean"')
    refused(
        ctx,
        ce,
        dt(ctx, x, [Shard(0)]),
        dt(ctx, target, [Shard(1)]),
        reduction="sum",
        match="target",
    )


@check
def rope_refusals(ctx):
    x = randn((4, 4, 6, 16), F32, "cpu", 86)
    cos, sin = randn((6, 16), F32, "cpu", 87), randn((6, 16), F32, "cpu", 88)
    rep, seq = [Replicate()], [Shard(0)]
    partial = DTensor.from_local(x.to(ctx.device).clone(), ctx.mesh, [Partial()])
    tables = dt(ctx, cos, rep), dt(ctx, sin, rep)
    refused(ctx, mti.rope_, dt(ctx, x, [Shard(3)]), *tables, match="rotated dim")
    refused(ctx, mti.rope_, partial, *tables, match="Partial")
    # The sequence sharded: replicated tables would be read from the wrong positions.
    refused(ctx, mti.rope_, dt(ctx, x, [Shard(2)]), *tables, match="cos must be Shard(0)")
    refused(
        ctx,
        mti.rope_,
        dt(ctx, x, [Shard(2)]),
        dt(ctx, cos, seq),
        dt(ctx, sin, rep),
        match="sin must be Shard(0)",
    )
    # Heads sharded, tables sharded on the sequence: each rank holds half the positions.
    refused(
        ctx,
        mti.rope_,
        dt(ctx, x, [Shard(1)]),
        dt(ctx, cos, seq),
        dt(ctx, sin, seq),
        match="cos must be Replicate",
    )
    g = dt(ctx, randn((4, 4, 6, 16), F32, "cpu", 89), [Shard(1)])
    grad_x = dt(ctx, torch.zeros(4, 4, 6, 16), [Shard(2)])
    refused(
        ctx,
        lambda gx: torch.ops.make_torch_inplace.rope_backward(g, *tables, gx),
        grad_x,
        match="grad_x has placements",
    )


@check
def refusal_not_hidden_by_cache(ctx):
    """An accepted call must not make a later call with other normalized dims pass: the
    sharding cache keys on every non-tensor argument."""
    x = randn((4, 6, 16), F32, "cpu", 50)
    mti.rms_norm_(dt(ctx, x, [Shard(1)]), (16,))
    refused(ctx, mti.rms_norm_, dt(ctx, x, [Shard(1)]), (6, 16), match="normalized dims")
    mti.softmax_(dt(ctx, x, [Shard(1)]), dim=2)
    refused(ctx, mti.softmax_, dt(ctx, x, [Shard(1)]), dim=1, match="softmax dim")


# --------------------------------------------------------------------------- autograd


def _grads(fn, x, params, grad_out):
    """Gradients of sum(fn(x', *params) * grad_out) w.r.t. x and params, x' = x * 1 (the ops
    refuse to overwrite a leaf)."""
    x = x.detach().requires_grad_()
    params = [p.detach().requires_grad_() for p in params]
    (fn(x * 1, *params) * grad_out).sum().backward()
    return [x.grad, *(p.grad for p in params)]


def _full(t):
    return t.full_tensor().cpu() if isinstance(t, DTensor) else t


@check
def autograd(ctx):
    x = randn((4, 6, 16), F32, "cpu", 60)
    g = randn((4, 6, 16), F32, "cpu", 2**31 + 99)
    w, b, m = (randn(s, F32, "cpu", 61 + i) for i, s in enumerate(((16,), (16,), (16, 16))))
    # Norm weights near 1, as trained ones are: the norms' backward recovers x_hat from y
    # through 1 / weight, imprecise where |weight| is tiny (ops.py; test_backward's norm_case).
    w = 1 + 0.1 * w
    md = dt(ctx, m, [Replicate()])  # square_matmul_'s weight: frozen
    cases = [  # name, ours(x, *params), PyTorch's(x, *params), params
        ("softmax_", lambda t: mti.softmax_(t, scale=0.5), lambda t: F.softmax(t * 0.5, -1), []),
        ("log_softmax_", mti.log_softmax_, lambda t: F.log_softmax(t, -1), []),
        (
            "rms_norm_",
            lambda t, w: mti.rms_norm_(t, (16,), w),
            lambda t, w: F.rms_norm(t, (16,), w),
            [w],
        ),
        (
            "layer_norm_",
            lambda t, w, b: mti.layer_norm_(t, (16,), w, b),
            lambda t, w, b: F.layer_norm(t, (16,), w, b),
            [w, b],
        ),
        (
            "square_matmul_",
            lambda t, b: mti.square_matmul_(t, md, b),
            lambda t, b: t @ m.to(t.dtype) + b,
            [b],
        ),
    ]
    for name, op, ref, params in cases:
        truth = _grads(ref, x.double(), [p.double() for p in params], g.double())
        torch_grads = _grads(ref, x, params, g)
        for placements in ([Shard(0)], [Shard(1)]):
            xd = dt(ctx, x, placements)
            pds = [dt(ctx, p, [Replicate()]) for p in params]
            ours = _grads(op, xd, pds, dt(ctx, g, placements))
            assert ours[0].placements == tuple(placements), ours[0].placements
            for i, grad in enumerate(ours):
                what = f"{name} {placements} grad {i}"
                assert_accurate(_full(grad), torch_grads[i], truth[i], what)


@check
def rope_autograd(ctx):
    x = randn((3, 4, 6, 16), F32, "cpu", 90)
    g = randn((3, 4, 6, 16), F32, "cpu", 2**31 + 99)
    cos, sin = randn((6, 16), F32, "cpu", 91), randn((6, 16), F32, "cpu", 92)
    truth = _grads(lambda t: ref_rope(t, cos.double(), sin.double()), x.double(), [], g.double())
    torch_grads = _grads(lambda t: ref_rope(t, cos, sin), x, [], g)
    for placements, table_placements in (([Shard(1)], [Replicate()]), ([Shard(2)], [Shard(0)])):
        cd, sd = dt(ctx, cos, table_placements), dt(ctx, sin, table_placements)
        xd, gd = dt(ctx, x, placements), dt(ctx, g, placements)
        ours = _grads(lambda t, cd=cd, sd=sd: mti.rope_(t, cd, sd), xd, [], gd)
        assert ours[0].placements == tuple(placements), ours[0].placements
        assert_accurate(_full(ours[0]), torch_grads[0], truth[0], f"rope_ {placements} grad")


@check
def cross_entropy_autograd(ctx):
    logits = randn((6, 12), F32, "cpu", 70)
    target = torch.randint(0, 12, (6,), generator=torch.Generator().manual_seed(71))
    truth = _grads(
        lambda z: F.cross_entropy(z, target, reduction="sum") * 0.25, logits.double(), [], 1
    )
    torch_grad = _grads(lambda z: F.cross_entropy(z, target, reduction="sum") * 0.25, logits, [], 1)
    ld = dt(ctx, logits, [Shard(0)]).requires_grad_()
    loss = mti.cross_entropy_(ld * 1, dt(ctx, target, [Shard(0)]), reduction="sum")
    (loss.full_tensor() * 0.25).backward()
    assert ld.grad.placements == (Shard(0),), ld.grad.placements
    assert_accurate(_full(ld.grad), torch_grad[0], truth[0], "cross_entropy_ grad")
