"""Op sequences that compute one op the rewriter knows, replaced by that op before rewriting.

RMSNorm as Hugging Face models write it out (Llama, Mistral, Qwen2 and their kin):

    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * x32.to(x.dtype)

seven ops, which where autograd records save a float32 copy of x and the normalized tensor
besides the output, and allocate three x-sized temporaries. As F.rms_norm(x, [n], weight,
eps) it is one op, which the rewriter then runs as rms_norm_ (saving its output alone). The
result differs from the written-out form by rounding only: the product by weight is rounded
to x's dtype once, not twice.

GPT-2's GELU (transformers' NewGELUActivation), written out as eight ops:

    0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))

is F.gelu(x, approximate="tanh"): one op, which saves x alone where autograd records (the
written-out form saves x, the tanh, 0.5 * x and 1 + tanh), rounding once.

Rotary position embedding as Hugging Face models write it out (Llama and its kin, GPT-NeoX):

    x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin      (h = D / 2)

seven ops over x's size (the products by a broadcast cos and sin are strided, slow kernels),
is pieces.rope: one pass, which the rewriter runs as rope_ over a dead x (a query or key
projection), rounding once.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F
from torch import fx

from .fake import _same_layout, _tensor
from .patterns import _is_number
from .pieces import rope


def fuse(graph: fx.Graph) -> None:
    """Replaces each written-out RMSNorm in `graph` by F.rms_norm, each written-out tanh GELU
    by F.gelu(x, approximate="tanh"), and each written-out rotary embedding by rope."""
    for node in list(graph.nodes):
        found = _rms_norm_chain(node)
        if found is not None:
            x, weight, eps, chain = found
            _replace(node, F.rms_norm, (x, [_tensor(x).shape[-1]], weight, eps), {}, chain)
            continue
        found = _gelu_tanh_chain(node)
        if found is not None:
            x, chain = found
            _replace(node, F.gelu, (x,), {"approximate": "tanh"}, chain)
            continue
        found = _rope_chain(node)
        if found is not None:
            x, cos, sin, chain = found
            _replace(node, rope, (x, cos, sin), {}, chain)


def _replace(node: fx.Node, fn, args, kwargs, chain: list[fx.Node]) -> None:
    """fn(*args, **kwargs) in the place of `node`, the first of `chain`'s nodes, which go in
    their order (each read only by the ones before it)."""
    with node.graph.inserting_before(node):
        new = node.graph.call_function(fn, args, kwargs)
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    for dead in chain:
        node.graph.erase_node(dead)


_MUL = (operator.mul, torch.mul, "mul")
_ADD = (operator.add, torch.add, "add")
_RSQRT = (torch.rsqrt, "rsqrt")
_POW = (torch.pow, "pow")


def _call(node, targets, nargs: int, **kwargs) -> bool:
    """node calls one of `targets` (functions, or method names) with `nargs` positional
    arguments and exactly these keyword arguments."""
    return (
        isinstance(node, fx.Node)
        and node.op in ("call_function", "call_method")
        and node.target in targets
        and len(node.args) == nargs
        and node.kwargs == kwargs
    )


def _other(node: fx.Node, arg: fx.Node):
    """The operand of a binary node besides `arg`."""
    a, b = node.args
    return b if a is arg else a


def _rms_norm_chain(out: fx.Node):
    """(x, weight, eps, the chain's nodes from `out` back) if `out` ends a written-out RMSNorm
    (module docstring) whose every intermediate value only the next op reads, else None."""
    if not _call(out, _MUL, 2):
        return None
    for h, weight in (out.args, reversed(out.args)):
        found = _normalized(h)
        if found is None or not isinstance(weight, fx.Node):
            continue
        x, eps, chain = found
        t, w, o = _tensor(x), _tensor(weight), _tensor(out)
        if (
            t is not None
            and w is not None
            and o is not None
            and w.dim() == 1
            and isinstance(t.shape[-1], int)
            and w.shape[0] == t.shape[-1]
            and t.dtype == w.dtype == o.dtype
            and t.device == w.device
        ):
            return x, weight, eps, [out, *chain]
    return None


def _normalized(h):
    """(x, eps, chain) if h is x32 * rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) in x's
    dtype (.to(dtype) of it, or itself)."""
    chain = []
    if _call(h, ("to",), 2) and len(h.users) == 1:
        chain.append(h)
        h = h.args[0]
    if not (_call(h, _MUL, 2) and len(h.users) == 1):
        return None
    for x32, r in (h.args, reversed(h.args)):
        if not (_call(r, _RSQRT, 1) and len(r.users) == 1):
            continue
        v = r.args[0]
        if not (_call(v, _ADD, 2) and len(v.users) == 1):
            continue
        var, eps = v.args if _is_number(v.args[1]) else reversed(v.args)
        if not (_is_number(eps) and _call(var, ("mean",), 2, keepdim=True)):
            continue
        p = var.args[0]
        if not (
            var.args[1] in (-1, [-1], (-1,))
            and len(var.users) == 1
            and _call(p, _POW, 2)
            and p.args == (x32, 2)
            and len(p.users) == 1
            and _call(x32, ("to",), 2)
            and x32.args[1] is torch.float32
            and set(x32.users) == {p, h}
        ):
            continue
        x = x32.args[0]
        if not isinstance(x, fx.Node):
            continue
        return x, float(eps), [*chain, h, r, v, var, p, x32]
    return None


_TANH = (torch.tanh, "tanh")
_GELU_CONSTANTS = (0.5, 0.044715, math.sqrt(2.0 / math.pi), 1.0, 3.0)


def _scaled(node, constant: float):
    """The operand that `node` multiplies by `constant` (either side), or None."""
    if not _call(node, _MUL, 2):
        return None
    a, b = node.args
    if a == constant and isinstance(b, fx.Node):
        return b
    if b == constant and isinstance(a, fx.Node):
        return a
    return None


def _gelu_tanh_chain(out: fx.Node):
    """(x, the chain's nodes) if `out` ends a written-out tanh GELU (module docstring) whose
    intermediate values only the next op reads, else None."""
    half, k, c, one, three = _GELU_CONSTANTS
    if not _call(out, _MUL, 2):
        return None
    for h, b in (out.args, reversed(out.args)):
        x = _scaled(h, half)
        if x is None or not _call(b, _ADD, 2) or one not in b.args:
            continue
        t = b.args[1] if b.args[0] == one else b.args[0]
        if not _call(t, _TANH, 1):
            continue
        inner = _scaled(t.args[0], c)
        if not _call(inner, _ADD, 2) or x not in inner.args:
            continue
        cube = _scaled(_other(inner, x), k)
        if not (_call(cube, _POW, 2) and cube.args == (x, three)):
            continue
        chain = [out, h, b, t, t.args[0], inner, _other(inner, x), cube]
        if all(len(n.users) == 1 for n in chain[1:]) and _tensor(x) is not None:
            return x, chain
    return None


_CAT = (torch.cat, torch.concat, torch.concatenate)
_NEG = (operator.neg, torch.neg, "neg")


def _rope_chain(out: fx.Node):
    """(x, cos, sin, the chain's nodes) if `out` ends a written-out rotary embedding (module
    docstring) of a D-wide x (D even, known at capture) with cos and sin of x's dtype that
    autograd does not differentiate, whose intermediate values only the next op reads; else
    None."""
    if not _call(out, _ADD, 2):
        return None
    for direct, rotated in (out.args, reversed(out.args)):
        if not (_call(direct, _MUL, 2) and _call(rotated, _MUL, 2)):
            continue
        for x, cos in (direct.args, reversed(direct.args)):
            for cat, sin in (rotated.args, reversed(rotated.args)):
                halves = _rotated_halves(cat, x)
                if halves is None:
                    continue
                chain = [out, direct, rotated, cat, *halves]
                if all(len(n.users) == 1 for n in chain[1:]) and _rope_operands_ok(
                    x, cos, sin, out
                ):
                    return x, cos, sin, chain
    return None


def _rotated_halves(cat, x):
    """[neg, x2, x1] if `cat` is torch.cat((-x2, x1), dim=-1) with x1 = x[..., :h] and
    x2 = x[..., h:] for h half x's last dim, else None."""
    if not (
        isinstance(cat, fx.Node)
        and cat.op == "call_function"
        and cat.target in _CAT
        and len(cat.args) == 1
        and cat.kwargs in ({"dim": -1}, {"axis": -1})
        and isinstance(cat.args[0], (tuple, list))
        and len(cat.args[0]) == 2
    ):
        return None
    neg, x1 = cat.args[0]
    if not _call(neg, _NEG, 1):
        return None
    x2 = neg.args[0]
    t = _tensor(x)
    if t is None or not isinstance(t.shape[-1], int) or t.shape[-1] % 2:
        return None
    h = t.shape[-1] // 2
    if _half(x1, x) != slice(None, h, None) or _half(x2, x) != slice(h, None, None):
        return None
    return [neg, x2, x1]


def _half(node, x):
    """The slice s if node is x[..., s], else None."""
    if not (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and node.target is operator.getitem
        and node.args[0] is x
    ):
        return None
    index = node.args[1]
    if not (isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis):
        return None
    s = index[1]
    if not isinstance(s, slice) or s.step is not None:
        return None
    # A bound computed from sizes is a node; its example value is an int where x's last dim
    # is known at capture.
    bounds = [
        b.meta.get("example_value") if isinstance(b, fx.Node) else b for b in (s.start, s.stop)
    ]
    if not all(b is None or type(b) is int for b in bounds):
        return None
    return slice(*bounds)


def _rope_operands_ok(x, cos, sin, out) -> bool:
    t, c, s, o = (_tensor(n) for n in (x, cos, sin, out))
    if t is None or c is None or s is None or o is None:
        return False
    return (
        t.dtype == c.dtype == s.dtype == o.dtype
        and t.dtype.is_floating_point
        and t.device == c.device == s.device
        and not (c.requires_grad or s.requires_grad)
        and t.stride(-1) == 1
        and c.stride(-1) == 1
        and s.stride(-1) == 1
        and c.shape[-1] == s.shape[-1] == t.shape[-1]
        and _same_layout(t, o)
    )
