"""convert() where autograd records: losses, gradients and optimizer steps are the model's
(against an fp64 copy, PyTorch's own error as the yardstick), no tensor autograd saves is
written over, norms save their output instead of their input, and autograd's own checks still
fire where the model itself writes over a saved tensor."""

import copy

import pytest
import torch
import torch.nn.functional as F
from convert_helpers import D, PreNormBlock, block_inputs, make_block, ops_of, tiny_hf_config
from helpers import assert_accurate, randn
from torch import nn

import make_torch_inplace as mti
from benchmarks.live_tensors import LiveTensors
from make_torch_inplace.convert import (
    linear_cross_entropy,
    linear_of_gelu,
    linear_of_silu_mul,
    silu_mul,
)

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def _loss_weight(shape, dtype):
    return randn(shape, dtype, "cpu", seed=7)


def _step(model, inputs, loss_of, kwargs):
    """loss, and the parameters' gradients, of one forward and backward."""
    model.zero_grad(set_to_none=True)
    loss = loss_of(model(*inputs, **kwargs))
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters() if p.requires_grad]


def check_training(model, inputs, loss_of, convert_kwargs=None, **kwargs):
    """One training step through convert(model): its loss and gradients against an fp64 copy
    of the model, run first, with the unconverted model's as the yardstick. Returns the
    converted module."""
    as64 = [x.double() if x.is_floating_point() else x for x in inputs]
    loss64, grads64 = _step(copy.deepcopy(model).double(), as64, loss_of, kwargs)
    loss_t, grads_t = _step(copy.deepcopy(model), inputs, loss_of, kwargs)
    converted = mti.convert(model, **(convert_kwargs or {}))
    _assert_same_step(
        _step(converted, inputs, loss_of, kwargs), (loss_t, grads_t), (loss64, grads64)
    )
    return converted


def _assert_same_step(ours, torch_out, ref):
    """(loss, gradients) of our step against the fp64 reference's, PyTorch's as the yardstick."""
    (loss, grads), (loss_t, grads_t), (loss64, grads64) = ours, torch_out, ref
    assert_accurate(loss, loss_t, loss64, "loss")
    assert len(grads) == len(grads64)
    scale = max(r.abs().max().item() for r in grads64 if r is not None)
    for i, (g, t, r) in enumerate(zip(grads, grads_t, grads64)):
        if r is None:  # a parameter the loss does not reach (BERT's pooler)
            assert g is None and t is None
            continue
        if r.abs().max().item() <= 1e-9 * scale:
            # A gradient that vanishes (attention's key bias: softmax ignores what it adds to
            # a row): ours and PyTorch's are both rounding noise of the terms that cancel, so
            # they are held to that noise's size, not to each other.
            noise = 2 * t.abs().max().item() + torch.finfo(g.dtype).eps * scale
            assert g.abs().max().item() <= noise, f"grad #{i} does not vanish"
            continue
        assert_accurate(g, t, r, f"grad #{i}")


def _masked_sum(out):
    """A weighted sum of squares: its terms are positive, so the sum is as accurate as its
    size says (eps x the loss is its rounding). A plain weighted sum cancels to a fraction of
    its terms' size, and its error, the same for us as for PyTorch elementwise, decided the
    check by how it happened to cancel."""
    return (out * _loss_weight(out.shape, out.dtype).to(out.dtype)).square().sum()


def test_pre_norm_block_trains():
    """The norms' input (the residual) lives on: each norm runs over a copy, saving its output;
    the scores are dead and not saved, so softmax runs over them; GELU, whose in-place form
    would save a copy of its input, and the products autograd saves operands of, stay."""
    model = make_block(PreNormBlock, "cpu").train()
    x, mask = block_inputs("cpu")
    converted = check_training(model, (x.requires_grad_(), mask), _masked_sum)
    ops = ops_of(converted)
    assert ops.count("layer_norm_") == 2 and "softmax_" in ops
    assert not {"gelu_", "attention_in_pieces", "matmul_over_left", "linear_"} & set(ops)
    assert all(s.pattern.startswith("clone") for s in converted.sites if s.op == "layer_norm_")


class FrozenSquare(nn.Module):
    """A trainable projection, then a frozen square one over its (dead, unsaved) output."""

    def __init__(self):
        super().__init__()
        self.trained = nn.Linear(D, D)
        self.frozen = nn.Linear(D, D).requires_grad_(False)

    def forward(self, x):
        return torch.tanh(self.frozen(self.trained(x) + 1.0))


