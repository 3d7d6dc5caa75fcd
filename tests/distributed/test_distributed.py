"""The ops on DTensors, and FSDP2 training a converted model, over a 2-rank mesh: gloo on the
CPU always, NCCL on two GPUs when present. One spawn per backend runs every check of
dtensor_checks.py, tp_block.py and fsdp_checks.py on both ranks; a failure lists each failed
check with its traceback."""

import pytest
import torch
import torch.distributed as dist
from launch import run_checks

BACKENDS = [
    pytest.param(
        "gloo",
        marks=pytest.mark.skipif(
            not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"
        ),
    ),
    pytest.param(
        "nccl",
        marks=pytest.mark.skipif(
            not (dist.is_available() and dist.is_nccl_available()) or torch.cuda.device_count() < 2,
            reason="needs 2 CUDA devices and NCCL",
        ),
    ),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_distributed(backend):
    results = run_checks(["dtensor_checks", "tp_block", "fsdp_checks"], backend)
    failed = {name: err for name, err in results.items() if err is not None}
    assert not failed, "\n\n".join(f"{name} failed on {err}" for name, err in failed.items())
