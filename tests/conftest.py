"""pytest configuration: the hypothesis profile and markers shared by every test file."""

import os

from hypothesis import HealthCheck, settings

# Example counts are set per test (small: CI has 2 cores). No deadline: the first call of an
# op, or a large shape, is legitimately slow. Inputs are built inside each test body, so a
# parametrized argument being shared by the examples of one test is harmless.
settings.register_profile(
    "mti",
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "mti"))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "large_memory: needs several GB of free device memory (64-bit indexing)"
    )