def test_frozen_square_weight_runs_in_place():
    model = make_block(FrozenSquare, "cpu").train()
    x = randn((2, 8, D), torch.float32, "cpu", seed=1)
    converted = check_training(model, (x,), _masked_sum)
    assert "linear_" in ops_of(converted)  # the frozen one; the trained one's weight needs x


def _llama(dtype, layers=2):
    config = tiny_hf_config("llama", "sdpa", layers)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype).train()


def _hf_base(kind, attn):
    if kind == "llama":
        return _llama(torch.float32).model
    cls = transformers.GPT2Model if kind == "gpt2" else transformers.BertModel
    config = tiny_hf_config(kind, attn)
    torch.manual_seed(0)
    return cls(config).train()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["llama", "gpt2", "bert"])
def test_transformers_train(kind, attn):
    model = _hf_base(kind, attn)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    converted = check_training(model, (ids,), lambda out: _masked_sum(out.last_hidden_state))
    ops = ops_of(converted)
    norm = "rms_norm_" if kind == "llama" else "layer_norm_"
    assert norm in ops  # Llama's written-out RMSNorm is one op
    # The MLP's activation is computed again in the backward, not saved.
    recomputed = "linear_of_silu_mul" if kind == "llama" else "linear_of_gelu"
    mlps = [s.op for s in converted.sites if s.op.startswith(recomputed)]
    # Its inputs are read and saved by it alone: its backward writes their gradients over them.
    assert len(mlps) == 2 and all(op.endswith("gradients over its inputs)") for op in mlps)
    assert attn != "eager" or kind == "llama" or "softmax_" in ops


@pytest.mark.parametrize("kind", ["llama", "gpt2", "bert"])
def test_torch_compile_over_convert_runs_the_converted_graphs(kind):
    """torch.compile(convert(model)) runs convert's graphs on every call, the first and the
    cached ones (the converted module is a graph break for the outer compile, which would
    otherwise inline the model's own code), and trains as the model does."""
    model = _hf_base(kind, "sdpa")
    model64, reference = copy.deepcopy(model).double(), copy.deepcopy(model)
    converted = mti.convert(model)
    compiled = torch.compile(converted)
    loss_of = lambda out: _masked_sum(out.last_hidden_state)
    for seed in (3, 4, 5):
        ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(seed))
        ref = _step(model64, (ids,), loss_of, {})
        torch_out = _step(reference, (ids,), loss_of, {})
        ran = converted._backend.graph_calls
        ours = _step(compiled, (ids,), loss_of, {})
        assert converted._backend.graph_calls > ran
        _assert_same_step(ours, torch_out, ref)


