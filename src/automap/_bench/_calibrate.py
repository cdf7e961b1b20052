"""`automap calibrate`: measure the devices at hand and write a cluster file.

Three micro-benchmarks, each timed after a warm-up run and taken as the best of a few:

- matmul rate: a square float32 matmul on one device (FLOP/s reached, so the file sets
  `matmul_efficiency` to 1: the figure already is what matmuls reach);
- memory bandwidth: a large elementwise update (bytes read and written per second);
- collective bandwidth and latency of each mesh axis: all-reduces of two sizes over the
  axis, fitted to the ring model t = 2(n-1) alpha + 2(n-1)/n B / bw that the cost model uses.

On the CPU the "devices" are virtual and share one memory, so the figures describe this
machine, not a cluster; on GPUs the same code measures the real links.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .._cluster import Cluster


@dataclasses.dataclass(frozen=True)
class Calibration:
    matmul_flops: float  # FLOP/s reached by a square matmul on one device
    memory_bandwidth: float  # bytes/s of a large elementwise op
    link_bandwidth: float  # bytes/s per device on the measured axis (0: one device only)
    link_latency: float  # seconds per collective step
    devices: int
    platform: str


def _best_time(fn: Callable[[], Any], repeats: int) -> float:
    import jax

    jax.block_until_ready(fn())  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def measure(*, quick: bool = False) -> Calibration:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.devices()
    repeats = 2 if quick else 5
    n = 512 if quick else 2048
    a = jnp.ones((n, n), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    matmul_flops = 2 * n**3 / _best_time(lambda: matmul(a), repeats)

    size = (1 << 22) if quick else (1 << 25)  # float32 elements: 16 MiB or 128 MiB
    x = jnp.ones((size,), jnp.float32)
    update = jax.jit(lambda v: v * 1.0001 + 1.0)
    memory_bandwidth = 2 * 4 * size / _best_time(lambda: update(x), repeats)

    link_bandwidth = link_latency = 0.0
    if len(devices) > 1:
        mesh = Mesh(np.array(devices), ("axis",))
        split = NamedSharding(mesh, PartitionSpec("axis"))
        whole = NamedSharding(mesh, PartitionSpec())
        # Summing device shards into a replicated result is one all-reduce over the axis.
        reduce = jax.jit(lambda v: v.sum(0), out_shardings=whole)
        times = {}
        for elems in ((1 << 10), (1 << 18) if quick else (1 << 21)):
            shards = jax.device_put(jnp.ones((len(devices), elems), jnp.float32), split)
            times[elems * 4] = _best_time(lambda s=shards: reduce(s), repeats)
        (b0, t0), (b1, t1) = sorted(times.items())
        k = len(devices)
        per_byte = max((t1 - t0) / (b1 - b0), 1e-15)  # = 2(k-1)/k / bw
        link_bandwidth = 2 * (k - 1) / k / per_byte
        link_latency = max(t0 - per_byte * b0, 1e-7) / (2 * (k - 1))
    return Calibration(
        matmul_flops=float(matmul_flops),
        memory_bandwidth=float(memory_bandwidth),
        link_bandwidth=float(link_bandwidth),
        link_latency=float(link_latency),
        devices=len(devices),
        platform=devices[0].platform,
    )


def to_cluster(cal: Calibration, base: str = "cpu", memory_bytes: float | None = None) -> Cluster:
    """A cluster of the measured devices (one node: the measured axis is its only link)."""
    preset = Cluster.preset(base, devices=cal.devices)
    link = cal.link_bandwidth or preset.intra_bandwidth
    latency = cal.link_latency or preset.intra_latency
    return dataclasses.replace(
        preset,
        name=f"calibrated-{cal.platform}",
        devices_per_node=cal.devices,
        peak_flops=cal.matmul_flops,
        matmul_efficiency=1.0,
        hbm_bandwidth=cal.memory_bandwidth,
        memory_efficiency=1.0,
        intra_bandwidth=link,
        inter_bandwidth=link,
        intra_latency=latency,
        inter_latency=latency,
        comm_efficiency=1.0,
        hbm_bytes=memory_bytes if memory_bytes else preset.hbm_bytes,
    )


def write_cluster(cluster: Cluster, path: str | Path) -> Path:
    import yaml

    path = Path(path)
    body = yaml.safe_dump(cluster.to_dict(), sort_keys=False)
    path.write_text(
        "# Measured by `automap calibrate`; load with --cluster " + path.name + "\n" + body
    )
    return path
