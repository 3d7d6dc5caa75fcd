"""The ops convert recognises in Dynamo's graphs: their parameter names and defaults, the
in-place op each elementwise one becomes, and the ways a softmax's input reads as a scaled and
masked tensor."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import fx

from . import _compat
from .constants import _Constants
from .fake import _inplace_ok, _tensor
from .pieces import rope

# Parameter names of each recognised function or Tensor method, in positional order.
_SOFTMAX_F = ("input", "dim", "_stacklevel", "dtype")
_SOFTMAX = ("input", "dim", "dtype")
_LINEAR = ("input", "weight", "bias")
_MATMUL = ("input", "other")
_ADDMM = ("input", "mat1", "mat2", "beta", "alpha")
_LAYER_NORM = ("input", "normalized_shape", "weight", "bias", "eps")
_RMS_NORM = ("input", "normalized_shape", "weight", "eps")
_BINARY = ("input", "other")
_ALPHA = ("input", "other", "alpha")
_DIV = ("input", "other", "rounding_mode")
_UNARY = ("input",)
_WITH_INPLACE = ("input", "inplace")
_POW = ("input", "exponent")
_WHERE = ("condition", "input", "other")
_CROSS_ENTROPY = (
    "input",
    "target",
    "weight",
    "size_average",
    "ignore_index",
    "reduce",
    "reduction",
    "label_smoothing",
)
_SDPA = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_UNARY_NAMES = ("tanh", "exp", "sigmoid", "neg", "rsqrt", "sqrt", "relu")

_FUNCTIONS: dict[Callable, tuple[str, tuple[str, ...]]] = {
    F.linear: ("linear", _LINEAR),
    operator.matmul: ("matmul", _MATMUL),
    torch.matmul: ("matmul", _MATMUL),
    torch.mm: ("matmul", _MATMUL),
    torch.addmm: ("addmm", _ADDMM),
    F.softmax: ("softmax", _SOFTMAX_F),
    torch.softmax: ("softmax", _SOFTMAX),
    F.log_softmax: ("log_softmax", _SOFTMAX_F),
    torch.log_softmax: ("log_softmax", _SOFTMAX),
    F.layer_norm: ("layer_norm", _LAYER_NORM),
    torch.layer_norm: ("layer_norm", (*_LAYER_NORM, "cudnn_enable")),
    F.rms_norm: ("rms_norm", _RMS_NORM),
    torch.rms_norm: ("rms_norm", _RMS_NORM),
    operator.add: ("add", _BINARY),
    torch.add: ("add", _ALPHA),
    operator.sub: ("sub", _BINARY),
    torch.sub: ("sub", _ALPHA),
    operator.mul: ("mul", _BINARY),
    torch.mul: ("mul", _BINARY),
    operator.truediv: ("div", _BINARY),
    torch.div: ("div", _DIV),
    F.relu: ("relu", _WITH_INPLACE),
    F.silu: ("silu", _WITH_INPLACE),
    F.gelu: ("gelu", ("input", "approximate")),
    torch.pow: ("pow", _POW),
    torch.where: ("where", _WHERE),
    F.scaled_dot_product_attention: ("sdpa", _SDPA),
    F.cross_entropy: ("cross_entropy", _CROSS_ENTROPY),
    rope: ("rope", ("input", "cos", "sin")),
    **{getattr(torch, name): (name, _UNARY) for name in _UNARY_NAMES},
}

_METHODS: dict[str, tuple[str, tuple[str, ...]]] = {
    "softmax": ("softmax", _SOFTMAX),
    "log_softmax": ("log_softmax", _SOFTMAX),
    "matmul": ("matmul", _MATMUL),
    "add": ("add", _ALPHA),
    "sub": ("sub", _ALPHA),
    "mul": ("mul", _BINARY),
    "div": ("div", _DIV),
    "pow": ("pow", _POW),
    "where": ("where", ("input", "condition", "other")),
    **{name: (name, _UNARY) for name in _UNARY_NAMES},
}

# Defaults of the optional parameters; a parameter without one is required.
_SOFTMAX_DEFAULTS = {"dim": None, "_stacklevel": 3, "dtype": None}
_DEFAULTS: dict[str, dict[str, object]] = {
    "linear": {"bias": None},
    "matmul": {},
    "addmm": {"beta": 1, "alpha": 1},
    "softmax": _SOFTMAX_DEFAULTS,
    "log_softmax": _SOFTMAX_DEFAULTS,
    "layer_norm": {"weight": None, "bias": None, "eps": 1e-5, "cudnn_enable": True},
    "rms_norm": {"weight": None, "eps": None},
    "add": {"alpha": 1},
    "sub": {"alpha": 1},
    "mul": {},
    "div": {"rounding_mode": None},
    "relu": {"inplace": False},
    "silu": {"inplace": False},
    "gelu": {"approximate": "none"},
    "pow": {},
    "where": {},
    "cross_entropy": {
        "weight": None,
        "size_average": None,
        "ignore_index": -100,
        "reduce": None,
        "reduction": "mean",
        "label_smoothing": 0.0,
    },
    "sdpa": {
        "attn_mask": None,
        "dropout_p": 0.0,
        "is_causal": False,
        "scale": None,
        "enable_gqa": False,
    },
    "rope": {},
    **{name: {} for name in _UNARY_NAMES if name != "relu"},
}

# Elementwise family -> (in-place op, operands after the one written over, kwargs carried).
_ELEMENTWISE: dict[str, tuple[Callable, tuple[str, ...], tuple[str, ...]]] = {
    "add": (torch.Tensor.add_, ("other",), ("alpha",)),
    "sub": (torch.Tensor.sub_, ("other",), ("alpha",)),
    "mul": (torch.Tensor.mul_, ("other",), ()),
    "div": (torch.Tensor.div_, ("other",), ("rounding_mode",)),
    "pow": (torch.Tensor.pow_, ("exponent",), ()),
    "relu": (torch.relu_, (), ()),
    "silu": (_compat.inplace_activation("silu_"), (), ()),
    "gelu": (_compat.inplace_activation("gelu_"), (), ("approximate",)),
    **{
        name: (getattr(torch.Tensor, name + "_"), (), ()) for name in _UNARY_NAMES if name != "relu"
    },
}


def _match(node: fx.Node, families: Sequence[str] | None = None):
    """(family, {parameter: argument}) for a node we know how to rewrite, else None."""
    if node.op == "call_function":
        try:
            spec = _FUNCTIONS.get(node.target)
        except TypeError:  # an unhashable callable
            return None
    elif node.op == "call_method":
        spec = _METHODS.get(node.target)
    else:
        return None
    if spec is None or (families is not None and spec[0] not in families):
        return None
    family, params = spec
    bound = dict(_DEFAULTS[family])
    if len(node.args) > len(params) or any(k not in params for k in node.kwargs):
        return None
    bound.update(zip(params, node.args))
    bound.update(node.kwargs)
    if any(p not in bound for p in params):
        return None
    return family, bound


def _name(node: fx.Node) -> str:
    m = _match(node)
    return m[0] if m is not None else str(node.target)


def _op_name(fn: Callable) -> str:
    return getattr(fn, "__name__", str(fn))


def _is_conversion(node: fx.Node, src: fx.Node) -> bool:
    """node converts src's value to another dtype (whether it does so is checked by the caller)."""
    return (
        node.op == "call_method"
        and node.target in ("to", "type", "bfloat16", "half", "float")
        and node.args[:1] == (src,)
    )


