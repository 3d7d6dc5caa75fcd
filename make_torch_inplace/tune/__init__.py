"""Tuning: measure each tuned kernel parameter's candidates on the GPU present.

Every kernel family keeps its GPU-dependent choices in one table per parameter
(``csrc/kernels/<family>/tuning.h``). This package names those parameters, their candidate
values and the calls that decide them (one module per family), so that

    python -m make_torch_inplace.tune [--family NAME] [--param NAME]

can time every candidate of every parameter on this GPU and print the table rows it would
write. The tests run every candidate for correctness (``tests/test_tuning.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from .. import _C


@dataclass(frozen=True)
class Case:
    """One call that a parameter's value is chosen for: its dtype's element size and row
    length n (what the table rows are keyed on) and a function that makes the inputs and
    returns a callable running the op once on them."""

    label: str
    elem_bytes: int
    n: int
    make: Callable[[], Callable[[], object]]


@dataclass(frozen=True)
class Parameter:
    """A tuned parameter: its name in the C++ table, the candidates it may take, the calls it
    is measured on (``cases(device)`` builds them), ``check``, which runs one call of a case
    against a reference and raises if it is wrong (for the tests), and what it decides."""

    name: str
    family: str
    candidates: Sequence[int]
    cases: Callable[[str], Sequence[Case]]
    check: Callable[[Case], None]
    doc: str = field(compare=False)


@contextlib.contextmanager
def override(name: str, value: int | None) -> Iterator[None]:
    """Forces the C++ table's parameter `name` to `value` while the block runs (None: the
    table decides)."""
    _C._set_tuning_override(name, value)
    try:
        yield
    finally:
        _C._set_tuning_override(name, None)


def parameters(family: str | None = None) -> list[Parameter]:
    """Every tuned parameter, of one family or of all."""
    from . import families

    found = [p for p in families.ALL if family is None or p.family == family]
    if family is not None and not found:
        raise ValueError(f"no tuned parameters for family {family!r}")
    return found
