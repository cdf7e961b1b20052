"""Test set-up: JAX on the CPU with 8 virtual devices, set before any backend starts, XLA's
backend code generation at its lowest effort, and the tiers (`pyproject.toml` markers,
`_cases.py` for the number of generated cases)."""

import atexit
import collections
import gc
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

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

# Python's cycle collector, at its default thresholds (a young collection every 700 net
# allocations), took a quarter of the CPU of the tests that trace and price a large model:
# their graphs, jaxprs and cost tables are millions of live objects, which each older
# collection walks again (tests/test_korthikanti.py's 22B row: 7.9 of 32 CPU-s in the
# collector, 5,170 young collections; at these thresholds 1.8 s, 300, and the same peak
# memory). Full collections still run, when the young ones have promoted enough.
gc.set_threshold(10_000, 20, 10)

# A fresh directory per process, removed at exit (no run reads another's), for the
# compile caches below. XLA reads its flags when the first backend starts, after this.
_CACHES = tempfile.mkdtemp(prefix="automap-tests-xla-")
atexit.register(shutil.rmtree, _CACHES, ignore_errors=True)

# A program compiled for a GPU has each of its kernels assembled by a ptxas process,
# about half of them kernels an earlier compile already assembled: a two-stage GPT
# pipeline's programs ran ptxas 565 times on 261 distinct inputs, 10 s of the test's 20.
# XLA's kernel cache file keeps each assembled kernel and hands it to later compiles: 156
# runs, and the test took 11 s. It comes after the buffer assignment: five GPT and Llama
# plans compiled for A100s and an H100 had the same HLO text and memory analysis with it,
# cold or warm, as without it. Child processes inherit the file with the flags; those
# that compile for a GPU (the README's commands) run while their test waits.
os.environ["XLA_FLAGS"] += f" --xla_gpu_kernel_cache_file={_CACHES}/gpu-kernels"
# ptxas assembles at -O0: the machine code, which no test reads, is all it changes (a
# bf16 GPT at dp 2 x tp 4 compiled for A100s had the same HLO text and memory analysis;
# its process took 9.5 CPU-s against 10.7).
os.environ["XLA_FLAGS"] += " --xla_gpu_disable_gpuasm_optimizations=true"

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

# Tests compile again programs that they or an earlier test compiled: verify compiles
# the programs a test compiled to read them, and a zoo step made anew in each test is a
# new function, which JAX's in-memory caches miss. JAX's persistent compilation cache,
# keyed on the program's HLO, compile options, XLA flags and devices, hands back the
# executable XLA made for that same program (the same HLO, buffer assignment and cost
# analysis).
# (A CPU process's cache also keys the compile-only GPUs' and TPUs' programs, which
# their clients cannot load back: JAX then compiles them and warns, ignored below.)
jax.config.update("jax_compilation_cache_dir", f"{_CACHES}/executables")
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_configure(config):
    config.addinivalue_line(
        "filterwarnings",
        "ignore:Error reading persistent compilation cache entry:UserWarning",
    )
    gone = [name for name in SECONDS if not (config.rootpath / name).is_file()]
    if gone:
        raise pytest.UsageError(f"tests/conftest.py's SECONDS lists {gone}: no such test file")
    if MODE not in MODES:
        raise pytest.UsageError(
            f"AUTOMAP_TEST_CASES={MODE!r}: use quick (a few generated cases, the default) "
            "or full (every one, as make test runs)"
        )


def pytest_report_header(config):
    other = "full" if MODE == "quick" else "quick"
    return f"generated cases: {MODE} (AUTOMAP_TEST_CASES={other} for {other})"


