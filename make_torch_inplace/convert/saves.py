"""What autograd keeps of a graph's tensors for the backward pass.

In a graph captured where autograd records (training), a tensor that an op saves for the
backward must keep its value until the backward has run: no op may write over it, not even
after its last read in the forward. And an op's in-place form has saves of its own: ours save
their output (softmax_, the norms, cross_entropy_) or nothing of x (square_matmul_ by a frozen
weight); PyTorch's in-place elementwise ops save their output (tanh_, exp_), nothing (add_), or
a copy of their input that they make first (mul_ by a tensor that requires grad, gelu_): that
copy is the memory the rewrite meant to save, so such a rewrite is not made.

Both are found by running ops on fake tensors (no memory, no compute) under
torch.autograd.graph.saved_tensors_hooks, which sees every tensor autograd saves: the whole
captured graph once (saved_values), and an in-place form once per kind of call (inplace_saves).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable

import torch
from torch import fx

from . import _compat
from .fake import _hint, _tensor


def recording(graph: fx.Graph) -> bool:
    """Autograd records this graph: a value it computes requires grad (its inputs may require
    grad where grad mode is off: parameters under torch.no_grad)."""
    return any(
        isinstance(t, torch.Tensor) and t.requires_grad
        for node in graph.nodes
        if node.op not in ("placeholder", "get_attr")
        for t in _compat.tree_leaves(node.meta.get("example_value"))
    )


def saved_values(gm: fx.GraphModule) -> dict[fx.Node, set[fx.Node]] | None:
    """For each node, the nodes whose values (or tensors sharing their storage) it saves for
    the backward. The graph runs on new fake tensors with the capture's sizes (its example
    values carry symbolic sizes, whose guards this run must not touch). None where the graph
    cannot run on fake tensors (a value read as a Python number)."""
    mode = _compat.fake_mode()
    if mode is None:
        return None
    owner: dict[Hashable, fx.Node] = {}  # storage -> the first node whose value holds it
    packed: list[tuple[fx.Node, Hashable]] = []  # (the node saving, the storage it saves)
    running: list[fx.Node] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        # Matched to nodes after the run: an op may save its own output (tanh, softmax),
        # whose node is known only once the op returns.
        packed.append((running[-1], _compat.storage_key(t)))
        return t

    class Run(fx.Interpreter):
        def run_node(self, node):
            running.append(node)
            if node.op == "placeholder":
                value = _fresh(node.meta.get("example_value"))
            else:
                value = super().run_node(node)
            for t in _compat.tree_leaves(value):
                if isinstance(t, torch.Tensor):
                    owner.setdefault(_compat.storage_key(t), node)
            return value

    try:
        with mode, torch.enable_grad(), _saving(pack):
            # Every value kept to the end: a freed storage's key could come back as another's.
            run = Run(gm, garbage_collect_values=False)
            run.run(*[None] * sum(n.op == "placeholder" for n in gm.graph.nodes))
    except Exception:  # any op that cannot run on fake tensors
        return None
    saved: dict[fx.Node, set[fx.Node]] = {}
    for node, key in packed:
        if key in owner:  # else a tensor of the op's own (a norm's statistics)
            saved.setdefault(node, set()).add(owner[key])
    return saved


def _fresh(example):
    """A new fake tensor like `example` at its sizes' hints (or the hint of a symbolic size)."""
    if not isinstance(example, torch.Tensor):
        return _hint(example) if isinstance(example, torch.SymInt) else example
    t = torch.empty_strided(
        [_hint(s) for s in example.shape],
        [_hint(s) for s in example.stride()],
        dtype=example.dtype,
        device=example.device,
    )
    return t.requires_grad_(example.requires_grad)


def _saving(pack: Callable) -> contextlib.AbstractContextManager:
    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


# What an in-place form saves, per kind of call: (op, the call's arguments' kinds).
_INPLACE_SAVES: dict[tuple, tuple[bool, bool] | None] = {}


def inplace_saves(fn: Callable, args: tuple, kwargs: dict) -> tuple[bool, bool] | None:
    """(copies, keeps_output) of fn(*args, **kwargs), a PyTorch in-place op writing over
    args[0], where autograd records: whether it saves a copy of its input that it makes (a
    tensor not among its arguments), and whether it saves its output. None where it cannot
    run on fake tensors. Arguments are fx nodes (their example values) or constants."""
    values = [_tensor(a) if isinstance(a, fx.Node) else a for a in args]
    key = (
        fn,
        tuple(_kind(v) for v in values),
        tuple(sorted((k, repr(v)) for k, v in kwargs.items())),
    )
    if key not in _INPLACE_SAVES:
        _INPLACE_SAVES[key] = _probe(fn, values, kwargs)
    return _INPLACE_SAVES[key]


def _kind(v):
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.device, v.dim(), v.requires_grad)
    return repr(v)


def _probe(fn, values, kwargs):
    mode = _compat.fake_mode()
    if mode is None:
        return None
    keys = []
    try:
        with mode, torch.enable_grad():
            fakes = [_fresh(v) for v in values]
            # Written over: a non-leaf (autograd refuses writing over a leaf that requires grad).
            target = fakes[0] * 1 if fakes[0].requires_grad else fakes[0]
            with _saving(lambda t: keys.append(_compat.storage_key(t)) or t):
                fn(target, *fakes[1:], **kwargs)
    except Exception:  # an op that cannot run on fake tensors
        return None
    known = {_compat.storage_key(t) for t in fakes if isinstance(t, torch.Tensor)}
    out = _compat.storage_key(target)
    return any(k != out and k not in known for k in keys), out in keys
