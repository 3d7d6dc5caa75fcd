"""Modules whose forward writes its result over its input.

Each one subclasses the torch module it replaces, so it has the same constructor, parameters,
initialisation and state_dict keys; only forward differs. The ``from_<module>`` constructors
share the given module's parameters (no copy), so a model can be changed layer by layer.

Use them only where the input is dead after the layer (nothing reads it later): forward
overwrites it. ``make_torch_inplace.convert`` finds those places in a whole model by itself.
"""

from __future__ import annotations

import torch
from torch import nn

from . import ops

__all__ = [
    "InplaceCrossEntropyLoss",
    "InplaceLayerNorm",
    "InplaceLinear",
    "InplaceRMSNorm",
    "InplaceSoftmax",
]


def _adopt(new: nn.Module, old: nn.Module) -> nn.Module:
    """Gives `new` (built on the meta device, with the same layout) `old`'s parameters."""
    for name, param in old.named_parameters(recurse=False):
        setattr(new, name, param)
    new.train(old.training)
    return new


class _SaysInplace:
    """Mixin: the module's repr says that it works in place."""

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, inplace=True"


class InplaceLinear(_SaysInplace, nn.Linear):
    """nn.Linear with a square weight whose forward overwrites its input: x <- x @ W.T + b.

    The weight must not require grad while autograd records (its gradient needs the input,
    which is gone); freeze it or run under torch.no_grad()/inference_mode().
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        if in_features != out_features:
            raise ValueError(
                "InplaceLinear: the weight must be square (in_features == out_features), got "
                f"in_features={in_features}, out_features={out_features}"
            )
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> InplaceLinear:
        """An InplaceLinear sharing `linear`'s weight and bias (no copy)."""
        return _adopt(
            cls(linear.in_features, linear.out_features, linear.bias is not None, device="meta"),
            linear,
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return ops.linear_(input, self.weight, self.bias)


class InplaceSoftmax(_SaysInplace, nn.Softmax):
    """nn.Softmax whose forward overwrites its input. dim must be given (no implicit dim)."""

    def __init__(self, dim: int) -> None:
        if not isinstance(dim, int):
            raise ValueError(f"InplaceSoftmax: dim must be an int, got {dim!r}")
        super().__init__(dim)

    @classmethod
    def from_softmax(cls, softmax: nn.Softmax) -> InplaceSoftmax:
        return _adopt(cls(softmax.dim), softmax)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return ops.softmax_(input, self.dim)


class InplaceLayerNorm(_SaysInplace, nn.LayerNorm):
    """nn.LayerNorm whose forward overwrites its input."""

    @classmethod
    def from_layer_norm(cls, norm: nn.LayerNorm) -> InplaceLayerNorm:
        """An InplaceLayerNorm sharing `norm`'s weight and bias (no copy)."""
        new = cls(
            norm.normalized_shape,
            eps=norm.eps,
            elementwise_affine=norm.elementwise_affine,
            bias=norm.bias is not None,
            device="meta",
        )
        return _adopt(new, norm)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm_(input, self.normalized_shape, self.weight, self.bias, self.eps)


class InplaceRMSNorm(_SaysInplace, nn.RMSNorm):
    """nn.RMSNorm whose forward overwrites its input (eps=None: torch.finfo(x.dtype).eps)."""

    @classmethod
    def from_rms_norm(cls, norm: nn.RMSNorm) -> InplaceRMSNorm:
        """An InplaceRMSNorm sharing `norm`'s weight (no copy)."""
        new = cls(
            norm.normalized_shape,
            eps=norm.eps,
            elementwise_affine=norm.elementwise_affine,
            device="meta",
        )
        return _adopt(new, norm)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm_(input, self.normalized_shape, self.weight, self.eps)


class InplaceCrossEntropyLoss(_SaysInplace, nn.CrossEntropyLoss):
    """nn.CrossEntropyLoss whose forward overwrites the logits with their gradient
    (ops.cross_entropy_). The classes are the last dim of the logits (..., V), which is
    nn.CrossEntropyLoss's layout for (N, V) input; class weights are not supported."""

    def __init__(
        self,
        weight: torch.Tensor | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
    ) -> None:
        if weight is not None:
            raise ValueError("InplaceCrossEntropyLoss: class weights are not supported")
        super().__init__(
            ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing
        )

    @classmethod
    def from_cross_entropy_loss(cls, loss: nn.CrossEntropyLoss) -> InplaceCrossEntropyLoss:
        return cls(loss.weight, loss.ignore_index, loss.reduction, loss.label_smoothing)

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ops.cross_entropy_(
            input, target, self.ignore_index, self.reduction, self.label_smoothing
        )
