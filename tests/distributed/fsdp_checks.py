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
        use_cache=False,  # as in training: transformers then passes SDPA a causal mask
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _train_against_one_process(ctx, **convert_kwargs):
    """STEPS steps of the converted, FSDP2-sharded model on this rank's half of the batch,
    each checked against one process training the model on the whole batch, and none
    capturing anew after the first. Returns the converted module and its last output."""
    reference = _llama().to(ctx.device)
    model = copy.deepcopy(reference)
    for layer in model.model.layers:
        fully_shard(layer, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    converted = mti.convert(model, **convert_kwargs)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    ids = ids.to(ctx.device)
    mine = ids.chunk(ctx.mesh.size())[ctx.rank]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)]
    captures = torch._dynamo.utils.counters["stats"]
    for step in range(STEPS):
        if step == 1:  # every graph is captured by the end of the first step
            captured = captures["unique_graphs"]
        out = converted(mine, labels=mine)
        out.loss.backward()
        expected = reference(ids, labels=ids).loss
        expected.backward()
        # Each rank's loss is its half's mean; equal halves: their mean is the whole's.
        mean = out.loss.detach().clone()
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
    assert captures["unique_graphs"] == captured, "captured again after the first step"
    return converted, out


def _ops(converted) -> set[str]:
    return {s.op.split(" ")[0] for s in converted.sites}


def check_fsdp2_trains_a_converted_model(ctx):
    """FSDP2's hooks are graph breaks: the forward is captured as several graphs (the
    mask's, each layer's, the head's). The layers read the causal mask as an input, which
    is checked once per forward and runs SDPA with is_causal=True, as in one graph."""
    converted, _ = _train_against_one_process(ctx)
    assert max(converted._captured.values()) > 1, converted._captured  # split into graphs
    ops = _ops(converted)
    assert {
        "rms_norm_",
        "linear_of_silu_mul",
        "scaled_dot_product_attention(is_causal=True)",
    } <= ops
    assert "scaled_dot_product_attention" not in ops  # every length here is causal


def check_fsdp2_trains_a_converted_model_without_its_logits(ctx):
    """drop_outputs=("logits",) under FSDP2: the logits are dropped inside the model's
    forward, in the graph computing them, so the head and loss run as linear_cross_entropy
    and never hold the logits whole."""
    converted, out = _train_against_one_process(ctx, drop_outputs=("logits",))
    assert out.logits is None
    assert "linear_cross_entropy" in _ops(converted)


CHECKS = {
    "fsdp2_trains_a_converted_model": check_fsdp2_trains_a_converted_model,
    "fsdp2_trains_a_converted_model_without_its_logits": (
        check_fsdp2_trains_a_converted_model_without_its_logits
    ),
}
