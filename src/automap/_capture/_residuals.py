"""Which tensors a training step keeps alive for its backward pass.

A `value_and_grad` jaxpr runs the forward ops first and the transposed (backward) ops
after them. The forward ends where the loss is produced: a float scalar output of the step
(the `boundary`). Activations kept for backward are the intermediates produced up to the
boundary and read after it; their bytes (divided by each tensor's sharding) are the
activation memory at the turn of the step, which is where a training step peaks.

When no scalar loss is found, the boundary is the op where the unsharded live bytes of
intermediates peak (a liveness sweep over the op list).

Rematerialization needs the layers (`_remat/_recompute.py` `remat_residuals`, Megatron's full recomputation:
each layer's input is kept, its forward runs again in the backward). Without them
`saved_remat` is all of `saved` and nothing is recomputed.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .._graph import Graph, Role, TensorKind


@dataclasses.dataclass(frozen=True)
class Residuals:
    boundary: int  # index of the last forward op
    saved: tuple[int, ...]  # tensor ids kept for backward
    saved_remat: tuple[int, ...]  # alive at the turn under rematerialization
    forward_ops: tuple[int, ...]  # op indices up to the boundary
    # Ops run a second time under rematerialization (`remat_residuals` fills this and
    # `saved_remat` in; on their own, residuals know no layers: nothing is recomputed).
    recomputed: tuple[int, ...] = ()
    # Per recomputed layer, the residuals its recomputation makes (alive in its backward);
    # `saved_remat` holds the largest layer's, a pipeline stage its own largest.
    layer_saved: tuple[tuple[int, ...], ...] = ()
    # Forward tensors the backward reads as a value of its own, kept as they are (a split
    # stream tensor, gathered again there: `_remat.Recompute.rereading`).
    reread: tuple[int, ...] = ()


def find_residuals(graph: Graph) -> Residuals:
    return graph.recall("residuals", graph, None, lambda: _find_residuals(graph), keep=1)


def _find_residuals(graph: Graph) -> Residuals:
    n_ops = len(graph.ops)
    last_use = np.full(len(graph.tensors), -1, dtype=np.int64)
    for op in graph.ops:
        last_use[list(op.inputs)] = op.index
    boundary = loss_boundary(graph)
    if boundary is None:
        boundary = _liveness_peak(graph, last_use)
    saved = tuple(
        t.id
        for t in graph.tensors
        if t.kind == TensorKind.INTERMEDIATE
        and t.producer is not None
        and t.producer <= boundary
        and last_use[t.id] > boundary
    )
    return Residuals(boundary, saved, saved, tuple(range(min(boundary + 1, n_ops))))


def loss_boundary(graph: Graph) -> int | None:
    """The op that makes the loss: of the step's float scalar outputs (not state), the
    first one made from the batch inputs (any, where none is), None where there is none.
    Not the first in output order: a metrics dict flattens by key, and `grad_norm` sorts
    before `loss`, but is made after the backward, which then counted as forward (ZeRO-3's
    backward gathers went unrun and were priced all the same, 2x XLA's gathers). A metric
    of the parameters alone (`param_norm`) is not made from the batch, wherever it is."""
    state = {leaf.path for leaf in graph.inputs if leaf.role in (Role.PARAM, Role.OPT_STATE)}
    made = {
        graph.tensors[leaf.tensor].producer
        for leaf in graph.outputs
        if _scalar_float(graph.tensors[leaf.tensor]) and leaf.path not in state
    }
    if not made:
        return None
    batched = {leaf.tensor for leaf in graph.inputs if leaf.role == Role.BATCH}
    for op in graph.ops[: max(made) + 1]:
        if batched.intersection(op.inputs):
            batched.update(op.outputs)
            if op.index in made:
                return op.index
    return min(made)


def _scalar_float(t) -> bool:
    return (
        t.ndim == 0
        and t.producer is not None
        and np.issubdtype(np.dtype(t.dtype if t.dtype != "bfloat16" else "float16"), np.floating)
    )


def _liveness_peak(graph: Graph, last_use: np.ndarray) -> int:
    delta = np.zeros(len(graph.ops) + 1)
    for t in graph.tensors:
        if t.producer is not None and last_use[t.id] >= 0:
            delta[t.producer] += t.nbytes
            delta[last_use[t.id] + 1] -= t.nbytes
    live = np.cumsum(delta)[: len(graph.ops)]
    return int(np.argmax(live)) if len(live) else 0
