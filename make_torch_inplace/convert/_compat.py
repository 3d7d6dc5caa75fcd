"""The private PyTorch APIs convert uses, each behind a function that falls back to public API,
or to a slower but still correct path, where this torch lacks it.

Nothing else in the package imports a private torch name. Each private name is resolved once,
at import, to None where it is missing (tests/test_convert_compat.py sets each to None in turn).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Hashable

import torch


def _resolve(module: str, name: str | None = None):
    """A module, or its attribute `name`, or None where this torch lacks it."""
    try:
        found = importlib.import_module(module)
        return found if name is None else getattr(found, name)
    except (ImportError, AttributeError):
        return None


# Sizes' expressions, to evaluate a symbolic size for given values of its symbols.
_sympy = _resolve("sympy")
# Pytrees: flattening nested containers the way torch.compile does.
_pytree = _resolve("torch.utils._pytree")
# Whether a SymBool holds for every value of its symbols, without adding a guard.
_statically_known_true = _resolve("torch.fx.experimental.symbolic_shapes", "statically_known_true")
# A hashable key per storage (of fake tensors too), which is how tensors are found to alias.
_StorageWeakRef = _resolve("torch.multiprocessing.reductions", "StorageWeakRef")
# Leaves the fake mode, to evaluate constant attention masks on real tensors.
_unset_fake_temporarily = _resolve("torch._subclasses.fake_tensor", "unset_fake_temporarily")
# A fake mode of our own, to run a graph's ops where autograd records and see what it saves.
_FakeTensorMode = _resolve("torch._subclasses.fake_tensor", "FakeTensorMode")
# Dynamo's run-only mode: the C-level switch and the counter that CUDA graph trees read.
_set_eval_frame = _resolve("torch._C._dynamo.eval_frame", "set_eval_frame")
_GenerationTracker = _resolve("torch._dynamo.mutation_guard", "GenerationTracker")
# Dynamo's settings (dynamic shapes, the recompile limit) and its symbolic shapes' settings.
_dynamo_config = _resolve("torch._dynamo.config")
_shapes_config = _resolve("torch.fx.experimental._config")
# The GraphModule that generates its code at its first call.
_LazyGraphModule = _resolve("torch.fx._lazy_graph_module", "_LazyGraphModule")
# Dispatcher ops, whose schemas tell whether they return anything.
_OpOverload = _resolve("torch._ops", "OpOverload")
_OpOverloadPacket = _resolve("torch._ops", "OpOverloadPacket")
# A dictionary keyed by tensors that holds them weakly: what each input mask keeps, remembered
# per tensor (constants.checked_mask).
_WeakTensorKeyDictionary = _resolve("torch.utils.weak", "WeakTensorKeyDictionary")
# The in-place activations F.silu(inplace=True) calls; torch.ops.aten's add a Python-level
# OpOverloadPacket call (a few microseconds) to every call of a rewritten graph.
_nn_bindings = _resolve("torch._C", "_nn")


def tensor_memo():
    """A dictionary keyed by tensors that holds them weakly; None where this torch has none
    (then nothing is remembered per tensor)."""
    return None if _WeakTensorKeyDictionary is None else _WeakTensorKeyDictionary()


def version(t: torch.Tensor) -> int | None:
    """t's version counter, which every in-place write bumps; None where unknown."""
    return getattr(t, "_version", None)


def tree_leaves(tree) -> list:
    """The leaves of nested lists, tuples and dicts (and, with pytree, registered types)."""
    if _pytree is not None:
        return _pytree.tree_leaves(tree)
    if isinstance(tree, (list, tuple)):
        return [leaf for item in tree for leaf in tree_leaves(item)]
    if isinstance(tree, dict):
        return [leaf for item in tree.values() for leaf in tree_leaves(item)]
    return [tree]


def tree_flatten(tree) -> tuple[list, Hashable]:
    """(leaves, structure): a hashable structure equal for trees that differ only in leaves."""
    if _pytree is not None:
        return _pytree.tree_flatten(tree)
    if isinstance(tree, (list, tuple, dict)):
        keys = tuple(tree) if isinstance(tree, dict) else ()
        flat = [tree_flatten(item) for item in (tree.values() if keys else tree)]
        leaves = [leaf for item_leaves, _ in flat for leaf in item_leaves]
        return leaves, (type(tree), keys, tuple(spec for _, spec in flat))
    return [tree], None


def known_true(condition) -> bool:
    """`condition` (a bool, or a SymBool of sizes) holds for every value of its symbols.
    Without the prover a symbolic condition counts as unknown: fewer rewrites, none wrong."""
    if _statically_known_true is not None:
        return _statically_known_true(condition)
    return condition if isinstance(condition, bool) else False


def proves_sizes() -> bool:
    """Whether known_true can prove conditions on symbolic sizes (else it answers False)."""
    return _statically_known_true is not None


