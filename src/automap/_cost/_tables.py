"""The cost model's precomputed tables (see `_model.py` for what they mean).

Built once per graph and cluster. A *set* is a sorted tuple of splittable group ids: the
groups of one tensor's dims, or of an op's iteration space. Every per-plan quantity is a
function of which mesh axes a set holds, so tables index sets rather than tensors, and
rows with identical structure are merged ahead of time (summing bytes and occurrences:
collective times are linear in both).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping
from typing import NamedTuple

import numpy as np

from .._capture import Residuals
from .._cluster import Cluster
from .._graph import Graph, Role
from .._groups import (
    ARG_REDUCE,
    ELEMENTWISE,
    FREE,
    LOOPS,
    REDUCE_SUM_LIKE,
    Groups,
    body_tensor_groups,
    rule,
    zero_region,
)
from .._lowering import Lowering
from ._liveness import Buffers, Moments, gathered_parameters, past_forward, step_moments
from ._outputs import held_outputs, output_coef


class CandidateRow(NamedTuple):
    """One candidate collective as the tables are built (see `RowTable` for each field);
    `_rows` turns a list of them into the table's arrays."""

    group: list[int]
    small: list[int]
    tset: int
    tsmall: int
    other: int
    untied: bool
    nbytes: float
    grad: bool
    op: int
    peer: int
    count: float = 1.0  # occurrences per step (a loop body's: its trips)
    combine: int = 0  # a loop body's gradient row: its body's slot (`Tables.combine_trips`)


@dataclasses.dataclass(frozen=True)
class RowTable:
    """Candidate collectives, one row each: they happen when `group`'s axis calls for it.

    Partial-sum rows (one per op output) hold the op's reduced groups in `group` as a
    padded [rows, KR] matrix with `small` alongside: the axes of the groups that are split
    end up in the collectives the backend compiles (`_kernel.partial_rows`: one joint
    all-reduce on GPUs, one per axis chained on the CPU). Reshard rows (one per input dim)
    have a single column."""

    group: np.ndarray  # [rows, KR] the group(s) whose split triggers the row
    small: np.ndarray  # [rows, KR] set of the op's groups with a smaller id (they win an axis)
    tset: np.ndarray  # set of the tensor moved (bytes are divided by its sharding)
    tsmall: np.ndarray  # reshard: set of the tensor's groups with a smaller id
    other: np.ndarray  # reshard: the tensor's other groups the op keeps (all-to-all test)
    untied: np.ndarray  # reshard: the op needs this dim whole
    # reshard: a seam's other side (`Seam`): the row is idle when that set holds the axis,
    # since the flatten then keeps the split; the empty set for every other row.
    peer: np.ndarray
    nbytes: np.ndarray  # unsharded bytes of the tensor, summed over merged rows
    count: np.ndarray  # occurrences merged into the row
    grad: np.ndarray  # the result has a parameter's layout: a gradient collective
    op: np.ndarray  # op index (the first one, for merged rows)
    # A loop body's gradient partial sum (a result with a parameter's layout): its body's
    # slot, whose rows of one (kind, axes) XLA combines into one collective per trip; 0
    # for every other row (top-level gradients combine once per step through `grad`).
    combine: np.ndarray

    def merged(self) -> RowTable:
        if len(self.tset) == 0:
            return self
        kr = self.group.shape[1]
        # Bytes per occurrence are part of the key: each occurrence picks the cheaper of ring
        # and tree for its own size, and rows of one size merged keep that choice exact
        # (merging sizes would price their sum, which is never cheaper).
        per_occurrence = np.rint(self.nbytes / np.maximum(self.count, 1)).astype(np.int64)
        cols = [
            self.tset,
            self.tsmall,
            self.other,
            self.untied,
            self.grad,
            self.peer,
            self.combine,
            per_occurrence,
        ]
        keys = np.concatenate(
            [self.group, self.small, np.stack([c.astype(np.int64) for c in cols], axis=1)], axis=1
        )
        uniq, first, inv = np.unique(keys, axis=0, return_index=True, return_inverse=True)
        inv = inv.reshape(-1)
        n = len(uniq)
        rest = uniq[:, 2 * kr :]
        return RowTable(
            group=uniq[:, :kr],
            small=uniq[:, kr : 2 * kr],
            tset=rest[:, 0],
            tsmall=rest[:, 1],
            other=rest[:, 2],
            untied=rest[:, 3].astype(bool),
            grad=rest[:, 4].astype(bool),
            peer=rest[:, 5],
            combine=rest[:, 6],
            nbytes=np.bincount(inv, self.nbytes, minlength=n),
            count=np.bincount(inv, self.count, minlength=n),
            op=self.op[first],
        )


