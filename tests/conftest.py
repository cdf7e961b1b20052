"""Test set-up: JAX on the CPU with 8 virtual devices, set before any backend starts, XLA's
backend code generation at its lowest effort, and the tiers (`pyproject.toml` markers,
`_cases.py` for the number of generated cases)."""

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")  # the Keras example runs on JAX

# Most of the suite's time is XLA compiling small programs, and a part of each compile is
# LLVM optimizing the machine code. The tests read what comes before it (the partitioned
# HLO, the buffer assignment, `cost_analysis()`), which the backend's optimization level
# does not change: over the 36 one-stage expert plans of mlp, gpt2-xl and bert-base at
# float32 and bf16, and 25 compiled for an A100, the HLO, the memory and the cost
# analysis were identical at levels 0 and 2, and the tests' CPU time fell by 11-28%.
# Numerics are compared by rules that hold at any rounding. Child processes inherit it. A
# run that sets the level, or reproduces a CPU's vector width with `xla_cpu_max_isa`
# (the numerics tests under AVX2), keeps XLA's own code generation.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    if any(f in os.environ.get("XLA_FLAGS", "") for f in ("optimization_level", "max_isa"))
    else f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
)

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
