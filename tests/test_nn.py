"""The in-place modules against their torch counterparts: same constructor, initialisation and
state_dict; from_<module> shares parameters; forward overwrites its input where the input is
dead (a temporary, or a local that the caller rebinds), and elsewhere runs out of place: as
accurate as the torch module either way (fp64 reference computed first)."""

import copy
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import DEVICES, DTYPE_PARAMS, assert_accurate, randn
from torch import nn

import make_torch_inplace.nn as mnn
from make_torch_inplace import _call_site
from make_torch_inplace.nn import (
    InplaceFallbackWarning,
    InplaceLayerNorm,
    InplaceLinear,
    InplaceRMSNorm,
    InplaceSoftmax,
)

# Where a module falls back is tested on purpose; the warning itself is tested once.
pytestmark = pytest.mark.filterwarnings("ignore::make_torch_inplace.nn.InplaceFallbackWarning")

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
# One case per module class, for the tests of when forward overwrites its input.
CLASS_CASES = ["linear", "softmax", "layer_norm", "rms_norm"]


def torch_module(name, device="cpu", dtype=torch.float32, seed=0):
    """The torch module of a case with random (not default) parameters, so affine terms count."""
    torch_cls, _, _, kwargs = CASES[name]
    module = torch_cls(**kwargs).to(device=device, dtype=dtype)
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.copy_(randn(p.shape, dtype, device, seed + i, scale=0.5))
    return module


def inplace_module(name, device="cpu", dtype=torch.float32, **kwargs):
    """(torch module, in-place module sharing its parameters) of a case."""
    _, inplace_cls, from_name, _ = CASES[name]
    original = torch_module(name, device, dtype)
    return original, getattr(inplace_cls, from_name)(original, **kwargs)


class Fresh(nn.Module):
    """Returns op(x) (x * 1 by default), a new tensor, and remembers where its data lives: the
    next module's input is then a temporary whose memory the test can recognise."""

    def __init__(self, op=lambda x: x * 1):
        super().__init__()
        self.op = op

    def forward(self, x):
        out = self.op(x)
        self.data_ptr = out.data_ptr()
        return out


class Chain(nn.Module):
    """module(fresh(x)), as in ln(lin(x)): module's input is a temporary."""

    def __init__(self, module):
        super().__init__()
        self.fresh, self.module = Fresh(), module

    def forward(self, x):
        return self.module(self.fresh(x))


def temporaries_tell():
    """Whether this Python's reference counts tell a temporary argument from a named one
    (3.14 borrows references, so they may not: the modules then run ln(lin(x)) out of place)."""
    calibration = mnn._calibrate()
    return calibration is not None and calibration.temporary < calibration.named


needs_temporaries = pytest.mark.skipif(
    not temporaries_tell(), reason="reference counts here do not tell temporaries apart"
)


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
@needs_temporaries
def test_forward_overwrites_a_temporary_and_matches_torch(name, dtype, device):
    original, module = inplace_module(name, device, dtype)
    chain = Chain(module)
    x = randn((3, 5, D), dtype, device, seed=11)
    with torch.no_grad():
        ref64 = copy.deepcopy(original).double()(x.double())
        torch_out = original(x)
        out = chain(x)
    assert out.data_ptr() == chain.fresh.data_ptr, "ran out of place"
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


def gradients(run, module, leaf, grad):
    """[leaf.grad, *parameter grads] after run(module, leaf).backward(grad)."""
    leaf.grad = None
    run(module, leaf).backward(grad)
    return [leaf.grad] + [p.grad for p in module.parameters() if p.requires_grad]


def assert_trains_like_torch(name, run, device="cpu"):
    original = torch_module(name, device)
    if name == "linear":
        original.weight.requires_grad_(False)  # a trainable weight is refused
    module = getattr(CASES[name][1], CASES[name][2])(copy.deepcopy(original))
    leaf = randn((3, 5, D), torch.float32, device, seed=3).requires_grad_()
    grad = randn((3, 5, D), torch.float32, device, seed=4)
    expected = gradients(run, original, leaf, grad)
    got = gradients(run, module, leaf, grad)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)


