"""Whole-model conversion: run ops in place exactly where their input is dead.

``convert(model)`` captures the model's forward with ``torch.compile`` and a backend of ours.
Dynamo hands that backend torch-level FX graphs (``F.softmax``, ``F.linear``, ``operator.add``,
``Tensor.view`` ... as call_function / call_method nodes), one per captured region, with a
FakeTensor in ``node.meta["example_value"]`` for every value. The backend rewrites a node into
its in-place form when the tensor it would overwrite is dead there:

- Aliasing comes from the FakeTensors: Dynamo runs every op on fake tensors that share storage
  exactly where the real ones will (views, ``reshape`` that is a view, ``.to``/``.contiguous``/
  ``dropout`` that return their input, ...), so tensors are grouped by fake storage.
- A group may be overwritten at position i when none of its tensors is a graph input (model
  inputs, parameters and buffers are all placeholders under Dynamo) and no node after i reads
  any of them (graph outputs included). An op's other operands must not share the group.
- The written tensor must already have the output's shape, strides and dtype, so every later
  node sees the layout it was traced with.
- Folding ops into one (the scale and mask into softmax) moves reads of their operands to the
  folded op's position; nothing may touch those operands in between.
- A graph with a value whose aliasing is unknown (a call without an example value, a
  non-strided tensor) is left unchanged. Our own ops, which return nothing, count as reads.
- Inference only: autograd would save tensors that a later in-place op overwrites, so the
  converted model refuses to run where autograd records.

Patterns: F.linear / addmm / matmul with a square weight (-> linear_ / square_matmul_),
softmax / log_softmax with the scale and additive mask that feed them folded in
(``softmax(x * c + mask)``, ``x / d`` as scale 1/d) and with
``softmax(x, dtype=float32).to(x.dtype)`` folded into one op, layer_norm / rms_norm,
``torch.where(keep, x, fill)`` (-> ``x.masked_fill_(~keep, fill)``), and elementwise
arithmetic and activations (-> PyTorch's own ``mul_``, ``add_``, ``tanh_``, ...), and a
batched matmul whose left operand is dead and at least as wide as the product (attention's
``probs @ v`` -> matmul_over_left, the product written over the probabilities). Module
forms (nn.Linear, nn.Softmax, ...) reach the backend as these functions, since Dynamo inlines
torch.nn modules.

Eager attention, ``softmax_(q @ k_t, ...) @ v`` once the softmax is in place, with the scores
dead afterwards, becomes attention_in_pieces: the same three ops, run a few heads at a time,
so that only one piece of the B x heads x T x S scores (at most the workspace limit, at
least one T x S matrix) is ever allocated. In-place ops alone cannot go below the full
scores plus q, k, v and the hidden state, more than half of eager's peak (which holds two
score-sized tensors), for a model like BERT.

Constant attention masks: the model is captured with static shapes, so a mask computed from
sizes alone (transformers builds one under torch.compile where eager mode passes none) is
computed once at capture (_Constants). One that keeps every element is dropped; one that keeps
exactly j <= i becomes ``is_causal=True`` for scaled_dot_product_attention and ``causal=True``
for softmax_ (also from ``torch.where(mask, x, lowest)``). SDPA then keeps its flash kernel,
and no S x S mask is built.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import os
import re
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch._C._dynamo.eval_frame import set_eval_frame
from torch._dynamo.mutation_guard import GenerationTracker
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from . import ops

__all__ = ["ConvertedModule", "Site", "convert"]

# Dynamo keeps compiled graphs per code object, shared by every instance of a model class, and
# each convert() brings its own backend; the default limit (8) would send later converted
# instances (or shapes) back to plain eager without rewriting.
_RECOMPILE_LIMIT = 64

# Dynamo's settings while a converted model is captured: the recompile limit above, and static
# shapes (what torch.compile(dynamic=False) sets), one capture per input shape: a value
# computed from sizes alone, such as an attention mask, is then a constant of the graph, which
# the backend can read (see _Constants).
_CAPTURE_CONFIG = {
    "recompile_limit": _RECOMPILE_LIMIT,
    "automatic_dynamic_shapes": False,
    "assume_static_by_default": True,
}


def _capture_config() -> dict:
    """_CAPTURE_CONFIG, and where this torch's Dynamo has it, record_runtime_overhead off: on,
    every call of a compiled region enters and leaves a "Pregraph bytecode" profiler range,
    two calls of functions wrapped in torch._dynamo.disable even with no profiler attached,
    ~5 us of host time a call (CPU, benchmarks/convert_overhead.py). Dynamo reads it when it
    generates the region's bytecode, at capture; off, profiler traces lose that one range."""
    config = dict(_CAPTURE_CONFIG)
    if hasattr(torch._dynamo.config, "record_runtime_overhead"):  # not in older releases
        config["record_runtime_overhead"] = False
    return config


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def convert(model: nn.Module, verbose: bool = False) -> ConvertedModule:
    """Returns a module computing `model`'s forward with ops run in place where that is safe.

    An op writes over its input only where that input is dead: read by nothing later, not a
    model input, parameter or buffer, not visible through a view that is still used. The
    model is captured with torch.compile on its first call and again for each new input
    shape (static shapes; past 64 captures of a model class Dynamo runs it unconverted); with
    ``verbose=True`` each capture prints the rewritten sites and the bytes each saves, which
    also accumulate in ``ConvertedModule.sites``. `model` itself is left unchanged and shares
    its parameters with the result.

    Inference only: running the result where autograd would record (grad mode on and a
    parameter or input that requires grad) raises RuntimeError; use torch.no_grad() or
    torch.inference_mode(), or the original model for training.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: model must be a torch.nn.Module, got {type(model).__name__}")
    return ConvertedModule(model, verbose=verbose)


@dataclasses.dataclass(frozen=True)
class Site:
    """One rewritten place: the ops in `pattern` now run as `op`, writing over a dead tensor."""

    op: str  # the in-place op, e.g. "softmax_", "linear_", "mul_"
    pattern: str  # the original ops, e.g. "mul -> add -> softmax -> to"
    where: str  # module path and source line of the original op
    shape: tuple[int, ...]  # output shape (size hints for dynamic dims)
    dtype: torch.dtype
    # Bytes of the output the original op allocated, which it no longer does. A square
    # matmul borrows up to the workspace limit (mti.set_workspace_limit) while it runs (and
    # runs out of place, saving nothing, where its output fits within the limit),
    # attention_in_pieces as much for its scores (at least one matrix) and allocates the
    # product of probs @ v (unless that goes over the scores), and matmul_over_left a piece of
    # its product (_OVER_LEFT_PIECE_BYTES, at least one matrix), so their net saving is
    # nbytes minus that.
    nbytes: int

    def __str__(self) -> str:
        shape = "x".join(map(str, self.shape))
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"{self.where}: {self.pattern} -> {self.op} [{shape} {dtype}] "
            f"saves {self.nbytes:,} bytes"
        )


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

    @property
    def sites(self) -> list[Site]:
        """Every site rewritten so far, over all captured graphs and recompilations."""
        return self._backend.sites

    def forward(self, *args, **kwargs):
        grad = torch.is_grad_enabled()
        if grad:  # under no_grad / inference_mode, skip the call
            _check_no_autograd(self.module, args, kwargs)
        # Dynamo reads _capture_config only when it captures, which with static shapes is
        # when the inputs' layouts change. Patching the config costs tens of microseconds, so
        # only a call with a new signature does. A capture that happens anyway (a guard on
        # something else failed: a module attribute) runs with Dynamo's defaults, which is
        # still safe: the backend handles symbolic shapes, and past the default recompile
        # limit Dynamo runs the original forward.
        signature = _input_signature(grad, args, kwargs)
        graphs = self._captured.get(signature)
        if graphs is None:
            ran = self._backend.graph_calls
            with torch._dynamo.config.patch(_capture_config()):
                out = self._compiled_call(*args, **kwargs)
            self._captured[signature] = self._backend.graph_calls - ran
            return out
        if graphs == _THROUGH_COMPILE or torch.compiler.is_compiling():
            return self._compiled_call(*args, **kwargs)
        # A known signature runs the code Dynamo holds without entering torch.compile's
        # Python wrapper (_run_cached), which costs a small model's forward on a GPU, bound by
        # its host time, ~10% (benchmarks/convert_overhead.py). Dynamo's guards still decide
        # what runs. Where they reject this module's graphs (something the signature does not
        # hold changed: a module attribute, autocast), the call runs the original code, and
        # where they pick another capture's (another module of the same class, another
        # torch.compile of it), that one: correct either way, but the first may save
        # nothing. The count of our graphs that ran tells, and the signature's later calls go
        # through torch.compile, which captures anew where the guards fail.
        ran = self._backend.graph_calls
        out = _run_cached(self.module, args, kwargs)
        if self._backend.graph_calls - ran != graphs:
            self._captured[signature] = _THROUGH_COMPILE
        return out


# ConvertedModule._captured's mark of a signature whose cached run missed its graphs.
_THROUGH_COMPILE = -1


def _run_cached(module: nn.Module, args, kwargs):
    """module(*args, **kwargs) with Dynamo in run-only mode: each frame runs the compiled code
    Dynamo holds for it whose guards pass, else its original code, and nothing is compiled.
    That is torch._dynamo.run(module)(...) without its Python wrapper (the one torch.compile's
    functions share), which measured 10-20 us a call on the CPU: the same C-level switch,
    and the same count of calls that CUDA graph trees read."""
    GenerationTracker.generation += 1
    prior = set_eval_frame(False)
    try:
        return module(*args, **kwargs)
    finally:
        set_eval_frame(prior)


# matmul_over_left computes its product this many bytes at a time (whole matrices of the
# batch, at least one) into a temporary, then copies it over `a`: the temporary is all the
# memory it allocates, and each piece costs two launches.
_OVER_LEFT_PIECE_BYTES = 2 << 20


def matmul_over_left(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for a contiguous float (..., M, K) `a` that nothing reads afterwards and a
    (..., K, N) `b` with the same batch dims, N <= K: the product, contiguous, written over
    the first elements of a's memory and returned (a view of that memory). A product that is
    one piece is returned as computed instead: copying it over `a` would allocate as much
    (the piece's temporary) and add a launch (host time, which a small model's forward is
    bound by).

    Each piece of matrices i0 .. i1 - 1 is read whole (into the temporary) before its product
    is written, to elements [i0 * M * N, i1 * M * N) of a: since N <= K, inside matrices
    0 .. i1 - 1 of a, which are read by then, and before the matrices still to be read.
    """
    *batch, m, k = a.shape
    n = b.shape[-1]
    if n > k or not a.is_contiguous() or list(b.shape[:-2]) != batch or b.shape[-2] != k:
        raise ValueError(
            f"matmul_over_left: needs a contiguous (..., M, K) a and a (..., K, N) b with the "
            f"same batch dims and N <= K, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    count = math.prod(batch)
    step = max(1, _OVER_LEFT_PIECE_BYTES // max(1, m * n * a.element_size()))
    if step >= count:
        return torch.matmul(a, b)
    a3, b3 = a.view(count, m, k), b.reshape(count, k, n)
    out = a.as_strided((count, m, n), (m * n, n, 1))
    for i0 in range(0, count, step):
        i1 = min(i0 + step, count)
        out[i0:i1].copy_(torch.bmm(a3[i0:i1], b3[i0:i1]))
    return out.view(*batch, m, n)


def square_matmul_over_dead(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    transpose: bool = False,
) -> torch.Tensor:
    """x @ weight (+ bias; x @ weight.T with transpose, F.linear's layout) for an x that nothing
    reads afterwards: square_matmul_ over x where that allocates less than the out-of-place
    product, else the out-of-place product. square_matmul_ computes chunks of rows into at
    most the workspace limit and copies each back; an output within the limit is one chunk,
    for which it allocates the whole output as the out-of-place op does, and adds a copy (a
    launch, and ~10 us of host time that a small model's forward, bound by its host time,
    pays in full) for nothing.
    """
    if x.numel() * x.element_size() > ops.get_workspace_limit():
        return ops.square_matmul_(x, weight, bias, transpose=transpose)
    if transpose:
        return F.linear(x, weight, bias)
    return torch.matmul(x, weight) if bias is None else torch.addmm(bias, x, weight)


def attention_in_pieces(
    q: torch.Tensor,
    k_t: torch.Tensor,
    v: torch.Tensor,
    *,
    log: bool = False,
    over_left: bool = False,
    **softmax_kwargs,
) -> torch.Tensor:
    """softmax(q @ k_t) @ v (log_softmax with log=True; softmax_kwargs: softmax_'s dim,
    scale, mask, causal) for (..., T, d) q, (..., d, S) k_t and (..., S, dv) v with the same
    batch dims, a few matrices of the batch at a time: each piece's scores are computed,
    normalised in place and multiplied into their rows of the (..., T, dv) product. Besides
    the product, one piece of scores is all it allocates: as many whole T x S matrices of the
    last batch dim (attention's heads) as fit in the workspace limit (mti.get_workspace_limit),
    at least one. over_left: where one piece holds every matrix, write the product over the
    scores (matmul_over_left) instead of allocating it; the caller has checked that this is
    safe (see _Rewriter._over_left_ok).
    """
    *batch, t, _ = q.shape
    s = k_t.shape[-1]
    if not batch or list(k_t.shape[:-2]) != batch or list(v.shape[:-1]) != [*batch, s]:
        raise ValueError(
            f"attention_in_pieces: needs (..., T, d) q, (..., d, S) k_t and (..., S, dv) v with "
            f"the same batch dims, got {tuple(q.shape)}, {tuple(k_t.shape)}, {tuple(v.shape)}"
        )
    softmax = ops.log_softmax_ if log else ops.softmax_
    dim = softmax_kwargs.pop("dim", -1)
    dim = dim - q.dim() if dim >= 0 else dim  # the pieces drop the leading batch dims
    mask = softmax_kwargs.pop("mask", None)
    heads = batch[-1]
    matrix_bytes = max(1, t * s * q.element_size())
    step = max(1, min(heads, ops.get_workspace_limit() // matrix_bytes))
    if step == heads and math.prod(batch) == heads and over_left:
        scores = torch.matmul(q, k_t)
        softmax(scores, dim, mask=mask, **softmax_kwargs)
        return matmul_over_left(scores, v)
    if mask is not None:  # as many dims as the scores, to index like them
        mask = mask[(None,) * (q.dim() - mask.dim())]
    out = torch.empty((*batch, t, v.shape[-1]), dtype=q.dtype, device=q.device)
    for outer in itertools.product(*map(range, batch[:-1])):
        for h0 in range(0, heads, step):
            piece = (*outer, slice(h0, h0 + step))
            scores = torch.matmul(q[piece], k_t[piece])
            if mask is not None:  # the same rows of a broadcast mask, which may have size 1
                at = [i if n > 1 else 0 for i, n in zip(outer, mask.shape)]
                at.append(piece[-1] if mask.shape[len(outer)] > 1 else slice(0, 1))
                softmax_kwargs["mask"] = mask[tuple(at)]
            softmax(scores, dim, **softmax_kwargs)
            torch.matmul(scores, v[piece], out=out[piece])
    return out


class _Backend:
    """The torch.compile backend of one converted module. Dynamo's caches keep it alive, so
    it holds no reference to the module (whose parameters reach the graphs as inputs)."""

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose
        self.sites: list[Site] = []
        self.graph_calls = 0  # calls of the graphs it returned, which ConvertedModule reads

    def __call__(self, gm: fx.GraphModule, example_inputs) -> Callable:
        self.sites.extend(_rewrite_graph(gm, report=print if self.verbose else None))
        # A lazily recompiled GraphModule's forward generates its code at the first call, and
        # then goes through nn.Module.__call__ at every call (~5 us of host time on the CPU);
        # generated now, gm.forward is the generated function itself.
        if isinstance(gm, _LazyGraphModule):
            gm.real_recompile()
        forward = gm.forward

        def run(*args):
            self.graph_calls += 1
            return forward(*args)

        return run


def _input_signature(grad_enabled: bool, args, kwargs) -> tuple:
    """What a static-shape capture of a call depends on in its inputs, and what Dynamo's
    guards on them check that commonly changes between calls: tensors' layouts, whether they
    require grad or are inference tensors, Python scalars' values, and grad mode (the
    caller's torch.is_grad_enabled(), which it has read already). It runs on
    every call, where a small model's forward is bound by host time: list comprehensions over
    a module-level function cost a third less there than map() over a closure made at each
    call."""
    return (
        grad_enabled,
        tuple([_arg_signature(a) for a in args]),
        tuple([(k, _arg_signature(v)) for k, v in kwargs.items()]),
    )


def _arg_signature(a):
    if isinstance(a, torch.Tensor):
        return a.shape, a.stride(), a.dtype, a.device, a.requires_grad, a.is_inference()
    if isinstance(a, (list, tuple, dict)):
        leaves, spec = pytree.tree_flatten(a)
        return spec, tuple([_arg_signature(leaf) for leaf in leaves])
    return a if isinstance(a, (int, float, bool, str, type(None))) else type(a)


def _check_no_autograd(module: nn.Module, args, kwargs) -> None:
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if any(t.requires_grad for t in tensors) or any(
        p.requires_grad for p in module.parameters()
    ):
        raise RuntimeError(
            "convert: the converted model runs ops in place, which is only done for "
            "inference, but autograd would record this call (grad mode is on and a parameter "
            "or input requires grad). Call it under torch.no_grad() or torch.inference_mode(), "
            "freeze the parameters (requires_grad_(False)), or train with the original model."
        )


# --------------------------------------------------------------------------- graph rewriting


def _rewrite_graph(gm: fx.GraphModule, report: Callable[[str], None] | None = None) -> list[Site]:
    """Rewrites a Dynamo graph in place (see the module docstring); returns the sites."""
    blocker = _unanalyzable_node(gm.graph)
    if blocker is not None:
        if report:
            report(
                f"mti.convert: graph left unchanged: the aliasing of node {blocker.name} "
                f"({blocker.target}) is unknown (no example value, or not a strided tensor)"
            )
        return []
    constants = _Constants(gm.graph)
    sites = [_fold_sdpa_mask(node, constants) for node in list(gm.graph.nodes)]
    rewriter = _Rewriter(gm.graph, constants)
    rewriter.sites += [site for site in sites if site is not None]
    # Softmax first: it folds the scale and mask ops before them, which the elementwise
    # rewrites of the second pass would otherwise take.
    for node in list(gm.graph.nodes):
        if _match(node, ("softmax", "log_softmax")):
            rewriter.softmax(node)
    # The masks folded away above are no longer computed at all.
    constants.erase_unused(gm.graph)
    for node in list(gm.graph.nodes):
        rewriter.other(node)
    gm.graph.lint()
    gm.recompile()
    if report:
        for site in rewriter.sites:
            report(f"mti.convert: {site}")
    return rewriter.sites


class _Liveness:
    """Groups of tensors sharing storage, and the last position at which each group is read.

    Groups are union-find sets over fake storages. A rewrite that makes node n write over
    tensor x merges n's storage into x's, and marks every input of the new node as read at
    its position.
    """

    def __init__(self, graph: fx.Graph) -> None:
        self.pos: dict[fx.Node, int] = {}
        self._parent: dict[StorageWeakRef, StorageWeakRef] = {}
        self._last_read: dict[StorageWeakRef, int] = {}
        self._inputs: set[StorageWeakRef] = set()
        for i, node in enumerate(graph.nodes):
            self.pos[node] = i
            for key in _storages(node):
                self._parent.setdefault(key, key)
                if node.op in ("placeholder", "get_attr"):
                    self._inputs.add(key)
            self.note_reads(node, i)
            if _drops_nothing(node) and _storages(node) and _storages(node.args[0]):
                self.merge(node, node.args[0])  # the same tensor at run time

    def _root(self, key: StorageWeakRef) -> StorageWeakRef:
        while self._parent[key] != key:
            self._parent[key] = self._parent[self._parent[key]]
            key = self._parent[key]
        return key

    def _roots(self, node) -> set[StorageWeakRef]:
        if not isinstance(node, fx.Node):
            return set()
        return {self._root(k) for k in _storages(node)}

    def add(self, node: fx.Node, pos: int) -> None:
        """A node inserted at `pos` with a new value of its own."""
        self.pos[node] = pos
        for key in _storages(node):
            self._parent.setdefault(key, key)
        self.note_reads(node, pos)

    def note_reads(self, node: fx.Node, pos: int) -> None:
        for inp in node.all_input_nodes:
            for root in self._roots(inp):
                self._last_read[root] = max(self._last_read.get(root, -1), pos)

    def dead_after(self, node: fx.Node, pos: int) -> bool:
        """True if `node`'s value may be overwritten at `pos`: nothing reads it later."""
        roots = self._roots(node)
        return bool(roots) and all(
            r not in self._inputs and self._last_read.get(r, -1) <= pos for r in roots
        )

    def last_read(self, node: fx.Node) -> int:
        """The last position at which `node`'s group is read (-1: never)."""
        return max((self._last_read.get(r, -1) for r in self._roots(node)), default=-1)

    def allocates(self, node: fx.Node) -> bool:
        """`node`'s value is a tensor in new memory, shared with none of its inputs."""
        return bool(_storages(node)) and self.disjoint(node, node.all_input_nodes)

    def disjoint(self, node: fx.Node, others: Iterable) -> bool:
        mine = self._roots(node)
        return all(not (mine & self._roots(o)) for o in others)

    def merge(self, old: fx.Node, target: fx.Node) -> None:
        """`old`'s storage now is `target`'s (old was rewritten to write over target)."""
        keep = self._root(next(iter(_storages(target))))
        for root in self._roots(old) | self._roots(target):
            if root != keep:
                self._parent[root] = keep
                self._last_read[keep] = max(
                    self._last_read.get(keep, -1), self._last_read.get(root, -1)
                )
                if root in self._inputs:
                    self._inputs.add(keep)


class _Rewriter:
    def __init__(self, graph: fx.Graph, constants: _Constants) -> None:
        self.graph = graph
        self.constants = constants
        self.live = _Liveness(graph)
        self.sites: list[Site] = []

    # ----------------------------------------------------------------- softmax (first pass)

    def softmax(self, node: fx.Node) -> None:
        family, a = _match(node, ("softmax", "log_softmax"))
        x, dim, dtype = a["input"], a["dim"], a["dtype"]
        if not isinstance(dim, int) or _tensor(x) is None:
            return
        result = node  # the node whose value the in-place op provides
        if dtype is not None and dtype != _tensor(x).dtype:
            # softmax(x, dtype=float32).to(x.dtype): one op in x's dtype, accumulating in fp32.
            users = list(node.users)
            if len(users) != 1 or not _is_conversion(users[0], node):
                return
            result = users[0]
        pos = self.live.pos[node]
        out = _tensor(result)
        last_dim = dim in (-1, _tensor(x).dim() - 1)
        for base, scale, mask, causal, folded in _softmax_inputs(x, self.constants):
            t = _tensor(base)
            if (
                t is not None
                and _inplace_ok(t, out, mti_op=True)
                and (mask is None or _mask_ok(_tensor(mask), t))
                and (last_dim or not causal)
                and self.live.dead_after(base, pos)
                and self.live.disjoint(base, [mask])
                and self._unread_between(folded, node, [base, mask])
            ):
                kwargs = {"dim": dim}
                if scale is not None:
                    kwargs["scale"] = scale
                if mask is not None:
                    kwargs["mask"] = mask
                if causal:
                    kwargs["causal"] = True
                fn = ops.softmax_ if family == "softmax" else ops.log_softmax_
                pattern = [_name(n) for n in folded] + [family]
                if causal:
                    pattern[-1] += " (causal mask)"
                if result is not node:
                    pattern.append(_name(result))
                self._replace(
                    result, fn, (base,), kwargs, base, at=node, erase=[node, *reversed(folded)]
                )
                self._site(fn, pattern, node, result)
                return

    def _unread_between(self, folded: list[fx.Node], node: fx.Node, operands) -> bool:
        """Folding moves the reads of `operands` from folded[0] to `node`: nothing else may
        touch (read, hence possibly write) them in between."""
        if not folded:
            return True
        between = folded[0].next
        while between is not node:
            if between not in folded and not all(
                self.live.disjoint(inp, operands) for inp in between.all_input_nodes
            ):
                return False
            between = between.next
        return True

    # ----------------------------------------------------------------- everything else

    def other(self, node: fx.Node) -> None:
        m = _match(node)
        if m is None:
            return
        family, a = m
        if family in _ELEMENTWISE:
            self._elementwise(node, family, a)
        elif family in ("linear", "matmul", "addmm"):
            self._matmul(node, family, a)
        elif family in ("layer_norm", "rms_norm"):
            self._norm(node, family, a)
        elif family == "where":
            self._where(node, a)

    def _where(self, node, a) -> None:
        """torch.where(keep, x, fill) -> x.masked_fill_(~keep, fill) for a dead x and a
        scalar fill (HF's masking of attention scores); ~keep costs keep's size, not x's."""
        x, keep, fill = a["input"], a["condition"], a["other"]
        t, k = _tensor(x), _tensor(keep)
        fill_t = _tensor(fill)
        scalar_fill = _is_number(fill) or (fill_t is not None and fill_t.dim() == 0)
        pos = self.live.pos[node]
        if (
            t is None
            or k is None
            or k.dtype != torch.bool
            or not scalar_fill
            or not _inplace_ok(t, _tensor(node), mti_op=False)
            or not self.live.dead_after(x, pos)
            or not self.live.disjoint(x, [keep, fill])
        ):
            return
        with self.graph.inserting_before(node):
            drop = self.graph.call_function(torch.logical_not, (keep,))
        drop.meta["example_value"] = torch.empty_like(k)
        self.live.add(drop, pos)
        self._replace(node, torch.Tensor.masked_fill_, (x, drop, fill), {}, x)
        self._site(torch.Tensor.masked_fill_, ["where"], node, node)

    def _elementwise(self, node, family, a) -> None:
        fn, rest, carried = _ELEMENTWISE[family]
        if a.get("inplace"):  # already in place
            return
        orders = [("input", *rest)]
        if family in ("add", "mul") and a.get("alpha", 1) == 1:
            orders.append(("other", "input"))  # commutative: write over either operand
        pos = self.live.pos[node]
        out = _tensor(node)
        for order in orders:
            target, *others = (a[k] for k in order)
            t = _tensor(target)
            if (
                t is not None
                and _inplace_ok(t, out, mti_op=False)
                and self.live.dead_after(target, pos)
                and self.live.disjoint(target, others)
            ):
                kwargs = {k: a[k] for k in carried if a[k] != _DEFAULTS[family][k]}
                self._replace(node, fn, (target, *others), kwargs, target)
                self._site(fn, [family], node, node)
                return

    def _matmul(self, node, family, a) -> None:
        if family == "linear":
            x, weight, bias, fn = a["input"], a["weight"], a["bias"], ops.linear_
        elif family == "matmul":
            x, weight, bias, fn = a["input"], a["other"], None, ops.square_matmul_
        else:  # addmm(bias, x, weight): GPT-2's Conv1D
            if a["beta"] != 1 or a["alpha"] != 1:
                return
            x, weight, bias, fn = a["mat1"], a["mat2"], a["input"], ops.square_matmul_
        t, w = _tensor(x), _tensor(weight)
        if family == "matmul" and t is not None and w is not None and w.dim() >= 3:
            if not self._attention(node, x, weight) and self._over_left_ok(node, x, weight):
                self._replace(node, matmul_over_left, (x, weight), {}, x,
                              value=t.as_strided(_tensor(node).shape, _tensor(node).stride()))
                self._site(matmul_over_left, ["matmul"], node, node)
            return
        if t is None or w is None or w.dim() != 2 or not _same(w.shape[0], w.shape[1]):
            return
        if bias is not None and (_tensor(bias) is None or _tensor(bias).dim() != 1):
            return
        params = [weight] + ([bias] if bias is not None else [])
        if not all(_like(_tensor(p), t) for p in params):
            return
        pos = self.live.pos[node]
        if (
            t.dim() >= 1
            and _inplace_ok(t, _tensor(node), mti_op=True)
            and self.live.dead_after(x, pos)
            and self.live.disjoint(x, params)
        ):
            self._replace(node, square_matmul_over_dead, (x, weight, bias, family == "linear"),
                          {}, x)
            self._site(fn, [family], node, node)

    def _over_left_ok(self, node, a, b) -> bool:
        """Whether a @ b of batches of matrices (attention's probs @ v) may be written over a
        dead contiguous `a` at least as wide as the product (matmul_over_left): the product
        then lives in a's memory, so a (the S x S probabilities) is freed only with the
        product. That is a saving only if nothing else is allocated meanwhile: the product's
        last reader must be the first node after it to allocate, and allocate no more than the
        product (the copy that merges heads does both)."""
        t, u, out = _tensor(a), _tensor(b), _tensor(node)
        if out is None or not all(
            isinstance(s, int) for v in (t, u, out) for s in (*v.shape, *v.stride())
        ):
            return False  # static shapes only: the pieces of the product are sized when it runs
        *batch, m, k = t.shape
        if not (
            t.dim() == u.dim()
            and list(u.shape) == [*batch, k, u.shape[-1]]
            and u.shape[-1] <= k
            and t.dtype == u.dtype
            and _inplace_ok(t, t, mti_op=True)  # a float, contiguous
            and _contiguous_dims(out.shape, out.stride())
        ):
            return False
        pos = self.live.pos[node]
        if not (self.live.dead_after(a, pos) and self.live.disjoint(a, [b])):
            return False
        last = max(self.live.last_read(node), pos)
        later = node.next
        while (at := self.live.pos.get(later)) is None or at <= last:
            if at is None or later.op == "output":  # (output: the caller would get a's memory)
                return False
            if self.live.allocates(later):
                value = _tensor(later)  # None: several values (max's values and indices)
                if at != last or value is None or value.nbytes > out.nbytes:
                    return False
            later = later.next
        return True

    def _attention(self, node, probs, v) -> bool:
        """softmax_(q @ k_t, ...) @ v (softmax_ as the first pass left it; eval-mode dropout
        or other aliases of the probabilities in between) with the scores dead afterwards ->
        attention_in_pieces(q, k_t, v, ...): the whole (..., T, S) scores are never
        allocated, one piece of them at a time. Returns whether it rewrote."""
        chain = []  # probs back to the softmax_ node: nodes that return their input as is
        sm = probs
        while len(sm.users) == 1 and _returns_input(sm):
            chain.append(sm)
            sm = sm.args[0]
        if not (
            sm.op == "call_function"
            and sm.target in (ops.softmax_, ops.log_softmax_)
            and len(sm.users) == 1
            and isinstance(sm.args[0], fx.Node)
            and len(sm.args[0].users) == 1
        ):
            return False
        scores = sm.args[0]
        m = _match(scores, ("matmul",))
        if m is None:
            return False
        q, k_t = m[1]["input"], m[1]["other"]
        tq, tk, tv, ts, out = map(_tensor, (q, k_t, v, scores, node))
        if any(t is None for t in (tq, tk, tv, ts, out)):
            return False
        batch = list(ts.shape[:-2])
        dim = sm.kwargs.get("dim", -1)
        mask = sm.kwargs.get("mask")
        pos = self.live.pos[node]
        if not (
            ts.dim() >= 3
            and all(t.dim() == ts.dim() and list(t.shape[:-2]) == batch for t in (tq, tk, tv))
            and _same(tv.shape[-2], ts.shape[-1])
            and all(t.dtype == ts.dtype for t in (tq, tk, tv))
            and isinstance(dim, int)
            and dim in (-1, -2, ts.dim() - 1, ts.dim() - 2)  # not a batch dim
            and _contiguous_dims(out.shape, out.stride())
            and self.live.allocates(scores)
            and self.live.dead_after(probs, pos)
            and self.live.dead_after(scores, pos)
            and self._unread_between([scores, sm, *reversed(chain)], node, [scores, q, k_t, mask])
        ):
            return False
        kwargs = dict(sm.kwargs)
        if sm.target is ops.log_softmax_:
            kwargs["log"] = True
        pattern = ["matmul", _op_name(sm.target), "matmul"]
        if self._over_left_ok(node, probs, v):
            kwargs["over_left"] = True
            pattern[-1] += " (over the scores when in one piece)"
        erase = [*chain, sm, scores]
        self._replace(node, attention_in_pieces, (q, k_t, v), kwargs, node, erase=erase)
        self._site(attention_in_pieces, pattern, scores, scores)
        return True

    def _norm(self, node, family, a) -> None:
        x, weight = a["input"], a["weight"]
        t = _tensor(x)
        params = [p for p in (weight, a.get("bias")) if p is not None]
        if t is None or not all(_like(_tensor(p), t) for p in params):
            return
        pos = self.live.pos[node]
        if not (
            _inplace_ok(t, _tensor(node), mti_op=True)
            and self.live.dead_after(x, pos)
            and self.live.disjoint(x, params)
        ):
            return
        if family == "layer_norm":
            fn, args = ops.layer_norm_, (x, a["normalized_shape"], weight, a["bias"], a["eps"])
        else:
            fn, args = ops.rms_norm_, (x, a["normalized_shape"], weight, a["eps"])
        self._replace(node, fn, args, {}, x)
        self._site(fn, [family], node, node)

    # ----------------------------------------------------------------- shared

    def _replace(self, result, fn, args, kwargs, target, at=None, erase=(), value=None) -> None:
        """Puts `fn(*args, **kwargs)`, which writes over `target`, in the place of `result`.

        The new node goes where `at` (default: `result`) was; `result` and then the nodes in
        `erase` (folded into the new op, each used only by the next) are removed. `value`:
        the fake tensor the new op returns, a view of target's memory (default: target).
        """
        at = result if at is None else at
        with self.graph.inserting_before(at):
            new = self.graph.call_function(fn, args, kwargs)
        new.meta.update(result.meta)
        # The op returns `target` itself (or `value`, a view of it), so the new node's storage
        # (and hence group) is target's.
        new.meta["example_value"] = target.meta["example_value"] if value is None else value
        pos = self.live.pos[at]
        self.live.pos[new] = pos
        self.live.merge(result, target)
        result.replace_all_uses_with(new)
        for dead in dict.fromkeys([result, *erase]):
            self.graph.erase_node(dead)
        self.live.note_reads(new, pos)

    def _site(self, fn, pattern: Sequence[str], origin: fx.Node, result: fx.Node) -> None:
        # `result` is out of the graph by now, but keeps its meta: the output it allocated.
        out = result.meta["example_value"]
        shape = tuple(_hint(s) for s in out.shape)
        numel = 1
        for s in shape:
            numel *= s
        self.sites.append(
            Site(
                op=_op_name(fn),
                pattern=" -> ".join(pattern),
                where=_where(origin),
                shape=shape,
                dtype=out.dtype,
                nbytes=numel * out.element_size(),
            )
        )


# --------------------------------------------------------------------------- constant masks

# Functions and Tensor methods that compute their result from their arguments alone, the ops
# models build attention masks from (arange, comparisons, broadcasting, cumsum ...).
_PURE_FUNCTIONS = {
    torch.arange, torch.tensor, torch.scalar_tensor, torch.ones, torch.zeros, torch.full,
    torch.ones_like, torch.zeros_like, torch.full_like, torch.tril, torch.triu, torch.diff,
    torch.cumsum, torch.where, torch.logical_and, torch.logical_or, torch.logical_not,
    torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge,
    operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.neg,
    operator.invert, operator.and_, operator.or_, operator.xor, operator.eq, operator.ne,
    operator.lt, operator.le, operator.gt, operator.ge, operator.getitem,
}
_PURE_METHODS = {
    "to", "type", "expand", "view", "reshape", "unsqueeze", "squeeze", "transpose", "permute",
    "contiguous", "bool", "int", "long", "float", "half", "bfloat16", "new_ones", "new_zeros",
    "new_full", "cumsum", "diff", "masked_fill", "logical_not", "logical_and", "logical_or",
    "eq", "ne", "lt", "le", "gt", "ge", "__and__", "__or__", "__xor__", "__invert__",
    # Dynamo may record `a == b` on tensors as a call of the method (torch 2.11 does, for the
    # packed-sequence test of transformers' masks).
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
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
            with unset_fake_temporarily(), torch.no_grad():
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
        with unset_fake_temporarily(), torch.no_grad():
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
        for t in pytree.tree_leaves(node.meta.get("example_value"))
        if isinstance(t, torch.Tensor)
        for s in (*t.shape, *t.stride())
    )


def _hashable_in(target, collection) -> bool:
    try:
        return target in collection
    except TypeError:  # an unhashable callable
        return False


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
        nbytes=value.untyped_storage().nbytes(),
    )


# --------------------------------------------------------------------------- op matching

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
    "sdpa": {
        "attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
        "enable_gqa": False,
    },
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
    # The bindings F.silu(inplace=True) calls: torch.ops.aten.* would add a Python-level
    # OpOverloadPacket call (a few microseconds) to every call of the graph.
    "silu": (torch._C._nn.silu_, (), ()),
    "gelu": (torch._C._nn.gelu_, (), ("approximate",)),
    **{
        name: (getattr(torch.Tensor, name + "_"), (), ())
        for name in _UNARY_NAMES
        if name != "relu"
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
            kind = constants.mask_kind(mask, out.shape)
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


# --------------------------------------------------------------------------- fake values


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


def _storages(node: fx.Node) -> set[StorageWeakRef]:
    value = node.meta.get("example_value")
    return {
        StorageWeakRef(t.untyped_storage())
        for t in pytree.tree_leaves(value)
        if isinstance(t, torch.Tensor)
    }


def _unanalyzable_node(graph: fx.Graph) -> fx.Node | None:
    """A node whose aliasing cannot be read from fake values, if the graph has one."""
    for node in graph.nodes:
        value = node.meta.get("example_value")
        if any(
            isinstance(t, torch.Tensor) and t.layout != torch.strided
            for t in pytree.tree_leaves(value)
        ):
            return node
        if "example_value" not in node.meta and (
            node.op == "get_attr"
            or (
                node.op.startswith("call_")
                and not _returns_nothing(node.target)
                and any(map(_storages, node.all_input_nodes))
            )
        ):
            return node
    return None


def _returns_nothing(target) -> bool:
    """A dispatcher op that returns nothing (it only mutates its arguments, like ours): it
    has no value to analyse, and its mutations are reads of its inputs at its position."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        return all(not getattr(target, o)._schema.returns for o in target.overloads())
    return isinstance(target, torch._ops.OpOverload) and not target._schema.returns


def _same(a, b) -> bool:
    """a == b for every value of the symbols in them (ints or SymInts)."""
    return statically_known_true(a == b)


def _hint(size) -> int:
    """A size's value in the traced example (SymInts hold one)."""
    if isinstance(size, int):
        return size
    hint = size.node.hint
    return int(hint) if hint is not None else 0


def _same_layout(t: torch.Tensor, u: torch.Tensor) -> bool:
    if t.dim() != u.dim() or not all(_same(a, b) for a, b in zip(t.shape, u.shape)):
        return False
    return all(
        _same(s, 1) or _same(a, b) for s, a, b in zip(t.shape, t.stride(), u.stride())
    )


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
    return all(
        _same(m, 1) or _same(m, s) for m, s in zip(reversed(mask.shape), reversed(t.shape))
    )


def _where(node: fx.Node) -> str:
    """Module path and source line of a node, for the report."""
    stack = node.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else ""
    path = re.sub(r"^L\['[^']*'\]\.?", "", path) or "(top)"
    files = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    if files:
        file, line = files[-1]
        path += f" ({os.path.basename(file)}:{line})"
    return path
