"""convert(model, recompute=("mlp",)): an MLP saves its input alone and computes its inner
projections again in the backward (SwiGLU: gate and up; GELU: the first); gradients are the
model's, and autograd saves two (one) MLP-wide tensors fewer per layer."""

import pytest
import torch
import torch.nn.functional as F
from convert_helpers import D, ops_of, tiny_hf_config
from helpers import randn
from test_convert_train import (
    _llama,
    _masked_sum,
    _saved_bytes,
    check_against_fp64,
    check_training,
)

import make_torch_inplace as mti
from make_torch_inplace.convert import gelu_mlp_recomputed, swiglu_recomputed

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def _swiglu(x, wg, wu, wd, bg, bu, bd):
    return F.linear(F.silu(F.linear(x, wg, bg)) * F.linear(x, wu, bu), wd, bd)


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_recomputed(dtype, bias, frozen):
    """Value and gradients against fp64, PyTorch's composition as the yardstick; frozen: the
    weights take no gradient (a LoRA base)."""
    inter = 3 * D
    shapes = [(inter, D), (inter, D), (D, inter)]
    x = randn((2, 5, D), dtype, "cpu", seed=0).requires_grad_()
    weights = [randn(s, dtype, "cpu", seed=i + 1) / 4 for i, s in enumerate(shapes)]
    biases = [
        randn((s[0],), dtype, "cpu", seed=i + 4) if bias else None for i, s in enumerate(shapes)
    ]
    args = [x, *weights, *biases]
    if not frozen:
        for t in args[1:]:
            if t is not None:
                t.requires_grad_()
    check_against_fp64(swiglu_recomputed, _swiglu, args, dtype)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_mlp_recomputed(dtype, bias, frozen, approximate):
    inter = 4 * D
    x = randn((2, 5, D), dtype, "cpu", seed=0).requires_grad_()
    weights = [randn((inter, D), dtype, "cpu", seed=1) / 4, randn((D, inter), dtype, "cpu", seed=2)]
    biases = [
        randn((n,), dtype, "cpu", seed=3 + i) if bias else None for i, n in enumerate((inter, D))
    ]
    args = [x, *weights, *biases]
    if not frozen:
        for t in args[1:]:
            if t is not None:
                t.requires_grad_()

    def reference(x, w1, w2, b1, b2):
        return F.linear(F.gelu(F.linear(x, w1, b1), approximate=approximate), w2, b2)

    def ours(*args):
        return gelu_mlp_recomputed(*args, approximate=approximate)

    check_against_fp64(ours, reference, args, dtype)


def _gelu_model(kind):
    """A BERT (nn.Linear MLP) or a GPT-2 (Conv1D MLP: addmm over views)."""
    torch.manual_seed(0)
    cls = transformers.BertModel if kind == "bert" else transformers.GPT2Model
    return cls(tiny_hf_config(kind, "sdpa")).train()


def _hidden_loss(out):
    return _masked_sum(out.last_hidden_state)


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_gelu_mlp_recomputed_trains(kind):
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    converted = check_training(_gelu_model(kind), (ids,), _hidden_loss, {"recompute": ("mlp",)})
    assert ops_of(converted).count("gelu_mlp_recomputed (recomputes h)") == 2


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_gelu_mlp_recomputed_saves_less(kind):
    model = _gelu_model(kind)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def saved(converted):
        """Bytes of the distinct storages autograd saves, parameters aside (the recomputing
        piece saves the first projection's bias, which the products before did not)."""
        storages = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _hidden_loss(converted(ids))
        return sum(storages.values())

    kept = saved(mti.convert(model))
    recomputed = saved(mti.convert(model, recompute=("mlp",)))
    rows, layers, inter = 2 * 12, 2, 4 * D  # both models' MLPs are 4 x D wide
    assert recomputed <= kept - layers * rows * inter * 4  # h, float32


@pytest.mark.parametrize("frozen", [False, True])
def test_llama_mlp_recomputed_trains(frozen):
    model = _llama(torch.float32)
    if frozen:  # a LoRA-like base: only the embedding trains
        model.requires_grad_(False)
        model.model.embed_tokens.weight.requires_grad_(True)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    converted = check_training(
        model, (ids,), lambda out: out.loss, {"recompute": ("mlp",)}, labels=ids
    )
    assert ops_of(converted).count("swiglu_recomputed (recomputes g and u)") == 2


def test_llama_mlp_recomputed_saves_less():
    model = _llama(torch.float32)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))

    def loss_of(out):
        return out.loss

    kept = _saved_bytes(mti.convert(model), ids, loss_of)
    recomputed = _saved_bytes(mti.convert(model, recompute=("mlp",)), ids, loss_of)
    rows, layers, inter = 2 * 12, 2, model.config.intermediate_size
    assert recomputed <= kept - layers * rows * 2 * inter * 4  # g and u, float32


def test_recompute_takes_known_names():
    model = _llama(torch.float32)
    with pytest.raises(TypeError, match="sequence of names"):
        mti.convert(model, recompute="mlp")
    with pytest.raises(ValueError, match="recompute takes names"):
        mti.convert(model, recompute=("attention",))
