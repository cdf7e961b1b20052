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

Memory: the kernel writes none of the core's inner tensors (the scores, their mask, max,
exp and sums, the probabilities, and in the backward their gradients), so the step's
buffers are walked moment by moment without them (`kernel_buffers`: `Moments.flash`,
picked by `Layout.flash`), the peak placed among the moments of both walks (taking the
kept scores off the finished peak instead was wrong: the busiest moment need not hold
them, and a 64B Llama's no-recomputation plan on 64 v5p chips came out at -21.9 GB). What
the kernel keeps for its backward beyond Q, K, V and the output (which the written core
keeps too) is its two float32 row statistics (log-sum-exp and maximum), each laid
[batch, heads, queries, 128]: the Pallas TPU kernel broadcasts a row's statistic over the
128 lanes of a vector register (`MIN_BLOCK_SIZE` in `jax.experimental.pallas.ops.tpu.
flash_attention`; its VJP takes the statistics' first lane and broadcasts them again,
which XLA's TPU folds into holding the broadcast ones), so they take 1 KiB per query row
and head, as much as the row's queries at a head dimension of 512 in bf16. They are
buffers in the walk, from the forward kernel (from the backward's start where the core is
recomputed) to the core's backward's end, with the third its backward makes (the rows of
dO·O, `di`), laid alike, while that backward runs. So are the kernel's operands, which the
runtime lays [batch, heads, sequence, head dim] for it (`_run/_flash.py`): the queries and
the output kept for the backward as the statistics are (beside the core's own, which the
written step keeps too), the keys and values repeated to every query head while the
backward runs (read in the buffer assignments of a 2-layer bf16 Llama, 8 heads in 2
key/value groups, rows of 1024, at data 4 on v5p 2x2x1: the statistics as float32
[32, 1, 1024, 128], the queries and output as bf16 [32, 1, 1024, 64] and, under
recomputation, the repeated keys and values as bf16 [4, 2, 4, 1024, 64], each laid in
128-lane tiles).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from .._errors import PlanError
from .._graph import Graph
from .._plan import Cost, Plan
from .._remat import BLOCK, FlashCore, flash_cores
from ._compute import op_compute
from ._liveness import Buffers

# float32 log-sum-exp and maximum per query row and head, each over the kernel's 128 lanes
_ROW_STATS = 2 * 4 * 128


def causal_share(seq: int, block: int = BLOCK) -> float:
    """The share of a causal kernel's blocks it computes: nb(nb+1)/2 of nb² (nb blocks of
    `block` queries and keys; the matcher refuses a sequence they do not divide)."""
    nb = max(1, math.ceil(seq / block))
    return (nb + 1) / (2 * nb)


def _cores(model: Any) -> tuple[FlashCore, ...]:
    """The cores the model's tables walked as the kernel runs them, else the one-line
    PlanError of a program the kernel cannot run (`flash_cores`)."""
    return model.tables.flash_cores or flash_cores(model.graph, model.groups)


def kernel_cores(graph: Graph, groups: Any) -> tuple[FlashCore, ...]:
    """Every attention core of the program, where the flash kernel can run them all (the
    cores `_run/_flash.py` binds), else none."""
    try:
        return flash_cores(graph, groups)
    except PlanError:
        return ()


def kernel_buffers(
    graph: Graph, buf: Buffers, cores: Sequence[FlashCore], recomputed: Collection[int] = ()
) -> Buffers | None:
    """`buf` as the flash kernel leaves them (None where it runs no core). It writes none of
    a core's inner values: the forward's but its output (the scores, their mask, max, exp,
    sums, the probabilities), the backward's but the cotangents of q, k and v. It keeps its
    two row statistics from the forward to the core's backward (from the backward's start
    where the core is `recomputed`: its forward runs again there), and the core's backward
    makes a third (the rows of dO·O), each float32 over 128 lanes (`_ROW_STATS`): buffers
    of their own, laid as the scores they stand for are split. So are the queries and the
    output as the runtime lays them for the kernel, kept alike, and the keys and values it
    repeats to every query head for the backward (the module's docstring)."""
    if not cores:
        return None
    gone: set[int] = set()
    extra: list[tuple[int, int, int, float]] = []  # tensor, birth, death, width
    for fc in cores:
        sinks = {fc.out, *fc.grads}
        for i in (*fc.forward, fc.d2, *fc.backward):
            gone.update(t for t in graph.ops[i].outputs if t not in sinks)
        scores = graph.ops[fc.d1].outputs[0]
        t = graph.tensors[scores]
        row = t.nbytes / math.prod(t.shape) * graph.tensors[fc.k].shape[fc.k_labels.index("t")]
        start, end = min(fc.backward), max(fc.backward)
        kept = start if fc.d1 in recomputed else fc.d1
        extra += [
            (scores, kept, end, _ROW_STATS / row),  # the row statistics
            (fc.q, kept, end, 1.0),  # the queries and the output, as the kernel lays them
            (fc.out, kept, end, 1.0),
            (scores, start, end, _ROW_STATS / 2 / row),  # the backward's rows of dO·O
            (fc.q, start, end, 2.0),  # and its keys and values, one per query head
        ]
    width = np.where(np.isin(buf.tensor, np.fromiter(gone, dtype=np.int64)), 0.0, buf.width)
    tensor, birth, death, more = (np.array(x) for x in zip(*extra, strict=True))
    epilogue = buf.epilogue
    if epilogue is not None:
        epilogue = np.concatenate([epilogue, np.full(len(extra), -1, dtype=np.int64)])
    return dataclasses.replace(
        buf,
        tensor=np.concatenate([buf.tensor, tensor.astype(buf.tensor.dtype)]),
        birth=np.concatenate([buf.birth, birth.astype(buf.birth.dtype)]),
        death=np.concatenate([buf.death, death.astype(buf.death.dtype)]),
        width=np.concatenate([width, more.astype(float)]),
        epilogue=epilogue,
    )


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
    written = kernel = 0.0
    for fc in cores:
        ops = (*fc.forward, fc.d2, *fc.backward)
        written += float(sum(first[i] + again[i] for i in ops))
        share = causal_share(graph.tensors[fc.k].shape[fc.k_labels.index("t")])
        dots = [j for j in fc.backward if graph.ops[j].primitive == "dot_general"]
        forward = first[fc.d1] + first[fc.d2] + again[fc.d1] + again[fc.d2]
        kernel += share * float(forward + sum(first[j] for j in dots) + first[fc.d1])
    compute = cost.compute_s - written + kernel
    step = cost.step_time_s - written + kernel
    return dataclasses.replace(
        cost,
        step_time_s=step,
        compute_s=compute,
        mfu=cost.mfu * cost.step_time_s / step if step > 0 else cost.mfu,
    )