def _softmax_inputs(x: fx.Node, constants: _Constants):
    """Ways to read softmax's input x as base * scale + mask: (base, scale, mask, causal,
    folded nodes in graph order), the most folded first. mask is an additive mask node or
    None; causal says the mask (folded) keeps exactly j <= i. Folded nodes are used only by
    the next."""
    found = [(x, None, None, False, [])]
    for p, mask, causal in _split_mask(x, constants):
        found.append((p, None, mask, causal, [x]))
        split = _split_scale(p)
        if split is not None:
            base, scale = split
            found.append((base, scale, mask, causal, [p, x]))
    split = _split_scale(x)
    if split is not None:
        found.append((split[0], split[1], None, False, [x]))
    return sorted(found, key=lambda c: -len(c[4]))


def _split_mask(node: fx.Node, constants: _Constants) -> list[tuple[fx.Node, fx.Node | None, bool]]:
    """(p, mask, causal) with node == p masked, p having node's layout: `p + mask` with an
    additive mask, or a mask that depends on no input and keeps everything (mask None) or
    exactly the causal part (causal), added or applied as torch.where(keep, p, lowest)."""
    if len(node.users) != 1:
        return []
    out = _tensor(node)
    m = _match(node, ("add", "where"))
    if m is None or out is None:
        return []
    family, a = m
    if family == "where":
        p, fill = a["input"], a["other"]
        kind = constants.mask_kind(a["condition"], out.shape) if _drops(fill, out.dtype) else None
        candidates = [(p, None)] if kind is not None else []
    elif a["alpha"] == 1:
        candidates = [(a["input"], a["other"]), (a["other"], a["input"])]
    else:
        candidates = []
    pairs = []
    for p, mask in candidates:
        t = _tensor(p)
        if t is None or not _inplace_ok(t, out, mti_op=True):
            continue
        if family == "add":
            kind = constants.mask_kind(mask, out.shape, added=True)
        if kind is not None:
            pairs.append((p, None, kind == "causal"))
        elif _tensor(mask) is not None:
            pairs.append((p, mask, False))
    return pairs


def _drops(fill, dtype: torch.dtype) -> bool:
    """torch.where(keep, p, fill) with this fill value drops an element from a softmax (its
    exp underflows to 0): -inf or the lowest finite value of p's dtype or below."""
    return (
        isinstance(fill, (int, float))
        and not isinstance(fill, bool)
        and dtype.is_floating_point
        and fill <= torch.finfo(dtype).min
    )


def _split_scale(node: fx.Node) -> tuple[fx.Node, float] | None:
    """(p, c) with node == p * c for a Python number c (node == p / d: c = 1 / d), p having
    node's layout."""
    m = _match(node, ("mul", "div"))
    if m is None or len(node.users) != 1:
        return None
    family, a = m
    out = _tensor(node)
    if family == "div":
        d = a["other"]
        if a["rounding_mode"] is not None or not _is_number(d) or d == 0:
            return None
        orders = ((a["input"], 1.0 / d),)
    else:
        orders = ((a["input"], a["other"]), (a["other"], a["input"]))
    for p, c in orders:
        t = _tensor(p)
        if _is_number(c) and t is not None and _inplace_ok(t, out, mti_op=True):
            return p, float(c)
    return None


def _is_number(c) -> bool:
    return isinstance(c, (int, float)) and not isinstance(c, bool)
