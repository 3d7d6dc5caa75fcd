"""Attention masks in a captured graph: masks that keep every element (dropped) or exactly
j <= i (SDPA's is_causal=True), whether made in the graph from sizes or passed in as a bool
input (mask_inputs; its values are read once per tensor, constants.checked_mask)."""

from __future__ import annotations

import operator

import torch
from torch import fx

from .constants import _Constants
from .fake import _hint, _same, _same_layout, _storages, _tensor
from .patterns import _SDPA, _match
from .report import Site, _where

# Functions that write into their first argument: Python's augmented assignments, item
# assignment.
_WRITING_FUNCTIONS = {
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
    operator.imod,
    operator.ipow,
    operator.imatmul,
    operator.iand,
    operator.ior,
    operator.ixor,
    operator.ilshift,
    operator.irshift,
    operator.setitem,
}


def _may_write(node: fx.Node) -> bool:
    """node may write into a tensor it is given: an in-place method or function (its name
    ends in one underscore), an augmented assignment, inplace=True or out=."""
    if node.op not in ("call_function", "call_method"):
        return False
    if node.kwargs.get("inplace") or node.kwargs.get("out") is not None:
        return True
    if node.op == "call_function":
        try:
            if node.target in _WRITING_FUNCTIONS:
                return True
        except TypeError:  # an unhashable callable
            pass
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__")


def _drop_mask_keeping_all(node: fx.Node, constants: _Constants):
    """torch.where(keep, p, fill) or p + mask, where the mask is constant and keeps every
    element -> p itself; returns (site, node, p), or None. transformers builds such a mask
    under torch.compile where eager mode passes none, and applies it to T5's position bias
    in every layer: a copy of heads x T x T that the model as is never makes. Sharing p's
    memory is safe where nothing writes into either tensor (nor any tensor sharing their
    memory), p has the result's layout (or the result, p broadcast over a batch, is only
    SDPA's mask: _broadcast_mask), and the result is not a graph output (the caller would
    get p's memory); the rewriter then treats the two as one tensor."""
    m = _match(node, ("where", "add"))
    out = _tensor(node)
    if m is None or out is None or any(_match(u, ("softmax", "log_softmax")) for u in node.users):
        return None  # (a softmax takes such a mask in with its site, see _softmax_inputs)
    family, a = m
    if family == "where":
        pairs = [(a["input"], a["condition"])]
    elif a["alpha"] == 1:
        pairs = [(a["input"], a["other"]), (a["other"], a["input"])]
    else:
        return None
    for p, mask in pairs:
        t, mt = _tensor(p), _tensor(mask)
        if (
            t is None
            or mt is None
            or (family == "add" and not mt.is_floating_point())  # a bool added is 0 or 1
            or t.dtype != out.dtype
            or t.device != out.device
            or not (_same_layout(t, out) or _broadcast_mask(node, t, out))
            or constants.mask_kind(mask, out.shape) != "all"
            or not _unwritten(node.graph, [node, p])
        ):
            continue
        node.replace_all_uses_with(p)
        node.graph.erase_node(node)
        site = Site(
            op="(the masked tensor itself)",
            pattern=f"{family} with a mask keeping every element",
            where=_where(node),
            shape=tuple(_hint(s) for s in out.shape),
            dtype=out.dtype,
            nbytes=out.untyped_storage().nbytes(),
        )
        return site, node, p
    return None


def _broadcast_mask(node: fx.Node, t: torch.Tensor, out: torch.Tensor) -> bool:
    """node's value `out` is `t` broadcast (a batch of masks from one), and is read only as
    scaled_dot_product_attention's attn_mask, which broadcasts t the same way itself."""
    if t.dim() != out.dim() or not all(
        _same(a, b) or _same(a, 1) for a, b in zip(t.shape, out.shape)
    ):
        return False
    for user in node.users:
        m = _match(user, ("sdpa",))
        if m is None or m[1]["attn_mask"] is not node:
            return False
        if any(arg is node for k, arg in m[1].items() if k != "attn_mask"):
            return False
    return bool(node.users)


def _unwritten(graph: fx.Graph, nodes: list[fx.Node]) -> bool:
    """No node writes into (or may write into) these nodes' memory, and none of it is an
    output of the graph."""
    keys = set().union(*map(_storages, nodes))
    sharing = {n for n in graph.nodes if _storages(n) & keys}
    return not any(
        _may_write(user) or user.op == "output" for n in sharing for user in n.users
    ) and not any(_may_write(n) for n in sharing)


def mask_inputs(graph: fx.Graph) -> tuple[int, ...]:
    """Positions among the graph's inputs of the bool tensors that scaled_dot_product_attention
    reads as its mask, directly or through ops of sizes (a slice): masks made outside the
    graph, which _fold_sdpa_mask folds where their values (constants.checked_mask) allow.
    Bool alone: what checked_mask finds then stands for the tensor exactly, whatever ops
    follow; a float input may be anything (a bias, the activations)."""
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    candidates = {}
    for i, node in enumerate(placeholders):
        t = node.meta.get("example_value")
        if isinstance(t, torch.Tensor) and t.dtype == torch.bool and t.dim() >= 2:
            candidates[node] = i
    if not candidates:
        return ()
    constants = _Constants(graph, masks=tuple(candidates.values()))
    found = set()
    for node in graph.nodes:
        m = _match(node, ("sdpa",))
        mask = m[1]["attn_mask"] if m is not None else None
        if not isinstance(mask, fx.Node) or mask not in constants.nodes:
            continue
        needed, seen = [mask], set()
        while needed:
            n = needed.pop()
            if n not in seen:
                seen.add(n)
                needed.extend(n.all_input_nodes)
        found.update(candidates[n] for n in seen if n in candidates)
    return tuple(sorted(found))


def _fold_sdpa_mask(node: fx.Node, constants: _Constants) -> Site | None:
    """scaled_dot_product_attention with a constant mask that keeps everything -> no mask;
    one that keeps exactly j <= i (square scores) -> is_causal=True, as eager mode does."""
    m = _match(node, ("sdpa",))
    if m is None:
        return None
    a = m[1]
    mask, q, k = a["attn_mask"], _tensor(a["query"]), _tensor(a["key"])
    if mask is None or a["is_causal"] or q is None or k is None or q.dim() < 2:
        return None
    shape = (*q.shape[:-1], k.shape[-2])
    kind = constants.mask_kind(mask, shape)
    if kind is None or (kind == "causal" and not _same(shape[-1], shape[-2])):
        return None
    args = dict(zip(_SDPA, node.args))
    args.update(node.kwargs)
    args["attn_mask"] = None
    if kind == "causal":
        args["is_causal"] = True
    node.args, node.kwargs = (), args
    value = _tensor(mask)
    return Site(
        op="scaled_dot_product_attention" + ("(is_causal=True)" if kind == "causal" else ""),
        pattern=f"attention mask keeping {'every element' if kind == 'all' else 'j <= i'}",
        where=_where(node),
        shape=tuple(_hint(s) for s in value.shape),
        dtype=value.dtype,
        nbytes=_hint(value.untyped_storage().nbytes()),
    )
