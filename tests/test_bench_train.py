"""benchmarks/bench_train.py end to end at --tiny on the CPU (fp32): the records it writes,
eager attention's loss and gradients against SDPA's, and convert's."""

import json
import re
import sys
import types

import pytest
import torch

from benchmarks import bench_train

FIELDS = {"device", "torch", "commit", "pass", "model", "variant", "seq", "batch", "dtype"}
FIELDS |= set(bench_train.MEASURED)
LOSS_STEPS = 4


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    threads = torch.get_num_threads()
    # One thread: the tiny model's matmuls are too small to share, and on a loaded machine a
    # second thread's barriers make each step 100x slower.
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("MTI_RESULTS_DIR", str(out))
            bench_train.main(
                ["--tiny", "--device", "cpu", "--models", "llama", "--variants", "eager"]
                + ["sdpa", "convert", "convert-recompute"]
                + ["--steps", "2", "--loss-steps", str(LOSS_STEPS)]
            )
    finally:
        torch.set_num_threads(threads)
    assert "| llama | 64 | eager |" in (out / "train.md").read_text()
    return {r["variant"]: r for r in json.loads((out / "train.json").read_text())}


def test_records_have_every_field(records):
    assert set(records) == {"eager", "sdpa", "convert", "convert-recompute"}
    for r in records.values():
        assert r.keys() >= FIELDS
        assert (r["pass"], r["model"], r["seq"], r["batch"]) == ("train_step", "llama", 64, 1)
        assert r["dtype"] == "float32"
        assert r["peak_extra_bytes"] is None  # measured on CUDA only


@pytest.mark.parametrize("variant", ["eager", "sdpa"])
def test_peers_train(records, variant):
    r = records[variant]
    assert r["error"] is None and r["skipped"] is None
    assert r["step_ms"] > 0
    assert r["loss_steps"] == LOSS_STEPS
    # Same batch every step: AdamW lowers the loss on it.
    assert r["loss_after_steps"] < r["loss"]


def test_eager_matches_sdpa(records):
    eager, sdpa = records["eager"], records["sdpa"]
    assert sdpa["max_grad_diff"] == 0.0  # the reference against itself
    assert sdpa["max_grad_ref"] > 0
    # fp32, the same weights and data: only the attention's rounding differs.
    assert eager["max_grad_diff"] <= 1e-5 * sdpa["max_grad_ref"]
    assert eager["loss"] == pytest.approx(sdpa["loss"], rel=1e-5)
    assert eager["loss_after_steps"] == pytest.approx(sdpa["loss_after_steps"], rel=1e-5)


@pytest.mark.parametrize("variant", ["convert", "convert-recompute"])
def test_convert_trains_as_the_model(records, variant):
    r, sdpa = records[variant], records["sdpa"]
    assert r["error"] is None
    assert r["max_grad_diff"] <= 1e-5 * sdpa["max_grad_ref"]
    assert r["loss"] == pytest.approx(sdpa["loss"], rel=1e-5)
    assert r["loss_after_steps"] == pytest.approx(sdpa["loss_after_steps"], rel=1e-5)
    assert r["step_ms"] > 0


def test_liger_patches_only_its_own_calls(monkeypatch):
    """Liger replaces module-level names of modeling_llama (the rotary embedding, looked up at
    every call); the bench sets them only around the liger model's calls, so the variants alive
    beside it run unpatched. A stub stands in for liger_kernel."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", original)  # restored after
    calls = []

    def counting_rope(*args, **kwargs):
        calls.append(None)
        return original(*args, **kwargs)

    def apply_liger_kernel_to_llama(model=None):
        modeling_llama.apply_rotary_pos_emb = counting_rope

    stub = types.ModuleType("liger_kernel.transformers")
    stub.apply_liger_kernel_to_llama = apply_liger_kernel_to_llama
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", stub)
    cpu, size = torch.device("cpu"), bench_train.TINY
    liger = bench_train.Run("liger", "llama", size, cpu, torch.float32)
    plain = bench_train.Run("sdpa", "llama", size, cpu, torch.float32)
    assert modeling_llama.apply_rotary_pos_emb is original
    batch = bench_train.make_batch("llama", 16, size, cpu)
    plain.step(batch)
    assert not calls
    liger.step(batch)
    assert len(calls) == size.layers
    assert modeling_llama.apply_rotary_pos_emb is original
    with pytest.raises(bench_train.Skipped, match="no patch for gpt2"):
        bench_train.Run("liger", "gpt2", size, cpu, torch.float32)


def test_profile_table_heads_the_costliest_ops_with_the_step_time():
    size, cpu = bench_train.TINY, torch.device("cpu")
    run = bench_train.Run("convert", "llama", size, cpu, torch.float32)
    batch = bench_train.make_batch("llama", 64, size, cpu)
    run.step(batch)  # captures outside the profiler
    head, table = bench_train.profile_table(run, batch, 3).split("\n", 1)
    assert re.fullmatch(r"step [0-9.]+ ms, [0-9.]+ ms of it busy on the device", head)
    assert "Self CPU" in table and "aten::" in table
