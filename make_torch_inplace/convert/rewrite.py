"""The rewriter: in a Dynamo graph, each op whose input is dead where it runs becomes its
in-place form (see the package's docstring for the rules)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
from torch import fx

from .. import ops
from .constants import _Constants
from .fake import (
    _contiguous_dims,
    _hint,
    _inplace_ok,
    _like,
    _mask_ok,
    _returns_input,
    _same,
    _same_layout,
    _tensor,
    _unanalyzable_node,
)
from .fuse import fuse
from .liveness import _Liveness, tensor_peak
from .masks import _drop_mask_keeping_all, _fold_sdpa_mask
from .patterns import (
    _DEFAULTS,
    _ELEMENTWISE,
    _is_conversion,
    _is_number,
    _match,
    _name,
    _op_name,
    _softmax_inputs,
)
from .pieces import (
    attention_in_pieces,
    gelu_mlp_recomputed,
    linear_cross_entropy,
    linear_of_gelu,
    linear_of_silu_mul,
    matmul_over_left,
    rope_through_views,
    silu_mul,
    square_matmul_over_dead,
    swiglu_recomputed,
)
from .report import GraphReport, Site, _mib, _where
from .saves import inplace_saves, recording, saved_values


def _rewrite_graph(
    gm: fx.GraphModule,
    report: Callable[[str], None] | None = None,
    constants: _Constants | None = None,
    recompute: Sequence[str] = (),
) -> GraphReport | None:
    """Rewrites a Dynamo graph in place (see the package's docstring); returns what it did,
    None if the graph was left unchanged because its aliasing is unknown. `constants`: the
    graph's _Constants, which says for which sizes masks are evaluated (default: the traced
    example's). `recompute`: convert's option of that name."""
    blocker = _unanalyzable_node(gm.graph)
    if blocker is not None:
        if report:
            report(
                f"mti.convert: graph left unchanged: the aliasing of node {blocker.name} "
                f"({blocker.target}) is unknown (no example value, not a strided tensor, or "
                f"storages this torch cannot tell apart)"
            )
        return None
    before = tensor_peak(gm.graph)
    captured = fx.Graph()
    captured.output(captured.graph_copy(gm.graph, {}))
    fuse(gm.graph)
    saves = None
    if recording(gm.graph):
        saves = saved_values(gm)
        if saves is None:
            if report:
                report(
                    "mti.convert: graph left unchanged: autograd records it, and what it saves "
                    "for the backward could not be found (an op that does not run on fake "
                    "tensors)"
                )
            gm.graph = captured
            gm.recompile()
            return None
    constants = _Constants(gm.graph) if constants is None else constants
    sites = [_fold_sdpa_mask(node, constants) for node in list(gm.graph.nodes)]
    dropped = [_drop_mask_keeping_all(node, constants) for node in list(gm.graph.nodes)]
    rewriter = _Rewriter(gm.graph, constants, saves, recompute)
    for site, old, kept in filter(None, dropped):
        rewriter.live.merge(old, kept)  # the same tensor now
        sites.append(site)
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
    result = GraphReport(tuple(rewriter.sites), before, tensor_peak(gm.graph))
    if result.after > before:
        # Never worse: keeping an input alive in place of an output can hold a larger
        # storage longer (an op over a view of a bigger tensor), and the rules above look at
        # one op at a time. Then the graph runs as captured.
        if report:
            report(
                f"mti.convert: graph left as captured: its rewrites would raise its tensors' "
                f"peak from {_mib(before)} to {_mib(result.after)}"
            )
        gm.graph = captured
        result = GraphReport((), before, before)
    gm.recompile()
    if report and result.sites:
        for line in result.lines():
            report(line)
    return result


class _Rewriter:
    """Rewrites one graph's nodes. `saves` (saves.saved_values): where autograd records the
    graph, what each node saves for the backward; then no saved tensor is written over, ops
    whose in-place form would save a copy of its input stay as they are, and products of
    batched matrices (attention's) are left to autograd, which saves their operands."""

    def __init__(
        self,
        graph: fx.Graph,
        constants: _Constants,
        saves: dict | None = None,
        recompute: Sequence[str] = (),
    ) -> None:
        self.graph = graph
        self.constants = constants
        self.training = saves is not None
        self.recompute_mlp = "mlp" in recompute
        self.live = _Liveness(graph, saves)
        self.sites: list[Site] = []
        # softmax_ nodes of the first pass -> their sites, which attention_in_pieces takes over
        self._softmax_sites: dict[fx.Node, Site] = {}
        # silu_mul nodes -> their sites, which linear_of_silu_mul takes over
        self._silu_mul_sites: dict[fx.Node, Site] = {}
        self._last_elementwise: Site | None = None  # see _chain

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
                new = self._replace(
                    result, fn, (base,), kwargs, base, at=node, erase=[node, *reversed(folded)]
                )
                self._keeps_output(new)
                self._softmax_sites[new] = self._site(fn, pattern, node, result)
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
        elif family == "cross_entropy":
            self._cross_entropy(node, a)
        elif family == "where":
            self._where(node, a)
        elif family == "rope":
            self._rope(node, a)

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
        drop_value = torch.empty_like(k)
        keeps = self._training_form(torch.Tensor.masked_fill_, (x, drop_value, fill), {})
        if keeps is None:
            return
        drop = self._insert(node, torch.logical_not, (keep,), drop_value)
        new = self._replace(node, torch.Tensor.masked_fill_, (x, drop, fill), {}, x)
        if keeps:
            self._keeps_output(new)
        self._site(torch.Tensor.masked_fill_, ["where"], node, node)

    def _rope(self, node, a) -> None:
        """fuse.py's rotary embedding over a dead x (a query or key projection) -> rope_
        written over it; its backward needs cos and sin alone."""
        x, cos, sin = a["input"], a["cos"], a["sin"]
        t = _tensor(x)
        if (
            t is None
            or not _inplace_ok(t, _tensor(node), mti_op=False)
            or not self.live.dead_after(x, self.live.pos[node])
            or not self.live.disjoint(x, [cos, sin])
        ):
            return
        viewed = self._recorded_view(x) if self.training else None
        if viewed is None:
            self._replace(node, ops.rope_, (x, cos, sin), {}, x)
        else:
            # rope_ through the views, recorded on their base; the views are taken again of
            # the result, for the op's readers.
            base, chain = viewed
            steps = tuple((v.target, tuple(v.args[1:])) for v in chain)
            new = self._replace(node, rope_through_views, (base, steps, cos, sin), {}, base)
            new.replace_all_uses_with(chain[-1])
            chain[0].replace_input_with(base, new)
            for before, v in zip((new, *chain), chain):
                before.append(v)
                self.live.pos[v] = self.live.pos[new]
        self._site(ops.rope_, ["rope"], node, node)

    def _recorded_view(self, x: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
        """(base, chain) where x is base viewed by the method calls `chain` (view, reshape,
        transpose, permute, unsqueeze; each read by the next alone, x by the op alone) of a
        contiguous base that autograd records; else None."""
        chain, node = [], x
        while (
            node.op == "call_method"
            and node.target in ("view", "reshape", "transpose", "permute", "unsqueeze")
            and not node.kwargs
            and len(node.users) == 1
        ):
            chain.insert(0, node)
            node = node.args[0]
        base = _tensor(node)
        if (
            not chain
            or base is None
            or not _tensor(x).requires_grad  # (base's may be of the tensor an add_ wrote over)
            or not base.is_contiguous()
            or self.live.disjoint(x, [node])  # a reshape that copied
        ):
            return None
        return node, chain

    def _elementwise(self, node, family, a) -> None:
        if self.training and family == "mul" and self._silu_mul(node, a):
            return
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
                keeps = self._training_form(fn, (target, *others), kwargs)
                if keeps is None:
                    continue
                new = self._replace(node, fn, (target, *others), kwargs, target)
                if keeps:
                    self._keeps_output(new)
                self._chain(self._site(fn, [family], node, node))
                return

    def _silu_mul(self, node, a) -> bool:
        """F.silu(g) * u, the silu read by nothing else, where autograd records -> silu_mul,
        which saves g and u but not silu(g). Returns whether it rewrote."""
        for act, u in ((a["input"], a["other"]), (a["other"], a["input"])):
            m = _match(act, ("silu",)) if isinstance(act, fx.Node) else None
            if m is None or m[1]["inplace"] or len(act.users) != 1:
                continue
            g = m[1]["input"]
            tg, tu, out = _tensor(g), _tensor(u), _tensor(node)
            if (
                tg is None
                or tu is None
                or out is None
                or tg.dtype != tu.dtype
                or not _same_layout(tg, tu)
                or not _same_layout(tg, out)
                or not _contiguous_dims(tg.shape, tg.stride())
            ):
                continue
            # Where nothing but this op reads or saves g and u, its backward writes their
            # gradients over them.
            pos = self.live.pos[node]
            consume = self.live.disjoint(g, [u]) and all(
                self.live.dead_after(v, pos, savers=(act, node)) for v in (g, u)
            )
            kwargs = {"consume": True} if consume else {}
            new = self._substitute(node, silu_mul, (g, u), kwargs, erase=[act])
            self.live.mark_saved(g, new)
            self.live.mark_saved(u, new)
            self._site(silu_mul, ["silu", "mul"], new, act)
            op = "silu_mul (recomputes silu" + (", gradients over g, u)" if consume else ")")
            self.sites[-1] = dataclasses.replace(self.sites[-1], op=op)
            self._silu_mul_sites[new] = self.sites[-1]
            return True
        return False

    def _chain(self, site: Site) -> None:
        """Elementwise ops rewritten one after the other from the same source line, with
        outputs of one shape (an activation written as arithmetic that fuse.py does not
        know) are one site: one line in the report, with the bytes of all the outputs they no
        longer allocate, and their ops in `op`, comma-separated."""
        last = self._last_elementwise
        self._last_elementwise = site
        if (
            last is None
            or (last.where, last.shape) != (site.where, site.shape)
            or self.sites[-2:] != [last, site]
        ):
            return
        joined = dataclasses.replace(
            last,
            op=f"{last.op}, {site.op}",
            pattern=f"{last.pattern}, {site.pattern}",
            nbytes=last.nbytes + site.nbytes,
        )
        self.sites[-2:] = [joined]
        self._last_elementwise = joined

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
        if self.training and self._recomputed_mlp(node, x, weight, bias, family):
            return
        if self.training and self._linear_of_activation(node, x, weight, bias, family):
            return
        if self.training and (w is None or w.requires_grad or w.dim() >= 3):
            return  # the weight's gradient, and attention's backward, need x
        if family == "matmul" and t is not None and w is not None and w.dim() >= 3:
            if not self._attention(node, x, weight) and self._over_left_ok(node, x, weight):
                self._replace(
                    node,
                    matmul_over_left,
                    (x, weight),
                    {},
                    x,
                    value=t.as_strided(_tensor(node).shape, _tensor(node).stride()),
                )
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
            self._replace(
                node, square_matmul_over_dead, (x, weight, bias, family == "linear"), {}, x
            )
            self._site(fn, [family], node, node)

    def _recomputed_mlp(self, node, p, weight, bias, family) -> bool:
        """With recompute=("mlp",), where autograd records: an MLP's last linear (or GPT-2's
        addmm over a view), of silu_mul(g, u) with g and u linears of one x (SwiGLU) or of
        F.gelu(h) with h a linear of x, each read by nothing else -> swiglu_recomputed /
        gelu_mlp_recomputed, which save x and compute g and u (h) again in the backward.
        Returns whether it rewrote."""
        if not (self.recompute_mlp and family in ("linear", "addmm") and isinstance(p, fx.Node)):
            return False
        erase = []
        if family == "addmm":  # Conv1D: addmm(b, act.view(-1, n), W) is F.linear(., W.t(), b)
            if not (p.op == "call_method" and p.target == "view" and len(p.users) == 1):
                return False
            erase.append(p)
            p = p.args[0]
        if not isinstance(p, fx.Node) or len(p.users) != 1:
            return False
        if p.op == "call_function" and p.target is silu_mul:
            inner, fn, kwargs, act = list(p.args[:2]), swiglu_recomputed, {}, "silu -> mul"
        elif (m := _match(p, ("gelu",))) is not None:
            inner, fn, act = [m[1]["input"]], gelu_mlp_recomputed, "gelu"
            kwargs = {"approximate": m[1]["approximate"]}
        else:
            return False
        projections = [_projection(q) for q in inner]
        if any(q is None for q in projections):
            return False
        x = projections[0][0]
        layers = [(w, conv) for _, w, _, conv, _ in projections] + [(weight, family == "addmm")]
        tensors = [_tensor(x)] + [_tensor(w) for w, _ in layers]
        if (
            any(q[0] is not x for q in projections)
            or any(t is None for t in tensors)
            or len({t.dtype for t in tensors}) != 1
            or any(t.dim() != 2 for t in tensors[1:])
        ):
            return False
        weights = [
            self._insert(node, "t", (w,), _tensor(w).t()) if conv else w for w, conv in layers
        ]
        biases = [q[2] for q in projections] + [bias]
        args = (x, *weights[:-1], weights[-1], *biases)
        erase += [p] + [n for q in projections for n in q[4]]
        new = self._substitute(node, fn, args, kwargs, erase)
        self.live.mark_saved(x, new)
        absorbed = self._silu_mul_sites.pop(p, None)
        if absorbed is not None:
            self.sites.remove(absorbed)
        pattern = [family] * len(inner) + [act, family]
        site = self._site(fn, pattern, new, new)
        recomputed = "g and u" if fn is swiglu_recomputed else "h"
        self.sites[-1] = dataclasses.replace(
            site,
            op=f"{site.op} (recomputes {recomputed})",
            nbytes=0,
            parts=(absorbed,) if absorbed else (),
        )
        return True

    def _linear_of_activation(self, node, p, weight, bias, family) -> bool:
        """Where autograd records: a linear (or GPT-2's addmm over a view) of silu_mul(g, u) or
        F.gelu(x), read by nothing else, by a weight that requires grad -> linear_of_silu_mul
        / linear_of_gelu, which save the activation's inputs but not the activation (the
        weight's gradient computes it again). Returns whether it rewrote."""
        w, out = _tensor(weight), _tensor(node)
        if family == "matmul" or w is None or out is None or not w.requires_grad or w.dim() != 2:
            return False
        view = None
        if family == "addmm" and p.op == "call_method" and p.target == "view":
            view, p = p, p.args[0]
        if not isinstance(p, fx.Node) or len(p.users) != 1 or (view and len(view.users) != 1):
            return False
        if p.op == "call_function" and p.target is silu_mul:
            fn, inputs, kwargs, act = (
                linear_of_silu_mul,
                list(p.args),
                dict(p.kwargs),
                "silu -> mul",
            )
            recomputed = "silu(g) * u"
        elif (m := _match(p, ("gelu",))) is not None:
            fn, inputs, act, recomputed = linear_of_gelu, [m[1]["input"]], "gelu", "gelu"
            kwargs = {"approximate": m[1]["approximate"]}
            if self.live.dead_after(inputs[0], self.live.pos[node], savers=(p,)):
                kwargs["consume"] = True  # as silu_mul's
        else:
            return False
        values = [_tensor(i) for i in inputs]
        if any(v is None or v.dtype != w.dtype for v in values):
            return False
        if view is not None:  # the activation's inputs viewed as its output was
            inputs = [
                self._insert(node, "view", (i, *view.args[1:]), v.view(_tensor(view).shape))
                for i, v in zip(inputs, values)
            ]
        if family == "addmm":  # x @ W + b is F.linear(x, W.t(), b)
            weight = self._insert(node, "t", (weight,), w.t())
        erase = [p] if view is None else [view, p]
        new = self._substitute(node, fn, (*inputs, weight, bias), kwargs, erase)
        for i in inputs:
            self.live.mark_saved(i, new)
        pattern = [act, "view", family] if view is not None else [act, family]
        absorbed = self._silu_mul_sites.pop(p, None)  # this site's part, on its line
        if absorbed is not None:
            self.sites.remove(absorbed)
        site = self._site(fn, pattern, new, new)
        self.sites[-1] = dataclasses.replace(
            site,
            op=f"{site.op} (recomputes {recomputed}"
            + (", gradients over its inputs)" if kwargs.get("consume") else ")"),
            nbytes=0,
            parts=(absorbed,) if absorbed else (),
        )
        return True

    def _over_left_ok(self, node, a, b) -> bool:
        """Whether a @ b of batches of matrices (attention's probs @ v) may be written over a
        dead contiguous `a` at least as wide as the product (matmul_over_left): the product
        then lives in a's memory, so a (the S x S probabilities) is freed only with the
        product. That is a saving only if nothing else is allocated meanwhile: the product's
        last reader must be the first node after it to allocate, and allocate no more than the
        product (the copy that merges heads does both)."""
        t, u, out = _tensor(a), _tensor(b), _tensor(node)
        if out is None:
            return False
        *batch, _, k = t.shape
        if not (
            t.dim() == u.dim()
            and all(_same(x, y) for x, y in zip(u.shape, [*batch, k, u.shape[-1]]))
            and self.constants.holds(u.shape[-1] <= k)  # for the sizes at hand
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
                if (
                    at != last
                    or value is None
                    or not self.constants.holds(
                        value.numel() * value.itemsize <= out.numel() * out.itemsize
                    )
                ):
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
        # One site for the whole attention: the softmax_ site of the first pass is its part.
        softmax_site = self._softmax_sites.pop(sm, None)
        parts = () if softmax_site is None else (softmax_site,)
        if softmax_site is not None:
            self.sites.remove(softmax_site)
            pattern = ["matmul", softmax_site.pattern, "matmul"]
        else:
            pattern = ["matmul", _op_name(sm.target), "matmul"]
        if self._over_left_ok(node, probs, v):
            kwargs["over_left"] = True
            pattern[-1] += " (over the scores when in one piece)"
        erase = [*chain, sm, scores]
        self._replace(node, attention_in_pieces, (q, k_t, v), kwargs, node, erase=erase)
        site = self._site(attention_in_pieces, pattern, scores, scores)
        self.sites[-1] = dataclasses.replace(site, parts=parts)
        return True

    def _norm(self, node, family, a) -> None:
        """A norm over its dead input in place; where autograd records and the input lives on
        (a pre-norm block's residual), over a copy of it: the norm then saves its output,
        which the next op saves anyway, instead of its input."""
        x, weight = a["input"], a["weight"]
        t = _tensor(x)
        params = [p for p in (weight, a.get("bias")) if p is not None]
        if t is None or not all(_like(_tensor(p), t) for p in params):
            return
        pos = self.live.pos[node]
        if not (_inplace_ok(t, _tensor(node), mti_op=True) and self.live.disjoint(x, params)):
            return
        pattern = [family]
        if not self.live.dead_after(x, pos, savers=(node,)):
            if not self.training:
                return
            x = self._insert(node, torch.clone, (x,), torch.empty_like(t))
            pattern.insert(0, "clone")
        if family == "layer_norm":
            fn, args = ops.layer_norm_, (x, a["normalized_shape"], weight, a["bias"], a["eps"])
        else:
            fn, args = ops.rms_norm_, (x, a["normalized_shape"], weight, a["eps"])
        new = self._replace(node, fn, args, {}, x)
        self._keeps_output(new)
        site = self._site(fn, pattern, node, node)
        if x is not a["input"]:  # the copy is allocated as the output was
            self.sites[-1] = dataclasses.replace(site, nbytes=0)

    def _cross_entropy(self, node, a) -> None:
        """F.cross_entropy over dead float32/64 logits -> cross_entropy_, which writes the
        loss's gradient over them: autograd saves that, not a log-softmax of the logits. Over
        a float32 copy of 16-bit logits (a causal LM's loss: logits.float().view(-1, V)), the
        op reads the 16-bit logits themselves, or a copy of them where they live on (they are
        the model's output), and writes the gradient in their dtype, which autograd would
        round it to anyway: half the float32 copy's memory, and no float32 gradient."""
        x, target = a["input"], a["target"]
        t, tt, loss = _tensor(x), _tensor(target), _tensor(node)
        if (
            t is None
            or tt is None
            or loss is None
            or a["weight"] is not None
            or a["size_average"] is not None
            or a["reduce"] is not None
            or a["reduction"] not in ("mean", "sum", "none")
            or not _is_number(a["ignore_index"])
            or not _is_number(a["label_smoothing"])
            or t.dtype not in (torch.float32, torch.float64)
            or loss.dtype != t.dtype
            or t.dim() != tt.dim() + 1
            or tt.dtype != torch.int64
            or not _contiguous_dims(t.shape, t.stride())
            or not self.live.disjoint(x, [target])
        ):
            return
        pos = self.live.pos[node]
        if self._linear_cross_entropy(node, x, target, a):
            return
        pattern, nbytes = ["cross_entropy"], t.untyped_storage().nbytes()
        upcast = _upcast_view(x)
        if upcast is not None:
            src, erase = upcast
            over = src
            if not self.live.dead_after(src, pos):
                over = self._insert(node, torch.clone, (src,), torch.empty_like(_tensor(src)))
                nbytes -= _tensor(src).untyped_storage().nbytes()
            if erase[0] is not erase[-1]:  # the view, as the float32 copy was viewed
                view = erase[0]
                x = self._insert(
                    node, view.target, (over, *view.args[1:]), _tensor(over).view(t.shape)
                )
            else:
                x = over
            pattern = [_name(n) for n in reversed(erase)] + pattern
            if over is not src:
                pattern.insert(0, "clone")
        elif self.live.dead_after(x, pos, savers=(node,)):
            erase = []
        else:
            return
        args = (x, target, a["ignore_index"], a["reduction"], a["label_smoothing"])
        new = self._substitute(node, ops.cross_entropy_, args, erase=erase)
        site = self._site(ops.cross_entropy_, pattern, new, x)
        self.sites[-1] = dataclasses.replace(site, nbytes=nbytes)

    def _linear_cross_entropy(self, node, x, target, a) -> bool:
        """The loss of logits F.linear(h, W) as float32 (viewed), where autograd records ->
        linear_cross_entropy(h, W, ...): where nothing else reads the logits (not returned:
        see convert's drop_outputs), they are never allocated whole; where something does
        (the model returns them), the loss reads them a piece at a time, and autograd keeps
        no copy of them. Returns whether it rewrote."""
        chain = [x]  # from the loss's input back to the linear
        while _is_view_or_float(chain[-1]) and len(chain[-1].users) == 1:
            chain.append(chain[-1].args[0])
        lin = chain[-1]
        m = _match(lin, ("linear",)) if isinstance(lin, fx.Node) else None
        if (
            not self.training
            or a["reduction"] not in ("mean", "sum")
            or m is None
            or m[1]["bias"] is not None
            or _tensor(m[1]["input"]) is None
        ):
            return False
        args = (m[1]["input"], m[1]["weight"], target, a["ignore_index"], a["reduction"])
        pattern = ["linear", *(_name(n) for n in reversed(chain[:-1])), "cross_entropy"]
        kwargs = {}
        if len(lin.users) > 1:  # the logits live on: the loss reads them, the linear stays
            if not self._reading_logits_pays(lin, m[1]["weight"]):
                return False
            kwargs["logits"], chain = lin, chain[:-1]
        new = self._substitute(
            node, linear_cross_entropy, (*args, a["label_smoothing"]), kwargs, erase=chain
        )
        self._site(linear_cross_entropy, pattern, new, lin)
        return True

    def _reading_logits_pays(self, lin, weight) -> bool:
        """Whether linear_cross_entropy reading logits that live on (rows x V) keeps less than
        cross_entropy_ over a copy of them, which autograd keeps until the backward: it keeps
        h's gradient and one piece of logits from the forward on, and the weight's gradient
        (V x H), which the copy's backward allocates while the copy lives."""
        out, w = _tensor(lin), _tensor(weight)
        if out is None or w is None or w.dim() != 2:
            return False
        if not w.requires_grad:
            return True
        rows, (vocab, hidden), size = math.prod(out.shape[:-1]), w.shape, out.element_size()
        kept = (vocab + rows) * hidden * size + ops.get_workspace_limit()
        return self.constants.holds(rows * vocab * size > kept)

    def _insert(self, before: fx.Node, target, args, value, kwargs=None) -> fx.Node:
        """A new node computing `target(*args, **kwargs)` (a method, if a string) before
        `before`, whose example value is `value`."""
        with self.graph.inserting_before(before):
            if isinstance(target, str):
                new = self.graph.call_method(target, args, kwargs or {})
            else:
                new = self.graph.call_function(target, args, kwargs or {})
        new.meta["example_value"] = value
        self.live.add(new, self.live.pos[before])
        return new

    def _substitute(self, node: fx.Node, fn, args, kwargs=None, erase=()) -> fx.Node:
        """`fn(*args, **kwargs)`, whose value is a new tensor like `node`'s, in the place of
        `node`; `node` and then the nodes in `erase` (each read only by the ones before it) go.
        Returns the new node."""
        new = self._insert(node, fn, args, node.meta.get("example_value"), kwargs)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        for dead in (node, *erase):
            self.graph.erase_node(dead)
        return new

    # ----------------------------------------------------------------- shared

    def _training_form(self, fn, args, kwargs) -> bool | None:
        """Whether PyTorch's in-place `fn(*args, **kwargs)` saves its output for the backward
        (False where autograd does not record the graph); None where it would save a copy of
        its input instead (then the rewrite saves nothing), or cannot be told."""
        if not self.training:
            return False
        saves = inplace_saves(fn, args, kwargs)
        if saves is None or saves[0]:
            return None
        return saves[1]

    def _keeps_output(self, new: fx.Node) -> None:
        """Where autograd records, `new` (an in-place op) saves the tensor it wrote for the
        backward: no later op may write over it."""
        if self.training:
            self.live.mark_saved(new, new)

    def _replace(self, result, fn, args, kwargs, target, at=None, erase=(), value=None):
        """Puts `fn(*args, **kwargs)`, which writes over `target`, in the place of `result`.

        The new node goes where `at` (default: `result`) was; `result` and then the nodes in
        `erase` (folded into the new op, each used only by the next) are removed. `value`:
        the fake tensor the new op returns, a view of target's memory (default: target).
        Returns the new node.
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
        return new

    def _site(self, fn, pattern: Sequence[str], origin: fx.Node, result: fx.Node) -> Site:
        # `result` is out of the graph by now, but keeps its meta: the output it allocated.
        out = result.meta["example_value"]
        shape = tuple(_hint(s) for s in out.shape)
        numel = 1
        for s in shape:
            numel *= s
        site = Site(
            op=_op_name(fn),
            pattern=" -> ".join(pattern),
            where=_where(origin),
            shape=shape,
            dtype=out.dtype,
            nbytes=numel * out.element_size(),
        )
        self.sites.append(site)
        return site


def _projection(node):
    """(x, weight, bias, conv, nodes) if `node` is an MLP's inner projection read by nothing
    but the activation: F.linear(x, weight, bias) (conv False), or GPT-2's Conv1D,
    addmm(bias, x, weight).view(...) with x a (rows, n) view (conv True: x @ weight); nodes
    are the projection's own, the last computed first. Else None."""
    if not isinstance(node, fx.Node) or len(node.users) != 1:
        return None
    m = _match(node, ("linear",))
    if m is not None:
        return m[1]["input"], m[1]["weight"], m[1]["bias"], False, [node]
    if not (node.op == "call_method" and node.target == "view"):
        return None
    fc = node.args[0]
    m = _match(fc, ("addmm",)) if isinstance(fc, fx.Node) else None
    if m is None or len(fc.users) != 1 or m[1]["beta"] != 1 or m[1]["alpha"] != 1:
        return None
    return m[1]["mat1"], m[1]["mat2"], m[1]["input"], True, [node, fc]


def _is_view_or_float(node) -> bool:
    """node views its input (view, reshape) or converts it to float32 (float, to)."""
    if not (isinstance(node, fx.Node) and node.op == "call_method" and node.args):
        return False
    if node.target in ("view", "reshape"):
        return True
    t = _tensor(node)
    return node.target in ("float", "to") and t is not None and t.dtype == torch.float32


def _upcast_view(x: fx.Node):
    """(src, [x, ..., the conversion]) if x is a float32 copy of a contiguous 16-bit `src`,
    as is or through one view/reshape, each value read only by the next."""
    chain = [x]
    if x.op == "call_method" and x.target in ("view", "reshape") and len(x.users) == 1:
        x = x.args[0]
        chain.append(x)
    if not (isinstance(x, fx.Node) and x.args and _is_conversion(x, x.args[0])):
        return None
    src, t, out = x.args[0], _tensor(x.args[0]), _tensor(x)
    if (
        len(x.users) != 1
        or t is None
        or out is None
        or out.dtype != torch.float32
        or t.dtype not in (torch.float16, torch.bfloat16)
        or not _same_layout(t, out)
        or not _contiguous_dims(t.shape, t.stride())
    ):
        return None
    return src, chain
