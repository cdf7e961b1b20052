"""The XLA compiler options a plan's programs are compiled with, per backend.

On TPUs, XLA runs every collective synchronously at its default flags (libtpu 0.0.42.1,
read in `_verify/_schedule.py`), so a ZeRO-3 step waits on each layer's gather. MaxText's
v5p scripts set the flags below (in `LIBTPU_INIT_ARGS`), under which XLA's TPU compiler
runs the gathers as chains of async collective fusions carried on by the matmuls beside
them: what users of TPUs run, so the runtime compiles a plan for TPU devices with them,
per program (`jax.jit(..., compiler_options=)`), and the cost model prices the overlap
they buy (`Lowering.tpu()`, `_cost/_overlap.py`). CPU and GPU programs get no options
at all: their compiles stay exactly what `jax.jit` makes (a TPU flag is an error there).
"""

from __future__ import annotations

from collections.abc import Mapping

from jax.sharding import Mesh

TPU_OVERLAP_FLAGS: Mapping[str, str] = {
    "xla_tpu_enable_async_collective_fusion": "true",
    "xla_tpu_enable_async_collective_fusion_fuse_all_gather": "true",
    "xla_tpu_enable_async_collective_fusion_multiple_steps": "true",
    "xla_tpu_overlap_compute_collective_tc": "true",
    "xla_enable_async_all_gather": "true",
}


def compiler_options(mesh: Mesh) -> dict[str, str] | None:
    """The options to jit a program on `mesh` with: `TPU_OVERLAP_FLAGS` where every
    device is a TPU (a real slice or libtpu's compile-only chips), None (jit's default)
    on any other backend."""
    platforms = {d.platform for d in mesh.devices.flat}
    return dict(TPU_OVERLAP_FLAGS) if platforms == {"tpu"} else None
