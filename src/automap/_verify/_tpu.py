"""Compile-only TPUs: XLA's TPU compiler without a TPU, for what a TPU program holds.

`libtpu` (the PJRT plugin `jax[tpu]` pins) describes a TPU slice from its name alone
("v5p:4x4x4": generation and chips per torus dimension) and hands JAX compile-only devices
for it (`jax.experimental.topologies.get_topology_desc(..., platform="tpu")`): a sharded
`jit` over a mesh of them goes through XLA's TPU pipeline (its SPMD partitioner,
collective rewrites, fusion, scheduling, buffer assignment) and `memory_analysis()` says
what each chip would hold. Nothing runs and no TPU is needed.

The plugin is pyproject's `tpu-compile` dependency, which `make` installs apart from the
venv's packages, in `.venv/tpu-compile` (`PLUGIN_DIR`): JAX would otherwise try to start
a TPU backend in every process and warn that it finds none. Its library is loaded from
there on first use, after the CPU backend, which stays the process's default (verify's
own process keeps its CPU devices; seen with jax 0.10.2 and libtpu 0.0.42.1).

The mesh is laid on the slice as `jax.experimental.mesh_utils.create_device_mesh` lays
it (`tpu_devices` returns the devices in that order, row-major over the plan's mesh), as
`jax.make_mesh` does on a real slice.
"""

from __future__ import annotations

import functools
import math
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._cluster import Cluster
from .._errors import ApplyError

PLUGIN_DIR = Path(sys.prefix) / "tpu-compile"

# Each generation's name in a topology ("v5p:4x4x4") and its torus dimensions. libtpu
# 0.0.42 presents a v4 chip's two TensorCores as two devices (`core_on_chip`), so a v4
# topology has twice as many devices as chips.
GENERATIONS = {"v4": 3, "v5p": 3, "v5e": 2, "v6e": 2}
_CORES_PER_CHIP = {"v4": 2}
_TARGET = re.compile(r"^(v4|v5p|v5e|v6e):(\d+(?:x\d+)*)$")

# libtpu reads the slice it runs on from these (or from the TPU VM's metadata server):
# given a one-host slice here, it describes the named topology without warning that it
# finds no TPU VM. It also takes a machine-wide lock (/tmp/libtpu_lockfile) that a second
# process loading it (verify's child, another verify) fails on: compiling needs no TPU to
# guard, so the lock is skipped. Set only while the plugin starts, and only where unset.
_QUIET_ENV = {
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_HOST_BOUNDS": "1,1,1",
    "TPU_STDERR_LOG_LEVEL": "3",
    "TPU_MIN_LOG_LEVEL": "3",
}


def is_tpu_target(target: str | None) -> bool:
    """Whether `target` names a TPU topology ("v5p:4x4x4") rather than a GPU ("a100")."""
    return bool(target) and ":" in str(target)


def parse_target(target: str) -> tuple[str, tuple[int, ...]]:
    """("v5p", (4, 4, 4)) for "v5p:4x4x4"; an ApplyError naming the form otherwise."""
    m = _TARGET.match(str(target).strip().lower())
    if not m:
        raise ApplyError(
            f"{target!r} is not a TPU topology: write generation:topology, one of "
            f"{', '.join(GENERATIONS)} and chips per torus dimension, e.g. v5p:4x4x4 or v5e:4x4."
        )
    gen, dims = m.group(1), tuple(int(d) for d in m.group(2).split("x"))
    if len(dims) != GENERATIONS[gen] or min(dims) < 1:
        example = "x".join(["2"] * GENERATIONS[gen])
        raise ApplyError(
            f"{target!r}: a {gen} slice is a {GENERATIONS[gen]}-D torus of chips: give "
            f"{GENERATIONS[gen]} sizes, e.g. {gen}:{example}."
        )
    return gen, dims


def target_devices(target: str) -> int:
    """How many JAX devices the topology `target` has (chips, times cores on v4)."""
    gen, dims = parse_target(target)
    return math.prod(dims) * _CORES_PER_CHIP.get(gen, 1)


