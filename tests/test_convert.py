"""convert(): rewritten models compute what the originals compute (against an fp64 copy of
the model, PyTorch's own error as the yardstick), never write their inputs or parameters, and
rewrite exactly the sites where the overwritten tensor is dead."""

import contextlib
import copy
import importlib

import pytest
import torch
import torch.nn.functional as F
from convert_helpers import (
    HEADS,
    D,
    PostNormBlock,
    PreNormBlock,
    block_inputs,
    check_call,
    check_converted,
    count_captures,
    make_block,
    ops_of,
    record_graphs,
    sites_of,
)
from helpers import (
    DEVICES,
    assert_accurate,
    randn,
)
from torch import nn

import make_torch_inplace as mti

# --------------------------------------------------------------------------- hand-written blocks


@pytest.mark.parametrize("device", DEVICES)
def test_pre_norm_block(device):
    model = make_block(PreNormBlock, device)
    converted = check_converted(model, *block_inputs(device))
    ops = ops_of(converted)
    assert "layer_norm_" not in ops, "a pre-norm norm's input is read later"
    [softmax] = [s for s in sites_of(converted) if s.op == "softmax_"]
    assert softmax.pattern == "mul -> add -> softmax"  # scale and mask folded in
    assert ops.count("linear_") == 1  # proj; qkv, fc1 and fc2 are not square
    assert "gelu_" in ops and "add_" in ops


@pytest.mark.parametrize("device", DEVICES)
def test_pre_norm_block_bf16_folds_the_float32_softmax(device):
    """softmax(x, dtype=float32).to(x.dtype) becomes one softmax_ in x's dtype."""
    model = make_block(PreNormBlock, device, torch.bfloat16)
    converted = check_converted(model, *block_inputs(device, torch.bfloat16))
    [softmax] = [s for s in sites_of(converted) if s.op == "softmax_"]
    assert softmax.pattern == "mul -> add -> softmax -> to"
    assert softmax.dtype == torch.bfloat16 and softmax.nbytes == 2 * HEADS * 8 * 8 * 2


@pytest.mark.parametrize("device", DEVICES)
def test_post_norm_block(device):
    model = make_block(PostNormBlock, device)
    converted = check_converted(model, randn((2, 8, D), torch.float32, device, seed=1))
    ops = ops_of(converted)
    for op in ("layer_norm_", "rms_norm_", "square_matmul_", "softmax_", "log_softmax_"):
        assert op in ops, op
    assert ops.count("square_matmul_") == 2  # h @ w and addmm(bias, h, w)


def test_verbose_lists_sites(capsys):
    model = make_block(PreNormBlock, "cpu")
    converted = mti.convert(model, verbose=True)
    with torch.no_grad():
        converted(*block_inputs("cpu"))
    lines = [line for line in capsys.readouterr().out.splitlines() if "mti.convert" in line]
    head, *site_lines = converted.report().splitlines()
    assert lines == [head] and f"{len(converted.sites)} sites" in head
    assert len(site_lines) == len(converted.sites) > 0
    for line, site in zip(site_lines, converted.sites, strict=True):
        assert site.op in line and f"{site.nbytes / 2**20:.2f} MiB not allocated" in line
    assert any("matmul -> mul -> add -> softmax -> matmul" in line for line in site_lines)
    assert any(line.startswith("  proj") for line in site_lines)


def test_new_shapes_recompile_and_stay_correct():
    model = make_block(PreNormBlock, "cpu")
    converted = mti.convert(model)
    for b, t in ((2, 8), (1, 16), (3, 5)):
        x, mask = block_inputs("cpu", b=b, t=t)
        with torch.no_grad():
            expected = model(x, mask)
            ref64 = copy.deepcopy(model).double()(x.double(), mask.double())
            assert_accurate(converted(x, mask), expected, ref64)


