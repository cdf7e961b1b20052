"""The layout transposes sequence parallelism costs where the backend collects on a
buffer's major dim alone (`Lowering.major_dim_collectives`, XLA's GPUs): a stream split
on a dim that is not its major one (a batch-major [b, s, h] stream split on its
sequence, a microbatch over 1) is gathered and reduce-scattered sequence-major, and each
gathered copy and scattered buffer is transposed between that layout and its matmuls'.
`_seqpar.seqpar_terms` prices them (`SeqparTerms.transposed`), which every path reads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from .._graph import Graph
from .._plan import Plan, Spec

_MATMUL = "dot_general"


def layout_rate(cluster) -> float:
    """`seqpar_terms`'s `layout_rate` on `cluster`: its memory-bound kernels' HBM rate where
    its backend collects on major dims alone (`Lowering.major_dim_collectives`), else 0."""
    if not cluster.lowering.major_dim_collectives:
        return 0.0
    return cluster.hbm_bandwidth * cluster.memory_efficiency


def layout_transposes(
    graph: Graph, plan: Plan, lay, axis: str, gathered: list[int], at: list[int],
    whole: list[tuple[int, int]], scattered: list[int], rs_op: Mapping[int, int], rate: float,
) -> list[tuple[float, int]]:  # fmt: skip
    """(seconds, op) of each layout transpose a backend that collects on major dims alone
    (`Lowering.major_dim_collectives`) runs around the stream's collectives, where a dim
    before the sequence holds more than one element per device (a batch-major stream,
    microbatch over 1): each gathered copy a matmul reads (`gathered`, read first by op
    `at`) is transposed from the gather's sequence-major layout, once for its matmuls and
    once more where a matmul reads it as its left operand contracting the sequence (a
    gathered cotangent's weight gradient, which XLA reads hidden-major); each reduce-scattered
    buffer (`scattered`: those whose partial sums no add joins first, whose whole kernel
    writes that layout) is transposed to the collective's layout by a kernel reading the
    matmul's output, charged to that matmul (`rs_op`). Each transpose
    reads and writes the whole buffer at its own width. Read in XLA's A100 program of a
    2-layer bf16 GPT at the 22B width, microbatch 4, tp 8: 22 transposes of 201 MB."""
    out = []
    readers: dict[int, list[int]] = {}
    for t, op in whole:
        readers.setdefault(t, []).append(op)
    for t, op in zip(gathered, at, strict=True):
        if not _minor_sequence(graph, plan, t, axis):
            continue
        if not any(graph.ops[o].primitive == _MATMUL for o in readers[t]):
            continue  # (an embedding's gradient reads the gathered layout as it is)
        seconds = 2 * buffer_bytes(graph, t, lay[t], plan.mesh, 0) / rate
        left = any(_left_contracted(graph, plan, graph.ops[o], t, axis) for o in readers[t])
        out += [(seconds, op)] * (2 if left else 1)
    for end in scattered:
        if _minor_sequence(graph, plan, end, axis):
            out.append((2 * buffer_bytes(graph, end, lay[end], plan.mesh, 0) / rate, rs_op[end]))
    return out


def _minor_sequence(graph: Graph, plan: Plan, t: int, axis: str) -> bool:
    """Whether a dim before split tensor t's sequence holds more than one element on a
    device in one program: its constraint's other axes divide it, and a pipeline's
    microbatches its leading (batch) dim (a microbatch of 1 is sequence-major already)."""
    spec = plan.constraints[t]
    shape = graph.tensors[t].shape

    def local(i: int) -> int:
        n = shape[i] // math.prod(plan.mesh.get(a, 1) for a in spec_axes(spec[i : i + 1]))
        return n // max(1, plan.microbatches) if i == 0 else n

    return any(local(i) > 1 for i in range(seq_dim(spec, axis) or 0))


def _left_contracted(graph: Graph, plan: Plan, op, t: int, axis: str) -> bool:
    """Whether matmul op reads t as its left operand with t's sequence contracted."""
    if op.primitive != _MATMUL or op.inputs[0] != t:
        return False
    (lhs_contract, _), _ = op.params["dimension_numbers"]
    return seq_dim(plan.constraints[t], axis) in lhs_contract


def seq_dim(spec: Spec, axis: str) -> int | None:
    """The dim of a split tensor's constraint that holds `axis`."""
    return next((d for d in range(len(spec)) if axis in spec_axes(spec[d : d + 1])), None)


def spec_axes(spec: Spec) -> set[str]:
    """The mesh axes a spec (or a slice of one) names."""
    out: set[str] = set()
    for e in spec:
        out.update([e] if isinstance(e, str) else (e or ()))
    return out


def buffer_bytes(
    graph: Graph, t: int, spec: Spec, mesh: Mapping[str, int], float_bytes: int
) -> float:
    """Per-device bytes of tensor t laid out by `spec` (whole on the sequence)."""
    tensor = graph.tensors[t]
    split = math.prod(mesh.get(a, 1) for a in spec_axes(spec))
    size = tensor.nbytes
    if float_bytes and "float" in tensor.dtype and tensor.itemsize < float_bytes:
        size = tensor.size * float_bytes
    return size / split