@needs_temporaries
@pytest.mark.parametrize("before", ["times_one", "torch_linear"])
@pytest.mark.parametrize("name", CLASS_CASES)
def test_trains_like_torch(name, before):
    """In place on a temporary (after torch's nn.Linear, a view of its GEMM's result), autograd
    works: gradients for the input and the parameters match torch's."""
    in_place = []
    torch.manual_seed(0)
    linear = nn.Linear(D, D)

    def run(module, leaf):
        chain = Chain(module)
        if before == "torch_linear":
            chain.fresh.op = linear
        out = chain(leaf)
        in_place.append(out.data_ptr() == chain.fresh.data_ptr)
        return out

    assert_trains_like_torch(name, run)
    assert in_place == [False, True]  # torch's module, then ours


@pytest.mark.parametrize("temporary", [False, True])
def test_linear_refuses_a_trainable_weight(temporary):
    """Whether or not the call would run in place: training with it fails the same way."""
    module = InplaceLinear(D, D)
    x = randn((2, D), torch.float32, "cpu", seed=0)
    before = x.clone()
    with pytest.raises(RuntimeError, match="requires grad"):
        Chain(module)(x) if temporary else module(x)
    assert torch.equal(x, before)


# --------------------------------------------------------------------------- when it overwrites


def pre_norm(module, x):
    """A pre-norm residual: x is read again after module(x)."""
    return x + module(x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CLASS_CASES)
def test_pre_norm_block_runs_out_of_place(name, device):
    original, module = inplace_module(name, device)
    x = randn((3, 5, D), torch.float32, device, seed=11)
    before = x.clone()
    with torch.no_grad():
        ref64 = pre_norm(copy.deepcopy(original).double(), x.double())
        torch_out = pre_norm(original, x)
        out = pre_norm(module, x)
    assert torch.equal(x, before)
    assert_accurate(out, torch_out, ref64, what=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CLASS_CASES)
def test_pre_norm_block_trains_like_torch(name, device):
    assert_trains_like_torch(name, lambda module, leaf: pre_norm(module, leaf * 2), device)


# Calls of a module on an input made by fresh(x); each returns (output, [(tensor that held the
# input, what it must still equal)]).


def rebinding(fresh, module, x):
    h = fresh(x)
    h = module(h)  # h's old value is dead: in place
    return h, []


def kept_in_list(fresh, module, x):
    hidden = [fresh(x)]  # as Hugging Face's all_hidden_states
    return module(hidden[-1]), [(hidden[-1], x)]


def view_alive(fresh, module, x):
    h = fresh(x)
    row = h[0]
    h = module(h)
    return h, [(row, x[0])]


def view_of_a_temporary(fresh, module, x):
    """The base had a Python object, which torch keeps alive with the view: out of place."""
    return module(fresh(x).view(-1, D)).view(x.shape), []


def view_of_a_named_tensor(fresh, module, x):
    h = fresh(x)
    return module(h.view(-1, D)).view(x.shape), [(h, x)]


def after_torch_linear(fresh, module, x):
    """F.linear returns a 3-D output as a view of its 2-D result, which nothing else holds."""
    eye, zero = torch.eye(D, dtype=x.dtype), torch.zeros(D, dtype=x.dtype)
    fresh.op = lambda t: F.linear(t, eye, zero)  # x itself, exactly
    return module(fresh(x)), []


def keyword_argument(fresh, module, x):
    name = "x" if isinstance(module, nn.RMSNorm) else "input"  # forward's argument
    return module(**{name: fresh(x)}), []


def dunder_call(fresh, module, x):
    return module.__call__(fresh(x)), []


def with_forward_hook(fresh, module, x):
    """A forward hook can read the input after forward."""
    seen = []
    handle = module.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    try:
        out = module(fresh(x))
    finally:
        handle.remove()
    return out, [(seen[0], x)]


