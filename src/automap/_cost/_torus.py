"""Mesh axes on a TPU torus: the link each axis's collectives run on, by the torus
dimensions it spans.

A TPU slice is a 2-D or 3-D torus of chips (`Cluster.topology`), each chip linked to its
neighbours in every dimension (`ici_link_bandwidth` per link and direction); slices are
joined by the data-centre network (DCN, `inter_bandwidth` per chip). The mesh is laid as
JAX lays it: its leading axes split across slices as `create_hybrid_device_mesh` splits
them (the DCN part of an axis outermost), the rest of each axis on the slice as
`mesh_utils.create_device_mesh` lays it (run here on stand-in devices with the slice's
coordinates, so no TPU or libtpu is needed).

An axis whose devices vary along torus dimensions D runs its collectives on rings along
each dimension of D at once (XLA's TPU collectives split a buffer over the dimensions
an axis spans, e.g. its N-D all-reduce strategies): each dimension carries one link's
bandwidth each way where it wraps around (two rings, one per direction) and spans the
whole dimension, one link's otherwise (a line: the ring goes out and comes back over the
same links). An axis with a DCN part runs at the DCN's bandwidth ("inter", or "mixed"
where it also spans ICI: as slow as its slowest hop). Contention between axes that share
a dimension is not priced.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._cluster import Cluster, Link
from .._slices import generation, wraps

# The device kind libtpu gives each generation's chips (jax 0.10.2, libtpu 0.0.42.1):
# create_device_mesh picks its layout by it.
_KIND = {"v4": "TPU v4", "v5p": "TPU v5", "v5e": "TPU v5 lite", "v6e": "TPU v6 lite"}


@dataclasses.dataclass(frozen=True)
class _Chip:
    """A stand-in for a compile-only TPU device: what create_device_mesh reads (a class,
    not a tuple, so NumPy keeps it whole in an object array)."""

    id: int
    coords: tuple[int, int, int]
    device_kind: str
    platform: str = "tpu"
    core_on_chip: int = 0
    process_index: int = 0
    slice_index: int = 0


def axis_links(cluster: Cluster, mesh: Mapping[str, int]) -> dict[str, Link]:
    """The link each mesh axis runs on: on the torus where the cluster has one
    (`Cluster.topology`), else as `Cluster.axis_links` places it."""
    if not cluster.topology or not mesh:
        return cluster.axis_links(mesh)
    sizes = tuple(mesh.values())
    on = cluster if math.prod(sizes) == cluster.devices else _fitting(cluster, sizes)
    if on is None:
        return cluster.axis_links(mesh)
    gen = generation(on.name) or ("v5p" if len(on.topology) == 3 else "v5e")
    spans = _spans(gen, on.topology, on.slices, sizes)
    if spans is None:  # the mesh does not split over the slices: priced as placed
        return cluster.axis_links(mesh)
    link = on.ici_link_bandwidth or on.intra_bandwidth / 2
    out = {}
    for name, (dcn, lanes) in zip(mesh, spans, strict=True):
        if dcn > 1:
            kind = "inter" if lanes == 0 else "mixed"
            out[name] = Link(on.inter_bandwidth, on.inter_latency, kind)
        else:
            out[name] = Link(link * max(lanes, 1), on.intra_latency, "intra")
    return out


def axis_torus_dims(cluster: Cluster, mesh: Mapping[str, int]) -> dict[str, int]:
    """How many torus dimensions each mesh axis' groups span on the cluster's slice (as
    `axis_links` lays the mesh); 0 for an axis that crosses slices or where the cluster
    has no torus."""
    sizes = tuple(mesh.values())
    on = cluster if math.prod(sizes or (1,)) == cluster.devices else _fitting(cluster, sizes)
    if not cluster.topology or not mesh or on is None or not on.topology:
        return {name: 0 for name in mesh}
    gen = generation(on.name) or ("v5p" if len(on.topology) == 3 else "v5e")
    spans = _spans(gen, on.topology, on.slices, sizes, dims=True)
    if spans is None:
        return {name: 0 for name in mesh}
    return {name: 0 if dcn > 1 else n for name, (dcn, n) in zip(mesh, spans, strict=True)}


def axis_spans_and_rings(cluster: Cluster, mesh: Mapping[str, int], axis: str) -> tuple[int, int]:
    """(`axis_torus_dims`' count for `axis`, the chips of the shortest torus dimension its
    groups span: 0 where they span none). XLA's TPU picks its ZeRO reduce-scatters by it
    (`_tiles.tpu_zero_scatter`)."""
    spans = axis_torus_dims(cluster, mesh).get(axis, 0)
    sizes = tuple(mesh.values())
    on = cluster if math.prod(sizes) == cluster.devices else _fitting(cluster, sizes)
    if not spans or on is None or not on.topology or on.slices > 1:
        return spans, 0
    gen = generation(on.name) or ("v5p" if len(on.topology) == 3 else "v5e")
    coords = _laid(gen, on.topology, sizes)
    line = np.moveaxis(coords, list(mesh).index(axis), 0)
    line = line[(slice(None),) + (0,) * (len(mesh) - 1)]
    spanned = [n for dim, n in enumerate(on.topology) if len(set(line[:, dim].tolist())) > 1]
    return spans, min(spanned, default=0)


def _fitting(cluster: Cluster, sizes: tuple[int, ...]) -> Cluster | None:
    """The cluster cut to the mesh's devices (a pipeline stage's sub-slice), if it cuts."""
    try:
        return cluster.with_devices(math.prod(sizes))
    except Exception:  # no sub-slice of that size: priced as placed
        return None


@functools.lru_cache(maxsize=4096)
def _spans(
    gen: str, topology: tuple[int, ...], slices: int, sizes: tuple[int, ...], dims: bool = False
) -> tuple[tuple[int, int], ...] | None:
    """Per mesh axis: (its DCN part, the links each way its collectives use on the torus,
    0 where it spans no torus dimension; with `dims`, the torus dimensions it spans)."""
    dcn = _dcn_parts(sizes, slices)
    if dcn is None:
        return None
    ici = tuple(s // d for s, d in zip(sizes, dcn, strict=True))
    coords = _laid(gen, topology, ici)
    out = []
    for axis, d in enumerate(dcn):
        # The devices along this axis, the others fixed at 0: the coordinates they vary in.
        line = np.moveaxis(coords, axis, 0)[(slice(None),) + (0,) * (len(ici) - 1)]
        lanes = 0
        for dim, size in enumerate(topology):
            span = len(set(line[:, dim].tolist()))
            if span > 1:
                whole = span == size and wraps(size, gen) and not dims
                lanes += 2 if whole else 1
        out.append((d, lanes))
    return tuple(out)


def _dcn_parts(sizes: tuple[int, ...], slices: int) -> tuple[int, ...] | None:
    """How much of each axis crosses slices: the leading axes take the slices first, as a
    hybrid mesh puts its DCN axes outermost; None when the sizes cannot take them."""
    left, out = slices, []
    for s in sizes:
        g = math.gcd(s, left)
        out.append(g)
        left //= g
    return tuple(out) if left == 1 else None


def _laid(gen: str, topology: tuple[int, ...], ici: tuple[int, ...]) -> np.ndarray:
    """The torus coordinates of every device of a mesh of `ici` laid on one slice as
    create_device_mesh lays it (row-major over chip ids where it cannot)."""
    from jax.experimental import mesh_utils

    dims = (*topology, 1, 1)[:3]
    chips = [
        _Chip(i, (i % dims[0], i // dims[0] % dims[1], i // (dims[0] * dims[1])), _KIND[gen])
        for i in range(math.prod(dims))
    ]
    try:
        grid: Any = mesh_utils.create_device_mesh(ici, chips, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AssertionError):
        grid = np.empty(len(chips), dtype=object)
        grid[:] = chips
        grid = grid.reshape(ici)
    flat = [c.coords[: len(topology)] for c in np.asarray(grid, dtype=object).flat]
    return np.array(flat).reshape((*ici, len(topology)))
