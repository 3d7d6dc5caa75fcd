"""A 2-way tensor- and sequence-parallel post-norm attention block on DTensors whose rotary
embedding, softmax and LayerNorms run in place through the ops, against the same block in one
process with PyTorch's ops (fp32, tight).

Layout (Megatron's sequence parallelism): the residual stream is Shard(1) (sequence); q, k, v
and the MLP's first layer are column-parallel (their input gathered), the attention's output
projection and the MLP's second layer row-parallel with a reduce-scatter back to Shard(1).
So queries and keys are sharded on heads (dim 0) for the rotary embedding (its tables
replicated), and so are the scores for the causal softmax; each LayerNorm runs on a sequence
shard over the whole hidden dim, in place on the residual sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from helpers import ref_rope
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import make_torch_inplace as mti
import make_torch_inplace.distributed  # registers the DTensor rules and buffers

CHECKS = {}
D, HEADS, SEQ, BATCH = 32, 4, 8, 2


def in_place(calls, op, x, *args, **kwargs):
    """op(x, ...), recording in calls what it got (x's type and placements) and how many
    collectives it issued."""
    with CommDebugMode() as comm:
        out = op(x, *args, **kwargs)
    calls.append((op.__name__, type(x).__name__, getattr(x, "placements", None)))
    calls.append(comm.get_total_counts())
    return out


class Norm(nn.Module):
    def __init__(self, inplace: bool, calls: list):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D) * 0.5 + 1)
        self.bias = nn.Parameter(torch.randn(D) * 0.1)
        self.inplace, self.calls = inplace, calls

    def forward(self, x):
        if self.inplace:
            return in_place(self.calls, mti.layer_norm_, x, (D,), self.weight, self.bias)
        return F.layer_norm(x, (D,), self.weight, self.bias)


class Block(nn.Module):
    def __init__(self, inplace: bool):
        super().__init__()
        self.inplace, self.calls = inplace, []
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.norm1, self.norm2 = Norm(inplace, self.calls), Norm(inplace, self.calls)
        angles = torch.arange(SEQ)[:, None] * 0.3 ** torch.arange(D // HEADS // 2)[None, :]
        angles = torch.cat((angles, angles), dim=-1)  # (SEQ, head_dim), as Llama's tables
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def heads(self, t):
        # (B, S, D) -> (heads, B, S, head_dim); on DTensors, Shard(2) becomes Shard(0). Heads
        # lead so that the batched products flatten (heads, B) with the sharded dim first,
        # which DTensor does without a gather.
        return t.view(BATCH, SEQ, HEADS, D // HEADS).permute(2, 0, 1, 3)

    def rotary(self, t):
        if not self.inplace:
            return ref_rope(t, self.cos, self.sin)
        cos, sin = self.cos, self.sin
        if isinstance(t, DTensor):  # the tables replicated on every rank
            cos, sin = (
                DTensor.from_local(c, t.device_mesh, [Replicate()], run_check=False)
                for c in (cos, sin)
            )
        return in_place(self.calls, mti.rope_, t, cos, sin)

    def attention(self, x):
        q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x))
        q, k = self.rotary(q), self.rotary(k)
        scores = q @ k.transpose(-2, -1)
        scale = (D // HEADS) ** -0.5
        if self.inplace:
            probs = in_place(self.calls, mti.softmax_, scores, scale=scale, causal=True)
        else:
            causal = torch.ones(SEQ, SEQ, dtype=torch.bool, device=scores.device).tril()
            probs = (scores * scale).masked_fill(~causal, float("-inf")).softmax(-1)
        out = (probs @ v).permute(1, 2, 0, 3).reshape(BATCH, SEQ, D)
        return self.o(out)

    def forward(self, x):
        x = self.norm1(x + self.attention(x))
        return self.norm2(x + self.down(F.gelu(self.up(x))))


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def parallelize(block, mesh):
    gather = {"input_layouts": Shard(1), "use_local_output": False}
    plan = {
        "q": ColwiseParallel(**gather),
        "k": ColwiseParallel(**gather),
        "v": ColwiseParallel(**gather),
        "o": RowwiseParallel(
            input_layouts=Shard(2), output_layouts=Shard(1), use_local_output=False
        ),
        "up": ColwiseParallel(**gather),
        "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "norm1": SequenceParallel(),
        "norm2": SequenceParallel(),
    }
    return parallelize_module(block, mesh, plan)


@check
def tensor_sequence_parallel_block(ctx):
    torch.manual_seed(0)
    reference = Block(inplace=False).to(ctx.device)
    block = Block(inplace=True).to(ctx.device)
    block.load_state_dict(reference.state_dict())
    x = torch.randn(BATCH, SEQ, D, device=ctx.device)
    g = torch.randn(BATCH, SEQ, D, device=ctx.device)

    xr = x.clone().requires_grad_()
    (reference(xr) * g).sum().backward()

    block = parallelize(block, ctx.mesh)
    xd = distribute_tensor(x, ctx.mesh, [Shard(1)]).requires_grad_()
    gd = distribute_tensor(g, ctx.mesh, [Shard(1)])
    out = block(xd)
    assert isinstance(out, DTensor) and out.placements == (Shard(1),), out
    (out * gd).sum().backward()
    # The rotary embedding ran on head shards of q and k (dim 0), the softmax on head shards
    # of the scores, the norms on sequence shards (dim 1 of the residual), each with no
    # collective.
    shard0, shard1 = ("DTensor", (Shard(0),)), ("DTensor", (Shard(1),))
    expected_calls = [("rope_", *shard0), 0] * 2 + [("softmax_", *shard0), 0]
    expected_calls += [("layer_norm_", *shard1), 0] * 2
    assert block.calls == expected_calls, block.calls

    expected = reference(x.clone()).detach()
    torch.testing.assert_close(out.full_tensor(), expected)
    torch.testing.assert_close(xd.grad.full_tensor(), xr.grad)
    for (name, p), (_, pr) in zip(block.named_parameters(), reference.named_parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, pr.grad, msg=lambda m, name=name: f"{name}: {m}")
