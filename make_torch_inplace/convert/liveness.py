"""Which tensors of a graph share storage, and where each such group is last read."""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable

import torch
from torch import fx

from .. import ops
from . import _compat, pieces
from .fake import _drops_nothing, _hint, _storages, _tensor


class _Liveness:
    """Groups of tensors sharing storage, and the last position at which each group is read.

    Groups are union-find sets over fake storages. A rewrite that makes node n write over
    tensor x merges n's storage into x's, and marks every input of the new node as read at
    its position. Where autograd records, `saves` (saves.saved_values) says which nodes save
    which values for the backward: those groups may not be written over at all.
    """

    def __init__(self, graph: fx.Graph, saves: dict[fx.Node, set[fx.Node]] | None = None) -> None:
        self.pos: dict[fx.Node, int] = {}
        self._parent: dict[Hashable, Hashable] = {}
        self._last_read: dict[Hashable, int] = {}
        self._inputs: set[Hashable] = set()
        self._saved_by: dict[Hashable, set[fx.Node]] = {}  # group -> the nodes saving it
        for i, node in enumerate(graph.nodes):
            self.pos[node] = i
            for key in _storages(node):
                self._parent.setdefault(key, key)
                if node.op in ("placeholder", "get_attr"):
                    self._inputs.add(key)
            self.note_reads(node, i)
            if _drops_nothing(node) and _storages(node) and _storages(node.args[0]):
                self.merge(node, node.args[0])  # the same tensor at run time
        for saver, values in (saves or {}).items():
            for value in values:
                self.mark_saved(value, saver)

    def _root(self, key: Hashable) -> Hashable:
        while self._parent[key] != key:
            self._parent[key] = self._parent[self._parent[key]]
            key = self._parent[key]
        return key

    def _roots(self, node) -> set[Hashable]:
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

    def mark_saved(self, node: fx.Node, saver: fx.Node) -> None:
        """`saver` saves `node`'s value for the backward."""
        for root in self._roots(node):
            self._saved_by.setdefault(root, set()).add(saver)

    def dead_after(self, node: fx.Node, pos: int, savers: Iterable[fx.Node] = ()) -> bool:
        """True if `node`'s value may be overwritten at `pos`: nothing reads it later, and
        nothing saves it for the backward but `savers` (the ops being rewritten, whose new
        form saves its output instead, or writes over what it saved in its backward)."""
        roots, savers = self._roots(node), set(savers)
        return bool(roots) and all(
            r not in self._inputs
            and self._last_read.get(r, -1) <= pos
            and self._saved_by.get(r, set()) <= savers
            for r in roots
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
        """`old`'s storage now is `target`'s (old was rewritten to write over target, or
        replaced by it: then no node may hold old's storage any more)."""
        for key in _storages(old):
            self._parent.setdefault(key, key)
        keep = self._root(next(iter(_storages(target))))
        for root in self._roots(old) | self._roots(target):
            if root != keep:
                self._parent[root] = keep
                self._last_read[keep] = max(
                    self._last_read.get(keep, -1), self._last_read.get(root, -1)
                )
                if root in self._inputs:
                    self._inputs.add(keep)
                if root in self._saved_by:
                    self._saved_by.setdefault(keep, set()).update(self._saved_by[root])


def tensor_peak(graph: fx.Graph) -> int:
    """Peak bytes of the graph's own tensors while it runs, at the capture's sizes: each
    storage that a node makes (one no earlier node holds, and no model input or parameter)
    is held from that node to the last node reading any tensor sharing it (to the end, if
    the graph returns one), and the helpers of rewritten graphs hold their workspaces while
    they run (workspace_bytes). Storages are told apart by the example values' fake storages,
    as in _Liveness; two nodes that are the same tensor at run time (an eval-mode dropout)
    count once."""
    last: dict[Hashable, int] = {}
    size: dict[Hashable, int] = {}
    born: dict[Hashable, int] = {}
    inputs: set[Hashable] = set()
    nodes = list(graph.nodes)
    for i, node in enumerate(nodes):
        for key, nbytes in _storage_bytes(node):
            if node.op in ("placeholder", "get_attr"):
                inputs.add(key)
            if key not in size:
                size[key], born[key] = nbytes, i
        for inp in node.all_input_nodes:
            for key, _ in _storage_bytes(inp):
                last[key] = len(nodes) if node.op == "output" else i
    delta = [0] * (len(nodes) + 2)
    for key, nbytes in size.items():
        if key not in inputs:
            delta[born[key]] += nbytes
            delta[max(last.get(key, born[key]), born[key]) + 1] -= nbytes
    peak = held = 0
    for i, node in enumerate(nodes):
        held += delta[i]
        peak = max(peak, held + workspace_bytes(node))
    return peak


def _storage_bytes(node: fx.Node) -> list[tuple[Hashable, int]]:
    return [
        (_compat.storage_key(t), _hint(t.untyped_storage().nbytes()))
        for t in _compat.tree_leaves(node.meta.get("example_value"))
        if isinstance(t, torch.Tensor)
    ]


def workspace_bytes(node: fx.Node) -> int:
    """Memory a helper of a rewritten graph allocates while it runs, besides its result:
    square_matmul_over_dead its workspace or the out-of-place product (at most the workspace
    limit or the product), attention_in_pieces one piece of scores, matmul_over_left one
    piece of its product (pieces.py says how they size them)."""
    if node.op != "call_function":
        return 0
    if node.target is pieces.square_matmul_over_dead:
        x = _tensor(node.args[0])
        return min(_hint(x.numel()) * x.element_size(), ops.get_workspace_limit())
    if node.target is pieces.attention_in_pieces:
        q, k_t = _tensor(node.args[0]), _tensor(node.args[1])
        *batch, t, _ = (_hint(s) for s in q.shape)
        matrix = max(1, t * _hint(k_t.shape[-1]) * q.element_size())
        heads = batch[-1]
        return max(1, min(heads, ops.get_workspace_limit() // matrix)) * matrix
    if node.target is pieces.matmul_over_left:
        out = _tensor(node)
        *batch, m, n = (_hint(s) for s in out.shape)
        matrix = max(1, m * n * out.element_size())
        step = max(1, pieces._OVER_LEFT_PIECE_BYTES // matrix)
        return min(math.prod(batch), step) * matrix
    return 0
