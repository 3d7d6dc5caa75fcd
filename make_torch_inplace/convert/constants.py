"""Values computed from sizes and constants alone, attention masks above all, evaluated for given
sizes to tell what a mask keeps."""

from __future__ import annotations

import operator

import torch
from torch import fx

from . import _compat

# Functions and Tensor methods that compute their result from their arguments alone, the ops
# models build attention masks from (arange, comparisons, broadcasting, cumsum ...).
_PURE_FUNCTIONS = {
    torch.Size,
    torch.sym_max,
    torch.sym_min,
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
    """The nodes whose value depends on no graph input but sizes: pure ops of constants and of
    the graph's size placeholders (the SymInts Dynamo passes for the sizes it keeps dynamic).

    Models build attention masks this way; transformers does so under torch.compile even
    where it passes no mask in eager mode (it cannot test the mask's values while tracing),
    which sends scaled_dot_product_attention from its flash kernel to a masked one, or to the
    math path that materialises the scores. Such a value is the same on every call with the
    same sizes: mask_kind computes it for `sizes` (the values of the size placeholders in
    graph order; default: the traced example's), on the CPU, to tell what the mask keeps.
    Each answer that depends on the sizes is kept in `queries` with the query, which tells it
    again for other sizes: a graph rewritten on these answers is right for exactly the sizes
    for which every query gives the same answer (see runtime._SizeClasses).
    """

    def __init__(self, graph: fx.Graph, sizes: tuple | None = None, masks: tuple = ()) -> None:
        placeholders = _key_placeholders(graph, masks)
        if sizes is None:
            sizes = tuple(_compat.size_hint(node.meta["example_value"]) for _, node in placeholders)
        self.sizes = sizes
        # Each key placeholder's index in `sizes`, and the sympy symbol each size stands for.
        self._index = {node: i for i, (_, node) in enumerate(placeholders)}
        self._symbols = {
            _compat.size_expr(node.meta["example_value"]): i
            for i, (_, node) in enumerate(placeholders)
            if isinstance(node.meta.get("example_value"), torch.SymInt)
        }
        self.nodes: set[fx.Node] = set(self._index)
        for node in graph.nodes:
            pure = (node.op == "call_function" and _hashable_in(node.target, _PURE_FUNCTIONS)) or (
                node.op == "call_method" and node.target in _PURE_METHODS
            )
            if pure and all(i in self.nodes for i in node.all_input_nodes):
                self.nodes.add(node)
        self.queries: list[tuple[_MaskQuery, str | None]] = []

    def mask_kind(self, mask, shape, added: bool = False) -> str | None:
        """What an attention mask broadcast to `shape` (..., q, k) keeps for these sizes:
        "all" (every element), "causal" (exactly j <= i), or None (something else, or
        unknown). A bool mask keeps its True elements, unless it is `added` to the scores
        (as 0 or 1: no mask); a float mask is additive, keeping its zeros and dropping -inf
        or the lowest finite value of its dtype."""
        if not isinstance(mask, fx.Node) or mask not in self.nodes or len(shape) < 2:
            return None
        query = _MaskQuery(mask, shape, added, self)
        kind = query.kind(self.sizes)
        if query.uses_sizes:
            self.queries.append((query, kind))
        return kind

    def holds(self, condition) -> bool:
        """Whether `condition` (a bool, or a SymBool of sizes) holds for these sizes; False
        where that is unknown."""
        if isinstance(condition, bool) or _compat.known_true(condition):
            return bool(condition)
        query = _SizeQuery(condition, self._symbols)
        answer = query.kind(self.sizes)
        self.queries.append((query, answer))
        return answer is True

    def erase_unused(self, graph: fx.Graph) -> None:
        for node in reversed(graph.nodes):
            if node in self.nodes and not node.users and node.op != "placeholder":
                graph.erase_node(node)
                self.nodes.discard(node)


class _Recipe:
    """How to compute one value of a graph from sizes alone, as a function of them: the steps
    from constants and key placeholders to it (copied, so the graph may change afterwards)."""

    def __init__(self, value: fx.Node, constants: _Constants) -> None:
        needed = {value}
        steps = []
        for node in reversed(value.graph.nodes):  # the value's ancestors, in graph order
            if node in needed:
                needed.update(node.all_input_nodes)
                index = constants._index.get(node)
                steps.append((node, index, node.op, node.target, node.args, node.kwargs))
        self._steps = steps[::-1]
        self._value = value
        self.uses_keys = any(index is not None for _, index, *_ in steps)

    def evaluate(self, sizes: tuple):
        """The value for these sizes (and bool input masks: _Kept), computed on the CPU."""
        env = {}
        for node, index, op, target, args, kwargs in self._steps:
            if index is not None:
                key = sizes[index]
                env[node] = key.evaluate() if isinstance(key, _Kept) else key
                continue
            args, kwargs = fx.node.map_arg((args, kwargs), env.__getitem__)
            args, kwargs = _on_cpu(args), {k: _on_cpu(v, k) for k, v in kwargs.items()}
            if op == "call_function":
                env[node] = target(*args, **kwargs)
            else:
                self_arg, *rest = args
                if target == "to":  # .to("cuda"): a device given as a string
                    rest = [_on_cpu(a, "device") if isinstance(a, str) else a for a in rest]
                env[node] = getattr(self_arg, target)(*rest, **kwargs)
        return env[self._value]


class _Kept:
    """What a bool input mask of a graph keeps, checked on its values (checked_mask): "all"
    or "causal" elements, for its shape. Equal for equal answers, so a graph keys its rewrites
    on it as on sizes; evaluate() gives a CPU tensor equal to the mask, from which the graph's
    mask steps are computed as from a mask of sizes."""

    __slots__ = ("kind", "shape")

    def __init__(self, kind: str, shape: tuple[int, ...]) -> None:
        self.kind, self.shape = kind, shape

    def __eq__(self, other) -> bool:
        return isinstance(other, _Kept) and (self.kind, self.shape) == (other.kind, other.shape)

    def __hash__(self) -> int:
        return hash((self.kind, self.shape))

    def evaluate(self) -> torch.Tensor:
        keep = torch.ones(self.shape[-2:], dtype=torch.bool)
        return (keep.tril() if self.kind == "causal" else keep).expand(self.shape)


# Each input mask checked so far (checked_mask), by tensor, with its version counter then.
# Weak: an entry leaves with its tensor.
_CHECKED = _compat.tensor_memo()


def checked_mask(t: torch.Tensor) -> _Kept | None:
    """What the bool attention mask t keeps ("all" or "causal" elements: _Kept), None for
    anything else. Where Dynamo splits a forward into graphs (FSDP2's hooks are graph
    breaks), a mask computed in one graph, or in eager code between graphs, is an input of
    the graphs of the layers that read it: their rewrites then depend on its values, read
    here once per tensor (on its device: a sync with the host), not once per layer. A
    tensor written since it was checked is checked again."""
    version = _compat.version(t)
    memo = _CHECKED if version is not None else None
    hit = memo.get(t) if memo is not None else None
    if hit is not None and hit[1] == version:
        return hit[0]
    real = _compat.real_tensors()
    kind = None
    if real is not None and t.dtype == torch.bool and t.dim() >= 2:
        with real, torch.no_grad():
            kind = _classify(t, tuple(t.shape), added=False)
    kept = None if kind is None else _Kept(kind, tuple(t.shape))
    if memo is not None:
        memo[t] = (kept, version)
    return kept


class _MaskQuery:
    """What one mask keeps, as a function of the sizes: how the mask is computed (_Recipe)
    and the shape of the scores it is broadcast to."""

    def __init__(self, mask: fx.Node, shape, added: bool, constants: _Constants) -> None:
        self._recipe = _Recipe(mask, constants)
        self._added = added
        self._shape = tuple(shape)
        self._symbols = constants._symbols
        self.uses_sizes = self._recipe.uses_keys or not all(isinstance(s, int) for s in self._shape)

    def kind(self, sizes: tuple) -> str | None:
        shape = tuple(_compat.evaluate_size(s, _values(self._symbols, sizes)) for s in self._shape)
        real = _compat.real_tensors()
        if real is None or None in shape or None in sizes:  # no real tensors, or sizes unknown
            return None
        with real, torch.no_grad():
            try:
                return _classify(self._recipe.evaluate(sizes), shape, self._added)
            except (RuntimeError, TypeError, ValueError, IndexError):
                return None  # an unusual argument: unknown


class _SizeQuery:
    """Whether a condition on sizes (a SymBool) holds, as a function of the sizes."""

    def __init__(self, condition, symbols: dict) -> None:
        self._condition = condition
        self._symbols = symbols

    def kind(self, sizes: tuple[int, ...]) -> bool | None:
        value = _compat.evaluate_size(self._condition, _values(self._symbols, sizes))
        return value if isinstance(value, bool) else None


def _values(symbols: dict, sizes: tuple) -> dict:
    """{sympy symbol: its value} for these sizes (each size placeholder's symbol -> index)."""
    return {s: sizes[i] for s, i in symbols.items() if s is not None and sizes[i] is not None}


def _classify(m, shape: tuple[int, ...], added: bool) -> str | None:
    """What a mask value m broadcast to `shape` keeps (see _Constants.mask_kind). Only m's
    own elements are compared: the dims it is broadcast along repeat them."""
    if not isinstance(m, torch.Tensor) or m.dim() > len(shape):
        return None
    if torch.broadcast_shapes(m.shape, shape) != torch.Size(shape):
        return None  # would grow the scores
    if m.dtype == torch.bool and not added:
        keep = m
    elif m.is_floating_point():
        keep = m == 0
        if not (keep | (m <= torch.finfo(m.dtype).min)).all():
            return None
    else:
        return None
    if keep.all():
        return "all"
    q, k = shape[-2:]
    keep = keep.expand(*keep.shape[:-2], q, k) if keep.dim() >= 2 else keep.expand(q, k)
    causal = torch.ones(q, k, dtype=torch.bool, device=keep.device).tril()
    return "causal" if torch.equal(keep, causal.expand(keep.shape)) else None


def _on_cpu(value, name: str | None = None):
    """An argument of a mask's step with its device replaced by the CPU's: a mask is
    classified on the CPU, with no device memory and no launches. Mask steps compute on
    integers and compare, which give the same values on every device."""
    if isinstance(value, torch.device) or (name == "device" and value is not None):
        return torch.device("cpu")
    if type(value) in (list, tuple):
        return type(value)(_on_cpu(v) for v in value)
    return value


def _size_placeholders(graph: fx.Graph) -> list[tuple[int, fx.Node]]:
    """(position among the graph's inputs, node) of each placeholder of a dynamic size."""
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    return [
        (i, node)
        for i, node in enumerate(placeholders)
        if isinstance(node.meta.get("example_value"), torch.SymInt)
    ]


def _key_placeholders(graph: fx.Graph, masks: tuple = ()) -> list[tuple[int, fx.Node]]:
    """The placeholders a graph's rewrites may depend on: its dynamic sizes, then the inputs
    at positions `masks` (attention masks, whose values checked_mask reads)."""
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    return _size_placeholders(graph) + [(i, placeholders[i]) for i in masks]


def _hashable_in(target, collection) -> bool:
    try:
        return target in collection
    except TypeError:  # an unhashable callable
        return False
