"""make_torch_inplace: transformer ops that write their output over their input."""

from . import nn
from .convert import convert
from .ops import (
    cross_entropy_,
    get_workspace_limit,
    layer_norm_,
    linear_,
    log_softmax_,
    rms_norm_,
    rope_,
    set_workspace_limit,
    softmax_,
    square_matmul_,
    workspace_limit,
)

__version__ = "0.1.0"

__all__ = [
    "convert",
    "cross_entropy_",
    "get_workspace_limit",
    "layer_norm_",
    "linear_",
    "log_softmax_",
    "nn",
    "rms_norm_",
    "rope_",
    "set_workspace_limit",
    "softmax_",
    "square_matmul_",
    "workspace_limit",
]
