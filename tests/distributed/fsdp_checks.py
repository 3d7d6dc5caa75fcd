"""FSDP2 (fully_shard per layer) training a converted model on 2 ranks: each rank trains on
its half of the batch, and the losses and gradients of the steps match one process training
the unconverted model on the whole batch."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import make_torch_inplace as mti

STEPS = 5


def _llama():
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=128,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def check_fsdp2_trains_a_converted_model(ctx):
    reference = _llama().to(ctx.device)
    model = copy.deepcopy(reference)
    for layer in model.model.layers:
        fully_shard(layer, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    converted = mti.convert(model)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    ids = ids.to(ctx.device)
    mine = ids.chunk(ctx.mesh.size())[ctx.rank]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)]
    for step in range(STEPS):
        loss = converted(mine, labels=mine).loss
        loss.backward()
        expected = reference(ids, labels=ids).loss
        expected.backward()
        # Each rank's loss is its half's mean; equal halves: their mean is the whole's.
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        torch.testing.assert_close(mean / ctx.mesh.size(), expected.detach(), rtol=1e-5, atol=0)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            grad = p.grad.full_tensor()
            torch.testing.assert_close(
                grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"{name}, step {step}"
            )
        for opt in opts:
            opt.step()
            opt.zero_grad()
    ops = {s.op.split(" ")[0] for s in converted.sites}
    assert {"rms_norm_", "linear_of_silu_mul"} <= ops, ops


CHECKS = {"fsdp2_trains_a_converted_model": check_fsdp2_trains_a_converted_model}
