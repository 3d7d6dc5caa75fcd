"""convert(model, recompute=("mlp",)): a SwiGLU MLP saves its input alone and computes its
gate and up projections again in the backward; gradients are the model's, and autograd
saves two MLP-wide tensors fewer per layer."""

import pytest
import torch
import torch.nn.functional as F
from convert_helpers import D, ops_of
from helpers import randn
from test_convert_train import _llama, _saved_bytes, check_against_fp64, check_training

import make_torch_inplace as mti
from make_torch_inplace.convert import swiglu_recomputed

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
