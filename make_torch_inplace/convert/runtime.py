"""The converted module at run time: capturing each new input layout through torch.compile
with the rewriting backend, and running known layouts' captured code at the least host cost."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import fx, nn

from . import _compat, rewrite
from .rewrite import Site

# Dynamo keeps compiled graphs per code object, shared by every instance of a model class, and
# each convert() brings its own backend; the default limit (8) would send later converted
# instances (or shapes) back to plain eager without rewriting.
_RECOMPILE_LIMIT = 64

# Dynamo's settings while a converted model is captured:
# - the recompile limit above;
# - static shapes (what torch.compile(dynamic=False) sets), one capture per input shape: a
#   value computed from sizes alone, such as an attention mask, is then a constant of the
#   graph, which the backend can read (see constants.py);
# - record_runtime_overhead off: on, every call of a compiled region enters and leaves a
#   "Pregraph bytecode" profiler range, two calls of functions wrapped in
#   torch._dynamo.disable even with no profiler attached, ~5 us of host time a call (CPU).
#   Dynamo reads it when it generates the region's bytecode, at capture; off, profiler traces
#   lose that one range.
_CAPTURE_CONFIG = {
    "recompile_limit": _RECOMPILE_LIMIT,
    "automatic_dynamic_shapes": False,
    "assume_static_by_default": True,
    "record_runtime_overhead": False,
}


class ConvertedModule(nn.Module):
    """`module` with its forward rewritten to run ops in place; made by convert()."""

    def __init__(self, module: nn.Module, verbose: bool = False) -> None:
        super().__init__()
        self.module = module
        self._backend = _Backend(verbose)
        # _input_signature of each call captured so far, and how many of this converted
        # module's graphs that call ran (one, or more where Dynamo split the forward), or
        # _THROUGH_COMPILE.
        self._captured: dict[tuple, int] = {}
        # A bound method, not the OptimizedModule torch.compile(module) would return, so the
        # parameters are registered once (under self.module). Static shapes come from
        # _CAPTURE_CONFIG, not dynamic=False, which would patch Dynamo's config around every
        # call (see forward).
        self._compiled_call = torch.compile(module.__call__, backend=self._backend)

    def __getattr__(self, name: str):
        # Parameters, buffers and submodules (the model itself, as `module`) are nn.Module's;
        # any other attribute is the model's, as torch.compile's wrapper forwards them: config,
        # generate, save_pretrained. The model's own methods run its original forward.
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)

    @property
    def sites(self) -> list[Site]:
        """Every site rewritten so far, over all captured graphs and recompilations."""
        return [site for r in self._backend.reports for site in r.sites]

    def report(self) -> str:
        """What convert did, one block per captured graph: the graph's sites, one line
        each, and the peak of its tensors before and after (rewrite.GraphReport)."""
        return "\n".join(line for r in self._backend.reports for line in r.lines())

    def forward(self, *args, **kwargs):
        grad = torch.is_grad_enabled()
        if grad:  # under no_grad / inference_mode, skip the call
            _check_no_autograd(self.module, args, kwargs)
        # Dynamo reads _CAPTURE_CONFIG only when it captures, which with static shapes is
        # when the inputs' layouts change. Patching the config costs tens of microseconds, so
        # only a call with a new signature does. A capture that happens anyway (a guard on
        # something else failed: a module attribute) runs with Dynamo's defaults, which is
        # still safe: the backend handles symbolic shapes, and past the default recompile
        # limit Dynamo runs the original forward.
        signature = _input_signature(grad, args, kwargs)
        graphs = self._captured.get(signature)
        if graphs is None:
            ran = self._backend.graph_calls
            with _compat.dynamo_config(_CAPTURE_CONFIG):
                out = self._compiled_call(*args, **kwargs)
            self._captured[signature] = self._backend.graph_calls - ran
            if self._captured[signature] == 0:
                _warn_unconverted(_NOT_CAPTURED)
            return out
        if graphs == _THROUGH_COMPILE or torch.compiler.is_compiling():
            return self._compiled_call(*args, **kwargs)
        # A known signature runs the code Dynamo holds without entering torch.compile's
        # Python wrapper (_compat.run_cached), which costs a small model's forward on a GPU,
        # bound by its host time, ~10% (benchmarks/convert_overhead.py). Dynamo's guards still
        # decide what runs. Where they reject this module's graphs (something the signature
        # does not hold changed: a module attribute, autocast), the call runs the original
        # code, and where they pick another capture's (another module of the same class,
        # another torch.compile of it), that one: correct either way, but the first may save
        # nothing. The count of our graphs that ran tells, and the signature's later calls go
        # through torch.compile, which captures anew where the guards fail.
        ran = self._backend.graph_calls
        out = _compat.run_cached(self.module, args, kwargs, self._compiled_call)
        if self._backend.graph_calls - ran != graphs:
            self._captured[signature] = _THROUGH_COMPILE
            if self._backend.graph_calls == ran:
                _warn_unconverted(_GUARDS_FAILED)
        return out


# ConvertedModule._captured's mark of a signature whose cached run missed its graphs.
_THROUGH_COMPILE = -1

# Why a call ran the model's original forward, which computes the same result without the
# saving (its peak is the unconverted model's). warnings shows each once per place.
_NOT_CAPTURED = (
    "ran none of its converted graphs: torch.compile returned the original forward for this "
    "input (past the recompile limit, or the forward could not be captured)"
)
_GUARDS_FAILED = (
    "ran none of its converted graphs: their guards rejected the call (a module attribute, "
    "autocast or another global changed since the capture); the next call captures anew"
)


def _warn_unconverted(cause: str) -> None:
    warnings.warn(f"mti.convert: a call ran unconverted: it {cause}", RuntimeWarning, stacklevel=3)


class _Backend:
    """The torch.compile backend of one converted module. Dynamo's caches keep it alive, so
    it holds no reference to the module (whose parameters reach the graphs as inputs)."""

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose
        self.reports: list[rewrite.GraphReport] = []
        self.graph_calls = 0  # calls of the graphs it returned, which ConvertedModule reads

    def __call__(self, gm: fx.GraphModule, example_inputs) -> Callable:
        result = rewrite._rewrite_graph(gm, report=print if self.verbose else None)
        if result is not None:
            self.reports.append(result)
        _compat.generate_code(gm)  # gm.forward is then the generated function itself
        forward = gm.forward

        def run(*args):
            self.graph_calls += 1
            return forward(*args)

        return run


def _input_signature(grad_enabled: bool, args, kwargs) -> tuple:
    """What a static-shape capture of a call depends on in its inputs, and what Dynamo's
    guards on them check that commonly changes between calls: tensors' layouts, whether they
    require grad or are inference tensors, Python scalars' values, and grad mode (the
    caller's torch.is_grad_enabled(), which it has read already). It runs on every call,
    where a small model's forward is bound by host time: hence list comprehensions over a
    module-level function, cheaper than map() over a closure made at each call."""
    return (
        grad_enabled,
        tuple([_arg_signature(a) for a in args]),
        tuple([(k, _arg_signature(v)) for k, v in kwargs.items()]),
    )


def _arg_signature(a):
    if isinstance(a, torch.Tensor):
        return a.shape, a.stride(), a.dtype, a.device, a.requires_grad, a.is_inference()
    if isinstance(a, (list, tuple, dict)):
        leaves, spec = _compat.tree_flatten(a)
        return spec, tuple([_arg_signature(leaf) for leaf in leaves])
    return a if isinstance(a, (int, float, bool, str, type(None))) else type(a)


def _check_no_autograd(module: nn.Module, args, kwargs) -> None:
    tensors = [t for t in _compat.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if any(t.requires_grad for t in tensors) or any(p.requires_grad for p in module.parameters()):
        raise RuntimeError(
            "convert: the converted model runs ops in place, which is only done for "
            "inference, but autograd would record this call (grad mode is on and a parameter "
            "or input requires grad). Call it under torch.no_grad() or torch.inference_mode(), "
            "freeze the parameters (requires_grad_(False)), or train with the original model."
        )