def test_bf16_causal_lm_loss_runs_in_place():
    """The LM loss over the float32 copy of the logits runs as cross_entropy_, which autograd
    saves instead of a log-softmax of them; gradients as the model's within bf16 rounding."""
    model = _llama(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    converted = check_training(model, (ids,), lambda out: out.loss, labels=ids)
    (site,) = [s for s in converted.sites if s.op == "cross_entropy_"]
    # The logits are the model's output: the op runs over a 16-bit copy of them.
    assert site.pattern == "clone -> float -> view -> cross_entropy"


class LossOnly(nn.Module):
    """A causal LM's loss alone: its 16-bit logits are dead once their float32 copy is made."""

    def __init__(self):
        super().__init__()
        self.lm = _llama(torch.bfloat16, layers=1)

    def forward(self, ids):
        return self.lm(ids, labels=ids).loss


def test_loss_of_dead_logits_never_holds_them():
    """A model returning the loss alone: its logits are dead, and the LM head and the loss run
    as one linear_cross_entropy."""
    model = LossOnly()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    converted = check_training(model, (ids,), lambda loss: loss)
    (site,) = [s for s in converted.sites if "cross_entropy" in s.op]
    assert site.op == "linear_cross_entropy"
    assert site.pattern == "linear -> float -> view -> cross_entropy"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_lm_without_its_logits(dtype):
    """drop_outputs=("logits",): the result returns no logits, and the loss runs as
    linear_cross_entropy, which never holds them whole (pieces of rows: a tiny workspace)."""
    model = _llama(dtype)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    ids[0, :3] = -100  # ignored targets count in no mean
    with mti.workspace_limit(128 * 5 * 4):  # five rows of logits a piece
        converted = check_training(
            model,
            (ids.clamp(min=0),),
            lambda out: out.loss,
            {"drop_outputs": ("logits",)},
            labels=ids,
        )
        assert converted(ids.clamp(min=0), labels=ids).logits is None
    assert "linear_cross_entropy" in ops_of(converted)


@pytest.mark.parametrize("head", ["frozen", "trained"])
def test_returned_logits_are_read_a_piece_at_a_time(head):
    """The model returns its logits: the loss reads them a piece at a time (linear_cross_
    entropy) instead of keeping a copy of them, where that keeps less: a frozen head, or one
    whose weight's gradient (V x D) and h's are smaller than the logits (many rows)."""
    model = _llama(torch.float32)
    seq = 12
    if head == "frozen":
        model.lm_head.requires_grad_(False)
    else:  # rows x V > (V + rows) x D + the workspace limit
        seq = 200
    ids = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(3))
    with mti.workspace_limit(128 * 5 * 4):  # five rows of logits a piece
        converted = check_training(model, (ids,), lambda out: out.loss, labels=ids)
        logits = converted(ids, labels=ids).logits
    with torch.no_grad():
        torch.testing.assert_close(logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    (site,) = [s for s in converted.sites if "cross_entropy" in s.op]
    assert site.op == "linear_cross_entropy"
    assert site.pattern == "linear -> float -> view -> cross_entropy"


def test_causal_lm_without_its_logits_across_graph_breaks():
    """Forward pre-hooks Dynamo does not trace, on the model and on each layer (as FSDP2's
    fully_shard puts there), split the converted forward into graphs; the logits are still
    dropped in the graph that computes them (linear_cross_entropy), and the causal mask that
    transformers makes without a cache, which the layers' graphs read as an input, still
    lets SDPA run with is_causal=True."""
    model = _llama(torch.float32)
    model.config.use_cache = False
    hook = torch._dynamo.disable(lambda module, args: None)
    for module in (model, *model.model.layers):
        module.register_forward_pre_hook(hook)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    converted = check_training(
        model, (ids,), lambda out: out.loss, {"drop_outputs": ("logits",)}, labels=ids
    )
    assert max(converted._captured.values()) > 1  # the forward ran as several graphs
    assert converted(ids, labels=ids).logits is None
    ops = ops_of(converted)
    assert {"linear_cross_entropy", "scaled_dot_product_attention(is_causal=True)"} <= set(ops)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy(dtype, reduction):
    h = randn((3, 7, D), dtype, "cpu", seed=1).requires_grad_()
    w = randn((50, D), dtype, "cpu", seed=2).requires_grad_()
    target = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(4))
    target[1, 2:5] = -100

    def reference(h, w):
        logits = F.linear(h, w).float().view(-1, 50)
        return F.cross_entropy(logits, target.view(-1), reduction=reduction, label_smoothing=0.1)

    h64, w64 = (t.detach().double().requires_grad_() for t in (h, w))
    loss64 = reference(h64, w64)
    grads64 = torch.autograd.grad(loss64, (h64, w64))
    loss_t = reference(h, w)
    grads_t = torch.autograd.grad(loss_t, (h, w))
    with mti.workspace_limit(50 * 4 * h.element_size()):  # four rows a piece
        loss = linear_cross_entropy(h, w, target, -100, reduction, 0.1)
    grads = torch.autograd.grad(loss, (h, w))
    assert_accurate(loss.detach(), loss_t.detach(), loss64.detach(), "loss")
    for i, (g, t, r) in enumerate(zip(grads, grads_t, grads64)):
        assert_accurate(g, t, r, f"grad #{i}")


@pytest.mark.parametrize("given", [False, True])
def test_linear_cross_entropy_holds_one_piece_at_a_time(given):
    """At most the workspace limit of logits is alive at once, beyond the gradients it keeps
    (h's and the weight's) and the loss: one piece, never two."""
    rows, vocab = 64, 96
    h = randn((rows, D), torch.float32, "cpu", seed=1).requires_grad_()
    w = randn((vocab, D), torch.float32, "cpu", seed=2).requires_grad_()
    target = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(4))
    logits = F.linear(h, w).detach() if given else None
    limit = 8 * vocab * 4  # eight rows a piece: eight pieces
    tracker = LiveTensors()
    with mti.workspace_limit(limit), tracker:
        loss = linear_cross_entropy(h, w, target, logits=logits)
    kept = h.numel() * 4 + w.numel() * 4  # the two gradients autograd keeps
    assert kept < tracker.peak <= kept + limit + 256  # + the loss's scalars
    del loss


