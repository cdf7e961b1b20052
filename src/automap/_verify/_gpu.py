"""Compile-only GPUs: XLA's GPU compiler without a GPU, for what a GPU program holds.

XLA's CPU backend keeps buffers a GPU program does not (its library fusions' materialized
operands, float32 copies of bf16 matmul operands, an all-reduce into a fresh
buffer), so its buffer assignment is the wrong yardstick for a cost model priced for
GPUs. JAX's CUDA plugin compiles for a described GPU without one being present (a
"compile-only" topology from a target description: the device's figures, no driver):
the partitioned program goes through XLA's GPU pipeline, fusion, scheduling and buffer
assignment included, and `memory_analysis()` reports what it would hold on that GPU.

The plugin is pyproject's `gpu-compile` dependency, which `make` installs apart from the
venv's packages, in `.venv/gpu-compile` (`PLUGIN_DIR`): JAX loads every plugin on its
path at start-up, and this one logs that no CUDA driver is found. It is loaded from there
on first use, after the CPU backend (registering a backend late is what JAX's plugin
discovery does too); installed among the packages it is used as it is. Without it,
`gpu_devices` says so in one line. No CUDA driver or library is loaded: compiling needs
none.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from pathlib import Path
from typing import Any

from .._errors import ApplyError

PLUGIN_DIR = Path(sys.prefix) / "gpu-compile"

# The device figures XLA's GPU compiler plans with (stream_executor's DeviceDescription),
# from NVIDIA's published data sheets: compute capability, SMs, per-SM and per-block
# shared memory, L2, HBM size and bandwidth, boost clock.
_H100: dict[str, Any] = dict(
    name="NVIDIA H100 80GB HBM3",
    capability=(9, 0),
    sms=132,
    fpus_per_sm=128,
    shared_per_sm=233472,
    shared_per_block_optin=232448,
    l2=50 * 2**20,
    memory=80 * 2**30,
    bandwidth=3352e9,
    clock_ghz=1.98,
)
SPECS: dict[str, dict[str, Any]] = {
    "a100": dict(
        name="NVIDIA A100-SXM4-80GB",
        capability=(8, 0),
        sms=108,
        fpus_per_sm=64,
        shared_per_sm=167936,
        shared_per_block_optin=166912,
        l2=40 * 2**20,
        memory=80 * 2**30,
        bandwidth=2039e9,
        clock_ghz=1.41,
    ),
    "h100": _H100,
    # The H100's die (sm_90, 132 SMs) with 141 GB of HBM3e at 4.8 TB/s (NVIDIA's H200
    # data sheet); the memory XLA plans with and the L2 as a lent H200 reported them
    # (nvidia-smi: 143,771 MiB, SM clock up to 1,980 MHz; PyTorch: 60 MB of L2).
    "h200": dict(
        _H100,
        name="NVIDIA H200",
        l2=60 * 2**20,
        memory=143771 * 2**20,
        bandwidth=4.8e12,
    ),
}


def target_config(gpu: str) -> str:
    """The text form of XLA's GpuTargetConfig for a GPU of `SPECS`."""
    s = SPECS[gpu]
    major, minor = s["capability"]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {s["shared_per_sm"]}
  threads_per_core_limit: 2048
  core_count: {s["sms"]}
  fpus_per_core: {s["fpus_per_sm"]}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(s["bandwidth"])}
  l2_cache_size: {s["l2"]}
  clock_rate_ghz: {s["clock_ghz"]}
  device_memory_size: {s["memory"]}
  shared_memory_per_block_optin: {s["shared_per_block_optin"]}
  cuda_compute_capability {{
    major: {major}
    minor: {minor}
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
}}
device_description_str: "{s["name"]}"
"""


def gpu_devices(gpu: str, n: int) -> list[Any]:
    """`n` compile-only devices of the GPU `gpu` ("a100", "h100", "h200"), 8 to a node."""
    if gpu not in SPECS:
        raise ApplyError(
            f"no compile-only description of GPU {gpu!r}: use one of {', '.join(SPECS)}."
        )
    return list(_topology(gpu, n))


@functools.cache
def _topology(gpu: str, n: int) -> tuple[Any, ...]:
    from jax.experimental import topologies

    per_node = min(n, 8)
    if n % per_node:
        raise ApplyError(
            f"{n} compile-only GPUs do not fill whole nodes of 8: use a multiple of 8."
        )

    def topology():
        return topologies.get_topology_desc(
            "automap",
            "cuda",
            target_config=target_config(gpu),
            topology=f"1x{n // per_node}x{per_node}",
        )

    try:
        return tuple(topology().devices)
    except NotImplementedError:
        _load_plugin()
    try:
        return tuple(topology().devices)
    except NotImplementedError as e:
        raise ApplyError(
            f"JAX's CUDA plugin from {PLUGIN_DIR} did not register a GPU compiler ({e}): "
            "reinstall it with `make clean && make`."
        ) from None


def _load_plugin() -> None:
    """Register JAX's CUDA plugin from `PLUGIN_DIR`, skipping its check of the CUDA
    libraries' versions (there are none to check: it only compiles)."""
    if not (PLUGIN_DIR / "jax_plugins").is_dir():
        raise ApplyError(
            "compiling for a GPU without one needs JAX's CUDA plugin, which is not "
            f"installed in {PLUGIN_DIR}: run `make` (it installs pyproject's gpu-compile "
            "pins there)."
        )
    if str(PLUGIN_DIR) not in sys.path:
        sys.path.append(str(PLUGIN_DIR))
    skip = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"
    before = os.environ.get(skip)
    os.environ[skip] = "1"
    try:
        importlib.import_module("jax_plugins.xla_cuda12").initialize()
    finally:
        if before is None:
            del os.environ[skip]
        else:
            os.environ[skip] = before
