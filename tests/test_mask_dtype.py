"""The mask dtype rule (a softmax mask is bool or exactly x's dtype; refusals in
test_bad_input.py) as convert() meets it: a model whose additive mask has another dtype than
its attention scores keeps the mask's add (PyTorch's type promotion) and runs softmax_ on the
sum, in place, without folding the mask in."""

import pytest
import torch
from convert_helpers import PreNormBlock, block_inputs, check_converted, make_block
from helpers import DEVICES


@pytest.mark.parametrize(
    "model_dtype,mask_dtype",
    [(torch.float32, torch.float16), (torch.bfloat16, torch.float32)],
    ids=["f32_scores_f16_mask", "bf16_scores_f32_mask"],
)
@pytest.mark.parametrize("device", DEVICES)
def test_convert_leaves_a_mask_of_another_dtype_unfolded(device, model_dtype, mask_dtype):
    model = make_block(PreNormBlock, device, model_dtype)
    x, mask = block_inputs(device, model_dtype)
    converted = check_converted(model, x, mask.to(mask_dtype))
    [softmax] = [s for s in converted.sites if s.op == "softmax_"]
    assert "add" not in softmax.pattern, "the mask of another dtype was folded into softmax_"
