"""TPU slices: their shapes as a torus of chips, from a topology or a slice's name.

A TPU slice is a 2-D (v5e, v6e) or 3-D (v4, v5p) torus of chips, written as chips per
dimension ("4x4x4"), or named by generation and size ("v5p-128"). Google names v4 and
v5p slices by TensorCores (two per chip: v5p-128 is 64 chips) and v5e and v6e slices by
chips (v5e-16 is 16). A dimension wraps around (its two ends are linked) where it is
complete: on v4 and v5p a multiple of 4 (whole 4x4x4 cubes, joined through optical
switches), on v5e and v6e the pod's full 16 (Google Cloud's v4, v5p, v5e and v6e pages).
Kept apart from `_cluster.py`, which only stores the shape.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from ._errors import ClusterError

# Torus dimensions per generation, and TensorCores counted per chip in a slice's name.
DIMENSIONS = {"v4": 3, "v5p": 3, "v5e": 2, "v6e": 2}
NAME_CORES = {"v4": 2, "v5p": 2, "v5e": 1, "v6e": 1}
_NAMED = re.compile(r"^(?:tpu-)?(v4|v5p|v5e|v6e)-(\d+)$")


def generation(preset: str) -> str | None:
    """ "v5p" for the cluster preset "tpu-v5p"; None for a preset that is no TPU."""
    gen = preset.lower().removeprefix("tpu-")
    return gen if gen in DIMENSIONS else None


def parse_topology(value: Any, gen: str) -> tuple[int, ...]:
    """Chips per torus dimension from "4x4x4", a sequence of sizes, or a slice name
    ("v5p-128"); a ClusterError naming the form and an example otherwise."""
    if isinstance(value, str) and (m := _NAMED.match(value.strip().lower())):
        if m.group(1) != gen:
            raise ClusterError(
                f"slice {value!r} is a {m.group(1)} slice, not a {gen} one: use "
                f"--cluster tpu-{m.group(1)}, or name a {gen} slice."
            )
        cores = int(m.group(2))
        if cores % NAME_CORES[gen]:
            raise ClusterError(
                f"slice {value!r}: {gen} slices are named by TensorCores, "
                f"{NAME_CORES[gen]} per chip: give a multiple of {NAME_CORES[gen]}."
            )
        return default_shape(cores // NAME_CORES[gen], gen)
    sizes: Any = value
    if isinstance(value, str):
        sizes = value.strip().lower().split("x")
    try:
        dims = tuple(int(str(d).strip()) for d in sizes)
    except (TypeError, ValueError):
        dims = ()
    if len(dims) != DIMENSIONS[gen] or min(dims) < 1:
        example = "x".join(["4"] * DIMENSIONS[gen])
        raise ClusterError(
            f"{value!r} is not a {gen} slice topology: give chips per torus dimension, "
            f"{DIMENSIONS[gen]} of them (e.g. {example}), or a slice name such as "
            f"{gen}-{16 * NAME_CORES[gen]}."
        )
    return dims


def default_shape(chips: int, gen: str) -> tuple[int, ...]:
    """The slice shape Google offers for `chips` (a power of two): doubling the
    smallest dimension first, the last one first on a tie (2x2x1, 2x2x2, 2x2x4, 2x4x4,
    4x4x4, 4x4x8, ...; 2x2, 2x4, 4x4, 4x8, ...)."""
    if chips < 1 or chips & (chips - 1):
        raise ClusterError(
            f"{chips} chips make no standard {gen} slice: give a power of two, or the "
            f"slice's shape (--topology {'x'.join(['2'] * DIMENSIONS[gen])})."
        )
    dims = [1] * DIMENSIONS[gen]
    while math.prod(dims) < chips:
        dims[dims.index(min(dims))] *= 2
    # Listed smallest dimension first, a dimension of 1 last (v5p's 2x2x1), as Google
    # lists them and libtpu takes them.
    return tuple(sorted(dims, key=lambda d: (d == 1, d)))


def wraps(size: int, gen: str) -> bool:
    """Whether a torus dimension of `size` chips links its two ends (module docstring)."""
    return size % 4 == 0 if DIMENSIONS[gen] == 3 else size == 16


def sub_slice(dims: Sequence[int], chips: int, gen: str) -> tuple[int, ...]:
    """The shape of `chips` chips cut from a slice of `dims` (a pipeline stage's share):
    the largest dimension halved until it fits."""
    out = list(dims)
    while math.prod(out) > chips:
        i = out.index(max(out))
        if out[i] % 2:
            break
        out[i] //= 2
    if math.prod(out) != chips:
        raise ClusterError(
            f"{chips} chips are no sub-slice of a {'x'.join(map(str, dims))} {gen} slice: "
            "give a power-of-two share of it."
        )
    return tuple(out)