def saved_by_autograd(fresh, module, x):
    """exp saves its output for backward: overwritten, backward would raise."""
    leaf = x.detach().requires_grad_()
    fresh.op = torch.exp
    out = module(fresh(leaf))
    torch.autograd.grad(out.sum(), leaf)
    return out, []


def leaf_that_requires_grad(fresh, module, x):
    return module(fresh(x).detach().requires_grad_()), []


# name -> (call, whether it runs in place, grad mode)
CALLS = {
    "rebinding": (rebinding, True, torch.no_grad),
    "kept_in_list": (kept_in_list, False, torch.no_grad),
    "view_alive": (view_alive, False, torch.no_grad),
    "view_of_a_temporary": (view_of_a_temporary, False, torch.no_grad),
    "view_of_a_named_tensor": (view_of_a_named_tensor, False, torch.no_grad),
    "after_torch_linear": (after_torch_linear, True, torch.no_grad),
    "keyword_argument": (keyword_argument, False, torch.no_grad),
    "dunder_call": (dunder_call, False, torch.no_grad),
    "with_forward_hook": (with_forward_hook, False, torch.no_grad),
    "saved_by_autograd": (saved_by_autograd, False, torch.enable_grad),
    "leaf_that_requires_grad": (leaf_that_requires_grad, False, torch.enable_grad),
}


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("name", CLASS_CASES)
def test_overwrites_only_a_dead_input(name, call):
    """Each call is as accurate as torch's module, and overwrites its input only where nothing
    reads it afterwards: whatever else held the input still holds it unchanged."""
    run, in_place, grad_mode = CALLS[call]
    original, module = inplace_module(name)
    original.requires_grad_(False)
    x = randn((3, 5, D), torch.float32, "cpu", seed=5)
    with grad_mode():
        ref64 = run(Fresh(), copy.deepcopy(original).double(), x.double())[0]
        torch_out = run(Fresh(), original, x)[0]
        fresh = Fresh()
        out, held = run(fresh, module, x)
    assert_accurate(out.detach(), torch_out.detach(), ref64.detach(), what=call)
    for tensor, value in held:
        assert torch.equal(tensor, value), f"{call}: the input was overwritten"
    assert (out.data_ptr() == fresh.data_ptr) == in_place


@pytest.mark.parametrize("name", CLASS_CASES)
def test_sequential_overwrites_all_but_its_own_input(name):
    """nn.Sequential rebinds its `input` local to each module's output: every module but the
    first, whose input the caller holds, runs in place."""
    original, module = inplace_module(name)
    fresh = Fresh()
    sequential = nn.Sequential(copy.deepcopy(module), fresh, module)
    x = randn((3, 5, D), torch.float32, "cpu", seed=6)
    before = x.clone()
    with torch.no_grad():
        original64 = copy.deepcopy(original).double()
        ref64 = original64(original64(x.double()))
        torch_out = original(original(x))
        out = sequential(x)
    assert torch.equal(x, before)
    assert out.data_ptr() == fresh.data_ptr
    assert_accurate(out, torch_out, ref64, what=name)


def test_still_overwrites_a_temporary_after_torch_compile_ran():
    """A torch.compile that raised can leave the interpreter's frames holding more references
    at forward than when the modules measured them: they measure again and still run in
    place on a temporary, and out of place on a named tensor."""
    _, module = inplace_module("layer_norm")
    compiled = torch.compile(lambda t: t.view(-1, 7), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception):  # noqa: B017 (whichever error Dynamo wraps it in)
        compiled(torch.ones(3))
    fresh = Fresh()
    x = randn((3, 5, D), torch.float32, "cpu", seed=7)
    with torch.no_grad():
        out = module(fresh(x))
    assert out.data_ptr() == fresh.data_ptr
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", mnn.InplaceFallbackWarning)
        y = x.clone()
        assert module(y).data_ptr() != y.data_ptr()


