"""convert() and the rotary position embedding: Hugging Face's written-out form becomes one
op (fuse.py), rope_ over a dead query or key, and the converted call computes what the model
computes, in inference and training."""

import collections

import pytest
import torch
from convert_helpers import check_converted, ops_of, tiny_hf_config
from helpers import randn
from test_convert_train import _masked_sum, check_training
from torch import nn

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

HEADS, T, HD = 4, 12, 16


class Rotary(nn.Module):
    """q and k projected, rotated as Llama does; `read_q` also returns the unrotated q (then
    it lives on), `learned` makes cos a parameter (then autograd differentiates it)."""

    def __init__(self, read_q=False, learned=False):
        super().__init__()
        self.q, self.k = nn.Linear(HEADS * HD, HEADS * HD), nn.Linear(HEADS * HD, HEADS * HD)
        angles = torch.arange(T)[:, None] * torch.rand(
            HD // 2, generator=torch.Generator().manual_seed(5)
        )
        angles = torch.cat((angles, angles), -1)[None]
        self.register_buffer("sin", angles.sin())
        if learned:
            self.cos = nn.Parameter(angles.cos())
        else:
            self.register_buffer("cos", angles.cos())
        self.read_q = read_q

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, HEADS, HD).transpose(1, 2)  # a strided view, as in Llama
        k = self.k(x).view(b, t, HEADS, HD).transpose(1, 2)
        q_embed, k_embed = apply_rotary_pos_emb(q, k, self.cos[:, :t], self.sin[:, :t])
        out = q_embed * 2 + k_embed
        return (out, q) if self.read_q else out


def _model(**kwargs):
    torch.manual_seed(0)
    return Rotary(**kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_runs_in_place(dtype):
    model = _model().to(dtype)
    x = randn((2, T, HEADS * HD), dtype, "cpu", seed=1)
    converted = check_converted(model, x)
    assert ops_of(converted).count("rope_") == 2


def test_rotary_of_a_tensor_read_later_is_one_op_out_of_place():
    model = _model(read_q=True)
    x = randn((2, T, HEADS * HD), torch.float32, "cpu", seed=1)
    converted = check_converted(model, x)
    assert ops_of(converted).count("rope_") == 1  # k's; q is read after


def test_learned_cos_is_left_as_written():
    model = _model(learned=True)
    x = randn((2, T, HEADS * HD), torch.float32, "cpu", seed=1)
    converted = check_training(model, (x,), _masked_sum)
    assert "rope_" not in ops_of(converted)


def _autograd_nodes(t: torch.Tensor) -> collections.Counter:
    """How many nodes of each class t's autograd graph has."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and fn not in seen:
            seen.add(fn)
            todo += [next_fn for next_fn, _ in fn.next_functions]
    return collections.Counter(type(fn).__name__ for fn in seen)


@pytest.mark.parametrize("frozen_k", [False, True])
def test_rotary_trains(frozen_k):
    """The rotations, written over views of the q and k projections, are recorded on the
    projections, not through CopySlices (whose backward would copy a projection's whole
    gradient and replay the views through as_strided); the projections' outputs with a bias
    are themselves views of the 2-D products. With k's projection frozen and x needing no
    gradient, k needs none: its rope_ is not recorded at all."""
    model = _model()
    model.k.requires_grad_(not frozen_k)
    x = randn((2, T, HEADS * HD), torch.float32, "cpu", seed=1).requires_grad_(not frozen_k)
    converted = check_training(model, (x,), _masked_sum)
    assert ops_of(converted).count("rope_") == 2
    nodes = _autograd_nodes(_masked_sum(converted(x)))
    assert nodes["_RopeThroughViewsBackward"] == (1 if frozen_k else 2)
    # The one in-place op on a view left is the elementwise q_embed * 2 (then + k_embed).
    assert nodes["CopySlices"] <= 2


@pytest.mark.parametrize("grad", [False, True])
def test_llama_rotates_in_place(grad):
    config = tiny_hf_config("llama", "sdpa", layers=2)
    torch.manual_seed(0)
    model = transformers.LlamaModel(config).train(grad)
    model.config.use_cache = False
    ids = torch.randint(0, 128, (2, T), generator=torch.Generator().manual_seed(3))
    if grad:
        converted = check_training(model, (ids,), lambda out: _masked_sum(out.last_hidden_state))
    else:
        converted = check_converted(model, ids)  # the last hidden state
    assert ops_of(converted).count("rope_") == 2 * 2  # q and k in each layer
