"""rope_ against an fp64 reference of Hugging Face Llama's apply_rotary_pos_emb for one tensor
(helpers.ref_rope): drawn shapes, layouts of x (the transposed view that a query is, strided
and unaligned rows) and of cos/sin ((s, D), (b, 1, s, D), (1, 1, s, D), expanded, strided),
every dtype, on the CPU and on CUDA; its gradients against the fp64 gradients of the
written-out formula; what autograd saves and refuses; torch.compile."""

import pytest
import torch
from helpers import (
    DEVICES,
    HAS_CUDA,
    SENTINEL,
    Untouched,
    assert_accurate,
    assert_close64,
    check_op,
    examples,
    output_grad,
    randn,
    ref_rope,
    seeds,
    with_layout,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import make_torch_inplace as mti

F32, F64 = torch.float32, torch.float64
ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
DTYPE_IDS = {d: str(d).removeprefix("torch.") for d in ALL_DTYPES}
ALL_DTYPE_PARAMS = [pytest.param(d, id=DTYPE_IDS[d]) for d in ALL_DTYPES]

# Head dims: the scalar CUDA path (a half not a multiple of 16 bytes), one 16-byte chunk or a
# few per half, Llama's 128, and halves of more chunks than a warp has threads (fp32: 260).
HEAD_DIMS = (2, 4, 6, 10, 16, 34, 64, 80, 128, 256, 520)

# x of shape (b, h, s, D) laid out as:
X_LAYOUTS = (
    "contiguous",
    "heads_transposed",  # (b, s, h, D) in memory, x its transpose(1, 2): a query as HF makes it
    "row_padded",  # rows D + 5 apart: unaligned row starts
    "every_other_row",
    "lead_permuted",
)
# cos and sin of shape:
TABLE_SHAPES = ("seq", "batch_seq", "one_seq", "full", "expanded_batch", "row_padded")


def x_in_layout(values, layout):
    if layout == "heads_transposed":
        b, h, s, d = values.shape
        x = torch.full((b, s, h, d), SENTINEL, dtype=values.dtype, device=values.device)
        x = x.transpose(1, 2)
        x.copy_(values)
        return x
    return with_layout(values, layout)


def table(kind, shape, dtype, device, seed):
    """A cos or sin table for x of shape (b, h, s, D), of random values (so that the halves
    differ, which real tables do not; the formula holds for any)."""
    b, h, s, d = shape
    if kind == "seq":
        return randn((s, d), dtype, device, seed)
    if kind == "batch_seq":
        return randn((b, 1, s, d), dtype, device, seed)
    if kind == "one_seq":
        return randn((1, 1, s, d), dtype, device, seed)
    if kind == "full":
        return randn((b, h, s, d), dtype, device, seed)
    if kind == "expanded_batch":
        return randn((1, 1, s, d), dtype, device, seed).expand(b, 1, s, d)
    if kind == "row_padded":
        return with_layout(randn((s, d), dtype, device, seed), "row_padded", pad=3)
    raise ValueError(kind)


def hf_tables(positions, d, dtype, device, base=10000.0):
    """Llama's cos and sin (LlamaRotaryEmbedding, default rope type) for positions, (s, d)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=F64) / d))
    freqs = positions.to(F64)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def check_rope(x, cos, sin):
    """rope_ returns x, writes nothing outside it and is as accurate as PyTorch's formula in
    x's dtype (helpers.check_op); float64 within helpers.F64_ULPS units at the scale of the
    products."""
    if x.dtype != F64:
        check_op(mti.rope_, ref_rope, x, cos, sin)
        return
    ref = ref_rope(x, cos, sin)
    terms = 0.0
    if x.numel():
        terms = x.abs().max().item() * (cos.abs().max().item() + sin.abs().max().item())
    guard = Untouched(x)
    assert mti.rope_(x, cos, sin) is x
    assert guard.outside_unchanged(), "rope_ wrote memory outside x"
    assert_close64(x, ref, "rope_", terms=terms)


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("dtype", ALL_DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=examples(25))
@given(
    lead=st.tuples(st.integers(0, 3), st.integers(1, 4), st.integers(1, 5)),
    d=st.sampled_from(HEAD_DIMS),
    layout=st.sampled_from(X_LAYOUTS),
    kind=st.sampled_from(TABLE_SHAPES),
    seed=seeds,
)
def test_matches_reference(device, dtype, lead, d, layout, kind, seed):
    shape = (*lead, d)
    x = x_in_layout(randn(shape, dtype, device, seed), layout)
    cos = table(kind, shape, dtype, device, seed + 1)
    sin = table(kind, shape, dtype, device, seed + 2)
    check_rope(x, cos, sin)


@pytest.mark.parametrize("dtype", ALL_DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "x_shape,table_shape",
    [
        ((8,), (8,)),  # one row
        ((7, 64), (7, 64)),  # (s, D)
        ((7, 64), (64,)),  # one position for every row
        ((2, 7, 3, 64), (2, 7, 1, 64)),  # (b, s, h, D) with HF's unsqueeze_dim=2
        ((2, 3, 0, 64), (0, 64)),  # empty
        ((2, 3, 5, 0), (5, 0)),  # D = 0
        ((2, 1, 3, 5, 16), (3, 1, 16)),  # five dims, broadcast on two
    ],
    ids=str,
)
def test_shapes(device, dtype, x_shape, table_shape):
    x = randn(x_shape, dtype, device, 1)
    check_rope(x, randn(table_shape, dtype, device, 2), randn(table_shape, dtype, device, 3))


@pytest.mark.parametrize("dtype", ALL_DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
def test_llama_tables_on_query_and_key(device, dtype):
    """Real rotary tables (positions to 8191, D = 128) on a query and a key with 8 and 2
    heads, each the transpose of its projection's (b, s, h, D) output, as Llama makes them."""
    b, s, d = 2, 48, 128
    positions = torch.arange(8192 - s, 8192)
    cos, sin = hf_tables(positions, d, dtype, device)
    cos, sin = cos[None, None], sin[None, None]  # (1, 1, s, D)
    for heads, seed in ((8, 4), (2, 5)):
        x = randn((b, s, heads, d), dtype, device, seed).transpose(1, 2)
        check_rope(x, cos, sin)


def test_matches_transformers():
    """helpers.ref_rope is transformers' own apply_rotary_pos_emb."""
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    q, k = randn((2, 4, 6, 16), F64, "cpu", 6), randn((2, 2, 6, 16), F64, "cpu", 7)
    cos, sin = hf_tables(torch.arange(6), 16, F64, "cpu")
    cos, sin = cos.expand(2, 6, 16), sin.expand(2, 6, 16)  # (b, s, D), as the model passes them
    q_ref, k_ref = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(ref_rope(q, cos[:, None], sin[:, None]), q_ref, rtol=0, atol=0)
    torch.testing.assert_close(ref_rope(k, cos[:, None], sin[:, None]), k_ref, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_and_inference_mode(device):
    x = randn((2, 3, 4, 16), F32, device, 8)
    cos, sin = randn((4, 16), F32, device, 9), randn((4, 16), F32, device, 10)
    expected = ref_rope(x, cos, sin)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            y = x.clone()
            assert mti.rope_(y, cos, sin) is y
        torch.testing.assert_close(y, expected)
    # Under no_grad cos and sin may require grad: nothing is recorded.
    with torch.no_grad():
        y = x.clone()
        mti.rope_(y, cos.requires_grad_(), sin)
    torch.testing.assert_close(y, expected)


# --------------------------------------------------------------------------- autograd


def grads(op, x, cos, sin, g):
    """The gradient w.r.t. x of sum(op(x', cos, sin) * g), x' a copy of x that requires grad
    (through x' * 1, a non-leaf, for the in-place op)."""
    leaf = x.detach().clone().requires_grad_()
    y = op(leaf * 1 if op is mti.rope_ else leaf, cos, sin)
    (grad,) = torch.autograd.grad(y, leaf, g)
    return grad


def check_grads(x, cos, sin, g):
    ours = grads(mti.rope_, x, cos, sin, g)
    truth = grads(ref_rope, x.double(), cos.double(), sin.double(), g.double())
    if x.dtype == F64:
        terms = g.abs().max().item() * (cos.abs().max().item() + sin.abs().max().item())
        assert_close64(ours, truth, "rope_ grad", terms=terms)
    else:
        assert_accurate(ours, grads(ref_rope, x, cos, sin, g), truth, "rope_ grad")


@pytest.mark.parametrize("dtype", ALL_DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=examples(15))
@given(
    lead=st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 5)),
    d=st.sampled_from(HEAD_DIMS),
    layout=st.sampled_from(X_LAYOUTS),
    kind=st.sampled_from(TABLE_SHAPES),
    grad_layout=st.sampled_from(("contiguous", "heads_transposed", "row_padded")),
    seed=seeds,
)
def test_gradients(device, dtype, lead, d, layout, kind, grad_layout, seed):
    shape = (*lead, d)
    x = x_in_layout(randn(shape, dtype, device, seed), layout)
    cos = table(kind, shape, dtype, device, seed + 1)
    sin = table(kind, shape, dtype, device, seed + 2)
    g = x_in_layout(output_grad(x), grad_layout)
    g_before = g.clone()
    check_grads(x, cos, sin, g)
    assert torch.equal(g, g_before), "the backward wrote over the incoming gradient"


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_of_unusual_output_gradients(device):
    """Output gradients whose rows rope_backward cannot read as they are: the expanded one of
    .sum() (stride 0 everywhere) and one whose last dim is strided."""
    x = randn((2, 3, 5, 16), F32, device, 11)
    cos, sin = randn((5, 16), F32, device, 12), randn((5, 16), F32, device, 13)
    g = randn((2, 3, 16, 5), F32, device, 14).transpose(-1, -2)
    check_grads(x, cos, sin, g)
    expanded = torch.ones((), device=device).expand(x.shape)
    check_grads(x, cos, sin, expanded)


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck(device):
    x = randn((2, 3, 4, 6), F64, device, 15).requires_grad_()
    cos, sin = randn((4, 6), F64, device, 16), randn((1, 3, 4, 6), F64, device, 17)
    assert torch.autograd.gradcheck(lambda t: mti.rope_(t.clone(), cos, sin), (x,))