def size_hint(size) -> int | None:
    """A SymInt's value in the traced example (its node's hint), None where unknown."""
    return getattr(getattr(size, "node", None), "hint", None)


def size_expr(size):
    """A SymInt's (or SymBool's) sympy expression, None for an int or where this torch has
    none."""
    return getattr(getattr(size, "node", None), "expr", None)


def evaluate_size(size, values: dict) -> int | bool | None:
    """`size` (an int or a SymInt, or a bool or a SymBool of sizes) where the sympy symbols in
    `values` take those values, or None where it depends on other symbols or this torch
    cannot tell."""
    if isinstance(size, (int, bool)):
        return size
    expr = size_expr(size)
    if expr is None or _sympy is None:
        return None
    value = expr.xreplace({s: _sympy.Integer(v) for s, v in values.items()})
    if value is _sympy.true or value is _sympy.false:
        return bool(value)
    return int(value) if value.is_Integer else None


def storage_key(t: torch.Tensor) -> Hashable | None:
    """A key equal for exactly the tensors sharing t's storage (fake tensors included), or
    None where this torch has none: aliasing is then unknown and graphs are left unchanged."""
    return None if _StorageWeakRef is None else _StorageWeakRef(t.untyped_storage())


def real_tensors() -> contextlib.AbstractContextManager | None:
    """A context in which ops compute on real tensors even inside Dynamo's fake mode, or None
    where this torch has none: constant masks are then left unevaluated (kept as computed)."""
    return None if _unset_fake_temporarily is None else _unset_fake_temporarily()


def fake_mode() -> contextlib.AbstractContextManager | None:
    """A context in which new tensors are fake (no memory, no compute), outside any fake mode
    Dynamo has set, or None where this torch has none: a graph captured where autograd
    records is then left unchanged."""
    if _FakeTensorMode is None or _unset_fake_temporarily is None:
        return None
    return _fake_scope()


@contextlib.contextmanager
def _fake_scope():
    with _unset_fake_temporarily(), _FakeTensorMode(allow_non_fake_inputs=True):
        yield


def run_cached(module: torch.nn.Module, args, kwargs, compiled: Callable):
    """module(*args, **kwargs) with Dynamo in run-only mode: each frame runs the compiled code
    Dynamo holds for it whose guards pass, else its original code, and nothing is compiled.
    That is torch._dynamo.run(module)(...) without its Python wrapper (the one torch.compile's
    functions share, 10-20 us a call on the CPU): the same C-level switch, and the same count
    of calls that CUDA graph trees read. Without the switch: compiled(*args, **kwargs), the
    torch.compile wrapper, which runs the same code but captures anew where guards fail."""
    if _set_eval_frame is None or _GenerationTracker is None:
        return compiled(*args, **kwargs)
    _GenerationTracker.generation += 1
    prior = _set_eval_frame(False)
    try:
        return module(*args, **kwargs)
    finally:
        _set_eval_frame(prior)


def dynamo_config(settings: dict, shape_settings: dict) -> contextlib.AbstractContextManager:
    """A context with Dynamo's config patched to `settings` and that of its symbolic shapes to
    `shape_settings`, the ones this torch has. A setting it lacks, or all of them, stays at
    Dynamo's default: the backend handles static and symbolic shapes alike, and past the
    default recompile limit Dynamo runs the original forward."""
    stack = contextlib.ExitStack()
    for config, patch in ((_dynamo_config, settings), (_shapes_config, shape_settings)):
        if config is not None:
            stack.enter_context(
                config.patch({k: v for k, v in patch.items() if hasattr(config, k)})
            )
    return stack


def generate_code(gm: torch.fx.GraphModule) -> None:
    """Generates a lazily recompiled GraphModule's code now: otherwise it does so at the first
    call and then goes through nn.Module.__call__ at every call (~5 us of host time on the
    CPU). Where the lazy class is missing, the GraphModule already generated its code."""
    if _LazyGraphModule is not None and isinstance(gm, _LazyGraphModule):
        gm.real_recompile()


def returns_nothing(target) -> bool:
    """`target` is a dispatcher op that returns nothing (it only mutates its arguments). False
    where the op classes are missing: a graph calling one is then left unchanged."""
    if _OpOverloadPacket is not None and isinstance(target, _OpOverloadPacket):
        return all(not getattr(target, o)._schema.returns for o in target.overloads())
    if _OpOverload is not None and isinstance(target, _OpOverload):
        return not target._schema.returns
    return False


def inplace_activation(name: str) -> Callable:
    """The in-place activation `name` ("silu_", "gelu_"): the binding F.silu(inplace=True)
    calls, or torch.ops.aten's op, which adds its Python-level call at every call."""
    binding = getattr(_nn_bindings, name, None)
    return binding if binding is not None else getattr(torch.ops.aten, name)