def test_one_capture_serves_new_sizes(monkeypatch):
    """The first capture has static sizes; the next, made when the batch size and length
    change, has them symbolic and serves every later size but a batch of 1, which Dynamo
    specialises and captures once more. The graphs hold symbolic sizes.
    Writing probs @ v over the probabilities needs the head dim (16) <= the length: lengths
    on either side of it run rewrites of their own, of the same capture."""
    captures, graphs = count_captures(monkeypatch), record_graphs(monkeypatch)
    converted = mti.convert(make_block(PreNormBlock, "cpu"))
    with torch.no_grad():
        for b, t in ((2, 8), (3, 16), (2, 8), (4, 5), (1, 7), (1, 9)):
            for _ in range(2):
                converted(*block_inputs("cpu", b=b, t=t))
    assert len(captures) <= 3  # 3 with torch 2.13, 2 with torch 2.11
    assert len(graphs) >= len(captures) + 1  # lengths 16 and 5: two rewrites of one capture
    assert any(
        not isinstance(s, int)
        for graph in graphs
        for node in graph.nodes
        if isinstance(node.meta.get("example_value"), torch.Tensor)
        for s in node.meta["example_value"].shape
    )


def _counting_compiled_call(monkeypatch, converted) -> list:
    """Records each call that goes through the converted module's torch.compile'd call."""
    calls = []
    compiled = converted._compiled_call

    def counting(*args, **kwargs):
        calls.append(args)
        return compiled(*args, **kwargs)

    monkeypatch.setattr(converted, "_compiled_call", counting)
    return calls


def test_known_layouts_run_the_rewritten_graph_without_torch_compile(monkeypatch):
    model = make_block(PreNormBlock, "cpu")
    converted = mti.convert(model)
    calls = _counting_compiled_call(monkeypatch, converted)
    inputs = block_inputs("cpu")
    for _ in range(3):
        assert check_call(converted, model, *inputs) == 1  # the rewritten graph ran
    assert len(calls) == 1  # only the first call captured
    assert "softmax_" in ops_of(converted)


class ScaledBlock(PreNormBlock):
    """PreNormBlock whose output scale is a Python attribute: Dynamo guards on its value."""

    def __init__(self):
        super().__init__()
        self.out_scale = 1.0

    def forward(self, x, mask):
        return super().forward(x, mask) * self.out_scale


def test_guard_failure_on_known_layouts_is_computed_right_and_recaptured(monkeypatch):
    """A known input layout whose cached graph no longer fits (an attribute it was traced
    with changed): the call still computes the new value, and the later ones go through
    torch.compile, which captures anew."""
    model = make_block(ScaledBlock, "cpu")
    converted = mti.convert(model)
    calls = _counting_compiled_call(monkeypatch, converted)
    inputs = block_inputs("cpu")
    assert check_call(converted, model, *inputs) == 1
    model.out_scale = 2.0
    with pytest.warns(RuntimeWarning, match="ran unconverted.*guards rejected"):
        assert check_call(converted, model, *inputs) == 0  # Dynamo ran the original code
    assert len(calls) == 1
    for _ in range(2):
        assert check_call(converted, model, *inputs) == 1
    assert len(calls) == 3


def test_a_call_past_the_recompile_limit_warns(monkeypatch):
    """Past Dynamo's recompile limit the original forward runs: correct, and said."""
    runtime = importlib.import_module("make_torch_inplace.convert.runtime")
    monkeypatch.setitem(runtime._CAPTURE_CONFIG, "recompile_limit", 1)
    # Dynamo skips a code object for good once past its limit: start and end afresh.
    torch._dynamo.reset()
    try:
        model = make_block(PreNormBlock, "cpu")
        converted = mti.convert(model)
        assert check_call(converted, model, *block_inputs("cpu", t=8)) == 1
        with pytest.warns(RuntimeWarning, match="ran unconverted.*recompile limit"):
            # a batch of one: Dynamo specialises it, which needs a new capture
            assert check_call(converted, model, *block_inputs("cpu", b=1, t=8)) == 0
    finally:
        torch._dynamo.reset()


def test_grad_modes_and_inference_tensors_take_turns():
    """Calls that differ in what Dynamo guards on besides layouts (grad mode, inference
    tensors) are told apart before they run: each runs a rewritten graph."""
    model = make_block(PreNormBlock, "cpu").requires_grad_(False)
    converted = mti.convert(model)
    x, mask = block_inputs("cpu")
    with torch.inference_mode():
        inference_inputs = x.clone(), mask.clone()
    with torch.no_grad():
        expected = model(x, mask)
    cases = [
        (torch.no_grad, (x, mask)),
        (torch.enable_grad, (x, mask)),
        (torch.inference_mode, inference_inputs),
    ]
    for _ in range(2):
        for mode, inputs in cases:
            ran = converted._backend.graph_calls
            with mode():
                torch.testing.assert_close(converted(*inputs), expected)
            assert converted._backend.graph_calls - ran == 1, mode