@pytest.mark.parametrize("device", DEVICES)
def test_saves_only_cos_and_sin(device):
    x = randn((2, 3, 4, 8), F32, device, 18).requires_grad_()
    cos, sin = randn((4, 8), F32, device, 19), randn((4, 8), F32, device, 20)
    h = x * 2  # saves nothing (a product by a constant)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = mti.rope_(h, cos, sin)
    assert [(t.data_ptr(), t.shape) for t in saved] == [
        (cos.data_ptr(), cos.shape),
        (sin.data_ptr(), sin.shape),
    ]
    y.sum().backward()
    expected = 2 * grads(ref_rope, x.detach(), cos, sin, torch.ones_like(x))
    torch.testing.assert_close(x.grad, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_refusals_under_autograd_leave_x_unchanged(device):
    cos, sin = randn((4, 8), F32, device, 21), randn((4, 8), F32, device, 22)
    leaf = randn((2, 4, 8), F32, device, 23).requires_grad_()
    guard = Untouched(leaf)
    with pytest.raises(RuntimeError, match="leaf tensor that requires grad"):
        mti.rope_(leaf, cos, sin)
    assert guard.x_unchanged()
    for name in ("cos", "sin"):
        x = randn((2, 4, 8), F32, device, 24)
        tables = {"cos": cos, "sin": sin}
        tables[name] = tables[name].clone().requires_grad_()
        guard = Untouched(x)
        with pytest.raises(RuntimeError, match="rope_: cos or sin requires grad"):
            mti.rope_(x, tables["cos"], tables["sin"])
        assert guard.x_unchanged()


def test_version_counter():
    """rope_ bumps x's version: a backward that needs x's old value (saved by sin) raises."""
    x = randn((3, 8), F32, "cpu", 25).requires_grad_()
    h = x * 1
    z = h.sin()
    mti.rope_(h, randn((8,), F32, "cpu", 26), randn((8,), F32, "cpu", 27))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


# --------------------------------------------------------------------------- torch.compile


def rotary_attention(h, wq, wk, cos, sin, heads):
    """Projections to queries and keys, each a transposed view of its (b, s, heads, D)
    output, rotated in place; their scores."""
    b, s, _ = h.shape
    q = (h @ wq).view(b, s, heads, -1).transpose(1, 2)
    k = (h @ wk).view(b, s, heads, -1).transpose(1, 2)
    q = mti.rope_(q, cos, sin)
    k = mti.rope_(k, cos, sin)
    return (q @ k.transpose(-1, -2)).softmax(-1)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_matches_eager(device, backend, grad):
    torch._dynamo.reset()
    heads, d = 2, 16
    h = randn((2, 5, heads * d), F32, device, 28)
    ws = [
        [randn((heads * d, heads * d), F32, device, seed, scale=0.2) for seed in (29, 30)]
        for _ in "ab"
    ]
    for w in ws[0] + ws[1]:
        w.requires_grad_(grad)
    cos, sin = hf_tables(torch.arange(5), d, F32, device)
    compiled = torch.compile(rotary_attention, backend=backend, fullgraph=True)
    with torch.set_grad_enabled(grad):
        expected = rotary_attention(h, *ws[0], cos, sin, heads)
        got = compiled(h, *ws[1], cos, sin, heads)
    torch.testing.assert_close(got, expected)
    if grad:
        g = output_grad(expected)
        expected.backward(g)
        got.backward(g)
        for ours, theirs in zip(ws[1], ws[0]):
            torch.testing.assert_close(ours.grad, theirs.grad)


# --------------------------------------------------------------------------- CUDA


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_runs_on_the_current_stream():
    """On a side stream kept busy, x is filled and then rotated: an op on another stream
    would run before the fill lands."""
    src = randn((4, 8, 64, 128), torch.bfloat16, "cuda", 31)
    cos, sin = hf_tables(torch.arange(64), 128, torch.bfloat16, "cuda")
    ref64, torch_out = ref_rope(src.double(), cos.double(), sin.double()), ref_rope(src, cos, sin)
    x = torch.zeros_like(src)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        x.copy_(src)
        mti.rope_(x, cos, sin)
    side.synchronize()
    assert_accurate(x, torch_out, ref64, "rope_")


@pytest.mark.large_memory
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_past_2_31_elements():
    """Rows whose offsets pass 2^31 elements: the first and last rows rotate correctly."""
    free, _ = torch.cuda.mem_get_info()
    if free < (6 << 30):
        pytest.skip("needs 6 GiB of free device memory")
    d, heads = 128, 32
    s = (1 << 31) // (heads * d) + 2
    x = torch.randn((1, s, heads, d), dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    cos, sin = hf_tables(torch.arange(s), d, torch.bfloat16, "cuda")
    ends = [0, 1, s - 2, s - 1]
    sample = x[:, :, ends].clone()
    mti.rope_(x, cos, sin)
    expected = ref_rope(sample.double(), cos[ends].double(), sin[ends].double())
    err = (x[:, :, ends].double() - expected).abs().max().item()
    assert err <= torch.finfo(torch.bfloat16).eps * expected.abs().max().item()