def tpu_devices(target: str, mesh_shape: Sequence[int]) -> list[Any]:
    """The compile-only devices of the TPU topology `target`, in the order a row-major
    reshape to `mesh_shape` lays them as `create_device_mesh` does (physical neighbours
    on the fastest axes)."""
    from jax.experimental import mesh_utils

    devices = list(_topology(target))
    need = math.prod(mesh_shape)
    if need != len(devices):
        raise ApplyError(
            f"the plan is for {need} devices but the TPU topology {target} has "
            f"{len(devices)}: plan for {len(devices)} devices, or name a topology of "
            f"{need} (e.g. {_example_topology(target, need)})."
        )
    try:
        # Split a torus dimension over two axes where it must (a 32 x 2 mesh on 4x4x4),
        # as the cost model lays the mesh (`_cost._torus`): the same devices per axis.
        shape = tuple(mesh_shape) or (1,)
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AssertionError) as e:
        raise ApplyError(
            f"JAX cannot lay the mesh {tuple(mesh_shape)} on the TPU topology {target} ({e}): "
            "give mesh axes whose sizes split the torus dimensions."
        ) from None
    return list(grid.flat)


def _example_topology(target: str, n: int) -> str:
    gen, dims = parse_target(target)
    chips = n // _CORES_PER_CHIP.get(gen, 1)
    out = [1] * len(dims)
    i = 0
    while chips > 1 and chips % 2 == 0:  # powers of two spread over the dimensions
        out[i % len(out)] *= 2
        chips //= 2
        i += 1
    out[0] *= chips
    return f"{gen}:{'x'.join(map(str, out))}"


@functools.cache
def _topology(target: str) -> tuple[Any, ...]:
    from jax.experimental import topologies

    gen, dims = parse_target(target)
    _load_plugin()
    name = f"{gen}:{'x'.join(map(str, dims))}"
    try:
        return tuple(topologies.get_topology_desc(topology_name=name, platform="tpu").devices)
    except Exception as e:  # libtpu's own errors (XlaRuntimeError): one line, not a trace
        raise ApplyError(
            f"libtpu cannot describe the TPU topology {name} ({str(e).splitlines()[0]}): "
            "give a slice shape the generation has, e.g. v5p:2x2x2, v5e:4x4."
        ) from None


def _load_plugin() -> None:
    """Load libtpu's PJRT plugin from `PLUGIN_DIR` (or an installed `libtpu` package)
    without starting a TPU backend: topologies need the plugin, not a device."""
    from jax._src.lib import xla_client

    if xla_client.pjrt_plugin_loaded("tpu"):
        return
    library = PLUGIN_DIR / "libtpu" / "libtpu.so"
    if not library.is_file():
        try:
            import libtpu  # installed among the packages: used as it is

            library = Path(libtpu.get_library_path())
        except ImportError:
            raise ApplyError(
                "compiling for a TPU without one needs libtpu, which is not installed in "
                f"{PLUGIN_DIR}: run `make` (it installs pyproject's tpu-compile pins there)."
            ) from None
    before = {k: os.environ.get(k) for k in _QUIET_ENV}
    os.environ.update({k: v for k, v in _QUIET_ENV.items() if before[k] is None})
    try:
        xla_client.load_pjrt_plugin_dynamically("tpu", str(library))
        xla_client.initialize_pjrt_plugin("tpu")
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)


def target_cluster(target: str, devices: int) -> Cluster:
    """The cluster a plan compiled for `target` is priced on by default: the TPU preset of
    its generation on its topology ("v5p:4x4x4": tpu-v5p, 4x4x4), or the GPU's preset."""
    if not is_tpu_target(target):
        return Cluster.preset(target, devices=devices)
    gen, dims = parse_target(target)
    if gen in _CORES_PER_CHIP:
        # One JAX device per TensorCore: priced as that many chips (not yet per core).
        return Cluster.preset(f"tpu-{gen}", devices=devices)
    return Cluster.preset(f"tpu-{gen}", topology=dims)
