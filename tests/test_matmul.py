"""square_matmul_ and linear_ against F.linear on an fp64 reference: transpose, bias, every
workspace mode (default, none, a few rows' worth so that many chunks run, the global limit and
its context manager), odd K and M, strided rows; on CUDA, the chunks copied back on a side
stream, the peak memory of the workspace path and what runs when no workspace can be
allocated."""

import contextlib

import pytest
import torch
from helpers import (
    DEVICES,
    DTYPE_PARAMS,
    ROW_STRIDED_LAYOUTS,
    assert_accurate,
    check_op,
    examples,
    lead_shapes,
    randn,
    ref_linear,
    ref_square_matmul,
    requires_cuda,
    seeds,
    with_layout,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st

import make_torch_inplace as mti

# How square_matmul_ is told its workspace: the default limit; workspace_bytes=0 (the kernel
# without workspace); room for three rows, so an input of more rows runs in several chunks;
# one byte (less than a row); and the global limit, through the context manager and the setter.
WORKSPACE_MODES = ("default", "none", "three_rows", "one_byte", "context_three_rows", "global_none")


def matmul_op(mode):
    """square_matmul_ with the workspace chosen as `mode` says, same signature otherwise."""

    def op(x, weight, bias=None, *, transpose=False):
        three_rows = 3 * x.shape[-1] * x.element_size()
        if mode == "default":
            return mti.square_matmul_(x, weight, bias, transpose=transpose)
        if mode in ("none", "three_rows", "one_byte"):
            nbytes = {"none": 0, "three_rows": three_rows, "one_byte": 1}[mode]
            return mti.square_matmul_(x, weight, bias, transpose=transpose, workspace_bytes=nbytes)
        if mode == "context_three_rows":
            with mti.workspace_limit(three_rows):
                return mti.square_matmul_(x, weight, bias, transpose=transpose)
        if mode == "global_none":
            previous = mti.get_workspace_limit()
            mti.set_workspace_limit(0)
            try:
                return mti.square_matmul_(x, weight, bias, transpose=transpose)
            finally:
                mti.set_workspace_limit(previous)
        raise ValueError(mode)

    op.__name__ = f"square_matmul_[{mode}]"
    return op


def check_matmul(
    device, dtype, lead, k, seed, *, transpose, with_bias, mode="default", layout="contiguous"
):
    x = with_layout(randn(lead + (k,), dtype, device, seed), layout)
    # Scaled so that outputs stay O(1) whatever K.
    weight = randn((k, k), dtype, device, seed + 1, scale=max(k, 1) ** -0.5)
    bias = randn((k,), dtype, device, seed + 2) if with_bias else None
    check_op(matmul_op(mode), ref_square_matmul, x, weight, bias, transpose=transpose)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=examples(30))
@given(
    lead=lead_shapes(max_size=5),
    k=st.sampled_from([1, 3, 8, 13, 255, 1000]) | st.integers(1, 40),
    transpose=st.booleans(),
    with_bias=st.booleans(),
    mode=st.sampled_from(WORKSPACE_MODES),
    layout=st.sampled_from(ROW_STRIDED_LAYOUTS),
    seed=seeds,
)
# A 3-row workspace over 4 rows: chunks of cuBLAS's 1-row GEMMs are less accurate in fp32 than
# torch.matmul, so such workspaces must take the zero-workspace kernel.
@example(
    lead=(4,),
    k=1000,
    transpose=False,
    with_bias=False,
    mode="three_rows",
    layout="contiguous",
    seed=0,
)
def test_square_matmul(device, dtype, lead, k, transpose, with_bias, mode, layout, seed):
    check_matmul(
        device,
        dtype,
        lead,
        k,
        seed,
        transpose=transpose,
        with_bias=with_bias,
        mode=mode,
        layout=layout,
    )


@pytest.mark.parametrize("mode", ["default", "none", "three_rows"])
@pytest.mark.parametrize("k", [13, 255])
@pytest.mark.parametrize("m", [1, 7, 1000])
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
def test_rows_not_a_tile_multiple(device, dtype, m, k, mode):
    """M of no tile size, K not a multiple of 8, both layouts of W, chunked and not."""
    for transpose in (False, True):
        check_matmul(
            device,
            dtype,
            (m,),
            k,
            seed=m + k,
            transpose=transpose,
            with_bias=True,
            mode=mode,
            layout="row_padded",
        )