@pytest.mark.parametrize("drop", [(), ("logits",)])
def test_state_dict_holds_each_parameter_once(drop):
    """The converted module's state_dict is the model's, under `module.`: what its calls run
    (the model, or the view dropping outputs) is not a submodule of its own."""
    model = _llama(torch.float32)
    converted = mti.convert(model, drop_outputs=drop)
    assert list(converted.state_dict()) == [f"module.{k}" for k in model.state_dict()]


def test_drop_outputs_of_a_model_holding_its_own_forward():
    """A forward set on the instance would shadow the view's: the outputs are then dropped
    around the model's call, which in one graph is as good."""
    model = _llama(torch.float32)
    model.forward = model.forward  # a bound method in the instance's __dict__
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    converted = mti.convert(model, drop_outputs=("logits",))
    out = converted(ids, labels=ids)
    assert out.logits is None
    torch.testing.assert_close(out.loss, model(ids, labels=ids).loss)
    assert "linear_cross_entropy" in ops_of(converted)


def test_drop_outputs_needs_a_mapping():
    with pytest.raises(TypeError, match="sequence of names"):
        mti.convert(make_block(FrozenSquare, "cpu"), drop_outputs="logits")
    converted = mti.convert(make_block(FrozenSquare, "cpu"), drop_outputs=("logits",))
    with pytest.raises(TypeError, match="mapping"):
        converted(randn((2, D), torch.float32, "cpu", seed=1))


def _saved_bytes(model, ids, loss_of) -> int:
    """Bytes of the distinct storages autograd saves during one forward."""
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_of(model(ids, labels=ids))
    return sum(storages.values())


def test_llama_saves_less():
    """What autograd saves of a Llama shrinks by the norms' inputs and the MLP's activations."""
    model = _llama(torch.float32)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))

    def loss_of(out):
        return out.loss

    before = _saved_bytes(model, ids, loss_of)
    after = _saved_bytes(mti.convert(model), ids, loss_of)
    rows, layers = 2 * 12, 2
    # Per layer, each of two norms saves its output (which the projections after it save too)
    # instead of its input and the normalized tensor: two rows x D tensors fewer; the MLP
    # saves neither silu(gate) nor silu(gate) * up: two rows x 3D tensors fewer.
    assert after <= before - layers * rows * (2 * 2 * D + 2 * 3 * D) * 4


def _swiglu(g, u):
    return F.silu(g) * u


_RECOMPUTING = {
    "silu_mul": (silu_mul, _swiglu, 2),
    "linear_of_silu_mul": (linear_of_silu_mul, lambda g, u, w, b: F.linear(_swiglu(g, u), w, b), 2),
    "linear_of_gelu": (
        lambda x, w, b, **kw: linear_of_gelu(x, w, b, approximate="tanh", **kw),
        lambda x, w, b: F.linear(F.gelu(x, approximate="tanh"), w, b),
        1,
    ),
}


def check_against_fp64(ours, reference, args, dtype):
    """ours(*args) and its gradients for the args that require grad (None args pass through)
    against reference(*args) in fp64, PyTorch's in `dtype` as the yardstick."""
    args64 = [
        a.detach().double().requires_grad_(a.requires_grad) if a is not None else None for a in args
    ]
    wanted = [a for a in args if a is not None and a.requires_grad]
    wanted64 = [a for a in args64 if a is not None and a.requires_grad]
    out64 = reference(*args64)
    grad = randn(out64.shape, dtype, "cpu", seed=3)
    grads64 = torch.autograd.grad(out64, wanted64, grad.double())
    out_t = reference(*args)
    grads_t = torch.autograd.grad(out_t, wanted, grad)
    out = ours(*args)
    grads = torch.autograd.grad(out, wanted, grad)
    assert_accurate(out.detach(), out_t.detach(), out64.detach(), "value")
    for i, (g, t, r) in enumerate(zip(grads, grads_t, grads64)):
        assert_accurate(g, t, r, f"grad #{i}")


@pytest.mark.parametrize("name", list(_RECOMPUTING))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recomputing_pieces(name, dtype):
    """The helpers that compute an activation again in the backward: values and gradients
    against fp64, PyTorch's composition as the yardstick."""
    ours, reference, n_inputs = _RECOMPUTING[name]
    args = [randn((2, 5, 3 * D), dtype, "cpu", seed=i) for i in range(n_inputs)]
    if name != "silu_mul":
        args += [randn((D, 3 * D), dtype, "cpu", seed=8), randn((D,), dtype, "cpu", seed=9)]
    check_against_fp64(ours, reference, [a.requires_grad_() for a in args], dtype)


