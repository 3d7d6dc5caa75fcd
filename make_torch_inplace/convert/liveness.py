"""Which tensors of a graph share storage, and where each such group is last read."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from torch import fx

from .fake import _drops_nothing, _storages


class _Liveness:
    """Groups of tensors sharing storage, and the last position at which each group is read.

    Groups are union-find sets over fake storages. A rewrite that makes node n write over
    tensor x merges n's storage into x's, and marks every input of the new node as read at
    its position.
    """

    def __init__(self, graph: fx.Graph) -> None:
        self.pos: dict[fx.Node, int] = {}
        self._parent: dict[Hashable, Hashable] = {}
        self._last_read: dict[Hashable, int] = {}
        self._inputs: set[Hashable] = set()
        for i, node in enumerate(graph.nodes):
            self.pos[node] = i
            for key in _storages(node):
                self._parent.setdefault(key, key)
                if node.op in ("placeholder", "get_attr"):
                    self._inputs.add(key)
            self.note_reads(node, i)
            if _drops_nothing(node) and _storages(node) and _storages(node.args[0]):
                self.merge(node, node.args[0])  # the same tensor at run time

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
