"""What the rewriter reports: each rewritten site, and each graph's peak before and after."""

from __future__ import annotations

import dataclasses
import os
import re

import torch
from torch import fx


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
    # nbytes minus that. Sites do not add up to a saving of the peak: GraphReport does that.
    nbytes: int
    # Sites of the first pass that this one took over (attention_in_pieces: the softmax_
    # of its scores), on this site's line and not counted again.
    parts: tuple[Site, ...] = ()

    def __str__(self) -> str:
        shape = "x".join(map(str, self.shape))
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"{self.where}: {self.pattern} as {self.op} [{shape} {dtype}, "
            f"{_mib(self.nbytes)} not allocated]"
        )


@dataclasses.dataclass(frozen=True)
class GraphReport:
    """The rewrites of one captured graph and what they do to its peak.

    `before` and `after` are the peak bytes of the graph's own tensors (liveness.tensor_peak:
    each value's storage held from the node that makes it to the last read of any tensor
    sharing it, the output included, model inputs and parameters not; the workspaces of
    square_matmul_, attention_in_pieces and matmul_over_left at their nodes) for the graph
    as captured and as rewritten, at the capture's sizes. A rewrite only merges an output's
    storage into its dead input's or drops a tensor, and PyTorch's in-place ops allocate
    nothing, so the drop of this peak is what the rewrites save of the graph's memory; it
    does not exceed the sum of the sites' bytes (every byte held at the new peak's moment
    was either held before at that moment or is a workspace counted in `after`). Memory
    that kernels allocate inside an op the rewrite left as it was is in neither figure.
    """

    sites: tuple[Site, ...]
    before: int
    after: int

    def lines(self) -> list[str]:
        saved = self.before - self.after
        head = (
            f"mti.convert: {len(self.sites)} sites; the graph's tensors peak at "
            f"{_mib(self.after)} instead of {_mib(self.before)} (saves {_mib(saved)})"
        )
        return [head, *(f"  {site}" for site in self.sites)]


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if abs(n) < 2**30 else f"{n / 2**30:.2f} GiB"


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
