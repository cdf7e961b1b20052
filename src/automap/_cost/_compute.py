"""The tables' compute terms: each op's unsharded seconds, by one rule, and what a plan
makes of them (`op_compute`).

An op runs at the device's sustained rate: a matmul (or convolution) at its FLOP rate, a
fusible op at the HBM rate on its fused kernel's traffic (`_fusion.fused_bytes`), other
memory-bound ops on their own operands and results (`compute_seconds`). A loop's compute
is its bodies' ops (x trips), each divided by its own split as an unrolled loop's would
be; ops whose results reach no step output cost nothing, as XLA removes dead code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import TYPE_CHECKING

import numpy as np

from .._capture import Residuals
from .._graph import Graph
from .._groups import LOOPS, Groups, body_tensor_groups, rule
from .._lowering import Lowering
from ._fusion import FUSIBLE, fused_bytes
from ._gemm import matmul_seconds
from ._residuals import written_residuals
from ._sets import SetIndex
from ._zero import shares, zero_shares

if TYPE_CHECKING:
    from ._tables import Tables


@dataclasses.dataclass(frozen=True)
class Rates:
    flop: float  # FLOP/s a matmul sustains (peak x matmul efficiency)
    byte: float  # HBM bytes/s a memory-bound kernel sustains
    tile: int = 1  # elements a matmul's M, N and K are tiled by (`_gemm.tile_efficiency`)


def compute_seconds(op, graph: Graph, compute: str, fused: np.ndarray, rates: Rates) -> float:
    """Unsharded seconds of one op of `graph`, top-level or a loop body's, whose rule
    computes as `compute` (`_groups.rule`); `fused`: its graph's `fused_bytes`. A matmul:
    by its shape (`_gemm.matmul_seconds`)."""
    if compute == "matmul":
        return matmul_seconds(op, graph, rates.flop, rates.byte, rates.tile)
    if compute == "loop":  # a body of matmuls or of memory traffic: the slower
        return max(op.flops / rates.flop, (op.bytes_read + op.bytes_written) / rates.byte)
    if op.primitive in FUSIBLE:
        return fused[op.index] / rates.byte
    if compute == "memory":
        return (op.bytes_read + op.bytes_written) / rates.byte
    return 0.0


def live_ops(graph: Graph) -> set[int]:
    """The ops some of whose results reach a step output: XLA removes the others."""
    live = {leaf.tensor for leaf in graph.outputs}
    out = set()
    for op in reversed(graph.ops):
        if any(t in live for t in op.outputs):
            out.add(op.index)
            live.update(op.inputs)
    return out


@dataclasses.dataclass(frozen=True)
class ComputeInputs:
    """What the compute terms of one step are built from (`compute_inputs`)."""

    graph: Graph
    tensor_groups: list  # `Groups.tensor_groups`
    ng: int  # number of groups
    sets: SetIndex
    lowering: Lowering
    rates: Rates
    live: set[int]  # `live_ops`
    recomputed: set[int]  # the ops rematerialization recomputes
    pinned: set[int]  # the tensors ZeRO's layout pins (`_groups.zero_region`)
    fused: np.ndarray  # [n_ops] `fused_bytes` of the step
    # [n_ops] the same for a recomputed layer's first forward, which keeps none of what its
    # backward reads (the recompute makes it again): its kernels write less.
    first: np.ndarray


def compute_inputs(
    graph: Graph,
    groups: Groups,
    res: Residuals,
    cluster_rates: Rates,
    lowering: Lowering,
    sets: SetIndex,
    pinned: Collection[int],
) -> ComputeInputs:
    live = live_ops(graph)
    # the residuals XLA writes, not the jaxpr's: it makes the cheap ones again in readers
    step_saved, first_saved = written_residuals(graph, res, lowering, graph.consumers())
    return ComputeInputs(
        graph=graph,
        tensor_groups=groups.tensor_groups,
        ng=len(groups.groups),
        sets=sets,
        lowering=lowering,
        rates=cluster_rates,
        live=live,
        recomputed=set(res.recomputed),
        pinned=set(pinned),
        fused=fused_bytes(graph, step_saved, live, lowering),
        first=fused_bytes(graph, first_saved, {i for i in live if i <= res.boundary}, lowering),
    )


@dataclasses.dataclass(frozen=True)
class ComputeEntries:
    """The compute terms found so far, one entry per top-level op and per loop body op
    (see `Tables` for each)."""

    op_set: list[int] = dataclasses.field(default_factory=list)
    op_coef: list[float] = dataclasses.field(default_factory=list)
    remat: list[float] = dataclasses.field(default_factory=list)
    body_op: list[int] = dataclasses.field(default_factory=list)
    body_set: list[int] = dataclasses.field(default_factory=list)
    body_coef: list[float] = dataclasses.field(default_factory=list)
    body_zero: list[bool] = dataclasses.field(default_factory=list)


def add_op_compute(out: ComputeEntries, inp: ComputeInputs, op) -> bool:
    """Adds top-level op's compute terms to `out` (its bodies' ops' for a loop); whether
    the op is live (XLA keeps it)."""
    graph, tg, split = inp.graph, inp.tensor_groups, inp.sets.split
    r = rule(op, graph)
    outs = {g for o in op.outputs for g in tg[o] if split[g]}
    red = {g for t, d in r.reduced if split[g := tg[t][d]]} - outs
    looped = op.primitive in LOOPS and graph.bodies.get(op.index)
    # A loop's own iteration set would tie every group it carries into one set (one
    # ILP scope of 3^dozens options): its bodies' ops carry its compute instead.
    out.op_set.append(inp.sets.of(()) if looped else inp.sets.of(outs | red))
    if looped and op.index in inp.live:
        add_body_compute(out, inp, op, graph, tg, 1.0, op.index)
        coef = 0.0  # its bodies' ops carry it
    else:
        coef = compute_seconds(op, graph, r.compute, inp.fused, inp.rates)
    if op.index not in inp.live:
        out.op_coef.append(0.0)
        out.remat.append(0.0)
        return False
    out.op_coef.append(coef)
    # A recomputed op runs twice: as `op_coef` prices it (the recompute, which writes
    # what the backward reads) and in the first forward, matmuls included.
    first = inp.first[op.index] / inp.rates.byte if op.primitive in FUSIBLE else coef
    out.remat.append(first if op.index in inp.recomputed else 0.0)
    return True


def add_body_compute(
    out: ComputeEntries, inp: ComputeInputs, op, g: Graph, tgs, scale: float, owner: int
) -> None:
    """Adds the compute of loop op's bodies (op of g, its dims' groups `tgs`) to `out`, op
    by op, each on its own split (nested loops through theirs), `scale` times per step, as
    entries owned by `owner`. A top-level loop's body op that makes (a trip's slice of) a
    gradient ZeRO pins is marked, as the op that makes one outside a loop is
    (`Tables.zero_op`)."""
    split = inp.sets.split
    for body, btg in zip(g.bodies[op.index], body_tensor_groups(op, g, tgs, inp.ng), strict=True):
        if not body.priced:
            continue
        bg, times = body.graph, scale * body.trips
        fused = fused_bytes(bg, (), None, inp.lowering)
        zeroed = {b for o, b, _ in body.binds if o in inp.pinned} if g is inp.graph else set()
        for bop in bg.ops:
            if bop.primitive in LOOPS and bg.bodies.get(bop.index):
                add_body_compute(out, inp, bop, bg, btg, times, owner)
                continue
            r = rule(bop, bg)
            outs = {x for o in bop.outputs for x in btg[o] if split[x]}
            red = {x for t, d in r.reduced if split[x := btg[t][d]]} - outs
            out.body_op.append(owner)
            out.body_set.append(inp.sets.of(outs | red))
            out.body_coef.append(times * compute_seconds(bop, bg, r.compute, fused, inp.rates))
            out.body_zero.append(bool(zeroed.intersection(bop.outputs)))


def compute_columns(
    entries: ComputeEntries, recomputed: Collection[int], zero_op: np.ndarray, n_sets: int
) -> dict[str, np.ndarray]:
    """The `Tables` fields of the compute terms (op_set, op_coef, body_*, compute_coef,
    remat_*, zero_op, body_zero, zero_coef) as arrays, summed by set where they are."""
    op_set = np.array(entries.op_set, dtype=np.int64)
    op_coef = np.array(entries.op_coef, dtype=float)
    body_op = np.array(entries.body_op, dtype=np.int64)
    body_set = np.array(entries.body_set, dtype=np.int64)
    body_coef = np.array(entries.body_coef, dtype=float)
    body_again = np.isin(body_op, list(recomputed)) * body_coef
    body_zero = np.array(entries.body_zero, dtype=bool)
    remat = np.array(entries.remat, dtype=float)

    def by_set(own: np.ndarray, body: np.ndarray) -> np.ndarray:
        return np.bincount(op_set, own, minlength=n_sets) + np.bincount(
            body_set, body, minlength=n_sets
        )

    return dict(
        op_set=op_set,
        op_coef=op_coef,
        body_op=body_op,
        body_set=body_set,
        body_coef=body_coef,
        body_remat_coef=body_again,
        compute_coef=by_set(op_coef, body_coef),
        zero_op=zero_op,
        body_zero=body_zero,
        zero_coef=by_set(op_coef * zero_op, body_coef * body_zero),
        remat_op_coef=remat,
        remat_coef=by_set(remat, body_again),
    )


def op_compute(T: Tables, inv: np.ndarray, remat: bool = False, zero=None) -> np.ndarray:
    """[n_ops] compute seconds of each top-level op under a plan whose per-set divisor
    inverses are `inv` (a loop's: its bodies' ops, each on its own split); `remat`: what a
    recomputed op adds under rematerialization (`remat_op_coef`) instead. `zero`: (P, d,
    size) of a ZeRO plan over the axis of code d (`zero_shares`)."""
    own = (T.remat_op_coef if remat else T.op_coef) * inv[T.op_set]
    body = (T.body_remat_coef if remat else T.body_coef) * inv[T.body_set]
    if zero is not None:
        own = own * zero_shares(T, *zero)
        body = body * shares(T.body_zero, T.body_set, *zero)
    return own + np.bincount(T.body_op, body, minlength=len(own))
