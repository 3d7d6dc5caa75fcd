"""The tuned parameters of every kernel family, gathered for the tuning command and tests."""

from __future__ import annotations

from . import rowwise, square_matmul

ALL: list = [
    *rowwise.PARAMETERS,
    *square_matmul.PARAMETERS,
]