@pytest.mark.parametrize("name", list(_RECOMPUTING))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_over_the_inputs(name, dtype):
    """consume=True: the backward writes the inputs' gradients over the inputs, a piece of
    rows at a time (here 5 pieces), with exactly the values of consume=False."""
    ours, _, n_inputs = _RECOMPUTING[name]
    shape = (2, 5, 3 * D)
    leaves = [randn(shape, dtype, "cpu", seed=i).requires_grad_() for i in range(n_inputs)]
    params = []
    if name != "silu_mul":
        params = [randn((D, 3 * D), dtype, "cpu", seed=8), randn((D,), dtype, "cpu", seed=9)]
        params = [p.requires_grad_() for p in params]
    results = []
    limit = 8 * 2 * 2 * shape[-1] * torch.finfo(dtype).bits // 8  # two rows a piece
    for consume in (False, True):
        inputs = [leaf * 1 for leaf in leaves]  # not leaves: dead after the op
        with mti.workspace_limit(limit):
            out = ours(*inputs, *params, consume=consume)
            grad = randn(out.shape, dtype, "cpu", seed=3)
            grads = torch.autograd.grad(out, inputs + params, grad)
        moved = [g.data_ptr() == i.data_ptr() for g, i in zip(grads, inputs)]
        assert all(moved) if consume else not any(moved)
        results.append(grads)
    for i, (g, ref) in enumerate(zip(*results)):
        assert torch.equal(g, ref), f"grad #{i}"


@pytest.mark.parametrize("name", list(_RECOMPUTING))
def test_gradients_over_the_inputs_backward_twice_or_recorded(name):
    """consume=True: a second backward through the graph (retain_graph) raises, as the
    inputs it would read hold gradients now (autograd's version check); a recorded backward
    (create_graph) keeps the inputs and its second-order gradients are the reference's
    (linear_of_gelu: SiLU's backward, aten.silu_backward, has no derivative of its own)."""
    ours, ref, n_inputs = _RECOMPUTING[name]
    leaves = [
        randn((2, 3 * D), torch.float64, "cpu", seed=i).requires_grad_() for i in range(n_inputs)
    ]
    params = []
    if name != "silu_mul":
        params = [
            randn((D, 3 * D), torch.float64, "cpu", seed=8),
            randn((D,), torch.float64, "cpu", seed=9),
        ]
        params = [p.requires_grad_() for p in params]
    out = ours(*[leaf * 1 for leaf in leaves], *params, consume=True)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()

    if name != "linear_of_gelu":
        return
    second = []
    for fn, kwargs in ((ours, {"consume": True}), (ref, {})):
        out = fn(*[leaf * 1 for leaf in leaves], *params, **kwargs)
        grads = torch.autograd.grad(out.pow(2).sum(), leaves, create_graph=True)
        second.append(torch.autograd.grad(sum(g.pow(2).sum() for g in grads), leaves))
    for g, r in zip(*second):
        torch.testing.assert_close(g, r)


class GateReadLater(nn.Module):
    """A SwiGLU MLP whose gate projection is read again after the activation (`late`) or saved
    by another op (`saved`): its backward may not write over it."""

    def __init__(self, use):
        super().__init__()
        self.use = use
        self.gate, self.up = nn.Linear(D, 3 * D), nn.Linear(D, 3 * D)
        self.down = nn.Linear(3 * D, D)

    def forward(self, x):
        g = self.gate(x)
        h = self.down(F.silu(g) * self.up(x))
        if self.use == "late":
            return h + g[..., :D]
        return h + (g * g)[..., :D]


@pytest.mark.parametrize("use", ["late", "saved"])
def test_gradients_not_over_an_input_read_elsewhere(use):
    model = make_block(lambda: GateReadLater(use), "cpu").train()
    x = randn((3, D), torch.float32, "cpu", seed=1)
    converted = check_training(model, (x,), _masked_sum)
    (op,) = [s.op for s in converted.sites if s.op.startswith("linear_of_silu_mul")]
    assert "gradients over" not in op


