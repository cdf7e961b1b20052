"""A matmul's seconds by its shape: tile quantization under a roofline.

A flat fraction of peak for every matmul is wrong both ways: it caps the large,
well-shaped GEMMs of a big model below what the hardware sustains, and it prices a
skinny or oddly sized product (an attention head of 96, a batch of 8 rows) as if its
units were full. Two mechanisms replace it:

- tile quantization (NVIDIA, "Matrix Multiplication Background User's Guide", DU-09799,
  ch. 2.2 and 3.1): the matrix units work on whole tiles, so each of a product's M, N
  and K runs as if rounded up to the device's tile granularity (`Cluster.matmul_tile`):
  A100 Tensor Cores are used best at multiples of 128 bytes (64 bf16 elements), a TPU's
  MXU is a 128 x 128 systolic array. Batch dimensions are separate products.
- a roofline: a product whose operands and result take longer to stream from HBM than
  its (tiled) arithmetic takes to run is memory-bound, and takes the streaming time.

The arithmetic rate is `Cluster.matmul_efficiency` x peak: what the largest well-shaped
GEMMs reach, a published measurement where the presets have one (`_presets.py`).
Wave quantization (tiles over a whole number of SM waves) depends on the per-device
shape a plan gives and is not modelled: a plan's split divides the unsharded seconds.
"""

from __future__ import annotations

import dataclasses
import math

from .._graph import Graph, Op


@dataclasses.dataclass(frozen=True)
class GemmShape:
    """A dot_general as batch x (M x K) @ (K x N): free dims of each side multiplied."""

    batch: int
    m: int
    n: int
    k: int


def gemm_shape(op: Op, graph: Graph) -> GemmShape | None:
    """The GEMM a dot_general computes (None for any other op or a malformed one)."""
    if op.primitive != "dot_general" or len(op.inputs) < 2:
        return None
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    lhs = graph.tensors[op.inputs[0]].shape
    rhs = graph.tensors[op.inputs[1]].shape
    return GemmShape(
        batch=math.prod(lhs[i] for i in lb),
        m=math.prod(d for i, d in enumerate(lhs) if i not in set(lc) | set(lb)),
        n=math.prod(d for i, d in enumerate(rhs) if i not in set(rc) | set(rb)),
        k=math.prod(lhs[i] for i in lc),
    )


def tile_efficiency(shape: GemmShape, tile: int) -> float:
    """The fraction of a tiled product's arithmetic that is useful: M, N and K each
    rounded up to `tile` elements (1.0 for a product of whole tiles; 0 < it <= 1)."""
    if tile <= 1:
        return 1.0
    useful = padded = 1.0
    for d in (shape.m, shape.n, shape.k):
        d = max(d, 1)
        useful *= d
        padded *= -(-d // tile) * tile
    return useful / padded


def matmul_seconds(op: Op, graph: Graph, flop_rate: float, byte_rate: float, tile: int) -> float:
    """Unsharded seconds of a matmul (dot_general or convolution): its tiled arithmetic
    at `flop_rate`, or its operands and result streamed at `byte_rate`, the slower."""
    shape = gemm_shape(op, graph)
    useful = tile_efficiency(shape, tile) if shape is not None else 1.0
    arithmetic = op.flops / (flop_rate * useful)
    return max(arithmetic, (op.bytes_read + op.bytes_written) / byte_rate)
