"""The environment of a child Python a test starts (a CLI run it signals or times)."""

import os
import sys


def child_env() -> dict[str, str]:
    """JAX on the CPU, and this process's path less the compile-only plugins a GPU or TPU
    verify test in it may have added (JAX would load them in the child and log to its
    stderr, which these tests read)."""
    path = [p for p in sys.path if not p.endswith(("gpu-compile", "tpu-compile"))]
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(path)}
