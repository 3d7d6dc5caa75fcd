"""The tuned parameters of every kernel family, gathered for the tuning command and tests."""

from __future__ import annotations

from . import rowwise

ALL: list = [
    *rowwise.PARAMETERS,
]