@pytest.mark.parametrize("mode", ["default", "none"])
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
def test_k_4097(device, dtype, mode):
    rows = 3 if device == "cpu" else 300
    for transpose in (False, True):
        check_matmul(
            device, dtype, (rows,), 4097, seed=30, transpose=transpose, with_bias=True, mode=mode
        )


# Shapes for sm_90's streaming zero-workspace kernels (row blocks of 64 or 128 rows shared by
# a cluster, 256-column tiles; the warpgroup MMA kernel in sm_90a builds, else mma.sync): M of
# no tile size, K a multiple of 8 but not of 64 or 256, so the last k step and column tile are
# part outside W; clusters of 2 to 16 blocks (K = 8192: 16 blocks of 2 tiles each on 132 SMs).
# K = 744 and 1784 (3 and 7 column tiles) split unevenly over the warpgroup kernel's clusters
# of 2 and 4 blocks: the last block has a tile fewer and takes the others' x tiles idle.
@requires_cuda
@pytest.mark.parametrize(
    "m,k",
    [
        (8209, 1000),
        (8209, 2568),
        (4100, 1032),
        (5000, 3080),
        (700, 8192),
        (8209, 744),
        (4100, 1784),
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_zero_workspace_cluster_shapes(dtype, m, k):
    for transpose in (False, True):
        for with_bias in (False, True):
            check_matmul(
                "cuda",
                dtype,
                (m,),
                k,
                seed=m + k,
                transpose=transpose,
                with_bias=with_bias,
                mode="none",
            )


# The few-rows kernel (CUDA, fp16/bf16 with tensor cores): with no workspace up to 64 rows
# and any K whose blocks all fit on the GPU at once; in the default mode up to 16 rows and
# K = 4096, for x @ W^T, and for x @ W up to 8 rows or K <= 1024. K a multiple of 16 (x @ W)
# or 32 (x @ W^T), rows in 16-byte chunks. Blocks of 16, 32 or 64 columns, by layout, rows
# and K, so K = 1040, 1056, 2080 or 8224 leaves the last block part outside W; rows in tiles
# of 8, 9 rows (17, 33) leaving a tile part (or, with two tiles, one wholly) empty; rows
# strided (every_other_row) or of two leading dims (lead_permuted). The others (65 rows,
# K = 1000, 48 with W^T; in the default mode K > 4096, x @ W of 9-16 rows past K = 1024 and
# every shape from 17 rows) run the other kernels, tested the same way.
@requires_cuda
@settings(max_examples=examples(80))
@given(
    lead=st.sampled_from(
        [(1,), (3,), (8,), (9,), (16,), (2, 8), (4, 3), (17,), (32,), (33,), (2, 32), (64,), (65,)]
    ),
    k=st.sampled_from([16, 32, 48, 1024, 1040, 1056, 2080, 4096, 4128, 1000, 8192, 8224]),
    transpose=st.booleans(),
    with_bias=st.booleans(),
    mode=st.sampled_from(["default", "none"]),
    layout=st.sampled_from(["contiguous", "every_other_row", "lead_permuted"]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    seed=seeds,
)
def test_few_rows_shapes(lead, k, transpose, with_bias, mode, layout, dtype, seed):
    check_matmul(
        "cuda",
        dtype,
        lead,
        k,
        seed,
        transpose=transpose,
        with_bias=with_bias,
        mode=mode,
        layout=layout,
    )


# x @ W of one tile of rows (up to 8) at K <= 2048, and of 17-64 rows at K <= 1024 (the
# zero-workspace mode), runs blocks of 16 columns (4-byte W loads): both sides of those
# bounds, in rows and in K.
@requires_cuda
@pytest.mark.parametrize(
    "rows,k",
    [
        (1, 16),
        (1, 2048),
        (1, 2064),
        (3, 1040),
        (8, 2048),
        (9, 1024),
        (16, 1024),
        (17, 1024),
        (33, 1008),
        (64, 1024),
        (64, 1040),
    ],
)
@pytest.mark.parametrize("mode", ["default", "none"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_few_rows_narrow_blocks(dtype, mode, rows, k):
    check_matmul(
        "cuda",
        dtype,
        (rows,),
        k,
        rows + k,
        transpose=False,
        with_bias=True,
        mode=mode,
        layout="every_other_row",
    )


def _captured_linear(static, weight, bias, prelude=lambda: None):
    """A CUDA graph of square_matmul_(static, weight, bias, transpose=True), called once on a
    side stream first (warm-up outside the graph); prelude runs in the capture just before."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mti.square_matmul_(static, weight, bias, transpose=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prelude()
        mti.square_matmul_(static, weight, bias, transpose=True)
    return graph


# The few-rows kernel's cooperative launch captured in a CUDA graph and replayed.
@requires_cuda
def test_few_rows_in_cuda_graph():
    m, k = 4, 1024
    weight = randn((k, k), torch.bfloat16, "cuda", seed=1, scale=k**-0.5)
    bias = randn((k,), torch.bfloat16, "cuda", seed=2)
    static = randn((m, k), torch.bfloat16, "cuda", seed=3)
    graph = _captured_linear(static, weight, bias)
    for seed in (4, 5):
        fresh = randn((m, k), torch.bfloat16, "cuda", seed=seed)
        ref64, ref = _handshake_refs(fresh, weight, bias)
        static.copy_(fresh)
        graph.replay()
        assert_accurate(static, ref, ref64, "the few-rows kernel replayed from a CUDA graph")


# Shapes for the default path's handshake kernel (sm_90a builds on sm_90, 16-bit, rows evenly
# spaced; CTAs write their tiles over x once every CTA of the same 128 rows has read them):
# M of no tile size; K a multiple of 8 but not of 64 or 256 (the last k step and column tile
# part outside W); row blocks of 1 (K = 8) to 33 (K = 8200) column tiles, of which a grid
# on 132 SMs (132 CTAs) holds 132 or 126 (K = 1784: 7 tiles). From K = 4096 the CTAs run in
# clusters of two that share W tiles and take two row blocks at a time: the grid is 132 CTAs
# at K = 8200 (2 x 33 clusters) and 102 at K = 4104 (3 x 17), and their odd counts of row
# blocks (17, 9) leave the last cluster's second CTA without rows; rows a pitch of 2K apart
# (every_other_row). Elsewhere these run the cuBLAS path, which they test as well.
@requires_cuda
@pytest.mark.parametrize(
    "m,k,layout",
    [
        (8209, 1032, "contiguous"),
        (4100, 2568, "contiguous"),
        (5000, 3080, "every_other_row"),
        (700, 8192, "contiguous"),
        (8209, 744, "contiguous"),
        (4100, 1784, "every_other_row"),
        (100003, 8, "contiguous"),
        (2050, 8200, "contiguous"),
        (1100, 4104, "every_other_row"),
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_default_handshake_shapes(dtype, m, k, layout):
    for transpose in (False, True):
        for with_bias in (False, True):
            check_matmul(
                "cuda",
                dtype,
                (m,),
                k,
                seed=m + k,
                transpose=transpose,
                with_bias=with_bias,
                layout=layout,
            )


def _handshake_refs(x, weight, bias):
    """The fp64 and PyTorch results of x @ W^T + b."""
    ref64 = ref_square_matmul(x.double(), weight.double(), bias.double(), transpose=True)
    return ref64, ref_square_matmul(x, weight, bias, transpose=True)


def _handshake_inputs(m, k, seed):
    """x, weight, bias of a handshake shape (bf16)."""
    x = randn((m, k), torch.bfloat16, "cuda", seed=seed)
    weight = randn((k, k), torch.bfloat16, "cuda", seed=seed + 1, scale=k**-0.5)
    bias = randn((k,), torch.bfloat16, "cuda", seed=seed + 2)
    return x, weight, bias


# The handshake kernel leaves its counters (an int per 128 rows) at 0 when it ends, and each
# stream keeps its own, zeroed only when they are allocated or grown. Counters left nonzero
# would let CTAs write their tiles over rows that others still read, so every result is
# checked: on one stream as M grows and shrinks (counters kept, grown, kept; from K = 4096 in
# clusters of two, whose last CTA has no rows at M = 4100), on two streams at once, and with
# no memory allocated by a repeated call. (Elsewhere these shapes run cuBLAS's path.)
@requires_cuda
def test_default_handshake_counters_kept_per_stream():
    k = 1032
    for m, k_ in (
        (8209, k),
        (4100, k),
        (20000, k),
        (8209, k),
        (20000, k),
        (4100, 2568),
        (4100, 2568),
        (4100, 4104),
        (4100, 4104),
    ):
        check_op(
            matmul_op("default"),
            ref_square_matmul,
            *_handshake_inputs(m, k_, m + k_),
            transpose=True,
        )

    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for round_ in range(2):  # the streams' counters allocated, then kept
        inputs = [_handshake_inputs(m, k, 10 * round_ + m) for m in (8209, 16500)]
        cases = [(*xwb, *_handshake_refs(*xwb)) for xwb in inputs]
        torch.cuda.synchronize()
        for stream, (x, weight, bias, _, _) in zip(streams, cases):
            with torch.cuda.stream(stream):
                mti.square_matmul_(x, weight, bias, transpose=True)
        torch.cuda.synchronize()
        for x, _, _, ref64, ref in cases:
            assert_accurate(x, ref, ref64, "square_matmul_ on two streams at once")

    x, weight, bias = _handshake_inputs(8209, k, 3)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    mti.square_matmul_(x, weight, bias, transpose=True)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() == before


# Captured into a CUDA graph, the call takes counters from the graph's pool and zeroes them in
# the graph: a block of that size freed in the capture just before, filled with 2^30 (at
# least any count the kernel waits for), may be the one it gets. Replays with eager calls on
# the same stream between them (the stream's kept counters) must all be right.
@requires_cuda
def test_default_handshake_in_cuda_graph():
    m, k = 8209, 1032
    x, weight, bias = _handshake_inputs(m, k, 7)
    static = x.clone()

    def junk():  # allocated and freed again in the capture
        torch.full((-(-m // 128),), 1 << 30, dtype=torch.int32, device="cuda")

    graph = _captured_linear(static, weight, bias, prelude=junk)
    for seed in (8, 9, 10):
        fresh = randn((m, k), torch.bfloat16, "cuda", seed=seed)
        ref64, ref = _handshake_refs(fresh, weight, bias)
        static.copy_(fresh)
        graph.replay()
        assert_accurate(static, ref, ref64, "square_matmul_ replayed from a CUDA graph")
        check_op(matmul_op("default"), ref_square_matmul, fresh, weight, bias, transpose=True)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear(device, dtype, with_bias):
    """linear_ is F.linear for a square (out, in) weight."""
    x = randn((2, 9, 24), dtype, device, seed=31)
    weight = randn((24, 24), dtype, device, seed=32, scale=24**-0.5)
    bias = randn((24,), dtype, device, seed=33) if with_bias else None
    check_op(mti.linear_, ref_linear, x, weight, bias)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0, 5), (2, 0, 5), (4, 0), (0,), (0, 0)], ids=str)
@pytest.mark.parametrize("mode", ["default", "none"])
def test_empty(device, shape, mode):
    """No rows, or K = 0 (x @ a 0x0 weight is the empty result itself)."""
    check_matmul(
        device,
        torch.float32,
        shape[:-1],
        shape[-1],
        seed=34,
        transpose=False,
        with_bias=True,
        mode=mode,
    )


def test_workspace_limit_api():
    default = mti.get_workspace_limit()
    assert default == mti.ops.DEFAULT_WORKSPACE_LIMIT == 64 << 20
    with mti.workspace_limit(123):
        assert mti.get_workspace_limit() == 123
        with mti.workspace_limit(0):
            assert mti.get_workspace_limit() == 0
        assert mti.get_workspace_limit() == 123
    assert mti.get_workspace_limit() == default
    with pytest.raises(KeyError), mti.workspace_limit(7):
        raise KeyError("the context manager restores the limit on the way out of an error")
    assert mti.get_workspace_limit() == default
    mti.set_workspace_limit(5)
    try:
        assert mti.get_workspace_limit() == 5
    finally:
        mti.set_workspace_limit(default)
    with pytest.raises(ValueError, match="workspace"):
        mti.set_workspace_limit(-1)
    assert mti.get_workspace_limit() == default


@pytest.mark.parametrize("device", DEVICES)
def test_every_workspace_mode(device):
    """Each workspace mode on one input of many rows; none leaves the global limit changed."""
    for mode in WORKSPACE_MODES:
        check_matmul(
            device,
            torch.float32,
            (50,),
            40,
            seed=35,
            transpose=True,
            with_bias=True,
            mode=mode,
            layout="row_padded",
        )
        assert mti.get_workspace_limit() == mti.ops.DEFAULT_WORKSPACE_LIMIT


# Room for two buffers of eight rows (the fewest that CUDA chunks with cuBLAS rather than
# taking the zero-workspace kernel): on CUDA the chunks alternate between them, each copied
# back on a side stream while the next GEMM runs; on the CPU, chunks of 16 rows in turn.
def two_buffers_of_eight_rows(x):
    """On CUDA rounded up to the caching allocator's 512 bytes, which square_matmul_ plans
    with (a chunk of the rounded size may hold a row more)."""
    nbytes = 2 * 8 * x.shape[-1] * x.element_size()
    return -(-nbytes // 512) * 512 if x.is_cuda else nbytes


@pytest.mark.parametrize("layout", ["contiguous", "row_padded", "every_other_row"])
@pytest.mark.parametrize("lead", [(37,), (3, 27)], ids=str)
@pytest.mark.parametrize("k", [13, 40])
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
def test_several_chunks(device, dtype, k, lead, layout):
    """Several chunks per block of rows, the last one shorter (37 = 8+8+8+8+5 rows on CUDA,
    16+16+5 on the CPU), across one or several strided blocks, with bias and both layouts of
    W."""
    for transpose in (False, True):
        x = with_layout(randn(lead + (k,), dtype, device, seed=40 + k), layout)
        weight = randn((k, k), dtype, device, seed=41, scale=k**-0.5)
        bias = randn((k,), dtype, device, seed=42)
        check_op(
            lambda x, *a, **kw: mti.square_matmul_(
                x, *a, **kw, workspace_bytes=two_buffers_of_eight_rows(x)
            ),
            ref_square_matmul,
            x,
            weight,
            bias,
            transpose=transpose,
        )


@pytest.mark.parametrize("device", DEVICES)
def test_chunks_of_many_rows(device):
    """Chunks of a few hundred rows, evened out and rounded to whole tiles (1000 rows with
    room for 2 x 300: four chunks of 256, 256, 256 and 232 rows on CUDA)."""
    x = randn((1000, 64), torch.float32, device, seed=43)
    weight = randn((64, 64), torch.float32, device, seed=44, scale=0.125)
    bias = randn((64,), torch.float32, device, seed=45)
    check_op(
        lambda x, *a, **kw: mti.square_matmul_(x, *a, **kw, workspace_bytes=2 * 300 * 64 * 4),
        ref_square_matmul,
        x,
        weight,
        bias,
        transpose=True,
    )


@requires_cuda
def test_side_stream_copies_land_before_the_caller_stream_goes_on():
    """The caller runs on a stream of its own, kept busy so the chunks' copies on the side
    stream start late; x read on the caller's stream right after the op must hold every chunk
    (the op makes its stream wait for the copies)."""
    k, rows = 256, 4096
    src = randn((rows, k), torch.float32, "cuda", seed=46)
    weight = randn((k, k), torch.float32, "cuda", seed=47, scale=k**-0.5)
    ref64 = ref_square_matmul(src.double(), weight.double())
    torch_out = ref_square_matmul(src, weight)
    x = torch.zeros_like(src)
    caller = torch.cuda.Stream()
    caller.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(caller):
        torch.cuda._sleep(50_000_000)
        x.copy_(src)
        mti.square_matmul_(x, weight, workspace_bytes=2 * 512 * k * 4)  # 8 chunks
        seen = x.clone()
    torch.cuda.current_stream().wait_stream(caller)
    assert_accurate(seen, torch_out, ref64, "square_matmul_ on a busy stream")


@requires_cuda
# The workspace of cuBLAS's chunks, in float32 where they are certain to run (on sm_90a, 16-bit
# inputs of enough rows take the handshake kernel, whose workspace is an int per 128 rows).
@pytest.mark.parametrize(
    "rows, k, workspace_bytes, dtype",
    [
        (64, 1024, None, torch.bfloat16),  # one chunk: the GEMM's output, x's size, is all
        (16384, 1024, None, torch.float32),  # pipelined through two buffers within 64 MiB
        (16384, 1024, 3 << 20, torch.float32),  # two buffers of 1 MiB (+ the allocator's slack)
        (4096, 2048, (1 << 20) + 5, torch.float32),  # an odd budget: two buffers of 64 rows each
        (6144, 2048, None, torch.float32),  # 1.5 of the default's chunks: two of 3072 rows
        (16384, 2048, None, torch.bfloat16),  # the handshake kernel on sm_90a: 512 bytes, kept
        (16384, 2048, 256, torch.bfloat16),
    ],  # too little for its counters: no workspace
    ids=str,
)
def test_peak_memory_within_the_workspace(rows, k, workspace_bytes, dtype):
    limit = mti.get_workspace_limit() if workspace_bytes is None else workspace_bytes
    x = randn((rows, k), dtype, "cuda", seed=48)
    weight = randn((k, k), dtype, "cuda", seed=49, scale=k**-0.5)
    bias = randn((k,), dtype, "cuda", seed=50)

    def op():
        mti.square_matmul_(x, weight, bias, transpose=True, workspace_bytes=workspace_bytes)

    op()  # cuBLAS allocates its own workspace once per stream, on first use: not ours
    torch.cuda.synchronize()
    # A cached free block just over the limit, fenced in by a live one: the allocator hands
    # out a block of more than 1 MiB whole when cutting it would leave <= 1 MiB, so a
    # workspace asked for at the limit would be counted as this whole block.
    hole = torch.empty(limit + (1 << 20) - 512, dtype=torch.uint8, device="cuda")
    fence = torch.empty(2 << 20, dtype=torch.uint8, device="cuda")
    del hole
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    op()
    torch.cuda.synchronize()
    # Never more than torch.matmul's output either.
    assert torch.cuda.max_memory_allocated() - before <= min(limit, x.numel() * x.element_size())
    assert torch.cuda.memory_allocated() == before
    del fence


@contextlib.contextmanager
def no_cuda_memory_to_spare():
    """Every further CUDA allocation of 512 bytes or more fails: the process may reserve no
    more than it holds, and what its segments have free is taken by filler tensors, each as
    large as still fits. The caching allocator serves up to 1 MiB from segments of its own,
    so the large ones' gaps are filled down to its smallest large block (1 MiB + 512 B)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(torch.cuda.memory_reserved() / total)
    sizes = [1 << p for p in range(30, 20, -1)] + [(1 << 20) + 512]
    sizes += [1 << p for p in range(20, 8, -1)]
    fillers = []
    try:
        for size in sizes:
            while True:
                try:
                    fillers.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
                except torch.OutOfMemoryError:
                    break
        yield
    finally:
        del fillers
        torch.cuda.set_per_process_memory_fraction(1.0)


@requires_cuda
# No workspace to be had: square_matmul_ runs what workspace_bytes=0 runs, with no memory of
# its own. 64 rows: the few-rows kernel, where the default mode would have cuBLAS write a new
# output; fp32 past 64 rows: the zero-workspace kernel.
@pytest.mark.parametrize(
    "rows, k, transpose, dtype",
    [
        (64, 8224, False, torch.bfloat16),
        (64, 4096, True, torch.float16),
        (4096, 1024, False, torch.float32),
    ],
    ids=str,
)
def test_workspace_out_of_memory_falls_back(rows, k, transpose, dtype):
    x = randn((rows, k), dtype, "cuda", seed=51)
    weight = randn((k, k), dtype, "cuda", seed=52, scale=k**-0.5)
    bias = randn((k,), dtype, "cuda", seed=53)

    def op(x, weight, bias, *, transpose):
        with no_cuda_memory_to_spare():
            ooms = torch.cuda.memory_stats()["num_ooms"]
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            mti.square_matmul_(x, weight, bias, transpose=transpose)
            torch.cuda.synchronize()
            assert torch.cuda.max_memory_allocated() == before
            assert torch.cuda.memory_stats()["num_ooms"] > ooms, "the workspace was allocated"
        return x

    check_op(op, ref_square_matmul, x, weight, bias, transpose=transpose)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nbytes", [0, 8 * 64 * 4, None])
def test_linear_takes_workspace_bytes(device, nbytes):
    """linear_ passes workspace_bytes on as square_matmul_ does (0: the kernels that need no
    memory; a few rows' worth: chunks), with F.linear's result either way."""
    x = randn((40, 64), torch.float32, device, seed=60)
    weight = randn((64, 64), torch.float32, device, seed=61, scale=0.125)
    bias = randn((64,), torch.float32, device, seed=62)
    check_op(
        lambda x, w, b: mti.linear_(x, w, b, workspace_bytes=nbytes), ref_linear, x, weight, bias
    )


def test_linear_refuses_a_negative_workspace():
    x = torch.randn(4, 8)
    before = x.clone()
    with pytest.raises(ValueError, match="workspace"):
        mti.linear_(x, torch.randn(8, 8), workspace_bytes=-1)
    assert torch.equal(x, before)
