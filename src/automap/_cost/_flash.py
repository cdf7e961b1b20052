"""A plan's attention cores priced as the flash kernel runs them (`Plan.attention="flash"`,
`_run/_flash.py`), in place of the written ops the tables price.

Compute: the written core's ops (its forward, their recompute where the plan recomputes
the core, its backward's dots and softmax backward) are taken out; in their place the
kernel's matmuls, priced as the tables price the written ones (the same shapes, split
and rate), on the blocks the kernel computes: a causal kernel skips the key blocks after
the query block's, so of nb × nb blocks it runs nb(nb+1)/2 (nb = sequence / block). The
forward is QKᵀ and the product with V (again where the core is recomputed); the backward
the four written backward dots (dP, dV, dQ, dK) and QKᵀ once more (flash's backward makes
the scores again from Q, K and the saved log-sum-exp). The softmax's elementwise work
runs inside the kernel, on blocks held in the core's VMEM: no HBM traffic is priced for it.

Memory: the kernel holds none of the core's inner tensors (the float32 scores, the
probabilities), but the price still does: what the kernel keeps for its backward beyond
Q, K, V and the output (which the written core keeps too), its two float32 row statistics
(log-sum-exp and maximum) per query and head, is added to the written core's memory
(for every core not recomputed; for the recomputed one while its backward runs). Taking
the kept scores off the finished peak was wrong: the step's busiest moment need not hold
them (a 64B Llama's no-recomputation plan on 64 v5p chips came out at -21.9 GB). Until
the liveness model takes them off moment by moment, a flash plan is priced at most its
written memory: never fitting where it does not. Under recomputation (MaxText's
configuration) the scores are not kept, and this is within 15% of XLA's v5p buffers.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Any

import numpy as np

from .._errors import PlanError
from .._graph import Graph
from .._plan import Cost, Plan
from .._remat import BLOCK, FlashCore, flash_cores
from ._compute import op_compute

_ROW_STATS = 2 * 4  # float32 log-sum-exp and maximum per query row and head

_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def causal_share(seq: int, block: int = BLOCK) -> float:
    """The share of a causal kernel's blocks it computes: nb(nb+1)/2 of nb² (nb blocks of
    `block` queries and keys; the matcher refuses a sequence they do not divide)."""
    nb = max(1, math.ceil(seq / block))
    return (nb + 1) / (2 * nb)


def _cores(model: Any) -> tuple[FlashCore, ...]:
    hit = _cache.get(model)
    if hit is None:
        hit = _cache[model] = flash_cores(model.graph, model.groups)
    return hit


def with_flash(model: Any, st: Any, plan: Plan, cost: Cost) -> Cost:
    """`cost` with every attention core priced as the flash kernel (the module's
    docstring); `cost` itself under written attention."""
    if plan.attention != "flash":
        return cost
    if not model.cluster.lowering.flash_attention:
        raise PlanError(
            f"flash attention is priced where the runtime runs its kernel (TPU clusters), "
            f"not on {model.cluster.name}; use attention='written'."
        )
    cores = _cores(model)
    graph, T = model.graph, model.tables
    first = op_compute(T, st.inv)
    again = op_compute(T, st.inv, remat=True) if st.remat else np.zeros_like(first)
    written = kernel = held = 0.0
    once = False  # the recomputed cores' statistics: one core's, while its backward runs
    recomputed = set(model.residuals.recomputed) if st.remat else set()
    for fc in cores:
        ops = (*fc.forward, fc.d2, *fc.backward)
        written += float(sum(first[i] + again[i] for i in ops))
        share = causal_share(graph.tensors[fc.k].shape[fc.k_labels.index("t")])
        dots = [j for j in fc.backward if graph.ops[j].primitive == "dot_general"]
        forward = first[fc.d1] + first[fc.d2] + again[fc.d1] + again[fc.d2]
        kernel += share * float(forward + sum(first[j] for j in dots) + first[fc.d1])
        if fc.d1 not in recomputed or not once:
            held += _row_stats(graph, T, st, fc)
            once = once or fc.d1 in recomputed
    acts = cost.memory_breakdown["activations"] + held  # the scores: see the module doc
    parts = {**cost.memory_breakdown, "activations": acts}
    total = sum(parts.values())
    compute = cost.compute_s - written + kernel
    step = cost.step_time_s - written + kernel
    return dataclasses.replace(
        cost,
        step_time_s=step,
        compute_s=compute,
        memory_bytes=total,
        memory_breakdown=parts,
        mfu=cost.mfu * cost.step_time_s / step if step > 0 else cost.mfu,
        feasible=total <= cost.memory_limit_bytes,
        reason="" if total <= cost.memory_limit_bytes else cost.reason,
    )


def _row_stats(graph: Graph, T: Any, st: Any, fc: FlashCore) -> float:
    """Bytes per device of the kernel's row statistics for one core: two float32 per
    query row per head (per element of the scores' rows), split as QKᵀ is."""
    scores = graph.tensors[graph.ops[fc.d1].outputs[0]]
    rows = math.prod(scores.shape) / graph.tensors[fc.k].shape[fc.k_labels.index("t")]
    return rows * _ROW_STATS * float(st.inv[T.op_set[fc.d1]])
