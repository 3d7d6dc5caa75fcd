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
