"""Modules whose forward writes its result over its input, where that is safe.

Each one subclasses the torch module it replaces, so it has the same constructor, parameters,
initialisation and state_dict keys; only forward differs. The ``from_<module>`` constructors
share the given module's parameters (no copy), so a model can be changed layer by layer.

Forward overwrites its input only where nothing can read it afterwards; elsewhere it runs the
torch module's own forward, which returns a new tensor, and warns once per class
(``InplaceFallbackWarning``; filter it where falling back is expected, e.g. a model asked for
its hidden states). The input counts as dead when all of these hold:

- Python: the caller passed a temporary (``ln(lin(x))``) or rebinds the local it passed to the
  result (``x = ln(x)``, ``nn.Sequential``), the module was called as ``module(x)`` with one
  positional argument and no hooks, and the reference count shows no other holder
  (``_call_site.py`` says how the count is read, and where a reference can hide from it);
- C++: no other tensor shares its memory (views, ``.detach()``, autograd's saved tensors), and
  if it is a view, nothing but this view holds its base (``_C._sole_tensor_owner``);
- autograd: it is not a leaf that requires grad.

Under ``torch.compile`` reference counts mean nothing, so forward is out of place there (the
compiled graph may still reuse memory; ``make_torch_inplace.convert`` proves each rewrite from
the graph). ``always_inplace=True`` skips every check and always overwrites: for code that
knows its inputs are dead, where the check cannot see it (an input passed on from an outer
forward's argument), or under torch.compile.
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch import nn

from . import _C, _call_site, ops

__all__ = [
    "InplaceFallbackWarning",
    "InplaceLayerNorm",
    "InplaceLinear",
    "InplaceRMSNorm",
    "InplaceSoftmax",
]


class InplaceFallbackWarning(UserWarning):
    """An in-place module ran out of place because its input may be read afterwards."""


def _adopt(new: nn.Module, old: nn.Module) -> nn.Module:
    """Gives `new` (built on the meta device, with the same layout) `old`'s parameters."""
    for name, param in old.named_parameters(recurse=False):
        setattr(new, name, param)
    new.train(old.training)
    return new


# --------------------------------------------------------------------------- when to overwrite

_is_compiling = torch.compiler.is_compiling
_calibration: _call_site.Calibration | None = None
_warned: set[type] = set()
# Call sites refused with a count under a calibration: (code, offset) -> (count, calibration).
_refused: dict[tuple, tuple] = {}
_MAX_REFUSED = 4096  # past this many call sites, they are forgotten


class _Probe(nn.Module):
    """Calls _call_site.observe from the same frame depth as _InplaceModule._overwrites does."""

    def forward(self, input):
        return self._observe(input)

    def _observe(self, x):
        return _call_site.observe(x)


def _global_hooks() -> bool:
    # Private, so a torch without it counts as having hooks: the probe would measure the path
    # with hooks, which forward hooks can read the input after.
    has_hooks = getattr(nn.modules.module, "_has_any_global_hook", None)
    return has_hooks is None or bool(has_hooks())


def _calibrate(again: bool = False) -> _call_site.Calibration | None:
    """Reference counts at forward for a temporary and for a named tensor, measured once per
    process, and again (`again`) where a call's count matched no measurement: the counts move
    when the interpreter's frame evaluation changes, as once torch.compile has run in the
    process (Dynamo's frame evaluator holds more references). None while global module hooks
    or a jit trace change the call path (measured again later); a calibration whose frames
    differ between the two calls trusts nothing."""
    global _calibration
    if (_calibration is None or again) and not (_global_hooks() or torch.jit.is_tracing()):
        probe = _Probe()
        temporary, frames = probe(torch.empty(0))
        tensor = torch.empty(0)
        named, named_frames = probe(tensor)
        if frames is None or frames != named_frames:
            frames = (None, -1, None, -1)  # matches no call
        _calibration = _call_site.Calibration(temporary, named, frames)
    return _calibration


class _InplaceModule:
    """Mixin: decides per call whether forward may overwrite its input (module docstring)."""

    always_inplace: bool

    def extra_repr(self) -> str:
        opt_out = ", always_inplace=True" if self.always_inplace else ""
        return f"{super().extra_repr()}, inplace=True{opt_out}"

    def _overwrites(self, input: torch.Tensor) -> bool:
        """Whether forward may overwrite input. Call it from forward, directly: the reference
        count is read from a fixed number of frames up."""
        if self.always_inplace:
            return True
        if _is_compiling():
            return False
        calibration = _calibration or _calibrate()
        held = calibration is not None and _call_site.held_by_call_only(input, calibration)
        if not held and calibration is not None:
            # Measure again, unless this call site was refused with this count under this
            # calibration before (a pre-norm block refuses every call): the counts move only
            # when the interpreter's frame evaluation changes, which moves this count too.
            try:
                caller = sys._getframe(4)  # past forward, _call_impl and _wrapped_call_impl
                site, refs = (caller.f_code, caller.f_lasti), sys.getrefcount(input)
            except ValueError:
                site = refs = None
            if site is None or _refused.get(site) != (refs, calibration):
                if _calibrate(again=True) != calibration:
                    held = _call_site.held_by_call_only(input, _calibration)  # measured now
                if not held and site is not None:
                    if len(_refused) >= _MAX_REFUSED:
                        _refused.clear()
                    _refused[site] = (refs, _calibration)
        if not held:
            reason = (
                "its input may be read after the call (another Python reference to it, or a "
                "call other than module(x) with one positional argument and no hooks)"
            )
        elif not _C._sole_tensor_owner(input):
            reason = "another tensor, a view or autograd shares its input's memory"
        elif input.requires_grad and input.is_leaf and torch.is_grad_enabled():
            reason = "its input is a leaf that requires grad"
        else:
            return True
        if type(self) not in _warned:
            _warned.add(type(self))
            warnings.warn(
                f"{type(self).__name__} ran out of place: {reason}. Later fallbacks of "
                f"{type(self).__name__} are not reported. Pass always_inplace=True where the "
                "input is known to be dead, or use make_torch_inplace.convert(model).",
                InplaceFallbackWarning,
                stacklevel=5,  # the module's caller, past forward, _call_impl and __call__
            )
        return False


