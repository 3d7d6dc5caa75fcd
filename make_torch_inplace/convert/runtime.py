"""The converted module at run time: capturing its forward through torch.compile with dynamic
shapes and the rewriting backend, running known layouts' captured code at the least host cost,
and picking, per sizes, the rewrite that fits the masks those sizes give."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable

import torch
from torch import fx, nn

from . import _compat, rewrite
from .constants import _Constants, _size_placeholders, checked_mask
from .masks import mask_inputs
from .report import GraphReport, Site

# Dynamo keeps compiled graphs per code object, shared by every instance of a model class, and
# each convert() brings its own backend; the default limit (8) would send later converted
# instances (or shapes) back to plain eager without rewriting.
_RECOMPILE_LIMIT = 64

# Dynamo's settings while a converted model is captured:
# - the recompile limit above;
# - automatic dynamic shapes (torch.compile's default): the first capture has static sizes;
#   a size that later changes (the sequence length, the batch) becomes symbolic in the next
#   capture, which then serves every value of it. Sizes that never change (the hidden size,
#   the heads) stay constants, so what is computed from them (a softmax scale from the head
#   size) folds, and the graph reads fewer symbolic sizes per call. Dynamo still specialises a
#   size of 0 or 1 (a batch of one, one new token). Masks computed from sizes alone are told
#   apart per sizes by the backend (_SizeClasses);
# - floats specialised: a module's float attribute (a softmax scale, a norm's eps) stays a
#   constant of the graph, which the rewrites fold, rather than a tensor read by .item();
# - record_runtime_overhead off: on, every call of a compiled region enters and leaves a
#   "Pregraph bytecode" profiler range, two calls of functions wrapped in
#   torch._dynamo.disable even with no profiler attached, ~5 us of host time a call (CPU).
#   Dynamo reads it when it generates the region's bytecode, at capture; off, profiler traces
#   lose that one range.
# - nested graph breaks: where a call Dynamo does not trace breaks the graph inside nested
#   frames (FSDP2's hooks around each sharded module), the graph after it continues the
#   callers' frames too, instead of each caller's rest becoming a graph of its own: a causal
#   LM's logits and its output mapping (drop_outputs) then meet in one graph.
_CAPTURE_CONFIG = {
    "recompile_limit": _RECOMPILE_LIMIT,
    "automatic_dynamic_shapes": True,
    "assume_static_by_default": True,
    "specialize_float": True,
    "record_runtime_overhead": False,
    "nested_graph_breaks": True,
}

# Static shapes, one capture per input shape, where this torch cannot prove conditions on
# symbolic sizes: every layout check of a rewrite would fail on a symbolic size.
_STATIC_SHAPES = {"automatic_dynamic_shapes": False, "assume_static_by_default": True}

# Symbolic shapes' settings while a converted model is captured: duck shaping off, which
# would give sizes that happen to be equal in the first call (a batch of 8 and 8 tokens) one
# symbol, and capture anew where they differ.
_SHAPES_CONFIG = {"use_duck_shape": False}

# Signatures ConvertedModule remembers; past this many (a long generation loop: one per
# length) it forgets them all, and each next new one goes through torch.compile once more.
_MAX_SIGNATURES = 4096


class ConvertedModule(nn.Module):
    """`module` with its forward rewritten to run ops in place; made by convert()."""

    def __init__(
        self,
        module: nn.Module,
        verbose: bool = False,
        drop_outputs: tuple[str, ...] = (),
        recompute: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self.module = module
        self._backend = _Backend(verbose, recompute)
        # _input_signature of each call captured so far, and how many of this converted
        # module's graphs that call ran (one, or more where Dynamo split the forward), or
        # _THROUGH_COMPILE.
        self._captured: dict[tuple, int] = {}
        # What the calls run: the model, or a view of it (_without). Set past
        # nn.Module.__setattr__, which would register it as a submodule: its parameters would
        # appear twice in state_dict().
        call = _without(module, tuple(drop_outputs)) if drop_outputs else module
        object.__setattr__(self, "_call", call)
        # A bound method, not the OptimizedModule torch.compile(module) would return, so the
        # parameters are registered once (under self.module). Dynamic shapes come from
        # _CAPTURE_CONFIG, not dynamic=True, which would patch Dynamo's config around every
        # call (see forward).
        self._compiled_call = torch.compile(
            self._call.__call__ if isinstance(self._call, nn.Module) else self._call,
            backend=self._backend,
        )
        # The model as its own methods see it when called through this module (see
        # __getattr__); set past nn.Module.__setattr__, which would register it as a submodule.
        object.__setattr__(self, "_model_calling_converted", _calling(module, self))

    def __getattr__(self, name: str):
        # Parameters, buffers and submodules (the model itself, as `module`) are nn.Module's;
        # any other attribute is the model's, as torch.compile's wrapper forwards them: config,
        # generate, save_pretrained. The model's own methods run bound to a view of the model
        # whose calls are this module's: generate's forward calls run converted.
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("module", "_model_calling_converted"):
                raise
            value = getattr(self.module, name)
            if inspect.ismethod(value) and value.__self__ is self.module:
                return value.__func__.__get__(self._model_calling_converted)
            return value

    @property
    def sites(self) -> list[Site]:
        """Every site rewritten so far, over all captured graphs and recompilations, and the
        rewrites of a graph for each class of sizes (see _SizeClasses)."""
        return [site for r in self._backend.reports for site in r.sites]

    def report(self) -> str:
        """What convert did, one block per rewritten graph (a captured graph, or its rewrite for
        a class of sizes): the graph's sites, one line each, and the peak of its tensors before
        and after (report.GraphReport)."""
        return "\n".join(line for r in self._backend.reports for line in r.lines())

    # An outer torch.compile does not trace into this forward (a graph break), since it would
    # inline the model's own code and drop the rewrites: the converted graphs run as they do
    # without it, and torch.compile compiles the code around this module.
    @torch.compiler.disable
    def forward(self, *args, **kwargs):
        grad = torch.is_grad_enabled()
        # Dynamo reads _CAPTURE_CONFIG only when it captures, which can happen only where the
        # inputs' layouts differ from every earlier call's (its guards passed for those).
        # Patching the config costs tens of microseconds, so only a call with a new signature
        # does. A capture that happens anyway (a guard on something else failed: a module
        # attribute) runs with Dynamo's defaults, which is still safe: the backend handles
        # static and symbolic shapes, and past the default recompile limit Dynamo runs the
        # original forward.
        signature = _input_signature(grad, args, kwargs)
        graphs = self._captured.get(signature)
        if graphs is None:
            ran = self._backend.graph_calls
            config = _CAPTURE_CONFIG if _compat.proves_sizes() else _CAPTURE_CONFIG | _STATIC_SHAPES
            with _compat.dynamo_config(config, _SHAPES_CONFIG):
                out = self._compiled_call(*args, **kwargs)
            if len(self._captured) >= _MAX_SIGNATURES:
                self._captured.clear()
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
        out = _compat.run_cached(self._call, args, kwargs, self._compiled_call)
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

    def __init__(self, verbose: bool, recompute: tuple[str, ...] = ()) -> None:
        self.verbose = verbose
        self.recompute = recompute
        self.reports: list[GraphReport] = []
        self.graph_calls = 0  # calls of the graphs it returned, which ConvertedModule reads

    def __call__(self, gm: fx.GraphModule, example_inputs) -> Callable:
        # Attention masks that the graph reads as inputs (Dynamo split the forward where they
        # were made: FSDP2's hooks are graph breaks) count as sizes: what they keep.
        masks = mask_inputs(gm.graph)
        # The graph as captured, for rewriting again for sizes whose masks differ.
        original = _copy_graph(gm.graph) if _size_placeholders(gm.graph) or masks else None
        sizes = None
        if masks:
            hints = [
                _compat.size_hint(n.meta["example_value"]) for _, n in _size_placeholders(gm.graph)
            ]
            sizes = (*hints, *[checked_mask(example_inputs[i]) for i in masks])
        constants = _Constants(gm.graph, sizes, masks)
        forward = self.rewrite(gm, constants)
        if not constants.queries:  # nothing it did depends on the sizes
            return self.counted(forward)
        return self.counted(_SizeClasses(self, gm, original, constants, forward, masks))

    def rewrite(self, gm: fx.GraphModule, constants: _Constants) -> Callable:
        """gm rewritten in place, for the sizes `constants` evaluates masks for; its forward."""
        report = print if self.verbose else None
        result = rewrite._rewrite_graph(
            gm, report=report, constants=constants, recompute=self.recompute
        )
        if result is not None:
            self.reports.append(result)
        _compat.generate_code(gm)  # gm.forward is then the generated function itself
        return gm.forward

    def counted(self, forward: Callable) -> Callable:
        def run(*args):
            self.graph_calls += 1
            return forward(*args)

        return run


class _SizeClasses:
    """A graph rewritten per class of sizes. With dynamic shapes, a mask computed from sizes
    alone (see constants.py) may keep every element for some sizes, exactly j <= i for others
    (which the rewrites turn into no mask, or causal=True) and something else for yet others
    (kept as computed). Each rewrite holds the answers of the mask queries it was made on; a
    call with new sizes takes the first rewrite whose queries give the same answers for them,
    or a new one, made from the graph as captured. Each distinct tuple of sizes evaluates the
    queries once, on the CPU; later calls with it cost a dict lookup."""

    _MAX_SIZES = 4096  # past this many remembered size tuples, they are forgotten

    def __init__(self, backend, gm, original, constants, forward, masks=()) -> None:
        self._backend = backend
        self._root = gm  # holds the attributes the graph's get_attr nodes read
        self._original = original
        self._positions = [i for i, _ in _size_placeholders(original)]
        self._masks = masks  # positions of the input masks (mask_inputs)
        self._rewrites = [(constants.queries, forward)]
        self._by_sizes = {constants.sizes: forward}

    def __call__(self, *args):
        sizes = _keys(args, self._positions, self._masks)
        forward = self._by_sizes.get(sizes)
        if forward is None:
            forward = self._for_new_sizes(sizes)
        return forward(*args)

    def _for_new_sizes(self, sizes: tuple[int, ...]) -> Callable:
        fits = (f for queries, f in self._rewrites if all(q.kind(sizes) == k for q, k in queries))
        forward = next(fits, None)
        if forward is None:
            gm = fx.GraphModule(self._root, _copy_graph(self._original))
            constants = _Constants(gm.graph, sizes, self._masks)
            forward = self._backend.rewrite(gm, constants)
            self._rewrites.append((constants.queries, forward))
        if len(self._by_sizes) >= self._MAX_SIZES:
            self._by_sizes.clear()
        self._by_sizes[sizes] = forward
        return forward


def _keys(args, positions: list[int], masks: tuple[int, ...]) -> tuple:
    """What a graph's rewrites depend on in a call: its dynamic sizes, then what its input
    masks keep (constants.checked_mask)."""
    sizes = tuple([args[i] for i in positions])
    return sizes + tuple([checked_mask(args[i]) for i in masks]) if masks else sizes


def _without(module: nn.Module, names: tuple[str, ...]) -> Callable:
    """module's calls, with the outputs `names` of its result (a mapping: a transformers
    ModelOutput, a dict) set to None: the graph then does not return them, so they are dead
    where the rewriter looks (a causal LM's logits, where only the loss is wanted).

    The outputs are dropped inside the module's call, by its forward, not around the call:
    where Dynamo splits the forward into graphs (FSDP2's hooks around a sharded module are
    graph breaks), the graph computing the logits is then the one that drops them, and the
    module's forward hooks get the result without them. A view of the module, as _calling
    makes, whose class overrides forward alone; the report's module paths stay the model's
    own. Where the instance holds a forward of its own (which would shadow the view's), a
    closure around the call instead."""
    cls = type(module)

    def drop(out):
        if not isinstance(out, dict):
            raise TypeError(
                f"convert: drop_outputs needs a model returning a mapping (a transformers "
                f"ModelOutput, a dict), got {type(out).__name__}"
            )
        return type(out)(**{k: (None if k in names else v) for k, v in out.items()})

    if "forward" in module.__dict__:

        def call(*args, **kwargs):
            return drop(module(*args, **kwargs))

        return call

    def forward(self, *args, **kwargs):
        return drop(cls.forward(self, *args, **kwargs))

    namespace = {"forward": forward, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    view = object.__new__(type(cls.__name__, (cls,), namespace))
    view.__dict__ = module.__dict__
    return view


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of `graph` whose nodes share the originals' example values."""
    copy = fx.Graph()
    copy.output(copy.graph_copy(graph, {}))
    return copy


def _calling(module: nn.Module, converted: nn.Module) -> nn.Module:
    """A view of `module` whose calls are `converted`'s: an instance of a subclass of its
    class overriding __call__ alone, sharing its __dict__ (parameters, submodules, config,
    every attribute, and what its methods set on it). Its methods, bound to the view, reach
    the converted forward wherever they call the model (generate's self(...),
    self.__call__)."""
    cls = type(module)

    def __call__(self, *args, **kwargs):
        return converted(*args, **kwargs)

    namespace = {
        "__call__": __call__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
    }
    view = object.__new__(type(cls.__name__, (cls,), namespace))
    view.__dict__ = module.__dict__
    return view


def _input_signature(grad_enabled: bool, args, kwargs) -> tuple:
    """What Dynamo's guards check of a call's inputs that commonly changes between calls,
    exactly: tensors' layouts (the sizes too: a guard may relate them, or pin one to 1; a
    call with a signature seen before passes the guards that passed for it), whether they
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
