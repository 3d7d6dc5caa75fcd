"""Every value a tuning table can select runs correctly: each tuned parameter, forced to each
of its candidates (the tuning command's override), on each of its cases, against the
family's reference check. Needs CUDA (the tables are the CUDA kernels')."""

import pytest
import torch

from make_torch_inplace import tune

PARAMS = tune.parameters()
CASES = [pytest.param(p, value, id=f"{p.name}={value}") for p in PARAMS for value in p.candidates]

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@requires_cuda
@pytest.mark.parametrize(("param", "value"), CASES)
def test_every_candidate_is_correct(param, value):
    assert param.check is not None, f"{param.name} has no correctness check"
    with tune.override(param.name, value):
        for case in param.cases("cuda"):
            param.check(case)


def test_override_is_scoped():
    from make_torch_inplace import _C

    with tune.override("no_such_parameter", 3):
        pass
    _C._set_tuning_override("no_such_parameter", None)  # removing an absent one is allowed
    with pytest.raises(TypeError):
        _C._set_tuning_override("no_such_parameter", "three")


def test_proposed_rows_merge_lengths_and_keep_the_table_within_the_margin():
    from make_torch_inplace.tune.__main__ import TABLE, proposed_rows

    timings = [
        (2, 1024, {TABLE: 10.0, 1: 10.0, 2: 12.0}),  # the table is best
        (2, 2048, {TABLE: 10.0, 1: 9.9, 2: 12.0}),  # 1% better: within the margin
        (2, 4096, {TABLE: 10.0, 1: 11.0, 2: 8.0}),  # fp16: 2 wins by 25%
        (2, 4096, {TABLE: 10.0, 1: 9.0, 2: 10.5}),  # bf16, same key: summed, 2 still wins
        (2, 8192, {TABLE: 10.0, 1: 11.0, 2: 9.0}),  # 2 wins again: one row for 4096-8192
        (4, 8192, {TABLE: 10.0, 1: 5.0, 2: 9.0}),  # another element size: its own row
    ]
    rows = proposed_rows(timings, margin=0.02)
    assert [r[:4] for r in rows] == [(2, 4096, 8192, 2), (4, 8192, 8192, 1)]
    assert rows[0][4] == pytest.approx(20.0 / 18.5)  # the smaller gain: 4096 summed, not 8192
    assert rows[1][4] == pytest.approx(2.0)