def test_mlp_backward_holds_one_activation_wide_tensor():
    """A LoRA-like Llama (every weight frozen but the embedding): the backward's peak above
    what the forward leaves alive is the MLP's backward: the activation's gradient (rows x I),
    the residual stream's gradient (rows x D) and two pieces of temporaries, here an eighth of
    the rows each. Autograd's silu backward would hold three more rows x I tensors."""
    inter, rows = 4 * D, 256
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=D,
        intermediate_size=inter,
        num_attention_heads=4,
        vocab_size=128,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train().requires_grad_(False)
    model.model.embed_tokens.weight.requires_grad_(True)
    ids = torch.randint(0, 128, (1, rows), generator=torch.Generator().manual_seed(3))
    with mti.workspace_limit(8 * 2 * (rows // 8) * inter * 4):
        converted = mti.convert(model, drop_outputs=("logits",))
        converted(ids, labels=ids).loss.backward()  # captures outside the tracker
        tracker = LiveTensors()
        with tracker:
            loss = converted(ids, labels=ids).loss
            forward_end = sum(a.nbytes for a in tracker.alive())
            loss.backward()
    extra = tracker.peak - forward_end
    assert extra <= rows * (inter + inter // 4 + D) * 4


def test_optimizer_steps_match():
    """Three SGD steps with momentum (Adam would turn the gradients that are 0 but for rounding,
    such as the key bias's, into steps of the learning rate's size)."""
    model = make_block(PreNormBlock, "cpu").train()
    model64, reference = copy.deepcopy(model).double(), copy.deepcopy(model)
    x, mask = block_inputs("cpu")
    for m, inputs in (
        (model64, (x.double(), mask.double())),
        (reference, (x, mask)),
        (mti.convert(model), (x, mask)),
    ):
        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        for _ in range(3):
            opt.zero_grad()
            _masked_sum(m(*inputs)).backward()
            opt.step()
    for i, (p, t, r) in enumerate(
        zip(model.parameters(), reference.parameters(), model64.parameters())
    ):
        assert_accurate(p.detach(), t.detach(), r.detach(), f"parameter #{i}")


@pytest.mark.parametrize("drop", [(), ("logits",)])
def test_adamw_training_of_a_causal_lm_matches(drop):
    """Twenty AdamW steps of a Llama on its own loss: every step's loss is the unconverted
    model's, held to fp64 (a wrong step would compound over the steps). The parameters are
    held to it after SGD steps (test_optimizer_steps_match): Adam scales each element's
    gradient by its own size, so a gradient of rounding size still moves its element by up to
    the learning rate."""
    model = _llama(torch.float32)
    model64, reference = copy.deepcopy(model).double(), copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(1))
    losses = {}
    for key, m in (
        ("fp64", model64),
        ("torch", reference),
        ("ours", mti.convert(model, drop_outputs=drop)),
    ):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        losses[key] = []
        for _ in range(20):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[key].append(loss.detach())
    ours, torch_out, ref = (torch.stack(losses[k]) for k in ("ours", "torch", "fp64"))
    assert ref[-1] < ref[0] - 0.5  # the steps train
    assert_accurate(ours, torch_out, ref, "losses")


class WritesSaved(nn.Module):
    """Writes over sigmoid's output, which autograd saves: PyTorch refuses in the backward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        y = torch.sigmoid(self.lin(x))
        y.add_(1.0)
        return y


def test_autograd_still_refuses_writing_over_a_saved_tensor():
    model = make_block(WritesSaved, "cpu").train()
    x = randn((2, D), torch.float32, "cpu", seed=1)
    for m in (model, mti.convert(model)):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            m(x).sum().backward()


class SavesItsOutput(nn.Module):
    """tanh (not in place: its input is read later) saves its own output, which nothing else
    saves or reads after the product by 2: writing the product over it (mul_) would break
    tanh's backward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        h = self.lin(x)
        return torch.tanh(h) * 2.0 + h


def test_an_output_its_op_saves_is_not_written_over():
    model = make_block(SavesItsOutput, "cpu").train()
    x = randn((3, D), torch.float32, "cpu", seed=1)
    converted = check_training(model, (x,), _masked_sum)
    assert "mul_" not in ops_of(converted)


def test_gradient_of_a_value_saved_by_a_later_op_is_right():
    """h = tanh(a) is read by exp_-able ops and saved by h * w (w requires grad): no later op
    may write over h, though nothing reads it in the forward after the product."""

    class Saved(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(D))
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            h = torch.tanh(self.lin(x))
            p = h * self.w
            return F.silu(p.exp() + h.sum(-1, keepdim=True))

    model = make_block(Saved, "cpu").train()
    x = randn((3, D), torch.float32, "cpu", seed=1)
    check_training(model, (x,), _masked_sum)
