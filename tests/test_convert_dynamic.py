"""convert() with dynamic shapes: one capture serves every sequence length and batch size
(Dynamo's specialisation of a size of 1 costs one more), masks computed from sizes alone are
classified for the sizes of each call, and generate() runs the converted forward."""

import copy
import importlib
import warnings

import pytest
import torch
from convert_helpers import HEADS, D, count_captures, sites_of
from helpers import assert_accurate, randn
from hypothesis import given, settings
from hypothesis import strategies as st
from test_convert import (
    MaskedAttention,
    _additive_causal,
    _causal,
    _keeps_all,
    _sliding_window,
)
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

import make_torch_inplace as mti


def _gpt2(attn, lm_head=False):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_layer=2, n_embd=D, n_head=HEADS, vocab_size=128, attn_implementation=attn
    )
    torch.manual_seed(0)
    cls = transformers.GPT2LMHeadModel if lm_head else transformers.GPT2Model
    return cls(config).eval()


def _ids(b, t, seed=0):
    return torch.randint(0, 128, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_gpt2_at_80_lengths_captures_twice(attn, monkeypatch):
    """Lengths 1 to 80 at batch sizes 2 and 3: length 1 (specialised by Dynamo) and one
    capture for all others. Without a padding mask, transformers builds a causal mask from
    the sizes under torch.compile, all-true at length 1: each call must take the path of its
    own sizes (eager: softmax_ with causal=True; SDPA: is_causal=True, or no mask)."""
    captures = count_captures(monkeypatch)
    model = _gpt2(attn)
    model64 = copy.deepcopy(model).double()
    converted = mti.convert(model)
    lengths = range(1, 81) if attn == "eager" else [1, 2, 3, 7, 16, 17, 40, 80]
    with torch.no_grad():
        for t in lengths:
            ids = _ids(2 + t % 2, t, seed=t)
            ref64 = model64(ids, use_cache=False).last_hidden_state
            expected = model(ids, use_cache=False).last_hidden_state
            ran = converted._backend.graph_calls
            out = converted(ids, use_cache=False).last_hidden_state
            assert converted._backend.graph_calls == ran + 1, t  # a converted graph ran
            assert_accurate(out, expected, ref64)
    assert len(captures) == 2
    ops = {s.op for s in sites_of(converted)}
    if attn == "eager":
        assert {"attention_in_pieces", "softmax_"} <= ops
        assert any(s.pattern.endswith("softmax (causal mask)") for s in sites_of(converted))
    else:  # length 1 keeps every element, the others exactly j <= i
        assert {
            "scaled_dot_product_attention",
            "scaled_dot_product_attention(is_causal=True)",
        } <= ops


def _additive_sliding_window(t, x):
    keep = _sliding_window(t, x)
    return torch.zeros(t, t, dtype=x.dtype).masked_fill(~keep, torch.finfo(x.dtype).min)


@pytest.mark.parametrize(
    "how, mask_fn",
    [
        ("sdpa", _sliding_window),
        ("add", _additive_sliding_window),
        ("where", _sliding_window),
        ("add", _sliding_window),  # a bool added to the scores (as 0 or 1) masks nothing
    ],
)
def test_a_mask_is_classified_for_each_calls_sizes(how, mask_fn, monkeypatch):
    """A sliding window of 3 built from sizes is exactly causal up to length 3 and neither
    causal nor all-true beyond: a rewrite made for one length must not serve the other. Every
    length runs the one capture, each with the mask path of its own class."""
    captures = count_captures(monkeypatch)
    torch.manual_seed(0)
    model = MaskedAttention(mask_fn, how).eval()
    model64 = copy.deepcopy(model).double()
    converted = mti.convert(model)

    @settings(max_examples=30, deadline=None)
    @given(b=st.integers(2, 3), t=st.integers(2, 12), seed=st.integers(0, 2**16))
    def check(b, t, seed):
        x = randn((b, t, D), torch.float32, "cpu", seed)
        with torch.no_grad():
            ref64 = model64(x.double())
            expected = model(x)
            assert_accurate(converted(x), expected, ref64)

    with torch.no_grad():  # both classes, whatever hypothesis draws
        for t in (3, 4):
            converted(randn((2, t, D), torch.float32, "cpu", 0))
    check()
    assert len(captures) <= 3  # static, then the length and the batch size symbolic
    causal = {
        "sdpa": "scaled_dot_product_attention(is_causal=True)",
        "add": "div -> add -> softmax (causal mask)",
        "where": "mul -> where -> softmax (causal mask)",
    }[how]
    sites = sites_of(converted)
    folded = causal in {s.op for s in sites} | {s.pattern for s in sites}
    assert folded == (mask_fn is not _sliding_window or how != "add")
    if how == "where":  # beyond length 3 the mask is applied over the dead scores
        assert "masked_fill_" in {s.op for s in sites_of(converted)}


def test_generate_runs_the_converted_forward(monkeypatch):
    """Greedy generate() through the converted module gives the model's tokens, and its
    forward calls (the prompt, then one per new token, with a KV cache) run converted graphs.
    The first capture has static sizes; the cache's length is hidden in an object, so the
    first token whose cache is longer than at the capture may run the original forward (with
    a warning) once, as it does with torch 2.13, and the capture made for the next serves
    every later length. A handful of captures serve every prompt length and token."""
    captures = count_captures(monkeypatch)
    model = _gpt2("eager", lm_head=True)
    converted = mti.convert(model)
    kwargs = dict(do_sample=False, pad_token_id=0)
    unconverted = 0
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for t, new in ((8, 12), (5, 20), (11, 3)):
            ids = _ids(1, t, seed=t)
            ran = converted._backend.graph_calls
            tokens = converted.generate(ids, max_new_tokens=new, **kwargs)
            unconverted += new - (converted._backend.graph_calls - ran)
            assert torch.equal(tokens, model.generate(ids, max_new_tokens=new, **kwargs))
    assert unconverted <= 1
    assert len(captures) <= 4
    assert converted.config is model.config


def test_masks_are_evaluated_once_per_sizes(monkeypatch):
    """A call with sizes seen before picks its rewrite with a dict lookup: the masks are
    evaluated (on the CPU) only for new sizes."""
    constants = importlib.import_module("make_torch_inplace.convert.constants")
    evaluated = []
    kind = constants._MaskQuery.kind

    def counting(self, sizes):
        evaluated.append(sizes)
        return kind(self, sizes)

    monkeypatch.setattr(constants._MaskQuery, "kind", counting)
    torch.manual_seed(0)
    model = MaskedAttention(_sliding_window, "sdpa").eval()
    converted = mti.convert(model)
    with torch.no_grad():  # the static capture, then the one with a symbolic length
        for t in (5, 6):
            converted(randn((2, t, D), torch.float32, "cpu", t))
    counts = []
    with torch.no_grad():
        for t in (7, 7, 8, 8, 7, 8):
            x = randn((2, t, D), torch.float32, "cpu", t)
            torch.testing.assert_close(converted(x), model(x))
            counts.append(len(evaluated))
    # for length 7, then for length 8 alone
    assert counts[0] == counts[1] < counts[2] == counts[3] == counts[4] == counts[5]


# A call Dynamo does not trace, as FSDP2's hooks around each sharded module: a graph break.
_opaque = torch._dynamo.disable(lambda t: t)


class SplitAttention(nn.Module):
    """Two attention layers (MaskedAttention, SDPA) reading one mask, each in a graph of its
    own: the mask is made, and each layer called, across a graph break."""

    def __init__(self, mask_fn):
        super().__init__()
        self.mask_fn = mask_fn
        self.layers = nn.ModuleList([MaskedAttention(None, "sdpa") for _ in range(2)])

    def forward(self, x):
        mask = _opaque(self.mask_fn(x.shape[1], x))
        x = x + self.layers[0].attend(x, mask)
        x = _opaque(x)
        return x + self.layers[1].attend(x, mask)


@pytest.mark.parametrize("mask_fn", [_causal, _additive_causal, _keeps_all, _sliding_window])
def test_a_mask_made_across_a_graph_break_is_checked_once_per_call(mask_fn, monkeypatch):
    """The layers' graphs read the mask as an input: what a bool mask keeps is read from its
    values, once per mask (not per layer), and SDPA runs with is_causal=True (or no mask)
    where it keeps exactly j <= i (or everything); a sliding window, causal only up to length
    3, is applied as it is beyond. Each length gets the path of its own mask. A float input
    is never read (it may be anything): an additive mask stays."""
    constants = importlib.import_module("make_torch_inplace.convert.constants")
    checked = []

    class Recording(WeakTensorKeyDictionary):
        def __setitem__(self, t, value):
            checked.append(t.shape)
            super().__setitem__(t, value)

    monkeypatch.setattr(constants, "_CHECKED", Recording())
    torch.manual_seed(0)
    model = SplitAttention(mask_fn).eval()
    model64 = copy.deepcopy(model).double()
    converted = mti.convert(model)
    with torch.no_grad():
        for t in (2, 3, 5, 8, 5):
            x = randn((2, t, D), torch.float32, "cpu", seed=t)
            ref64 = model64(x.double())
            expected = model(x)
            checked.clear()
            assert_accurate(converted(x), expected, ref64)
            # the call's one bool mask, checked once
            expected_checks = [] if mask_fn is _additive_causal else [(t, t)]
            assert [shape[-2:] for shape in checked] == expected_checks, (t, checked)
    ops = {s.op for s in sites_of(converted) if s.op.startswith("scaled")}
    if mask_fn is _keeps_all:
        assert ops == {"scaled_dot_product_attention"}
    elif mask_fn is _additive_causal:
        assert not ops
    else:  # a sliding window is causal at lengths 2 and 3
        assert ops == {"scaled_dot_product_attention(is_causal=True)"}