@dataclasses.dataclass(frozen=True)
class Tables:
    sets: np.ndarray  # [n_sets, K] group ids, padded with n_groups (always unsplit)
    splittable: np.ndarray  # [n_groups + 1]
    divisor: np.ndarray  # [n_groups + 1]
    op_set: np.ndarray  # [n_ops] iteration set of each op
    op_coef: np.ndarray  # [n_ops] unsharded seconds of each op
    # A loop's compute is its bodies' ops (x trips), each divided by its own split, as an
    # unrolled loop's ops are: one entry per body op, owned by the top-level loop op.
    body_op: np.ndarray  # [n_body] the top-level loop op each body op belongs to
    body_set: np.ndarray  # [n_body] the body op's iteration set
    body_coef: np.ndarray  # [n_body] its unsharded seconds per step (all trips)
    body_remat_coef: np.ndarray  # [n_body] the same for a recomputed loop's, else 0
    compute_coef: np.ndarray  # [n_sets] op_coef and body_coef summed by set
    # [n_ops] unsharded seconds a recomputed op adds under rematerialization: its first
    # forward, which writes none of what the backward reads (op_coef prices the recompute).
    remat_op_coef: np.ndarray
    remat_coef: np.ndarray  # [n_sets] recomputed layers' ops' first forward (see remat_op_coef)
    # [n_ops] whether ZeRO's layout pins the op's result (a gradient made where it meets
    # it, an update op): XLA computes the device's data shard of it, where the op's
    # iteration space is not already split over data (`_groups.zero_region`).
    zero_op: np.ndarray
    body_zero: np.ndarray  # [n_body] the same for a loop body's ops
    zero_coef: np.ndarray  # [n_sets] op_coef and body_coef of those ops, summed by set
    param_coef: np.ndarray  # [n_sets] bytes of parameter leaves
    # Per parameter leaf (tensor id), the bytes ZeRO-3's gather of it moves
    # (`gathered_bytes`), and those summed by set.
    gathered: Mapping[int, float]
    gather_coef: np.ndarray  # [n_sets]
    opt_coef: np.ndarray  # [n_sets] bytes of optimizer-state leaves
    other_coef: np.ndarray  # [n_sets] bytes of other inputs (batch, ...)
    act_coef: np.ndarray  # [n_sets] bytes of activations kept for backward
    act_remat_coef: np.ndarray  # same under rematerialization
    memory_coef: np.ndarray  # [5, n_sets] param, opt, act, act_remat, other coefs stacked
    # [3, n_sets] the outputs held apart from the arguments (a step that donates nothing):
    # new parameters, new optimizer state, the rest (`_outputs.held_outputs`).
    output_coef: np.ndarray
    # [3, n_sets] of those, the ones no update op makes (a loss): alive at the reduction
    early_output_coef: np.ndarray
    # The step's candidate peak moments, without and with rematerialization, where the
    # backend frees each buffer at its last reader (`Lowering.frees_at_last_use`), else None.
    moments: Moments | None
    moments_remat: Moments | None
    # The recomputed layers' activation all-reduces, copied once more at their recompute
    # (`combined_copies`); None where nothing is recomputed or the buffers aren't scheduled.
    copies: CombinedCopies | None
    param_leaves: np.ndarray  # [n_sets] parameter leaves (rank >= 1) of each set
    partial: RowTable  # merged, for evaluate
    reshard: RowTable
    partial_full: RowTable  # one row per op, for the per-op breakdown
    reshard_full: RowTable
    # The collectives of the recomputed ops, which run again in the backward (one row per
    # op, like the full tables).
    remat_partial: RowTable
    remat_reshard: RowTable
    # [slots] occurrences per step of each combined collective slot: 1 for slot 0 (the
    # step's gradients), a loop body's trips for its own slot (`RowTable.combine`).
    combine_trips: np.ndarray


