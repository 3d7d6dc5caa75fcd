"""The in-place modules against their torch counterparts: same constructor, initialisation and
state_dict; from_<module> shares parameters; forward overwrites its input and is as accurate
as the torch module (fp64 reference computed first)."""

import copy

import pytest
import torch
from helpers import DEVICES, DTYPE_PARAMS, assert_accurate, randn
from torch import nn

from make_torch_inplace.nn import InplaceLayerNorm, InplaceLinear, InplaceRMSNorm, InplaceSoftmax

D = 64
# name -> (torch module, in-place module, from_* constructor, constructor arguments)
CASES = {
    "linear": (nn.Linear, InplaceLinear, "from_linear", dict(in_features=D, out_features=D)),
    "linear_no_bias": (
        nn.Linear,
        InplaceLinear,
        "from_linear",
        dict(in_features=D, out_features=D, bias=False),
    ),
    "softmax": (nn.Softmax, InplaceSoftmax, "from_softmax", dict(dim=-1)),
    "softmax_dim1": (nn.Softmax, InplaceSoftmax, "from_softmax", dict(dim=1)),
    "layer_norm": (nn.LayerNorm, InplaceLayerNorm, "from_layer_norm", dict(normalized_shape=D)),
    "layer_norm_2d": (
        nn.LayerNorm,
        InplaceLayerNorm,
        "from_layer_norm",
        dict(normalized_shape=(5, D), eps=1e-3),
    ),
    "layer_norm_no_bias": (
        nn.LayerNorm,
        InplaceLayerNorm,
        "from_layer_norm",
        dict(normalized_shape=D, bias=False),
    ),
    "layer_norm_no_affine": (
        nn.LayerNorm,
        InplaceLayerNorm,
        "from_layer_norm",
        dict(normalized_shape=D, elementwise_affine=False),
    ),
    "rms_norm": (nn.RMSNorm, InplaceRMSNorm, "from_rms_norm", dict(normalized_shape=D)),
    "rms_norm_eps": (
        nn.RMSNorm,
        InplaceRMSNorm,
        "from_rms_norm",
        dict(normalized_shape=(5, D), eps=1e-6),
    ),
    "rms_norm_no_affine": (
        nn.RMSNorm,
        InplaceRMSNorm,
        "from_rms_norm",
        dict(normalized_shape=D, elementwise_affine=False),
    ),
}
CASE_NAMES = list(CASES)


def torch_module(name, device="cpu", dtype=torch.float32, seed=0):
    """The torch module of a case with random (not default) parameters, so affine terms count."""
    torch_cls, _, _, kwargs = CASES[name]
    module = torch_cls(**kwargs).to(device=device, dtype=dtype)
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.copy_(randn(p.shape, dtype, device, seed + i, scale=0.5))
    return module


@pytest.mark.parametrize("name", CASE_NAMES)
def test_same_constructor_initialisation_and_state_dict(name):
    torch_cls, inplace_cls, _, kwargs = CASES[name]
    torch.manual_seed(0)
    expected = torch_cls(**kwargs)
    torch.manual_seed(0)
    module = inplace_cls(**kwargs)
    assert isinstance(module, torch_cls)
    assert list(module.state_dict()) == list(expected.state_dict())
    for key, value in expected.state_dict().items():
        assert torch.equal(module.state_dict()[key], value), key
    # Round trips both ways.
    other = torch_module(name, seed=7)
    module.load_state_dict(other.state_dict())
    expected.load_state_dict(module.state_dict())
    for key, value in other.state_dict().items():
        assert torch.equal(module.state_dict()[key], value), key
        assert torch.equal(expected.state_dict()[key], value), key


@pytest.mark.parametrize("name", CASE_NAMES)
def test_from_module_shares_parameters(name):
    _, inplace_cls, from_name, _ = CASES[name]
    original = torch_module(name).eval()
    module = getattr(inplace_cls, from_name)(original)
    assert type(module) is inplace_cls
    assert not module.training
    assert list(module.state_dict()) == list(original.state_dict())
    for (n1, p1), (n2, p2) in zip(
        module.named_parameters(), original.named_parameters(), strict=True
    ):
        assert n1 == n2 and p1 is p2
    # Same configuration: the reprs differ only by the in-place marker.
    assert repr(module) == f"{inplace_cls.__name__}({original.extra_repr()}, inplace=True)"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("name", CASE_NAMES)
def test_forward_overwrites_input_and_matches_torch(name, dtype, device):
    _, inplace_cls, from_name, _ = CASES[name]
    original = torch_module(name, device, dtype)
    module = getattr(inplace_cls, from_name)(original)
    x = randn((3, 5, D), dtype, device, seed=11)
    with torch.no_grad():
        ref64 = copy.deepcopy(original).double()(x.double())
        torch_out = original(x)
        out = module(x)
    assert out is x
    assert_accurate(out, torch_out, ref64, what=name)


def test_repr_says_inplace():
    for name in CASE_NAMES:
        _, inplace_cls, from_name, _ = CASES[name]
        assert "inplace=True" in repr(getattr(inplace_cls, from_name)(torch_module(name)))


def test_linear_refuses_non_square():
    with pytest.raises(ValueError, match="square"):
        InplaceLinear(D, 2 * D)
    with pytest.raises(ValueError, match="square"):
        InplaceLinear.from_linear(nn.Linear(D, 2 * D))


def test_softmax_needs_a_dim():
    with pytest.raises(ValueError, match="dim"):
        InplaceSoftmax(None)
    with pytest.raises(ValueError, match="dim"):
        InplaceSoftmax.from_softmax(nn.Softmax())


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "softmax"])
def test_trains_like_torch(name):
    """Norms and softmax keep autograd: gradients for input and parameters match torch's."""
    _, inplace_cls, from_name, _ = CASES[name]
    original = torch_module(name)
    module = getattr(inplace_cls, from_name)(copy.deepcopy(original))
    leaf = randn((3, 5, D), torch.float32, "cpu", seed=3).requires_grad_()
    grad = randn((3, 5, D), torch.float32, "cpu", seed=4)
    original(leaf.clone()).backward(grad)
    expected = [leaf.grad.clone()] + [p.grad for p in original.parameters()]
    leaf.grad = None
    module(leaf.clone()).backward(grad)
    got = [leaf.grad] + [p.grad for p in module.parameters()]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)


def test_linear_refuses_a_trainable_weight():
    module = InplaceLinear(D, D)
    x = randn((2, D), torch.float32, "cpu", seed=0)
    before = x.clone()
    with pytest.raises(RuntimeError, match="requires grad"):
        module(x)
    assert torch.equal(x, before)
