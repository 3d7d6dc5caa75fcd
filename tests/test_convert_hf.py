"""convert() on Hugging Face transformers models built from small configs: the converted
models compute what the originals compute, rewrite the sites expected of each family, and keep
the model's attributes (config, generate)."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from convert_helpers import (
    HEADS,
    D,
    check_converted,
    ops_of,
    record_graphs,
    sites_of,
    tiny_hf_config,
)
from helpers import DEVICES
from torch import nn

import make_torch_inplace as mti

# --------------------------------------------------------------------------- transformers


def test_generate_and_config_of_a_converted_causal_lm():
    """A converted Hugging Face model keeps the model's config and generate(), which gives
    the model's tokens."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_layer=2, n_embd=D, n_head=HEADS, vocab_size=128, attn_implementation="eager"
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    converted = mti.convert(model)
    assert converted.config is model.config
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(converted.generate(ids, **kwargs), model.generate(ids, **kwargs))


def _hf_model(kind, attn):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = tiny_hf_config(kind, attn)
    cls = {"gpt2": "GPT2Model", "bert": "BertModel", "llama": "LlamaModel"}[kind]
    torch.manual_seed(0)
    return getattr(transformers, cls)(config).eval(), config


class _LastHiddenState(nn.Module):
    """A transformers model seen as a function of (input_ids, attention_mask) -> tensor."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("limit", [None, 0])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", ["gpt2", "bert", "llama"])
def test_transformers(kind, attn, limit, device):
    """With the workspace limit 0, eager attention runs one head's scores at a time."""
    model, config = _hf_model(kind, attn)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, 19:] = 0  # padding: the eager attention adds a mask
    with contextlib.nullcontext() if limit is None else mti.workspace_limit(limit):
        converted = check_converted(
            _LastHiddenState(model).to(device), ids.to(device), mask.to(device)
        )
    sites = sites_of(converted)
    layers = config.num_hidden_layers
    softmaxes = [s for s in sites if s.op == "softmax_"]
    assert len(softmaxes) == (layers if attn == "eager" else 0)
    assert all(s.pattern.startswith("mul -> add -> softmax") for s in softmaxes)
    norms = [s for s in sites if s.op == "layer_norm_"]
    if kind == "gpt2":  # pre-norm: only the final norm's input is dead
        assert [s.where.split()[0] for s in norms] == ["model.ln_f"]
    if kind == "bert":  # post-norm: the embeddings' norm and two per layer
        assert len(norms) == 1 + 2 * layers
    assert len([s for s in sites if s.op in ("linear_", "square_matmul_")]) == layers
    pieces = [s for s in sites if s.op == "attention_in_pieces"]
    assert len(pieces) == (layers if attn == "eager" else 0)
    assert "matmul_over_left" not in ops_of(converted)


class _InputIdsOnly(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).last_hidden_state


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", ["gpt2", "bert", "llama"])
def test_transformers_without_padding_mask(kind, attn, monkeypatch):
    """Without attention_mask, eager mode passes SDPA no mask (or is_causal) and eager
    attention at most a causal one; under torch.compile transformers may build the mask from
    sizes anyway. No mask tensor reaches SDPA or softmax_ in the converted graphs."""
    graphs = record_graphs(monkeypatch)
    model, _ = _hf_model(kind, attn)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    check_converted(_InputIdsOnly(model), ids)
    nodes = [n for g in graphs for n in g.nodes]
    assert not [
        n
        for n in nodes
        if n.target is F.scaled_dot_product_attention and n.kwargs.get("attn_mask") is not None
    ]
    assert not [n for n in nodes if n.target is mti.softmax_ and "mask" in n.kwargs]
