"""Values computed from sizes and constants alone, attention masks above all, evaluated once at
capture to tell what a mask keeps."""

from __future__ import annotations

import operator

import torch
from torch import fx

from . import _compat
from .fake import _hint

# Functions and Tensor methods that compute their result from their arguments alone, the ops
# models build attention masks from (arange, comparisons, broadcasting, cumsum ...).
_PURE_FUNCTIONS = {
    torch.arange,
    torch.tensor,
    torch.scalar_tensor,
    torch.ones,
    torch.zeros,
    torch.full,
    torch.ones_like,
    torch.zeros_like,
    torch.full_like,
    torch.tril,
    torch.triu,
    torch.diff,
    torch.cumsum,
    torch.where,
    torch.logical_and,
    torch.logical_or,
    torch.logical_not,
    torch.eq,
    torch.ne,
    torch.lt,
    torch.le,
    torch.gt,
    torch.ge,
    operator.add,
    operator.sub,
    operator.mul,
    operator.floordiv,
    operator.mod,
    operator.neg,
    operator.invert,
    operator.and_,
    operator.or_,
    operator.xor,
    operator.eq,
    operator.ne,
    operator.lt,
    operator.le,
    operator.gt,
    operator.ge,
    operator.getitem,
}
_PURE_METHODS = {
    "to",
    "type",
    "expand",
    "view",
    "reshape",
    "unsqueeze",
    "squeeze",
    "transpose",
    "permute",
    "contiguous",
    "bool",
    "int",
    "long",
    "float",
    "half",
    "bfloat16",
    "new_ones",
    "new_zeros",
    "new_full",
    "cumsum",
    "diff",
    "masked_fill",
    "logical_not",
    "logical_and",
    "logical_or",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "__and__",
    "__or__",
    "__xor__",
    "__invert__",
    # Dynamo may record `a == b` on tensors as a call of the method (transformers' test for
    # packed sequences).
    "__eq__",
    "__ne__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
}


class _Constants:
    """The nodes whose value depends on no graph input: pure ops of constants and sizes.

    Models build attention masks this way; transformers does so under torch.compile even
    where it passes no mask in eager mode (it cannot test the mask's values while tracing),
    which sends scaled_dot_product_attention from its flash kernel to a masked one, or to the
    math path that materialises the scores. The converted model is captured with static
    shapes (see ConvertedModule), so such a value is the same on every call of the graph:
    computing it once here, on real tensors, tells what the mask keeps.
    """

    def __init__(self, graph: fx.Graph) -> None:
        self.nodes: set[fx.Node] = set()
        for node in graph.nodes:
            pure = (node.op == "call_function" and _hashable_in(node.target, _PURE_FUNCTIONS)) or (
                node.op == "call_method" and node.target in _PURE_METHODS
            )
            if pure and _static(node) and all(i in self.nodes for i in node.all_input_nodes):
                self.nodes.add(node)
        self._values: dict[fx.Node, object] = {}

    def value(self, node: fx.Node):
        """node's real value, or None if it is not constant or computing it failed."""
        if node not in self.nodes:
            return None
        if node not in self._values:
            self._values[node] = None
            real = _compat.real_tensors()
            if real is None:  # no way to compute on real tensors here: nothing is known
                return None
            with real, torch.no_grad():
                try:
                    args, kwargs = fx.node.map_arg((node.args, node.kwargs), self._input)
                    if node.op == "call_function":
                        self._values[node] = node.target(*args, **kwargs)
                    else:
                        self_arg, *rest = args
                        self._values[node] = getattr(self_arg, node.target)(*rest, **kwargs)
                except (_NotConstant, RuntimeError, TypeError, ValueError, IndexError):
                    pass  # an input is unknown, or an unusual argument: stays unknown
        return self._values[node]

    def _input(self, node: fx.Node):
        value = self.value(node)
        if value is None:
            raise _NotConstant
        return value

    def mask_kind(self, mask, shape) -> str | None:
        """What an attention mask broadcast to `shape` (..., q, k) keeps: "all" (every
        element), "causal" (exactly j <= i), or None (something else, or unknown). A bool
        mask keeps its True elements; a float mask is additive, keeping its zeros and
        dropping -inf or the lowest finite value of its dtype; anything else is unknown."""
        if not isinstance(mask, fx.Node) or len(shape) < 2:
            return None
        m = self.value(mask)
        if not isinstance(m, torch.Tensor) or m.dim() > len(shape):
            return None
        shape = tuple(_hint(s) for s in shape)
        with _compat.real_tensors(), torch.no_grad():  # (m was computed, so there is one)
            if m.dtype == torch.bool:
                keep = m
            elif m.is_floating_point():
                keep = m == 0
                if not (keep | (m <= torch.finfo(m.dtype).min)).all():
                    return None
            else:
                return None
            try:
                keep = keep.expand(shape)
            except RuntimeError:  # would not broadcast to the scores without growing them
                return None
            if keep.all():
                return "all"
            q, k = shape[-2:]
            causal = torch.ones(q, k, dtype=torch.bool, device=keep.device).tril()
            return "causal" if torch.equal(keep, causal.expand(shape)) else None

    def erase_unused(self, graph: fx.Graph) -> None:
        for node in reversed(graph.nodes):
            if node in self.nodes and not node.users:
                graph.erase_node(node)
                self.nodes.discard(node)


class _NotConstant(Exception):
    pass


def _static(node: fx.Node) -> bool:
    """node's value has no symbolic size (which would make it differ between calls)."""
    return all(
        isinstance(s, int)
        for t in _compat.tree_leaves(node.meta.get("example_value"))
        if isinstance(t, torch.Tensor)
        for s in (*t.shape, *t.stride())
    )


def _hashable_in(target, collection) -> bool:
    try:
        return target in collection
    except TypeError:  # an unhashable callable
        return False
