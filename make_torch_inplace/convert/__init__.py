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
- Where autograd records (training), a tensor that an op saves for the backward is never
  written over, and an op whose in-place form would save a copy of its input (GELU, mul_ by
  a tensor that requires grad) stays as it is: saves.py finds both by running the graph on
  fake tensors. A norm whose input lives on runs over a copy of it, so that it saves its
  output (which the next op saves anyway) instead of its input; a square matmul runs in
  place only by a frozen weight; batched products (attention's) are left to autograd;
  ``F.silu(g) * u`` becomes silu_mul, which saves g and u and computes silu(g) again in the
  backward instead of saving it, and a linear of it or of ``F.gelu(x)`` becomes
  linear_of_silu_mul / linear_of_gelu, which save the activation's inputs alone (and write
  their gradients over them in the backward where nothing else reads or saves them).

Patterns: F.linear / addmm / matmul with a square weight (-> linear_ / square_matmul_),
softmax / log_softmax with the scale and additive mask that feed them folded in
(``softmax(x * c + mask)``, ``x / d`` as scale 1/d) and with
``softmax(x, dtype=float32).to(x.dtype)`` folded into one op, layer_norm / rms_norm,
``torch.where(keep, x, fill)`` (-> ``x.masked_fill_(~keep, fill)``), and elementwise
arithmetic and activations (-> PyTorch's own ``mul_``, ``add_``, ``tanh_``, ...), and a
batched matmul whose left operand is dead and at least as wide as the product (attention's
``probs @ v`` -> matmul_over_left, the product written over the probabilities), and
F.cross_entropy over dead float32/64 logits (-> cross_entropy_, the logits becoming their
gradient), and Hugging Face's written-out rotary embedding over a dead query or key (-> rope_).
Module
forms (nn.Linear, nn.Softmax, ...) reach the backend as these functions, since Dynamo inlines
torch.nn modules.

Eager attention, ``softmax_(q @ k_t, ...) @ v`` once the softmax is in place, with the scores
dead afterwards, becomes attention_in_pieces: the same three ops, run a few heads at a time,
so that only one piece of the B x heads x T x S scores (at most the workspace limit, at
least one T x S matrix) is ever allocated. In-place ops alone cannot go below the full
scores plus q, k, v and the hidden state, more than half of eager's peak (which holds two
score-sized tensors), for a model like BERT.

Masks computed from sizes alone: the model is captured with dynamic shapes, and transformers
builds a mask from the sizes under torch.compile where eager mode passes none. The backend
computes such a mask for the sizes of a call, on the CPU (_Constants): one that keeps every
element is dropped; one that keeps exactly j <= i becomes ``is_causal=True`` for
scaled_dot_product_attention and ``causal=True`` for softmax_ (also from
``torch.where(mask, x, lowest)``); any other is kept as computed. SDPA then keeps its flash
kernel, and no S x S mask is built. The class of a mask may change with the sizes (a sliding
window is causal up to its width), so each class of sizes runs a rewrite of its own
(runtime._SizeClasses): a call with sizes seen before costs a dict lookup, one with new sizes
evaluates the masks once, on the CPU, and picks the rewrite whose answers match or makes one
from the captured graph (no new capture). Conditions of a rewrite on the sizes themselves
(probs @ v over the probabilities needs the head dim <= the length) are classes alike.
``torch.where(keep_all, x, fill)`` or ``x + zeros`` is x itself where nothing writes either
(T5's position bias, which transformers masks in every layer under torch.compile).

Never worse: each rewrite's report (report.GraphReport) holds the peak bytes of the graph's
tensors as captured and as rewritten (liveness.tensor_peak); a graph whose rewrites would
raise that peak runs as captured.

Modules: runtime (ConvertedModule, its backend and its calls), rewrite (the rewriter), report
(Site and GraphReport), liveness (aliasing groups and their last reads), saves (what autograd
saves), fuse (op sequences that are one op: Hugging Face's written-out RMSNorm, GELU and rotary
embedding),
patterns (the ops recognised and their arguments), constants (constant masks), fake (what
example values tell), pieces (the helpers rewritten graphs call), _compat (every private
PyTorch API used, with its fallback).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .pieces import (
    attention_in_pieces,
    gelu_mlp_recomputed,
    linear_cross_entropy,
    linear_of_gelu,
    linear_of_silu_mul,
    matmul_over_left,
    rope,
    silu_mul,
    square_matmul_over_dead,
    swiglu_recomputed,
)
from .report import Site
from .runtime import ConvertedModule

# The names convert's `recompute` takes.
RECOMPUTABLE = ("mlp",)

__all__ = [
    "ConvertedModule",
    "Site",
    "attention_in_pieces",
    "convert",
    "gelu_mlp_recomputed",
    "linear_cross_entropy",
    "linear_of_gelu",
    "linear_of_silu_mul",
    "matmul_over_left",
    "rope",
    "silu_mul",
    "square_matmul_over_dead",
    "swiglu_recomputed",
]


def convert(
    model: nn.Module,
    verbose: bool = False,
    drop_outputs: Sequence[str] = (),
    recompute: Sequence[str] = (),
) -> ConvertedModule:
    """Returns a module computing `model`'s forward with ops run in place where that is safe.

    An op writes over its input only where that input is dead: read by nothing later, not a
    model input, parameter or buffer, not visible through a view that is still used. The
    model is captured with torch.compile on its first call, with dynamic shapes: one capture
    serves every sequence length and batch size, including a generation loop's tokens.
    Dynamo specialises a size of 1 (a batch of one, one new token), which costs one more
    capture; a new dtype, device or layout captures anew, and past 64 captures of a model
    class Dynamo runs it unconverted (with a RuntimeWarning). With ``verbose=True`` each
    rewrite prints its report: one line per rewritten site with the bytes it no longer
    allocates, and the peak of the graph's tensors before and after (also
    ``ConvertedModule.report()``; the sites accumulate in ``ConvertedModule.sites``). `model`
    itself is left unchanged and shares its parameters
    with the result; its methods called through the result (``generate``) run the converted
    forward wherever they call the model.

    Where autograd records, the result trains as the model does (the same gradients), with
    ops in place only where no tensor the backward needs is written over, and norms saving
    their output instead of their input (see the package docstring).

    ``drop_outputs``: names of outputs (of a model returning a mapping, such as a transformers
    ModelOutput) that the result returns as None, so that they are dead inside: with
    ``("logits",)``, a causal LM trained on its loss never holds its logits whole
    (linear_cross_entropy), as Liger-Kernel's fused linear cross entropy does.

    ``recompute``: what the backward computes again instead of autograd keeping it, trading
    time for memory where autograd records. ``("mlp",)``: an MLP of linears keeps its input
    alone, which its norm keeps anyway, and its backward computes the inner projections
    again: a SwiGLU MLP (Llama's) keeps two tensors of the MLP's width fewer per token and
    layer for two more products (swiglu_recomputed), a GELU MLP (BERT's, GPT-2's) one fewer
    for one more product (gelu_mlp_recomputed).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(drop_outputs, str):
        raise TypeError("convert: drop_outputs is a sequence of names, e.g. ('logits',)")
    if isinstance(recompute, str):
        raise TypeError("convert: recompute is a sequence of names, e.g. ('mlp',)")
    unknown = set(recompute) - set(RECOMPUTABLE)
    if unknown:
        raise ValueError(
            f"convert: recompute takes names from {RECOMPUTABLE}, got {sorted(unknown)}"
        )
    return ConvertedModule(
        model, verbose=verbose, drop_outputs=tuple(drop_outputs), recompute=tuple(recompute)
    )
