"""pytest configuration: the hypothesis profile and markers shared by every test file."""

import os

from hypothesis import HealthCheck, settings

# Example counts are set per test (small: CI has 2 cores). No deadline: the first call of an
# op, or a large shape, is legitimately slow. Inputs are built inside each test body, so a
# parametrized argument being shared by the examples of one test is harmless.
# "mti" (the default, and CI's) draws the same examples on every run, so that a run fails for
# a change, not for a seed; "explore" draws new ones each run (scripts/gpu_check.sh uses it).
_common = dict(
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.register_profile("mti", derandomize=True, **_common)
settings.register_profile("explore", **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "mti"))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "large_memory: needs several GB of free device memory (64-bit indexing)"
    )
