"""convert's private PyTorch API: all of it goes through convert/_compat.py, and each use
falls back to public API or to a slower path where this torch lacks it, with the converted
models still computing their results."""

import ast
import importlib
import inspect
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import randn
from test_convert import (
    PreNormBlock,
    _causal,
    _converted_masked,
    _converted_with_our_ops,
    block_inputs,
    check_converted,
    make_block,
)

_COMPAT = importlib.import_module("make_torch_inplace.convert._compat")
# The private names _compat resolves at import, each None where this torch lacks it.
_PRIVATE = [
    target.id
    for node in ast.parse(inspect.getsource(_COMPAT)).body
    if isinstance(node, ast.Assign)
    and isinstance(node.value, ast.Call)
    and getattr(node.value.func, "id", None) == "_resolve"
    for target in node.targets
]


@pytest.mark.parametrize("missing", [*_PRIVATE, "all"])
def test_runs_without_private_api(missing, monkeypatch):
    """Each private PyTorch API that convert uses, or all of them, missing: _compat falls back
    to public API or to a slower path, and the converted models still compute their results
    (rewriting nothing where aliasing is unknown)."""
    for name in _PRIVATE if missing == "all" else [missing]:
        monkeypatch.setattr(_COMPAT, name, None)
    torch.compiler.reset()  # Dynamo's default recompile limit, where its config is missing
    converted = check_converted(make_block(PreNormBlock, "cpu"), *block_inputs("cpu"))
    assert bool(converted.sites) == (missing not in ("_StorageWeakRef", "all"))
    _converted_masked(_causal, "where")  # a constant mask, evaluated at capture
    _converted_with_our_ops()  # ops that return nothing in the captured graph
    x = randn((3, 5), torch.float32, "cpu", seed=2)
    for name, kwargs in (("silu_", {}), ("gelu_", {"approximate": "tanh"})):
        y = x.clone()
        _COMPAT.inplace_activation(name)(y, **kwargs)
        assert torch.equal(y, getattr(F, name[:-1])(x, **kwargs))
    leaves, spec = _COMPAT.tree_flatten([x, (2, {"a": x})])
    assert leaves == [x, 2, x] and spec == _COMPAT.tree_flatten([1, (2, {"a": 3})])[1]
    assert spec != _COMPAT.tree_flatten([1, [2, {"a": 3}]])[1]


def test_private_torch_api_only_in_compat():
    """Outside _compat, the package imports torch, torch.nn.functional, fx and nn alone, and
    reaches no underscored attribute of them."""
    roots = {"torch", "F", "fx", "nn"}
    for path in Path(_COMPAT.__file__).parent.glob("*.py"):
        if path.name == "_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("torch"):
                        assert alias.name in ("torch", "torch.nn.functional"), (path, alias.name)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                assert node.module == "torch", (path, node.module)
            elif isinstance(node, ast.Attribute):
                chain, base = [node.attr], node.value
                while isinstance(base, ast.Attribute):
                    chain.append(base.attr)
                    base = base.value
                if isinstance(base, ast.Name) and base.id in roots:
                    assert not any(a.startswith("_") for a in chain), (path, chain)