def test_two_converted_modules_of_one_class_take_turns():
    """Dynamo keeps one cache per code object: each converted module's calls must compute its
    own model's outputs whichever module's graph the cache holds first."""
    models = [make_block(PreNormBlock, "cpu", seed=seed) for seed in (0, 1)]
    converted = [mti.convert(model) for model in models]
    inputs = block_inputs("cpu")
    ran = [0, 0]
    for _ in range(3):
        for i in (0, 1):
            ran[i] += check_call(converted[i], models[i], *inputs)
    assert all(ran), ran  # each module's own graphs ran for some of its calls


def test_input_signature_tells_layouts_apart():
    signature = importlib.import_module("make_torch_inplace.convert.runtime")._input_signature
    x = torch.randn(4, 6)

    def call(*args, **kwargs):
        return signature(torch.is_grad_enabled(), args, kwargs)

    base = call(x, [x, 2], scale=0.5)
    assert call(x.clone(), [torch.randn(4, 6), 2], scale=0.5) == base
    different = [
        call(x.t().contiguous().t(), [x, 2], scale=0.5),  # strides
        call(x.double(), [x, 2], scale=0.5),  # dtype
        call(x[:3], [x, 2], scale=0.5),  # shape
        call(x, [x, 3], scale=0.5),  # a scalar's value
        call(x, [x, 2, 2], scale=0.5),  # the structure of a list
        call(x, (x, 2), scale=0.5),  # a tuple for a list
        call(x, [x, 2], factor=0.5),  # a keyword
        call(x, [x, 2], 0.5),  # positional for keyword
        call(x.requires_grad_(), [x, 2], scale=0.5),  # requires grad
    ]
    x.requires_grad_(False)
    with torch.inference_mode():
        different.append(call(x.clone(), [x, 2], scale=0.5))  # an inference tensor
    with torch.no_grad():
        different.append(call(x, [x, 2], scale=0.5))  # grad mode
    assert base not in different
    assert len(set(different)) == len(different)


def test_inference_mode():
    model = make_block(PreNormBlock, "cpu")
    converted = check_converted(model, *block_inputs("cpu"), mode=torch.inference_mode)
    assert "softmax_" in ops_of(converted)


# --------------------------------------------------------------------------- constant masks


def _causal(t, x):
    i = torch.arange(t, device=x.device)
    return i[:, None] >= i[None, :]


def _causal_by_methods(t, x):  # comparisons as method calls, as Dynamo may record them
    i = torch.arange(t, device=x.device)
    same = i[:, None].__eq__(i[:, None])
    return i[:, None].__ge__(i[None, :]).__and__(same)


def _keeps_all(t, x):  # transformers' bidirectional mask under torch.compile
    return (torch.arange(t, device=x.device)[None, None, :, None] >= 0).expand(1, 1, t, t)


def _additive_causal(t, x):
    return _zeros(t, x).masked_fill(~_causal(t, x), torch.finfo(x.dtype).min)


def _zeros(t, x):
    return torch.zeros(t, t, dtype=x.dtype, device=x.device)


def _sliding_window(t, x):  # constant, but neither everything nor exactly causal
    i = torch.arange(t, device=x.device)
    return (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 3)


def _from_input(t, x):  # depends on the input's values: never read at capture time
    return (x[:, None, :, :1] > -1.0).expand(-1, 1, t, t)