@pytest.mark.parametrize("name", CLASS_CASES)
def test_always_inplace_overwrites_even_a_referenced_input(name):
    original, module = inplace_module(name, always_inplace=True)
    _, inplace_cls, _, kwargs = CASES[name]
    assert inplace_cls(**kwargs, always_inplace=True).always_inplace
    assert repr(module).endswith("inplace=True, always_inplace=True)")
    x = randn((3, 5, D), torch.float32, "cpu", seed=7)
    with torch.no_grad():
        ref64 = copy.deepcopy(original).double()(x.double())
        torch_out = original(x)
        out = module(x)  # x is a named local: only the opt-out overwrites it
    assert out is x
    assert_accurate(out, torch_out, ref64, what=name)


def chained(module, x):
    return module(x * 1)


@pytest.mark.parametrize("name", CLASS_CASES)
def test_compiled_is_out_of_place_unless_opted_out(name):
    """Under torch.compile reference counts mean nothing: the checking module runs out of
    place (the pre-norm block stays right), the opted-out one in place; no graph breaks."""
    torch._dynamo.reset()
    original, module = inplace_module(name)
    opted_out = copy.deepcopy(module)
    opted_out.always_inplace = True
    x = randn((3, 5, D), torch.float32, "cpu", seed=8)
    before = x.clone()
    original64 = copy.deepcopy(original).double()
    with torch.no_grad():
        refs64 = pre_norm(original64, x.double()), chained(original64, x.double())
        torch_outs = pre_norm(original, x), chained(original, x)
        compiled_pre_norm = torch.compile(pre_norm, backend="aot_eager", fullgraph=True)
        compiled_chain = torch.compile(chained, backend="aot_eager", fullgraph=True)
        outs = compiled_pre_norm(module, x), compiled_chain(opted_out, x)
    assert torch.equal(x, before)
    for out, torch_out, ref64 in zip(outs, torch_outs, refs64, strict=True):
        assert_accurate(out, torch_out, ref64, what=name)


def test_warns_once_per_class_at_the_call(monkeypatch):
    monkeypatch.setattr(mnn, "_warned", set())
    _, norm = inplace_module("layer_norm")
    _, softmax = inplace_module("softmax")
    x = randn((3, 5, D), torch.float32, "cpu", seed=9)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        rebinding(Fresh(), norm, x)  # in place: nothing to say
        for _ in range(2):
            pre_norm(norm, x)
            pre_norm(softmax, x)
    caught = [w for w in caught if issubclass(w.category, InplaceFallbackWarning)]
    assert [str(w.message).split(" ")[0] for w in caught] == ["InplaceLayerNorm", "InplaceSoftmax"]
    assert "always_inplace=True" in str(caught[0].message)
    assert all(w.filename == __file__ for w in caught), "the warning names the module's caller"


# Call sites, each calling m once: what _call_site makes of them.
def _rebinds(m, x):
    x = m(x)


def _temporary(m, x):
    m(x * 1)


def _local_lives_on(m, x):
    m(x)


def _keyword(m, x):
    m(input=x * 1)


def _star(m, x):
    m(*[x * 1])


def _dunder_call(m, x):
    m.__call__(x * 1)


def _two_arguments(m, x):
    m(x * 1, None)


SITES = {
    _rebinds: _call_site.REBINDS_LOCAL,
    _temporary: _call_site.TEMPORARY_ARG,
    _local_lives_on: _call_site.NOT_PLAIN,
    _keyword: _call_site.NOT_PLAIN,
    _star: _call_site.NOT_PLAIN,
    _dunder_call: _call_site.NOT_PLAIN,
    _two_arguments: _call_site.NOT_PLAIN,
}


@pytest.mark.parametrize("site", list(SITES), ids=lambda f: f.__name__)
def test_call_site_kinds(site):
    """The caller's bytecode, read on this Python version."""
    seen = []

    class Recorder:
        def __call__(self, *args, **kwargs):
            caller = sys._getframe(1)
            seen.append(_call_site.site_kind(caller.f_code, caller.f_lasti))

    site(Recorder(), 1)
    assert seen == [SITES[site]]
