"""The tuned parameters of every kernel family, gathered for the tuning command and tests."""

from __future__ import annotations

from . import square_matmul

ALL: list = [
    *square_matmul.PARAMETERS,
]
