"""What the convert() tests share: two hand-written transformer blocks, and the checks that a
converted call computes what the model computes (against an fp64 copy, PyTorch's own error as
the yardstick) and never writes its inputs or parameters."""

import copy
import importlib

import torch
import torch.nn.functional as F
from helpers import assert_accurate, randn
from torch import nn
from torch.utils import _pytree as pytree

import make_torch_inplace as mti

D, HEADS = 64, 4


def tiny_hf_config(kind: str, attn: str, layers: int = 2):
    """A transformers config of `layers` layers of width D: "gpt2", "bert" or "llama" (with
    HEADS // 2 key/value heads), vocabulary 128, attention `attn`, no dropout."""
    import transformers

    common = dict(vocab_size=128, attn_implementation=attn)
    if kind == "gpt2":
        return transformers.GPT2Config(
            n_layer=layers,
            n_embd=D,
            n_head=HEADS,
            resid_pdrop=0,
            embd_pdrop=0,
            attn_pdrop=0,
            **common,
        )
    if kind == "bert":
        return transformers.BertConfig(
            num_hidden_layers=layers,
            hidden_size=D,
            intermediate_size=4 * D,
            num_attention_heads=HEADS,
            hidden_dropout_prob=0,
            attention_probs_dropout_prob=0,
            **common,
        )
    return transformers.LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=D,
        intermediate_size=3 * D,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS // 2,
        **common,
    )


class PreNormBlock(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x)): x is read after each norm, so the norms
    must stay out of place; the attention scores and the projections are dead temporaries."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x, mask):
        b, t, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, D // HEADS)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        scores = (q @ k.transpose(-1, -2)) * (D // HEADS) ** -0.5 + mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        x = x + self.proj((probs @ v).transpose(1, 2).reshape(b, t, D))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class PostNormBlock(nn.Module):
    """norm(x + f(x)) with module and method forms: the norm's input is dead."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) / D**0.5)
        self.lin = nn.Linear(D, D)
        self.ln = nn.LayerNorm(D)
        self.rms = nn.RMSNorm(D)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x):
        h = self.ln(x + self.lin(x))
        h = self.rms(h @ self.w)
        h = torch.addmm(self.lin.bias, h.view(-1, D), self.w).view_as(x)
        return self.softmax(h).log_softmax(-1)


def make_block(cls, device, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return cls().to(device=device, dtype=dtype).eval()


def block_inputs(device, dtype=torch.float32, b=2, t=8):
    x = randn((b, t, D), dtype, device, seed=1)
    mask = randn((b, 1, t, t), dtype, device, seed=2)
    return x, mask


def check_call(converted, model, *inputs, mode=torch.no_grad):
    """One call of the converted module under `mode`, checked against the model and its fp64
    copy, run first (the converted call may overwrite its temporaries, never its inputs).
    Returns how many of the converted module's graphs the call ran."""
    as64 = [x.double() if x.is_floating_point() else x for x in inputs]
    with mode():
        ref64 = copy.deepcopy(model).double()(*as64)
        expected = model(*inputs)
        ran = converted._backend.graph_calls
        out = converted(*inputs)
    for o, e, r in zip(*map(pytree.tree_leaves, (out, expected, ref64)), strict=True):
        assert_accurate(o, e, r)
    return converted._backend.graph_calls - ran


def check_converted(model, *inputs, mode=torch.no_grad):
    """Converts the model and calls it twice under `mode` (capture, then the captured code),
    each call checked by check_call, the second running as many graphs as the first; checks
    that the inputs and parameters are untouched. Returns the converted module."""
    params = {k: v.clone() for k, v in model.state_dict().items()}
    before = [x.clone() for x in inputs]
    converted = mti.convert(model)
    captured_graphs = check_call(converted, model, *inputs, mode=mode)
    assert check_call(converted, model, *inputs, mode=mode) == captured_graphs, (
        "the second call's graphs"
    )
    for x, b in zip(inputs, before, strict=True):
        assert torch.equal(x, b), "an input was written"
    for k, v in model.state_dict().items():
        assert torch.equal(v, params[k]), f"parameter {k} was written"
    return converted


def sites_of(converted):
    """Every site, with the sites another took over (attention_in_pieces: its softmax_)."""
    return [part for s in converted.sites for part in (s, *s.parts)]


def ops_of(converted):
    """The in-place ops of every site (a site of several elementwise ops lists them all)."""
    return [op for s in sites_of(converted) for op in s.op.split(", ")]


def record_graphs(monkeypatch) -> list:
    """The graphs convert's backend rewrites from now on (for each capture, and for each
    class of sizes whose masks differ), each appended once rewritten."""
    rewrite_module = importlib.import_module("make_torch_inplace.convert.rewrite")
    graphs = []
    rewrite = rewrite_module._rewrite_graph

    def recording(gm, *args, **kwargs):
        sites = rewrite(gm, *args, **kwargs)
        graphs.append(gm.graph)
        return sites

    monkeypatch.setattr(rewrite_module, "_rewrite_graph", recording)
    return graphs


def count_captures(monkeypatch) -> list:
    """The graphs Dynamo hands convert's backends from now on: one per capture."""
    runtime = importlib.import_module("make_torch_inplace.convert.runtime")
    captured = []
    backend_call = runtime._Backend.__call__

    def counting(self, gm, example_inputs):
        captured.append(gm)
        return backend_call(self, gm, example_inputs)

    monkeypatch.setattr(runtime._Backend, "__call__", counting)
    return captured
