"""Test set-up: JAX on the CPU with 8 virtual devices, set before any backend starts, and
the tiers (`pyproject.toml` markers, `_cases.py` for the number of generated cases)."""

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")  # the Keras example runs on JAX

import jax

from _cases import MODE, MODES

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")


def pytest_configure(config):
    if MODE not in MODES:
        raise pytest.UsageError(
            f"AUTOMAP_TEST_CASES={MODE!r}: use quick (a few generated cases, the default) "
            "or full (every one, as make test runs)"
        )


def pytest_report_header(config):
    other = "full" if MODE == "quick" else "quick"
    return f"generated cases: {MODE} (AUTOMAP_TEST_CASES={other} for {other})"
