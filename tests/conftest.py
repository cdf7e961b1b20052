"""Test set-up: JAX on the CPU with 8 virtual devices, set before any backend starts, XLA's
backend code generation at its lowest effort, and the tiers (`pyproject.toml` markers,
`_cases.py` for the number of generated cases)."""

import atexit
import os
import shutil
import tempfile

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

# Tests compile again programs that they or an earlier test compiled: verify compiles
# the programs a test compiled to read them, and a zoo step made anew in each test is a
# new function, which JAX's in-memory caches miss. JAX's persistent compilation cache,
# keyed on the program's HLO, compile options, XLA flags and devices, hands back the
# executable XLA made for that same program (the same HLO, buffer assignment and cost
# analysis). A fresh directory per process, removed at exit: no run reads another's.
# (A CPU process's cache also keys the compile-only GPUs' and TPUs' programs, which
# their clients cannot load back: JAX then compiles them and warns, ignored below.)
_COMPILED = tempfile.mkdtemp(prefix="automap-tests-xla-")
atexit.register(shutil.rmtree, _COMPILED, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _COMPILED)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_configure(config):
    config.addinivalue_line(
        "filterwarnings",
        "ignore:Error reading persistent compilation cache entry:UserWarning",
    )
    if MODE not in MODES:
        raise pytest.UsageError(
            f"AUTOMAP_TEST_CASES={MODE!r}: use quick (a few generated cases, the default) "
            "or full (every one, as make test runs)"
        )


def pytest_report_header(config):
    other = "full" if MODE == "quick" else "quick"
    return f"generated cases: {MODE} (AUTOMAP_TEST_CASES={other} for {other})"
