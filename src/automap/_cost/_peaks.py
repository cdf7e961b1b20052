"""What a step holds at its peak: the moment, of the few its memory may peak at, whose
buffers add up to most, and what the gradients' reduction writes beside them.

The cost model (`_model.py`) reads these for one-stage plans and the shard ILP's memory
points (`_search/_mesh_terms.py`) state the same peaks as linear terms: kept in one
module so that the two read one statement of them.
"""

from __future__ import annotations

import numpy as np

from .._lowering import Lowering
from . import _collectives as C
from ._liveness import Moments


def reduction_copy(zero_size: float, lowering: Lowering, param_bytes: float) -> tuple[float, float]:
    """(share, constant): the bytes the step's gradient reduction writes beside the
    `reduced` gradients are share x reduced + constant. ZeRO's
    reduce-scatter over `zero_size` devices (a tuple of the local gradients, combined)
    the device's shards of them (where the backend has one: XLA's CPU all-reduces and
    slices); the all-reduce a copy of one combined bucket (XLA's GPU combiner concatenates
    its operands and reduces the concatenation; the CPU's writes its own): all of them where
    no plan reduces more than `Lowering.all_reduce_combine_bytes` (every gradient, reduced
    over two axes one after the other), else a whole bucket. That is min(reduced, bucket)
    but for a plan that reduces less than a bucket of a model that has more, at most a
    bucket over; and linear, as the shard ILP's memory points must be (`param_bytes`: the
    model's unsplit parameter bytes). Nothing where the backend reduces each combined operand
    in place (`Lowering.concatenates_combined`: XLA's TPU)."""
    if zero_size and lowering.reduce_scatter:
        return 1.0 / zero_size, 0.0
    if not lowering.concatenates_combined:
        return 0.0, 0.0
    bucket = lowering.all_reduce_combine_bytes
    return (1.0, 0.0) if 2 * param_bytes <= bucket else (0.0, bucket)


def moment_bytes(
    moments: Moments,
    inv: np.ndarray,
    reduced,
    gathered: np.ndarray | None = None,
    microbatches: int = 1,
    copies: np.ndarray | None = None,
    outputs: np.ndarray | None = None,
    shard: float | None = None,
):
    """(gradients, all, outputs) of what a scheduled step holds besides its arguments at
    each candidate moment (`_liveness.py`), [moments, ...] (`inv`: [sets, ...]): what is
    alive, with the `reduced` gradients' share made by then held for their reduction (and
    `copies`, per moment, of a recomputed layer's partial sums: `_buffers.combined_copies`;
    `outputs`, per moment, the outputs held apart from the arguments made by then:
    `_outputs.py`; `gathered`, per set, ZeRO-3's gathered parameters' share; `shard`:
    where ZeRO-3 reduces the gradients layer by layer, the share of a reduced one kept,
    the rest held whole only until their layer's reduction: `Moments.unreduced`)."""
    held = moments.held
    if shard is not None and moments.unreduced is not None:
        held = moments.unreduced + shard * moments.reduced
    made = np.multiply.outer(held, reduced)
    at = moments.live @ inv / microbatches + made
    if copies is not None:
        at = at + copies / microbatches
    out = np.zeros(at.shape) if outputs is None else outputs
    at = at + out
    if gathered is not None:
        at = at + moments.gathered @ gathered
        if moments.regathered is not None:  # the backward gathers its own copies
            at = at - moments.regathered @ gathered / microbatches
    return made, at, out


def busiest_moment(made, at, out, end: float, early: float = 0.0) -> tuple[float, float, float]:
    """(gradients, the rest, outputs) at the peak of a scheduled step: the busiest
    candidate moment (`moment_bytes`), or the reduction itself, the gradients and the copy
    it writes (`end`: `reduction_copy`), beside the `early` outputs (those no update op
    makes, a loss)."""
    k = int(np.argmax(at)) if len(at) else -1
    if k < 0 or end + early >= at[k]:
        return float(end), 0.0, float(early)
    return float(made[k]), float(at[k] - made[k] - out[k]), float(out[k])


def update_peak(
    grads: float, acts: float, reduced: float, outputs: float
) -> tuple[float, float, float]:
    """(gradients, activations, outputs) at the peak of a step whose buffers are not
    scheduled (XLA's CPU), of three: the backward's (the gradients and every activation),
    the reduction's (the gradients and their `reduced` copy) and the update's, the outputs
    held apart from the arguments (`_outputs.py`) alone: each gradient the update reads
    dies in the elementwise kernel that makes a new value of its shape, and XLA writes
    that output over it (read in the CPU's buffer assignment: a data-parallel MLP that
    donates nothing holds its new state and 0.1x of it besides)."""
    peaks = [(grads, acts, 0.0), (grads + reduced, 0.0, 0.0), (0.0, 0.0, outputs)]
    return max(peaks, key=sum)


def reduced_gradients(sums: np.ndarray, ac: C.AxisCosts) -> float:
    """Bytes per device of the step's gradient reductions' results (slot 0 of
    `K.sums`, every kind and axis): one buffer each where the all-reduce is not in place.
    A gradient reduced over two axes one after the other counts once per all-reduce, an
    upper bound: its local copy may be dead by the second."""
    return float(sums[3, : len(C.KINDS) * ac.masks].sum())