class InplaceLinear(_InplaceModule, nn.Linear):
    """nn.Linear with a square weight whose forward overwrites its input, x <- x @ W.T + b,
    where the input is dead after the call (module docstring; always_inplace=True: always).

    The weight must not require grad while autograd records (its gradient needs the input,
    which is gone); freeze it or run under torch.no_grad()/inference_mode(). That error is
    raised whether or not this call would have run in place.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        always_inplace: bool = False,
    ) -> None:
        if in_features != out_features:
            raise ValueError(
                "InplaceLinear: the weight must be square (in_features == out_features), got "
                f"in_features={in_features}, out_features={out_features}"
            )
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.always_inplace = bool(always_inplace)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, always_inplace: bool = False) -> InplaceLinear:
        """An InplaceLinear sharing `linear`'s weight and bias (no copy)."""
        new = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            device="meta",
            always_inplace=always_inplace,
        )
        return _adopt(new, linear)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # A trainable weight goes to linear_, which refuses it before writing anything, so
        # training with this module fails the same way on every call.
        if (torch.is_grad_enabled() and self.weight.requires_grad) or self._overwrites(input):
            return ops.linear_(input, self.weight, self.bias)
        return super().forward(input)


class InplaceSoftmax(_InplaceModule, nn.Softmax):
    """nn.Softmax whose forward overwrites its input where it is dead after the call (module
    docstring). dim must be given (no implicit dim)."""

    def __init__(self, dim: int, *, always_inplace: bool = False) -> None:
        if not isinstance(dim, int):
            raise ValueError(f"InplaceSoftmax: dim must be an int, got {dim!r}")
        super().__init__(dim)
        self.always_inplace = bool(always_inplace)

    @classmethod
    def from_softmax(cls, softmax: nn.Softmax, *, always_inplace: bool = False) -> InplaceSoftmax:
        return _adopt(cls(softmax.dim, always_inplace=always_inplace), softmax)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self._overwrites(input):
            return ops.softmax_(input, self.dim)
        return super().forward(input)


class InplaceLayerNorm(_InplaceModule, nn.LayerNorm):
    """nn.LayerNorm whose forward overwrites its input where it is dead after the call (module
    docstring). Takes nn.LayerNorm's arguments and always_inplace."""

    def __init__(self, *args, always_inplace: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.always_inplace = bool(always_inplace)

    @classmethod
    def from_layer_norm(
        cls, norm: nn.LayerNorm, *, always_inplace: bool = False
    ) -> InplaceLayerNorm:
        """An InplaceLayerNorm sharing `norm`'s weight and bias (no copy)."""
        new = cls(
            norm.normalized_shape,
            eps=norm.eps,
            elementwise_affine=norm.elementwise_affine,
            bias=norm.bias is not None,
            device="meta",
            always_inplace=always_inplace,
        )
        return _adopt(new, norm)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self._overwrites(input):
            return ops.layer_norm_(input, self.normalized_shape, self.weight, self.bias, self.eps)
        return super().forward(input)


class InplaceRMSNorm(_InplaceModule, nn.RMSNorm):
    """nn.RMSNorm whose forward overwrites its input where it is dead after the call (module
    docstring; eps=None: torch.finfo(x.dtype).eps). Takes nn.RMSNorm's arguments and
    always_inplace."""

    def __init__(self, *args, always_inplace: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.always_inplace = bool(always_inplace)

    @classmethod
    def from_rms_norm(cls, norm: nn.RMSNorm, *, always_inplace: bool = False) -> InplaceRMSNorm:
        """An InplaceRMSNorm sharing `norm`'s weight (no copy)."""
        new = cls(
            norm.normalized_shape,
            eps=norm.eps,
            elementwise_affine=norm.elementwise_affine,
            device="meta",
            always_inplace=always_inplace,
        )
        return _adopt(new, norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # nn.RMSNorm's argument name
        if self._overwrites(x):
            return ops.rms_norm_(x, self.normalized_shape, self.weight, self.eps)
        return super().forward(x)