class MaskedAttention(nn.Module):
    """Attention whose mask forward builds from sizes (or the input), applied as `how`:
    sdpa (attn_mask), add (additive, scores / sqrt(d)) or where (where(mask, scores, min))."""

    def __init__(self, mask_fn, how):
        super().__init__()
        self.mask_fn, self.how = mask_fn, how
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        return self.attend(x, self.mask_fn(x.shape[1], x))

    def attend(self, x, mask):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        if self.how == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            scores = q @ k.transpose(-1, -2)
            if self.how == "add":
                scores = scores / (D // HEADS) ** 0.5 + mask
            else:
                scores = torch.where(mask, scores * 0.25, torch.finfo(x.dtype).min)
            o = F.softmax(scores, dim=-1) @ v
        return self.proj(o.transpose(1, 2).reshape(b, t, D))


def _converted_masked(mask_fn, how, dtype=torch.float32):
    torch.manual_seed(0)
    model = MaskedAttention(mask_fn, how).to(dtype).eval()
    return check_converted(model, randn((2, 8, D), dtype, "cpu", seed=1))


@pytest.mark.parametrize(
    "mask_fn, op",
    [
        (_causal, "scaled_dot_product_attention(is_causal=True)"),
        (_causal_by_methods, "scaled_dot_product_attention(is_causal=True)"),
        (_keeps_all, "scaled_dot_product_attention"),
        (_additive_causal, "scaled_dot_product_attention(is_causal=True)"),
        (_zeros, "scaled_dot_product_attention"),
    ],
)
def test_sdpa_constant_mask_is_dropped(mask_fn, op):
    """A mask computed from sizes alone that keeps everything (or exactly j <= i) is what
    eager mode would not pass at all (or pass as is_causal): SDPA then keeps its fast path."""
    converted = _converted_masked(mask_fn, "sdpa")
    assert [s.op for s in converted.sites if s.op.startswith("scaled")] == [op]


@pytest.mark.parametrize("mask_fn", [_sliding_window, _from_input])
def test_sdpa_other_masks_are_kept(mask_fn):
    converted = _converted_masked(mask_fn, "sdpa")
    assert not [s for s in converted.sites if s.op.startswith("scaled")]


@pytest.mark.parametrize(
    "mask_fn, how, pattern",
    [
        (_additive_causal, "add", "div -> add -> softmax (causal mask)"),
        (_zeros, "add", "div -> add -> softmax"),
        (_causal, "where", "mul -> where -> softmax (causal mask)"),
        (_keeps_all, "where", "mul -> where -> softmax"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_folds_constant_mask(mask_fn, how, pattern, dtype):
    """The scale (a multiplication or a division) and a constant mask fold into softmax_,
    the mask as causal=True or not at all: no mask tensor is built."""
    converted = _converted_masked(mask_fn, how, dtype)
    assert [s.pattern for s in sites_of(converted) if s.op == "softmax_"] == [pattern]


def test_softmax_keeps_other_additive_masks():
    converted = _converted_masked(lambda t, x: _additive_causal(t, x).tril(-3), "add")
    assert [s.pattern for s in sites_of(converted) if s.op == "softmax_"] == [
        "div -> add -> softmax"
    ]


@pytest.mark.parametrize("mask_fn", [_sliding_window, _from_input])
def test_where_on_dead_scores_runs_in_place(mask_fn):
    """torch.where(keep, scores, min) with a mask softmax_ cannot take (its all-masked rows
    differ) becomes masked_fill_ over the dead scores, then softmax_ over them."""
    converted = _converted_masked(mask_fn, "where")
    assert "masked_fill_" in ops_of(converted) and "softmax_" in ops_of(converted)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("limit", [None, 0])
def test_pre_norm_block_attention_in_pieces(device, limit):
    """The scores, softmax_ and probs @ v become attention_in_pieces: with the workspace limit
    0, one head's scores at a time; with the default limit, all at once, and (seq >= head dim)
    the product over the dead scores, as the merge of the heads (reshape) is the first
    allocation after it and reads it last."""
    model = make_block(PreNormBlock, device)
    with contextlib.nullcontext() if limit is None else mti.workspace_limit(limit):
        converted = check_converted(model, *block_inputs(device, t=32))
    [site] = [s for s in converted.sites if s.op == "attention_in_pieces"]
    assert site.shape == (2, HEADS, 32, 32)
    assert site.pattern == (
        "matmul -> mul -> add -> softmax -> matmul (over the scores when in one piece)"
    )
    assert "matmul_over_left" not in ops_of(converted)


# --------------------------------------------------------------------------- where not to


class Probe(nn.Module):
    """A tiny model around one pattern, given as a function of (module, x)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.lin = nn.Linear(D, D)
        self.w = nn.Parameter(torch.randn(D, D))
        self.register_buffer("buf", torch.randn(D))

    def forward(self, x):
        return self.fn(self, x)


def _view_read_later(m, x):
    h = m.lin(x)
    first = h[..., :1]
    return torch.softmax(h, -1) * first


def _returned(m, x):
    h = m.lin(x)
    return torch.softmax(h, -1), h


def _written_between_scale_and_softmax(m, x):
    h = m.lin(x)
    t = h * 0.5
    h.add_(1.0)
    return torch.softmax(t, -1)


def _broadcast_target(m, x):
    small = m.lin(x).mean(1, keepdim=True)
    return small + x


def _promoting(m, x):
    return m.lin(x).to(torch.bfloat16) + x


def _expanded(m, x):
    return m.lin(x)[:, :1].expand_as(x) * 2.0


def _chunk_sibling(m, x):
    p, q = m.lin(x).chunk(2, -1)  # views of one tensor: q is read after softmax(p)
    return torch.softmax(p, -1) * q


def _where_target_read_later(m, x):
    h = m.lin(x)
    return torch.where(x > 0, h, -1.0) + h


def _across_graph_break(m, x):
    h = m.lin(x)
    torch._dynamo.graph_break()  # h is an input of the second graph
    return torch.softmax(h, -1)


def _probs(m, x):
    """Dead (2, 8, 8) probabilities, and an (8, 8)-wide strided value to multiply them by."""
    return torch.softmax(x @ x.transpose(-1, -2), -1), x[..., :8]


def _product_returned(m, x):
    p, v = _probs(m, x)
    return p @ v


def _probs_read_after_product(m, x):
    p, v = _probs(m, x)
    return (p @ v) + p


def _allocation_before_product_read(m, x):
    p, v = _probs(m, x)
    o = p @ v
    y = m.lin(x)  # would be allocated while o still holds p's memory
    return y[..., :8] * o


def _product_read_by_a_tuple_op(m, x):
    p, v = _probs(m, x)
    top, _ = (p @ v).max(-1)  # the last reader makes two new tensors
    return top


def _eval_dropout_read_later(m, x):
    p = torch.softmax(m.lin(x), -1)
    d = F.dropout(p, 0.1, training=False)  # p itself, though Dynamo's example value is a copy
    return d * 2.0 + p


def _attention_inputs(m, x):
    """A dead (2, 8, 4) q, a (2, 4, 8) k_t and a (2, 8, 8) v, none of which is x itself (q
    a view, so that q @ k_t does not go over q's memory instead)."""
    v = m.lin(x)[..., :8]
    return m.lin(x)[..., :4], x[..., :4].transpose(-1, -2), v


def _probs_returned(m, x):
    q, k_t, v = _attention_inputs(m, x)
    p = torch.softmax(q @ k_t, -1)
    return p @ v, p


def _q_written_before_product(m, x):
    q, k_t, v = _attention_inputs(m, x)
    p = torch.softmax(q @ k_t, -1)
    q.mul_(2.0)  # the scores were computed from q before this
    return p @ v, q


NOT_REWRITTEN = {
    "input": (lambda m, x: torch.softmax(x, -1), "softmax_"),
    "parameter": (lambda m, x: torch.softmax(m.w, -1) @ x.transpose(-1, -2), "softmax_"),
    "buffer": (lambda m, x: torch.softmax(m.buf, -1) * x, "softmax_"),
    "view_read_later": (_view_read_later, "softmax_"),
    "returned": (_returned, "softmax_"),
    "chunk_sibling": (_chunk_sibling, "softmax_"),
    "across_graph_break": (_across_graph_break, "softmax_"),
    "broadcast_target": (_broadcast_target, "add_"),
    "where_target_read_later": (_where_target_read_later, "masked_fill_"),
    "where_into_input": (lambda m, x: torch.where(m.lin(x) > 0, x, 0.0), "masked_fill_"),
    "promoting": (_promoting, "add_"),
    "expanded": (_expanded, "mul_"),
    "non_square": (lambda m, x: F.linear(m.lin(x), m.w[: D // 2]), "linear_"),
    "product_returned": (_product_returned, "matmul_over_left"),
    "probs_read_after_product": (_probs_read_after_product, "matmul_over_left"),
    "allocation_before_product_read": (_allocation_before_product_read, "matmul_over_left"),
    "product_read_by_a_tuple_op": (_product_read_by_a_tuple_op, "matmul_over_left"),
    "eval_dropout_read_later": (_eval_dropout_read_later, "mul_"),
    "probs_returned": (_probs_returned, "attention_in_pieces"),
    "q_written_before_product": (_q_written_before_product, "attention_in_pieces"),
}


@pytest.mark.parametrize("case", list(NOT_REWRITTEN))
def test_not_rewritten_where_unsafe(case):
    fn, op = NOT_REWRITTEN[case]
    torch.manual_seed(0)
    converted = check_converted(Probe(fn).eval(), randn((2, 8, D), torch.float32, "cpu", 1))
    assert op not in ops_of(converted)


def test_probs_at_v_over_the_probs_where_safe():
    """The probes above without their hazard: the product is copied (allocation and last
    read at once) and then dies."""

    def merged(m, x):
        p, v = _probs(m, x)
        return (p @ v).transpose(-1, -2).contiguous()

    torch.manual_seed(0)
    converted = check_converted(Probe(merged).eval(), randn((2, 8, D), torch.float32, "cpu", 1))
    assert "matmul_over_left" in ops_of(converted)


def test_attention_in_pieces_where_safe():
    """The attention probes above without their hazard."""

    def attention(m, x):
        q, k_t, v = _attention_inputs(m, x)
        return torch.softmax(q @ k_t, -1) @ v

    # One head of scores at a time, at a length where they outweigh the rest: the pieces
    # lower the graph's peak (in one piece, the product and q would be held with all the
    # scores, and the graph would run as captured).
    torch.manual_seed(0)
    with mti.workspace_limit(0):
        converted = check_converted(
            Probe(attention).eval(), randn((2, 64, D), torch.float32, "cpu", 1)
        )
    assert "attention_in_pieces" in ops_of(converted)


def test_write_between_scale_and_softmax_is_not_folded():
    torch.manual_seed(0)
    model = Probe(_written_between_scale_and_softmax).eval()
    converted = check_converted(model, randn((2, 8, D), torch.float32, "cpu", seed=1))
    assert [s.pattern for s in sites_of(converted) if s.op == "softmax_"] == ["softmax"]


def _converted_with_our_ops():
    torch.manual_seed(0)
    model = Probe(lambda m, x: torch.softmax(m.square(m.lin(x)), -1))
    model.square = mti.nn.InplaceLinear(D, D, always_inplace=True)
    model.eval().requires_grad_(False)
    return check_converted(model, randn((2, 8, D), torch.float32, "cpu", seed=1))


def test_model_with_inplace_modules():
    """Our own ops in the captured graph (they return nothing and mutate x) are analysed as
    reads of x: the softmax after an InplaceLinear still runs in place, correctly."""
    assert "softmax_" in ops_of(_converted_with_our_ops())


# --------------------------------------------------------------------------- autograd


def test_runs_with_grad_mode_on_when_nothing_requires_grad():
    model = make_block(PreNormBlock, "cpu").requires_grad_(False)
    converted = check_converted(model, *block_inputs("cpu"), mode=torch.enable_grad)
    assert "softmax_" in ops_of(converted)


def test_training_mode_under_no_grad():
    model = make_block(PreNormBlock, "cpu").train()
    converted = check_converted(model, *block_inputs("cpu"))
    assert "softmax_" in ops_of(converted)


def test_rejects_non_modules():
    with pytest.raises(TypeError, match=r"nn\.Module"):
        mti.convert(lambda x: x)


class TaggedBlock(PreNormBlock):
    def describe(self):
        return f"{self.tag}: {type(self).__name__}"


def test_forwards_the_models_attributes():
    """Attributes that are not parameters, buffers or submodules are the model's: a plain
    attribute, a method of the model's own class, and a missing one raising as on the model."""
    model = make_block(TaggedBlock, "cpu")
    model.tag = "block"
    converted = mti.convert(model)
    assert converted.tag == "block"
    assert converted.describe() == "block: TaggedBlock"
    with pytest.raises(AttributeError, match="no_such_attribute"):
        converted.no_such_attribute  # noqa: B018


class ItemAssignment(nn.Module):
    """x[..., 1:] = ... (T5 shifting its labels right): the graph is analysed, the write being
    a read of the assigned tensor at its place."""

    def forward(self, x):
        y = x.clone()
        y[..., 1:] = x[..., :-1]
        z = torch.softmax(y * 2.0, dim=-1)
        return z + x


def test_item_assignment_leaves_the_graph_analysable():
    x = randn((2, 8, D), torch.float32, "cpu", seed=1)
    converted = check_converted(ItemAssignment(), x)
    assert "softmax_" in ops_of(converted)