# The order the two xdist workers take test files in (`make test`: --dist loadfile, a file
# to a worker, the next file handed out as the last one drains; --no-loadscope-reorder,
# else xdist orders files by their number of tests). Longest first, so that the last files
# handed out are short and the workers finish together: by number of tests, the files of
# a few long tests (test_readme's 57 s, test_korthikanti's 41 s, test_schedule's TPU
# compiles) were handed out near the end. Seconds of one worker, the files over 12 s
# (an idle `make test` with AUTOMAP_TEST_TIMES, below, at b51610a: 999 s); the others
# follow, most tests first, as xdist orders them.
SECONDS = {
    "tests/test_verify_tpu.py": 162,
    "tests/test_verify_gpu.py": 170,
    "tests/test_numerics.py": 163,
    "tests/test_seqpar.py": 99,
    "tests/test_schedule.py": 95,
    "tests/test_flash.py": 84,
    "tests/test_llama.py": 62,
    "tests/test_tpu_memory.py": 105,  # its split-SwiGLU test added at 00b2fbe: 47 s loaded
    "tests/pipeline/test_zero.py": 57,
    "tests/pipeline/test_search_techniques.py": 49,
    "tests/test_recipe.py": 45,
    "tests/test_fsdp.py": 45,
    "tests/test_price_once.py": 39,
    "tests/test_remat_policies.py": 39,
    "tests/pipeline/test_search.py": 38,
    "tests/pipeline/test_interleaved.py": 37,
    "tests/test_readme.py": 37,
    "tests/pipeline/test_runtime.py": 36,
    "tests/test_thirdparty.py": 32,
    "tests/test_auto.py": 31,
    "tests/test_remat_units.py": 31,
    "tests/test_verify.py": 29,
    "tests/test_tpu_collectives.py": 29,
    "tests/test_zero.py": 28,
    "tests/test_remat.py": 26,
    "tests/zoo/test_zoo.py": 24,
    "tests/pipeline/test_cost.py": 24,
    "tests/test_bad_input.py": 23,
    "tests/test_compare.py": 23,
    "tests/test_korthikanti.py": 22,
    "tests/test_budgets.py": 19,
    "tests/pipeline/test_handed.py": 18,
    "tests/pipeline/test_zero_bubble.py": 18,
    "tests/rl/test_agent.py": 15,
    "tests/test_odd_steps.py": 15,
    "tests/test_distributed.py": 14,
    "tests/test_loops.py": 14,
    "tests/test_layouts.py": 14,
    "tests/pipeline/test_process.py": 13,
    "tests/test_fusion.py": 13,
    "tests/pipeline/test_grad_reduce.py": 13,
    "tests/test_capture.py": 13,
    "tests/test_maxtext.py": 13,
    "tests/test_api.py": 12,
    "tests/pipeline/test_process_techniques.py": 12,
}


def pytest_collection_modifyitems(config, items):
    tests = collections.Counter(item.nodeid.split("::", 1)[0] for item in items)

    def order(item):
        name = item.nodeid.split("::", 1)[0]
        return (0, -SECONDS[name]) if name in SECONDS else (1, -tests[name])

    items.sort(key=order)  # stable: a file's tests keep their order


# AUTOMAP_TEST_TIMES=<file>: each worker appends a JSON line per test file it ran, its
# seconds of wall clock and of CPU (its threads', and the child processes' it waited for:
# the README's commands, the distributed tests' processes), to refresh SECONDS, and the
# compile seconds the persistent cache saved it. CPU seconds hold on a loaded machine,
# where the wall clock does not.
_TIMES: dict[str, list[float]] = {}
_SAVED = [0.0]  # compile seconds the persistent cache saved (JAX's own count)


def _count_saved(event: str, seconds: float, **_: object) -> None:
    if event == "/jax/compilation_cache/compile_time_saved_sec":
        _SAVED[0] += seconds


if os.environ.get("AUTOMAP_TEST_TIMES"):
    jax.monitoring.register_event_duration_secs_listener(_count_saved)


def _cpu_s() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    wall, cpu, saved = time.perf_counter(), _cpu_s(), _SAVED[0]
    yield
    spent = _TIMES.setdefault(item.nodeid.split("::", 1)[0], [0.0, 0.0, 0.0])
    spent[0] += time.perf_counter() - wall
    spent[1] += _cpu_s() - cpu
    spent[2] += _SAVED[0] - saved


def pytest_sessionfinish(session):
    path = os.environ.get("AUTOMAP_TEST_TIMES")
    if path and _TIMES:
        with Path(path).open("a") as out:
            for name, (wall, cpu, saved) in _TIMES.items():
                row = {"file": name, "wall_s": wall, "cpu_s": cpu, "cache_saved_s": saved}
                out.write(json.dumps(row) + "\n")