def build_tables(
    graph: Graph,
    groups: Groups,
    cluster: Cluster,
    res: Residuals,
    regathered: Collection[int] = frozenset(),
) -> Tables:
    """The cost model's tables of `graph` (`Tables`). `regathered`: the forward's values
    ZeRO-3's backward makes again (`_groups.Regather.tensors`)."""
    ng = len(groups.groups)
    split = np.array([g.splittable for g in groups.groups] + [False])
    set_ids: dict[tuple[int, ...], int] = {}

    def sid(gs) -> int:
        key = tuple(sorted({g for g in gs if split[g]}))
        return set_ids.setdefault(key, len(set_ids))

    tg = groups.tensor_groups
    tset = [sid(g) for g in tg]
    param_sets = {tset[leaf.tensor] for leaf in graph.leaves(Role.PARAM)}
    flop_rate = cluster.peak_flops * cluster.matmul_efficiency
    byte_rate = cluster.hbm_bandwidth * cluster.memory_efficiency
    recomputed = set(res.recomputed)
    lowering = cluster.lowering
    wide = lowering.collective_float_bytes

    def comm_bytes(g: Graph, t: int) -> float:
        """Bytes a collective moves for tensor t of g (16-bit floats widened where the
        backend widens them, see Lowering.collective_float_bytes)."""
        x = g.tensors[t]
        if wide and x.dtype in ("bfloat16", "float16") and x.itemsize < wide:
            return x.size * wide
        return x.nbytes

    # XLA removes dead code: ops none of whose results reach a step output cost nothing.
    live = {leaf.tensor for leaf in graph.outputs}
    live_ops = set()
    for op in reversed(graph.ops):
        if any(t in live for t in op.outputs):
            live_ops.add(op.index)
            live.update(op.inputs)

    fused_bytes = _fused_bytes(graph, res.saved, live_ops, lowering)
    # Under rematerialization a recomputed layer's first forward keeps none of what its
    # backward reads (the recompute makes it again): its kernels write less.
    made_again = {t for ts in res.layer_saved for t in ts}
    first_bytes = _fused_bytes(
        graph,
        [t for t in res.saved if t not in made_again],
        {i for i in live_ops if i <= res.boundary},
        lowering,
    )

    empty = sid(())
    # A seam's input batch dim is untied from its output's, but moves only when the two
    # sides' axes differ: the other side is the row's peer (and, being the same logical
    # dim, never takes the axis from it as another of the op's groups would).
    after = {(s.op, s.before): s.after for s in groups.seams}
    op_set, op_coef, remat = [], [], []
    prow: list[CandidateRow] = []
    partial_row: dict[int, int] = {}  # a top-level op's output -> its partial-sum row
    rrow: dict[tuple, CandidateRow] = {}
    rrow_again: dict[tuple, CandidateRow] = {}  # the recomputed ops' own (XLA cannot reuse them)
    # Combined collective slots: the step's gradients (0), then each loop body with
    # gradient rows, with its trips per step.
    slots: dict[tuple, tuple[int, float]] = {(): (0, 1.0)}

    def collective_rows(
        op, g, tgs, tsets, scale: float, scope: tuple, row_op: int, hoist: dict, params: set
    ) -> None:
        """The candidate collectives of op (of graph g, its dims' groups `tgs`), each
        happening `scale` times per step; `scope` tells a loop body's tensors apart.
        `hoist[t]`: (outer tensor, its scope, its scale) of a body tensor that is the same
        on every trip, whose reshard XLA hoists out of the loop (and shares, as CSE).
        `params`: the sets of g's tensors with a parameter's layout (in a body: those
        bound to such a tensor outside)."""
        r = rule(op, g)
        outs = {x for o in op.outputs for x in tgs[o] if split[x]}
        red = {x for t, d in r.reduced if split[x := tgs[t][d]]} - outs
        it = outs | red
        looped = op.primitive in LOOPS and g.bodies.get(op.index)
        if red:
            gs = sorted(red)
            small = [sid(x for x in it if x < h) for h in gs]
            for o in op.outputs:
                nb = comm_bytes(g, o) * scale
                grad = tsets[o] in params
                # A body's gradient partial sums are combined per trip, not per step
                # (checked on XLA's CPU HLO in tests/test_loops.py).
                slot = slots.setdefault(scope, (len(slots), scale))[0] if grad and scope else 0
                if not scope:
                    partial_row[o] = len(prow)
                prow.append(
                    CandidateRow(
                        gs,
                        small,
                        tsets[o],
                        0,
                        0,
                        False,
                        nb,
                        grad and not scope,
                        row_op,
                        empty,
                        scale,
                        slot,
                    )
                )
        # A loop's operands cross into its bodies, which say what they need (below): only
        # dims no body sees (a scan's stacked dim) are the loop's own to keep whole.
        bound: set[tuple[int, int]] = set()
        for body in looped or ():
            for u, inner, off in body.binds:
                bound.update((u, d + off) for d in range(body.graph.tensors[inner].ndim))
        for u in dict.fromkeys(op.inputs):
            ugs = {x for x in tgs[u] if split[x]}
            for d, h in enumerate(tgs[u]):
                if not split[h] or (u, d) in bound:
                    continue
                # A dim no body sees is a scan's stacked dim, sliced per trip: XLA gathers
                # it whole for the loop even when a result (the stacked gradient) keeps it.
                untied = h not in it or bool(looped)
                seam = after.get((op.index, h)) if not scope else None
                # A loop's "iteration space" is every group it carries (dozens: one set of
                # them is an ILP scope of 3^dozens options); its stacked dim is gathered
                # whatever the others hold, so only the operand's own groups compete.
                rivals = it & ugs if looped else it
                op_small = {x for x in rivals if x < h and x != seam}
                if not untied and op_small <= ugs:
                    continue  # the op drops the axis exactly where the tensor does
                peer = empty if seam is None else sid((seam,))
                # XLA gathers a loop's operand for that loop (checked: a stacked weight split
                # on its layer dim is gathered once per scan reading it, not shared).
                where, ukey, times = (*scope, op.index) if looped else scope, u, scale
                if u in hoist and not looped:
                    ukey, where, times = hoist[u]
                key = (where, ukey, d, untied, sid(op_small), sid((ugs & it) - {h}), peer)
                if key not in rrow:
                    small_u = sid(x for x in ugs if x < h)
                    nb = comm_bytes(g, u)
                    if op.primitive in ARG_REDUCE:  # XLA reduces (value, int32 index) pairs
                        nb += g.tensors[u].size * 4
                    rrow[key] = CandidateRow(
                        group=[h],
                        small=[key[4]],
                        tset=tsets[u],
                        tsmall=small_u,
                        other=key[5],
                        untied=untied,
                        nbytes=nb * times,
                        grad=False,
                        op=row_op,
                        peer=peer,
                        count=times,
                    )
                if row_op in recomputed:
                    rrow_again.setdefault(key, rrow[key])
        for k, (body, btg) in enumerate(
            zip(looped or (), body_tensor_groups(op, g, tgs, ng) if looped else (), strict=True)
        ):
            if not body.priced:
                continue
            bsets = [sid(x) for x in btg]
            inner_hoist = {
                inner: hoist.get(outer, (outer, scope, scale))
                for outer, inner, _ in body.binds[: body.invariant]
            }
            where = (*scope, op.index, k)
            inner_params = {bsets[i] for u, i, _ in body.binds if tsets[u] in params}
            for bop in body.graph.ops:
                collective_rows(
                    bop,
                    body.graph,
                    btg,
                    bsets,
                    scale * body.trips,
                    where,
                    row_op,
                    inner_hoist,
                    inner_params,
                )

    body_op: list[int] = []
    body_set: list[int] = []
    body_coef: list[float] = []
    body_zero: list[bool] = []
    pinned, update = zero_region(graph, groups)
    pinned_set = set(pinned)

    def body_compute(op, g, tgs, scale: float, owner: int) -> None:
        """The compute of loop op's bodies, op by op, each on its own split (nested
        loops through theirs), `scale` times per step, as entries owned by `owner`. A
        top-level loop's body op that makes (a trip's slice of) a gradient ZeRO pins is
        marked, as the op that makes one outside a loop is (`Tables.zero_op`)."""
        for body, btg in zip(g.bodies[op.index], body_tensor_groups(op, g, tgs, ng), strict=True):
            if not body.priced:
                continue
            bg, times = body.graph, scale * body.trips
            fused = _fused_bytes(bg, (), None, lowering)
            zeroed = {b for o, b, _ in body.binds if o in pinned_set} if g is graph else set()
            for bop in bg.ops:
                if bop.primitive in LOOPS and bg.bodies.get(bop.index):
                    body_compute(bop, bg, btg, times, owner)
                    continue
                r = rule(bop, bg)
                outs = {x for o in bop.outputs for x in btg[o] if split[x]}
                red = {x for t, d in r.reduced if split[x := btg[t][d]]} - outs
                body_op.append(owner)
                body_set.append(sid(outs | red))
                body_coef.append(times * _compute_seconds(bop, r.compute, fused, rates))
                body_zero.append(bool(zeroed.intersection(bop.outputs)))

    rates = (flop_rate, byte_rate)
    for op in graph.ops:
        r = rule(op, graph)
        outs = {g for o in op.outputs for g in tg[o] if split[g]}
        red = {g for t, d in r.reduced if split[g := tg[t][d]]} - outs
        it = outs | red
        looped = op.primitive in LOOPS and graph.bodies.get(op.index)
        # A loop's own iteration set would tie every group it carries into one set (one
        # ILP scope of 3^dozens options): its bodies' ops carry its compute instead.
        op_set.append(empty if looped else sid(it))
        if looped and op.index in live_ops:
            body_compute(op, graph, tg, 1.0, op.index)
            coef = 0.0  # its bodies' ops carry it
        elif r.compute == "matmul":
            coef = op.flops / flop_rate
        elif r.compute == "loop":  # a body of matmuls or of memory traffic: the slower
            coef = max(op.flops / flop_rate, (op.bytes_read + op.bytes_written) / byte_rate)
        elif op.primitive in FUSIBLE:
            coef = fused_bytes[op.index] / byte_rate
        elif r.compute == "memory":
            coef = (op.bytes_read + op.bytes_written) / byte_rate
        else:
            coef = 0.0
        if op.index not in live_ops:
            op_coef.append(0.0)
            remat.append(0.0)
            continue
        op_coef.append(coef)
        # A recomputed op runs twice: as `op_coef` prices it (the recompute, which writes
        # what the backward reads) and in the first forward, matmuls included.
        first = first_bytes[op.index] / byte_rate if op.primitive in FUSIBLE else coef
        remat.append(first if op.index in recomputed else 0.0)
        collective_rows(op, graph, tg, tset, 1.0, (), op.index, {}, param_sets)

    n_sets = len(set_ids)
    width = max(1, *(len(k) for k in set_ids))
    sets = np.full((n_sets, width), ng, dtype=np.int64)
    for key, i in set_ids.items():
        sets[i, : len(key)] = key

    def by_set(tensors) -> np.ndarray:
        out = np.zeros(n_sets)
        for t in tensors:
            out[tset[t]] += graph.tensors[t].nbytes
        return out

    op_set_a = np.array(op_set, dtype=np.int64)
    op_coef_a = np.array(op_coef, dtype=float)
    body_op_a = np.array(body_op, dtype=np.int64)
    body_set_a = np.array(body_set, dtype=np.int64)
    body_coef_a = np.array(body_coef, dtype=float)
    body_again = np.isin(body_op_a, list(recomputed)) * body_coef_a
    consumers = graph.consumers()
    if lowering.reassociates_all_reduce:
        gone = summed_partials(graph, prow, partial_row, consumers)
        prow = [r for i, r in enumerate(prow) if i not in gone]
    partial_full = _rows(prow, ng, empty)
    reshard_full = _rows(list(rrow.values()), ng, empty)
    again_p = _rows([r for r in prow if r.op in recomputed], ng, empty)
    again_r = _rows(list(rrow_again.values()), ng, empty)
    param_coef = by_set(leaf.tensor for leaf in graph.leaves(Role.PARAM))
    gathered = gathered_bytes(graph, consumers, update, wide)
    gather_coef = np.zeros(n_sets)
    np.add.at(gather_coef, [tset[t] for t in gathered], list(gathered.values()))
    opt_coef = by_set(leaf.tensor for leaf in graph.leaves(Role.OPT_STATE))
    other_coef = by_set(
        leaf.tensor for leaf in graph.inputs if leaf.role in (Role.BATCH, Role.OTHER)
    )
    saved, saved_remat = kept_residuals(graph, res, lowering, consumers)
    act_coef, act_remat_coef = by_set(saved), by_set(saved_remat)
    tensor_set = np.array(tset, dtype=np.int64)
    nbytes = np.array([t.nbytes for t in graph.tensors], dtype=float)
    held = held_outputs(graph)
    moments = moments_remat = copies = None
    if lowering.frees_at_last_use:
        last = [max(consumers[t], default=-1) for t in range(len(graph.tensors))]
        grads = [(max(last[t] for t in graph.ops[r.op].outputs), r.nbytes) for r in prow if r.grad]

        def moments_of(remat: bool) -> tuple[Buffers, Moments]:
            buf = step_buffers(graph, res, consumers, remat, lowering)
            whole = gathered_parameters(graph, consumers, res.boundary, update, remat, gathered)
            made = None if remat else past_forward(buf, regathered, consumers, res.boundary)
            return buf, step_moments(
                buf, whole, nbytes, tensor_set, sets, ng, grads, len(graph.ops), made, held
            )

        moments = moments_of(False)[1]
        again, moments_remat = moments_of(True)
        recomputed_rows = [r for r in prow if r.op in recomputed and not r.grad]
        copies = combined_copies(recomputed_rows, again.blocks, moments_remat.at, ng, empty)
    body_zero_a = np.array(body_zero, dtype=bool)
    zero_op = np.zeros(len(graph.ops), dtype=bool)
    zero_op[[graph.tensors[t].producer for t in pinned]] = True
    zero_op[sorted(update)] = True
    return Tables(
        sets=sets,
        splittable=split,
        divisor=np.array([g.divisor for g in groups.groups] + [1], dtype=np.int64),
        op_set=op_set_a,
        op_coef=op_coef_a,
        body_op=body_op_a,
        body_set=body_set_a,
        body_coef=body_coef_a,
        body_remat_coef=body_again,
        compute_coef=np.bincount(op_set_a, op_coef_a, minlength=n_sets)
        + np.bincount(body_set_a, body_coef_a, minlength=n_sets),
        zero_op=zero_op,
        body_zero=body_zero_a,
        zero_coef=np.bincount(op_set_a, op_coef_a * zero_op, minlength=n_sets)
        + np.bincount(body_set_a, body_coef_a * body_zero_a, minlength=n_sets),
        remat_op_coef=np.array(remat, dtype=float),
        remat_coef=np.bincount(op_set_a, np.array(remat, dtype=float), minlength=n_sets)
        + np.bincount(body_set_a, body_again, minlength=n_sets),
        param_coef=param_coef,
        gathered=gathered,
        gather_coef=gather_coef,
        opt_coef=opt_coef,
        other_coef=other_coef,
        act_coef=act_coef,
        act_remat_coef=act_remat_coef,
        memory_coef=np.stack([param_coef, opt_coef, act_coef, act_remat_coef, other_coef]),
        output_coef=output_coef(held, nbytes, tensor_set, n_sets),
        early_output_coef=output_coef(held, nbytes, tensor_set, n_sets, sorted(update)),
        moments=moments,
        moments_remat=moments_remat,
        copies=copies,
        param_leaves=np.bincount(
            [tset[x.tensor] for x in graph.leaves(Role.PARAM) if graph.tensors[x.tensor].ndim],
            minlength=n_sets,
        ).astype(float),
        partial=partial_full.merged(),
        reshard=reshard_full.merged(),
        partial_full=partial_full,
        reshard_full=reshard_full,
        remat_partial=again_p,
        remat_reshard=again_r,
        combine_trips=np.array([t for _, t in sorted(slots.values())], dtype=float),
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
        body = body * _shares(T.body_zero, T.body_set, *zero)
    return own + np.bincount(T.body_op, body, minlength=len(own))


def zero_shares(T: Tables, P: np.ndarray, d: int, size: float) -> np.ndarray:
    """[n_ops] the share of its work each op runs on a device under ZeRO over the mesh
    axis of code `d` and size `size` (`P`: per set, its axes): 1 / size for an op ZeRO
    pins (`Tables.zero_op`) whose iteration space is not already split over that axis,
    else 1."""
    return _shares(T.zero_op, T.op_set, P, d, size)


def _shares(pinned: np.ndarray, sets: np.ndarray, P: np.ndarray, d: int, size: float):
    return np.where(pinned & ~P[sets, d], 1.0 / size, 1.0)


def _compute_seconds(op, compute: str, fused: np.ndarray, rates: tuple[float, float]) -> float:
    """Unsharded seconds of one body op, by the same rule as a top-level op's."""
    flop_rate, byte_rate = rates
    if compute == "matmul":
        return op.flops / flop_rate
    if compute == "loop":  # a loop kept without bodies: matmuls or memory, the slower
        return max(op.flops / flop_rate, (op.bytes_read + op.bytes_written) / byte_rate)
    if op.primitive in FUSIBLE:
        return fused[op.index] / byte_rate
    if compute == "memory":
        return (op.bytes_read + op.bytes_written) / byte_rate
    return 0.0


# Ops XLA fuses into loops over their operands (elementwise chains, layout changes,
# reductions as fusion roots): only tensors entering or leaving a fusion touch HBM.
FUSIBLE = (
    ELEMENTWISE
    | FREE
    | REDUCE_SUM_LIKE
    | {
        "transpose",
        "concatenate",
        "pad",
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "rev",
        "split",
        "argmax",
        "argmin",
    }
)


def _fused_bytes(
    graph: Graph, saved: Iterable[int], ops: set[int] | None, lowering: Lowering
) -> np.ndarray:
    """HBM bytes of each fusible op once XLA has fused it with its fusible neighbours.

    A tensor is written to memory when it must be: read by an op that cannot fuse, a step
    output, kept for the backward (`saved`), or a reduction's result. Each such write ends
    a kernel, whose root op is charged the kernel's traffic: what it writes, and the
    in-memory tensors its fused producers read (its cone, up to tensors in memory). A
    producer that two kernels need is fused into both, as XLA does, so what it reads is
    read twice (softmax's backward reads its incoming gradient before and after the
    row sum); ops inside a cone are charged nothing of their own.

    Two rules of XLA's fusion passes refine "must be written":
    - a broadcast (or iota, or elementwise work on those alone) is never written out, even
      when the backward reads it (a causal mask): every fusion that reads it regenerates it
      from its small operand (`_regenerated`; checked on XLA's CPU HLO in tests/test_fusion.py);
    - with `lowering.multi_output_fusion` (XLA's GPU pipeline: producer-consumer
      multi-output fusion, and the Triton normalization-diamond fusion on Ampere and
      later), a reduction of a tensor that its elementwise producer writes anyway (kept for
      backward, read by another kernel) runs in the producer's kernel: it does not read
      that tensor back (softmax's exp(x - max) is written once and summed in the same pass).

    Only `ops` run, all where None (XLA removes dead code; a first forward under
    rematerialization runs without the backward, whose reads the recompute serves)."""
    ops = set(range(len(graph.ops))) if ops is None else ops
    fusible = [op.primitive in FUSIBLE and op.index in ops for op in graph.ops]
    in_memory = in_memory_tensors(graph, saved, ops)
    nbytes = np.array([t.nbytes for t in graph.tensors], dtype=float)
    out = np.zeros(len(graph.ops))
    for op in graph.ops:
        written = [t for t in op.outputs if in_memory[t]]
        if not fusible[op.index] or not written:
            continue  # not a kernel's root: its work is charged to the roots it feeds
        read = _cone_reads(graph, op, in_memory, fusible)
        if lowering.multi_output_fusion and op.primitive in REDUCE_SUM_LIKE:
            read = {t for t in read if not (t in op.inputs and _written_alongside(graph, t))}
        out[op.index] = nbytes[written].sum() + nbytes[sorted(read)].sum()
    return out


def in_memory_tensors(
    graph: Graph, saved: Iterable[int], ops: set[int] | None = None
) -> np.ndarray:
    """Which tensors XLA writes to memory once it has fused the fusible ops (`_fused_bytes`
    gives the rules): per tensor, True where a kernel writes it (or it is a step input)."""
    ops = set(range(len(graph.ops))) if ops is None else ops
    fusible = [op.primitive in FUSIBLE and op.index in ops for op in graph.ops]
    regen = _regenerated(graph, fusible)
    in_memory = np.zeros(len(graph.tensors), dtype=bool)
    for t in graph.tensors:
        p = t.producer
        in_memory[t.id] = p is None or not fusible[p] or graph.ops[p].primitive in REDUCE_SUM_LIKE
    for op in graph.ops:
        if not fusible[op.index] and op.index in ops:
            in_memory[list(op.inputs)] = True
    in_memory[[leaf.tensor for leaf in graph.outputs]] = True
    in_memory[[t for t in saved if not regen[t]]] = True
    nbytes = np.array([t.nbytes for t in graph.tensors], dtype=float)
    return _materialize_shared(graph, in_memory, fusible, regen, nbytes)


def _materialize_shared(
    graph: Graph, in_memory: np.ndarray, fusible: list[bool], regen: np.ndarray, nbytes: np.ndarray
) -> np.ndarray:
    """Where a fused producer feeds k kernels, XLA either fuses it into all of them (each
    reads what it reads, L bytes) or writes its result (X bytes) once for all to read: it
    picks the cheaper, as its priority fusion weighs the two, so the result is written when
    (k - 1) L > (k + 1) X (a residual stream read by a layer norm's kernels and the next
    residual add is written; a convert feeding a softmax gradient's two kernels is not).
    Iterated to a fixed point: each write makes new kernel roots upstream."""
    in_memory = in_memory.copy()
    for _ in range(4):
        kernels = _kernels_reading(graph, in_memory, fusible)
        changed = False
        for op in graph.ops:
            if not fusible[op.index]:
                continue
            pending = [t for t in op.outputs if not in_memory[t] and not regen[t]]
            k = max((len(kernels[t]) for t in pending), default=0)
            if k < 2:
                continue
            reads = nbytes[sorted(_cone_reads(graph, op, in_memory, fusible))].sum()
            for t in pending:
                k = len(kernels[t])
                if (k - 1) * reads > (k + 1) * nbytes[t]:
                    in_memory[t] = changed = True
        if not changed:
            break
    return in_memory


def _kernels_reading(graph: Graph, in_memory: np.ndarray, fusible: list[bool]) -> list:
    """Per tensor not in memory, the kernel roots (ops writing a tensor to memory) whose
    fused cone computes it."""
    roots: list = [frozenset()] * len(graph.tensors)
    for op in reversed(graph.ops):
        if not fusible[op.index]:
            continue
        mine = {op.index} if any(in_memory[t] for t in op.outputs) else set()
        for o in op.outputs:
            if not in_memory[o]:
                mine |= roots[o]
        for t in op.inputs:
            if not in_memory[t]:
                roots[t] = roots[t] | mine
    return roots


def _cone_reads(graph: Graph, root, in_memory: np.ndarray, fusible: list[bool]) -> set[int]:
    """The in-memory tensors a kernel rooted at `root` reads: walking its operands back
    through fused producers (tensors not in memory) to tensors that are."""

    def through(t: int) -> Iterable[int] | None:
        p = graph.tensors[t].producer
        return None if in_memory[t] or p is None or not fusible[p] else graph.ops[p].inputs

    return _walk_back(root.inputs, through)


def _walk_back(start: Iterable[int], through) -> set[int]:
    """The tensors where a walk back from `start` stops: `through(t)` gives the tensors to
    walk on to in t's place (its producer's operands; empty: drop t), or None to stop at
    t and keep it."""
    out, seen, todo = set(), set(), list(start)
    while todo:
        t = todo.pop()
        if t in seen:
            continue
        seen.add(t)
        further = through(t)
        if further is None:
            out.add(t)
        else:
            todo.extend(further)
    return out


# Ops whose result XLA recomputes inside every fusion that reads it, from operands no
# larger than the result's own regenerated inputs.
_GENERATORS = frozenset({"broadcast_in_dim", "iota"})


def _regenerated(graph: Graph, fusible: list[bool]) -> np.ndarray:
    """Tensors made by broadcasts/iotas and elementwise ops on those (and on scalars) alone:
    XLA fuses them into each consumer rather than materializing them."""
    regen = np.zeros(len(graph.tensors), dtype=bool)
    for op in graph.ops:
        if not fusible[op.index]:
            continue
        if op.primitive in _GENERATORS:
            ok = True
        elif op.primitive in ELEMENTWISE:
            ok = all(regen[t] or graph.tensors[t].ndim == 0 for t in op.inputs)
        else:
            ok = False
        if ok:
            regen[list(op.outputs)] = True
    return regen


def _written_alongside(graph: Graph, t: int) -> bool:
    """Whether a reduction of t can run inside the kernel that writes t: t comes from an
    elementwise op (a loop fusion, the root of a multi-output fusion with the reduction)."""
    p = graph.tensors[t].producer
    return p is not None and graph.ops[p].primitive in ELEMENTWISE


def _rows(rows: list[CandidateRow], pad_group: int, empty_set: int) -> RowTable:
    """Rows as arrays; the group and small lists padded to one width (pad: never split)."""
    kr = max([1] + [len(r.group) for r in rows])
    group = np.full((len(rows), kr), pad_group, dtype=np.int64)
    small = np.full((len(rows), kr), empty_set, dtype=np.int64)
    for i, r in enumerate(rows):
        group[i, : len(r.group)] = r.group
        small[i, : len(r.small)] = r.small

    def column(field: str, dtype: type) -> np.ndarray:
        return np.array([getattr(r, field) for r in rows], dtype=dtype)

    return RowTable(
        group=group,
        small=small,
        tset=column("tset", np.int64),
        tsmall=column("tsmall", np.int64),
        other=column("other", np.int64),
        untied=column("untied", bool),
        nbytes=column("nbytes", float),
        count=column("count", float),
        grad=column("grad", bool),
        op=column("op", np.int64),
        peer=column("peer", np.int64),
        combine=column("combine", np.int64),
    )


# Elementwise ops XLA's fusion pass will not duplicate into a second consumer
# (`InstructionFusion::IsExpensive`: transcendental functions and float division): their
# result is written once and read back by every kernel that needs it.
EXPENSIVE = frozenset(
    """acos acosh asin asinh atan atan2 atanh cbrt cos cosh digamma div erf erf_inv erfc exp
    exp2 expm1 igamma lgamma log log1p logistic pow rem rsqrt sin sinh sqrt tan tanh""".split()  # noqa: SIM905
)


def gathered_bytes(graph: Graph, consumers, update: Collection[int], wide: int) -> dict[int, float]:
    """Per parameter leaf, the bytes ZeRO-3's gather of it moves (whole). XLA gathers a
    sharded parameter where an op needs it whole, after the elementwise ops that keep its
    sharding: where every reader outside the `update` casts it to a narrower float (a
    mixed-precision step's weights), it gathers the cast. Read in the programs compiled
    for A100s: a bf16 gather, half the float32 parameter's bytes (XLA's CPU widens a
    16-bit collective to `wide` bytes an element: `Lowering.collective_float_bytes`)."""
    out = {}
    for leaf in graph.leaves(Role.PARAM):
        x = graph.tensors[leaf.tensor]
        readers = [graph.ops[c] for c in consumers[leaf.tensor] if c not in update]
        casts = [
            graph.tensors[op.outputs[0]]
            for op in readers
            if op.primitive == "convert_element_type"
            and graph.tensors[op.outputs[0]].dtype.startswith(("float", "bfloat"))
        ]
        narrow = readers and len(casts) == len(readers)
        per_element = (
            min(x.itemsize, max(max(c.itemsize for c in casts), wide)) if narrow else x.itemsize
        )
        out[leaf.tensor] = float(x.size * per_element)
    return out


def summed_partials(
    graph: Graph, rows: list[CandidateRow], partial_row: dict[int, int], consumers
) -> set[int]:
    """The partial-sum rows XLA's all-reduce reassociation removes: where two partial sums
    that would be all-reduced alike (the same row but for its op) are added and read by
    nothing else, XLA adds them first and all-reduces the sum once (the input gradient of
    separate Q, K and V projections: three partial sums, one all-reduce, as Megatron-LM's
    fused QKV). Following the adds, a sum of k partials keeps one row; the others go.
    `consumers`: `graph.consumers()`."""

    def alike(r: CandidateRow) -> tuple:
        return r._replace(op=0)

    root = dict(partial_row)  # tensor -> the row that reduces it (or the sum it feeds)
    # A partial sum read only through transposes that undo each other reaches its add as
    # itself: XLA's simplifier folds transpose(transpose(x)) before it reassociates (a tied
    # embedding's output-projection gradient, transposed there and back, then added to its
    # lookup's scatter-add: one all-reduce on an A100 compile, two on the CPU's).
    moved: dict[int, tuple[int, tuple[int, ...]]] = {}  # tensor -> (its row, permutation)
    gone: set[int] = set()
    for op in graph.ops:
        if op.primitive == "transpose":
            source = op.inputs[0]
            if len(consumers[source]) != 1 or (source not in root and source not in moved):
                continue
            permutation = tuple(int(p) for p in op.params["permutation"])
            row, before = moved.get(source) or (root[source], tuple(range(len(permutation))))
            composed = tuple(before[p] for p in permutation)
            if composed == tuple(range(len(composed))):
                root[op.outputs[0]] = row
            else:
                moved[op.outputs[0]] = (row, composed)
            continue
        if op.primitive not in ("add", "add_any") or len(op.inputs) != 2:
            continue
        a, b = op.inputs
        if a == b or a not in root or b not in root:
            continue
        if alike(rows[root[a]]) != alike(rows[root[b]]):
            continue
        if len(consumers[a]) != 1 or len(consumers[b]) != 1:
            continue
        gone.add(root[b])
        root[op.outputs[0]] = root[a]
    return gone


def kept_residuals(
    graph: Graph, res: Residuals, lowering: Lowering, consumers
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What one program keeps for its backward, without and with rematerialization.

    With `lowering.remakes_residuals` (XLA's GPU pipeline) the residuals XLA
    stores (`stored_residuals`) of the jaxpr's: of every residual without remat; with it,
    of those no layer recomputes and the layer inputs, and of the largest layer's (made
    again by its recompute, alive in its backward). Without, the jaxpr's sets."""
    if not lowering.remakes_residuals:
        return res.saved, res.saved_remat
    layered = {t for ts in res.layer_saved for t in ts}
    once = [t for t in res.saved_remat if t not in layered]
    again = [t for t in res.saved_remat if t in layered]
    remat = set(stored_residuals(graph, once, lowering, consumers))
    remat |= set(stored_residuals(graph, again, lowering, consumers))
    return stored_residuals(graph, res.saved, lowering, consumers), tuple(sorted(remat))


def step_buffers(
    graph: Graph, res: Residuals, consumers, remat: bool, lowering: Lowering
) -> Buffers:
    """The buffers of a one-stage step as XLA's GPU pipeline keeps them (`_liveness.py`):
    what it writes to memory, each from its maker to its last reader; with
    `lowering.remakes_residuals` a stored residual until the last reader of those it
    stands in for (`stored_residuals`), else the jaxpr's residuals. Under `remat`
    a layer's residuals live twice: in the first forward until its last forward reader,
    and again from the backward's first read of any of them (JAX emits a layer's
    recompute as one block before its backward; each layer's first and last forward op and
    that moment are its `blocks`). With the copies of a convolutional net
    (`convolution_copies`)."""
    last = np.array([max(c) if c else -1 for c in consumers], dtype=np.int64)
    birth = np.array([-1 if t.producer is None else t.producer for t in graph.tensors])
    # the backward's first read of each tensor or of one it stands in for
    first = np.array([min((x for x in c if x > res.boundary), default=-1) for c in consumers])

    remade = lowering.remakes_residuals
    stored = stand_in_map(graph, consumers, lowering) if remade else lambda r: (r,)

    def stand_ins(saved: Iterable[int]) -> set[int]:
        out: set[int] = set()
        for r in saved:
            for t in stored(r):
                out.add(t)
                last[t] = max(last[t], last[r])
                if first[r] >= 0:
                    first[t] = first[r] if first[t] < 0 else min(first[t], first[r])
        return out

    layered = {t for ts in res.layer_saved for t in ts} if remat else set()
    kept = stand_ins(t for t in (res.saved_remat if remat else res.saved) if t not in layered)
    recomputed: list[int] = []
    blocks = []
    for ts in res.layer_saved if remat else ():
        again = sorted(stand_ins(ts) - kept)
        reads = first[again][first[again] >= 0]
        if len(reads):
            birth[again] = reads.min()
            made = [graph.tensors[t].producer for t in ts]
            blocks.append((min(made), max(made), reads.min()))
        recomputed += again
    in_memory = in_memory_tensors(graph, sorted(kept.union(recomputed)))
    outputs = {leaf.tensor for leaf in graph.outputs}
    ids = [
        t.id
        for t in graph.tensors
        if t.producer is not None
        and in_memory[t.id]
        and t.id not in outputs
        and t.nbytes
        and last[t.id] >= 0
    ]
    rows = [(t, birth[t], max(last[t], birth[t])) for t in ids]
    if recomputed:
        # the first forward makes them too, each dead after its last forward reader
        written = in_memory_tensors(graph, sorted(kept))
        for t in recomputed:
            reads = [c for c in consumers[t] if c <= res.boundary]
            if reads and written[t]:
                rows.append((t, graph.tensors[t].producer, max(reads)))
    rows += convolution_copies(graph, consumers)
    tensor, born, dies = np.array(rows, dtype=np.int64).reshape(-1, 3).T
    width = np.array([_held_wide(graph, consumers, t) for t in tensor], dtype=float)
    block = np.array(blocks, dtype=np.int64).reshape(-1, 3)
    return Buffers(tensor=tensor, birth=born, death=dies, width=width, blocks=block)


@dataclasses.dataclass(frozen=True)
class CombinedCopies:
    """The partial sums a recomputed layer all-reduces, each at its layer's recompute
    moment (`combined_copies`)."""

    rows: RowTable  # partial-sum rows of recomputed ops (not gradients), one per op
    moment: np.ndarray  # [rows] index into `Moments.at` of the row's layer's recompute


def combined_copies(
    rows: list[CandidateRow], blocks: np.ndarray, at: np.ndarray, pad_group: int, empty_set: int
) -> CombinedCopies | None:
    """A recomputed layer's activation all-reduces (a row-parallel matmul's partial sums)
    depend on the layer's input alone, not on the backward's, and XLA's all-reduce combiner
    joins them with the backward's own: a combined all-reduce first copies its operands into
    one buffer (its result then reuses that buffer, as a lone all-reduce reuses its
    operand's). So at the layer's recompute the step holds its partial sums twice (read in
    the buffer assignment on compile-only A100s: transformer plans under remat with split
    matmuls peaked at that copy, 0.78-0.84x priced without it). `blocks`: per layer, first
    and last forward op and its recompute moment (`Buffers.blocks`), one of `at`."""
    keep, moment = [], []
    for r in rows:
        hit = np.flatnonzero((blocks[:, 0] <= r.op) & (r.op <= blocks[:, 1]))
        if len(hit):
            keep.append(r)
            moment.append(int(np.searchsorted(at, blocks[hit[0], 2])))
    if not keep:
        return None
    return CombinedCopies(
        rows=_rows(keep, pad_group, empty_set), moment=np.array(moment, dtype=np.int64)
    )


def convolution_copies(graph: Graph, consumers) -> list[tuple[int, int, int]]:
    """(tensor, birth, death) of two copies XLA's GPU pipeline makes in a convolutional
    net (read on compile-only A100s, VGG): each step input a convolution reads (a kernel,
    the images) copied once to the layout cuDNN takes and kept for every convolution
    reading it, the backward's too; and the pooled tensor of a max pool, whose backward
    scatters in place into a copy that XLA's copy insertion makes where the tensor is."""
    rows = []
    for leaf in graph.inputs:
        conv = [c for c in consumers[leaf.tensor] if graph.ops[c].primitive == CONV]
        if conv and graph.tensors[leaf.tensor].ndim == 4:
            rows.append((leaf.tensor, min(conv), max(conv)))
    for op in graph.ops:
        pooled = graph.tensors[op.inputs[1]] if op.primitive == "select_and_scatter_add" else None
        if pooled is not None and pooled.producer is not None:
            rows.append((pooled.id, pooled.producer, op.index))
    return rows


CONV = "conv_general_dilated"


def stand_in_map(graph: Graph, consumers, lowering: Lowering):
    """`stored_residuals` of one residual at a time, memoized: r -> the tensors XLA stores
    in its place (r itself, or the operands it is made again from; and its wider source's
    where a reader converts it back, `_widened_source`)."""
    memo: dict[int, frozenset[int]] = {}

    def stored(r: int) -> frozenset[int]:
        todo = [r]
        while todo:
            t = todo[-1]
            if t in memo:
                todo.pop()
                continue
            further = _remade_from(graph, consumers, t, lowering)
            if further is None:
                memo[t] = frozenset((t,))
            elif all(i in memo for i in further):
                memo[t] = frozenset().union(*(memo[i] for i in further))
            else:
                todo.extend(i for i in further if i not in memo)
                continue
            todo.pop()
        return memo[r]

    def stored_or_widened(r: int) -> frozenset[int]:
        u = _widened_source(graph, consumers, r)
        return stored(r) if u is None else stored(r) | stored(u)

    return stored_or_widened


_CHEAP = ELEMENTWISE | FREE


def _remade_from(graph: Graph, consumers, t: int, lowering: Lowering) -> list[int] | None:
    """The operands XLA makes residual t again from (`stored_residuals`), or None: stored."""
    p = graph.tensors[t].producer
    if p is None:
        return []  # a step input: stored as such, not an activation
    op = graph.ops[p]
    remade = (
        op.primitive in _CHEAP
        and (
            op.primitive not in EXPENSIVE or (lowering.remakes_residuals and _normalizes(graph, t))
        )
        and all(graph.ops[c].primitive in FUSIBLE for c in consumers[t])
    )
    return [i for i in op.inputs if graph.tensors[i].ndim] if remade else None


def _normalizes(graph: Graph, t: int, depth: int = 8) -> bool:
    """Whether t is part of a row normalization (a softmax's exp or division): made by
    elementwise and layout ops from a reduction over a tensor's last axis, within `depth`
    ops. XLA's GPU pipeline fuses such a chain, its reductions included, into one Triton
    kernel that it also fuses into each reader, so an expensive op there is made again from
    the chain's input like a cheap one (read on compile-only A100s: the backward of a
    softmax reads the scores, not the probabilities it made in the forward)."""
    todo, seen = [(t, 0)], set()
    while todo:
        x, d = todo.pop()
        p = graph.tensors[x].producer
        if p is None or x in seen or d > depth:
            continue
        seen.add(x)
        op = graph.ops[p]
        if op.primitive in REDUCE_SUM_LIKE:
            operand = graph.tensors[op.inputs[0]]
            if tuple(op.params.get("axes", ())) == (operand.ndim - 1,):
                return True
        elif op.primitive in _CHEAP:
            todo.extend((i, d + 1) for i in op.inputs if graph.tensors[i].ndim)
    return False


def _widened_source(graph: Graph, consumers, t: int) -> int | None:
    """u, where t narrows float u (a convert to 16 bits) and a reader of t converts it back
    to u's type: XLA, allowed excess precision (its default), drops the round trip, so that
    reader reads u itself (a mixed-precision softmax's backward reads its float32 result,
    not the 16-bit probabilities, read on compile-only A100s). Else None."""
    p = graph.tensors[t].producer
    if p is None or graph.ops[p].primitive != "convert_element_type":
        return None
    u = graph.ops[p].inputs[0]
    wide, narrow = graph.tensors[u], graph.tensors[t]
    if not (_is_float(wide.dtype) and _is_float(narrow.dtype)) or narrow.itemsize >= wide.itemsize:
        return None
    back = any(
        graph.ops[c].primitive == "convert_element_type"
        and graph.tensors[graph.ops[c].outputs[0]].dtype == wide.dtype
        for c in consumers[t]
    )
    return u if back else None


def _is_float(dtype: str) -> bool:
    return dtype.startswith("float") or dtype == "bfloat16"


def _held_wide(graph: Graph, consumers, t: int) -> float:
    """How many times its own bytes a buffer of t takes: XLA's GPU pipeline computes a
    transcendental function (`EXPENSIVE`) of 16-bit floats in float32, and where only
    fusible ops read the result, it keeps that float32 value for them (excess precision:
    GELU's tanh is stored for the backward in float32, read on compile-only A100s)."""
    x = graph.tensors[t]
    p = x.producer
    if (
        p is None
        or graph.ops[p].primitive not in EXPENSIVE
        or x.dtype not in ("bfloat16", "float16")
        or not all(graph.ops[c].primitive in FUSIBLE for c in consumers[t])
    ):
        return 1.0
    return 4.0 / x.itemsize


def stored_residuals(
    graph: Graph, saved: Iterable[int], lowering: Lowering, consumers=None
) -> tuple[int, ...]:
    """Of the tensors the backward reads from the forward (`saved`), those XLA stores.

    A residual made by a cheap elementwise or layout op (not `EXPENSIVE`) that only fusible
    ops read is never written: XLA fuses its producer into each of its readers, the
    forward's and the backward's, and makes it again there from the producer's operands,
    which are stored in its place (recursively: GELU's polynomial chain is made again from
    the matmul output and the tanh). Residuals an unfusible op reads (a matmul's operand),
    expensive results and reductions stay stored. With `lowering.remakes_residuals` (XLA's
    GPU pipeline), a row normalization's expensive results are made again too
    (`_normalizes`), and a residual converted back to the type it was narrowed from is read
    as its wider source (`_widened_source`), which is stored or made again in turn."""
    consumers = graph.consumers() if consumers is None else consumers
    start = list(saved)
    if lowering.remakes_residuals:
        start += [u for t in start if (u := _widened_source(graph, consumers, t)) is not None]
    return tuple(sorted(_walk_back(start, lambda t: _remade_from(graph, consumers, t, lowering))))
