"""What Dynamo's example values (FakeTensors) tell about a graph's tensors: which share
storage, their layouts, and whether an op may write one over another."""

from __future__ import annotations

import operator
from collections.abc import Hashable

import torch
import torch.nn.functional as F
from torch import fx

from . import _compat

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _drops_nothing(node: fx.Node) -> bool:
    """node is a dropout that returns its input itself (eval mode, or p = 0), which Dynamo's
    example values may show as a copy."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.target is F.dropout:
        names = ("input", "p", "training", "inplace")
    elif node.target is torch.dropout:
        names = ("input", "p", "train")
    else:
        return False
    a = {"p": 0.5, "training": True, "train": True, **dict(zip(names, node.args)), **node.kwargs}
    return not (a["training"] and a["train"]) or a["p"] == 0


def _returns_input(node: fx.Node) -> bool:
    """node's value is its first argument's tensor as is, and node writes nothing: a dropout
    that drops nothing, .contiguous() / .to() / .type() that copy nothing."""
    if not (
        _drops_nothing(node)
        or (node.op == "call_method" and node.target in ("contiguous", "to", "type") and node.args)
    ):
        return False
    t, u = _tensor(node), _tensor(node.args[0])
    return (
        t is not None
        and u is not None
        and t.dtype == u.dtype
        and _same_layout(t, u)
        and _same(t.storage_offset(), u.storage_offset())
    )


def _tensor(arg) -> torch.Tensor | None:
    """The fake tensor an argument stands for, or None if it is not a tensor node."""
    if not isinstance(arg, fx.Node):
        return None
    value = arg.meta.get("example_value")
    return value if isinstance(value, torch.Tensor) else None


def _storages(node: fx.Node) -> set[Hashable]:
    value = node.meta.get("example_value")
    return {
        _compat.storage_key(t) for t in _compat.tree_leaves(value) if isinstance(t, torch.Tensor)
    }


def _unanalyzable_node(graph: fx.Graph) -> fx.Node | None:
    """A node whose aliasing cannot be read from fake values, if the graph has one. An op
    that returns nothing (it only mutates its arguments, like ours, or item assignment
    x[i] = v) has no value to analyse, and its mutations are reads of its inputs at its
    position."""
    for node in graph.nodes:
        value = node.meta.get("example_value")
        if any(
            isinstance(t, torch.Tensor)
            and (t.layout != torch.strided or _compat.storage_key(t) is None)
            for t in _compat.tree_leaves(value)
        ):
            return node
        if "example_value" not in node.meta and (
            node.op == "get_attr"
            or (
                node.op.startswith("call_")
                and not _compat.returns_nothing(node.target)
                and node.target is not operator.setitem
                and any(map(_storages, node.all_input_nodes))
            )
        ):
            return node
    return None


def _same(a, b) -> bool:
    """a == b for every value of the symbols in them (ints or SymInts)."""
    return _compat.known_true(a == b)


def _hint(size) -> int:
    """A size's value in the traced example (SymInts hold one)."""
    if isinstance(size, int):
        return size
    hint = _compat.size_hint(size)
    return int(hint) if hint is not None else 0


def _same_layout(t: torch.Tensor, u: torch.Tensor) -> bool:
    if t.dim() != u.dim() or not all(_same(a, b) for a, b in zip(t.shape, u.shape)):
        return False
    return all(_same(s, 1) or _same(a, b) for s, a, b in zip(t.shape, t.stride(), u.stride()))


def _contiguous_dims(sizes, strides) -> bool:
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if _same(size, 1):
            continue
        if not _same(stride, expected):
            return False
        expected = expected * size
    return True


def _dense(t: torch.Tensor) -> bool:
    """t's elements fill a block of memory, each once (a permuted contiguous tensor)."""
    order = sorted(range(t.dim()), key=lambda d: -_hint(t.stride(d)))
    return _contiguous_dims([t.shape[d] for d in order], [t.stride(d) for d in order])


def _inplace_ok(t: torch.Tensor, out: torch.Tensor | None, mti_op: bool) -> bool:
    """Writing `out` over `t` keeps the value later nodes were traced with: same shape,
    strides, dtype, device. Our ops take contiguous float tensors; PyTorch's in-place ops
    any dense one (an expanded tensor would write one element for many)."""
    if out is None or t.dtype != out.dtype or t.device != out.device:
        return False
    if not _same_layout(t, out):
        return False
    if mti_op:
        return t.dtype in _FLOAT_DTYPES and _contiguous_dims(t.shape, t.stride())
    return _dense(t)


def _like(p: torch.Tensor | None, t: torch.Tensor) -> bool:
    return p is not None and p.dtype == t.dtype and p.device == t.device


def _mask_ok(mask: torch.Tensor | None, t: torch.Tensor) -> bool:
    """An additive mask that softmax_ can read: t's dtype and device, broadcastable to t."""
    if not _like(mask, t) or mask.dim() > t.dim():
        return False
    return all(_same(m, 1) or _same(m, s) for m, s in zip(reversed(mask.shape), reversed(t.shape)))
