"""The cost model's precomputed tables (see `_model.py` for what they mean).

Built once per graph and cluster, indexed by sets (`_sets.py`): every per-plan quantity is
a function of which mesh axes a set holds. This module holds the tables and puts them
together from their parts, each in its own module: the compute terms (`_compute.py`, on
XLA's fusion, `_fusion.py`), the candidate collectives (`_rows.py`), the bytes kept for
the backward (`_residuals.py`), the buffers a step peaks with (`_buffers.py`,
`_liveness.py`) and the ZeRO terms (`_zero.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

import numpy as np

from .._capture import Residuals, loss_boundary
from .._cluster import Cluster
from .._graph import Graph, Role
from .._groups import Groups, distinct_casts, narrow_params, zero_region
from .._lowering import Lowering
from .._remat import FlashCore, LayerGathers, layer_gathers
from ._buffers import CombinedCopies, SplitOperands, combined_copies, split_operands, step_buffers
from ._compute import ComputeEntries, Rates, add_op_compute, compute_columns, compute_inputs
from ._epilogue import Epilogues, epilogues
from ._flash import kernel_buffers, kernel_cores
from ._fsdp import layer_gathered_parameters
from ._liveness import Moments, gathered_parameters, past_forward, step_moments
from ._outputs import held_outputs, output_coef
from ._residuals import kept_residuals
from ._rows import (
    At,
    CandidateRow,
    RowBuilder,
    RowTable,
    candidate_rows,
    iota_lookups,
    lookup_tables,
    narrow_partials,
    row_table,
    summed_partials,
)
from ._sets import SetIndex
from ._zero import MasterCoefs, gathered_bytes, matmul_gathered_bytes, zero_ops


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
    # Of those a matmul reads narrower than a gather moves them (a tied table's head),
    # the bytes of a gather only such matmuls read (`_zero.matmul_gathered_bytes`).
    gathered_narrow: Mapping[int, float]
    gather_coef: np.ndarray  # [n_sets]
    # The masters ZeRO-1/2 keeps on shards where it gathers compute-dtype copies
    # (`_groups.narrow_params`): their bytes, what their casts' gathers move (`gathered`,
    # once per dtype cast to: the runtime gathers one copy of each,
    # `_groups.distinct_casts`), their leaves; by set for a data axis' size (`at`).
    # Empty for a step computing in its parameters' dtype.
    master_coef: MasterCoefs
    masters: Mapping[int, int]  # those parameters (tensor id): how many copies each gathers
    opt_coef: np.ndarray  # [n_sets] bytes of optimizer-state leaves
    other_coef: np.ndarray  # [n_sets] bytes of other inputs (batch, ...)
    act_coef: np.ndarray  # [n_sets] bytes of activations kept for backward
    act_remat_coef: np.ndarray  # same under rematerialization
    memory_coef: np.ndarray  # [5, n_sets] param, opt, act, act_remat, other coefs stacked
    # [4, n_sets] the outputs held apart from the arguments (a step that donates nothing):
    # new parameters, new optimizer state, the rest, new masters (`_outputs.held_outputs`).
    output_coef: np.ndarray
    # [4, n_sets] of those, the ones no update op makes (a loss): alive at the reduction
    early_output_coef: np.ndarray
    # The step's candidate peak moments, without and with rematerialization, where the
    # backend frees each buffer at its last reader (`Lowering.frees_at_last_use`), else None.
    moments: Moments | None
    moments_remat: Moments | None
    # The recomputed layers' activation all-reduces, copied once more at their recompute
    # (`combined_copies`); None where nothing is recomputed, the buffers aren't scheduled
    # or the backend reduces combined operands in place (`Lowering.concatenates_combined`).
    copies: CombinedCopies | None
    # The operands a weight-gradient dot split beside ZeRO's data axis holds from the
    # forward, at the step's moments without remat (`split_operands`); None where none.
    split_operands: SplitOperands | None
    # The matmul outputs XLA's TPU may leave unwritten, at the step's moments without and
    # with remat (`_epilogue.py`); each None where none may be, the pair where the buffers
    # aren't scheduled.
    epilogues: tuple[Epilogues | None, Epilogues | None] | None
    param_leaves: np.ndarray  # [n_sets] parameter leaves (rank >= 1) of each set
    partial: RowTable  # merged, for evaluate
    reshard: RowTable
    partial_full: RowTable  # one row per op, for the per-op breakdown
    # The same for pipeline stages, which are compiled apart: the partial sums a tied
    # parameter's readers make on the first and the last layers (reached through
    # transposes, `summed_partials`) lie on two stages, each reducing its own.
    staged_partial_full: RowTable
    reshard_full: RowTable
    # The collectives of the recomputed ops, which run again in the backward (one row per
    # op, like the full tables).
    remat_partial: RowTable
    remat_reshard: RowTable
    # [slots] occurrences per step of each combined collective slot: 1 for slot 0 (the
    # step's gradients), a loop body's trips for its own slot (`RowTable.combine`).
    combine_trips: np.ndarray
    # A tied parameter's gradient partial sums that reassociation adds into another's
    # through transposes (`summed_partials`): under ZeRO-3 a GPU reduce-scatters each
    # (the word table's lookup and output-projection parts: 2 of one table's bytes).
    tied_partial: RowTable
    # where ZeRO-3 gathers layer by layer (`_remat.layer_gathers`), None without a loss:
    # per program, for pipeline stages (`_fsdp.program_gathers`)
    layers: LayerGathers | None = None
    # gather -> its iota op, where XLA partitions the lookup as parallel (`iota_lookups`)
    iota_lookups: Mapping[int, int] = dataclasses.field(default_factory=dict)
    # the attention cores the flash kernel runs, where the backend runs it, as the
    # moments' flash walk took them (`_flash.kernel_cores`; none elsewhere)
    flash_cores: tuple[FlashCore, ...] = ()
    # ZeRO-3's gather for a recompute moves `gathered` as the forward's does, not the
    # parameter (`Lowering.recompute_gathers_casts`: XLA's TPU; its GPU gathers the latter)
    casts_again: bool = False


@dataclasses.dataclass(frozen=True)
class TableInputs:
    """What the tables of one step are built from, besides the ops' own terms."""

    graph: Graph
    res: Residuals
    lowering: Lowering
    consumers: list  # `graph.consumers()`
    tset: list[int]  # each tensor's set
    ng: int  # number of groups (the pad group's id)
    update: Collection[int]  # the update ops ZeRO pins (`_groups.zero_region`)
    # the forward's values ZeRO-3's backward makes again (`_groups.Regather.tensors`)
    regathered: Collection[int]
    # where ZeRO-3 gathers layer by layer (`_remat.layer_gathers`), None without a loss
    layers: LayerGathers | None = None
    # the attention cores the flash kernel runs, where the backend runs it
    # (`_flash.kernel_cores`; none elsewhere)
    kernel: tuple[FlashCore, ...] = ()


def combine_update_sums(rows: RowBuilder, update: Collection[int]) -> None:
    """Give the update's own partial sums a combine slot of their own, once per step.

    A global norm's sums of squares over parameters split on an axis are partial sums
    that depend on no other collective: XLA's all-reduce combiner joins them into one
    all-reduce per axis, as it joins the gradients' (a 2-layer GPT at tp 8 compiled for
    8 A100s: one f32[21] for its 21 split parameters). Priced one by one, each would pay
    the collective's latency: 481 of them, 14 ms, on a 22B GPT at tp 8. They are not
    gradients: no gradient buffer holds them (`_peaks.reduced_gradients` reads slot 0)."""
    slot = None
    for i, r in enumerate(rows.partial):
        if r.grad or r.combine or r.op not in update:
            continue
        if slot is None:
            slot = rows.slots.setdefault(("update",), (len(rows.slots), 1.0))[0]
        rows.partial[i] = r._replace(combine=slot)


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
    sets = SetIndex(np.array([g.splittable for g in groups.groups] + [False]))
    tset = [sets.of(g) for g in groups.tensor_groups]
    lowering = cluster.lowering
    rates = Rates(
        flop=cluster.peak_flops * cluster.matmul_efficiency,
        byte=cluster.hbm_bandwidth * cluster.memory_efficiency,
        tile=cluster.matmul_tile,
    )
    pinned, update = zero_region(graph, groups)
    compute = compute_inputs(graph, groups, res, rates, lowering, sets, pinned)
    lookups = iota_lookups(graph) if lowering.parallel_iota_lookups else {}
    rows = RowBuilder(
        sets=sets,
        ng=ng,
        wide=lowering.collective_float_bytes,
        recomputed=compute.recomputed,
        after={(s.op, s.before): s.after for s in groups.seams},
        empty=sets.of(()),
        microbatch={op: frozenset(groups.batch_groups) for op in groups.microbatch_splits},
        iota_lookups=frozenset(lookups),
        lookups=lookup_tables(graph, skip=lookups),
        narrow=narrow_partials(graph, graph.consumers(), lowering.matmul_operand_bytes),
    )
    entries = ComputeEntries()
    params = {tset[leaf.tensor] for leaf in graph.leaves(Role.PARAM)}
    for op in graph.ops:
        if add_op_compute(entries, compute, op):
            at = At(scale=1.0, scope=(), row_op=op.index, hoist={}, params=params)
            candidate_rows(rows, op, graph, groups.tensor_groups, tset, at)
    combine_update_sums(rows, update)
    layers = layer_gathers(graph, groups) if loss_boundary(graph) is not None else None
    kernel = kernel_cores(graph, groups) if lowering.flash_attention else ()
    inp = TableInputs(
        graph, res, lowering, graph.consumers(), tset, ng, update, regathered, layers, kernel
    )
    partial = staged = rows.partial
    gone = apart = set()
    if lowering.reassociates_all_reduce:
        gone = summed_partials(graph, partial, rows.partial_row, inp.consumers)
        apart = summed_partials(graph, partial, rows.partial_row, inp.consumers, False)
        partial = [r for i, r in enumerate(rows.partial) if i not in gone]
        staged = [r for i, r in enumerate(rows.partial) if i not in apart]
    n_sets = len(sets.ids)
    gathered = gathered_bytes(graph, inp.consumers, update, lowering)
    gathered_narrow = matmul_gathered_bytes(graph, gathered, lowering)
    gather_coef = np.zeros(n_sets)
    np.add.at(gather_coef, [tset[t] for t in gathered], list(gathered.values()))
    narrow = narrow_params(graph, update)
    # one gather per dtype cast to: a tied table's two bf16 casts share one (`_mixed.py`)
    masters = {t: len(distinct_casts(graph, c)) for t, c in narrow.items()}
    master_coef = MasterCoefs(
        np.array([(graph.tensors[t].nbytes, gathered[t] * n, 1) for t, n in masters.items()])
        .reshape(-1, 3)
        .T,
        np.array([tset[t] for t in masters], dtype=np.int64),
        tuple(graph.tensors[t].shape for t in masters),
        n_sets,
    )
    table = sets.table(ng)
    computed = compute_columns(entries, compute.recomputed, zero_ops(graph, pinned, update), n_sets)
    op_s = computed["op_coef"]  # on the partial-sum rows (`RowTable.op_s`)
    return Tables(
        sets=table,
        splittable=sets.split,
        divisor=np.array([g.divisor for g in groups.groups] + [1], dtype=np.int64),
        **computed,
        **_memory_columns(inp, n_sets),
        gathered=gathered,
        gathered_narrow=gathered_narrow,
        gather_coef=gather_coef,
        master_coef=master_coef,
        masters=masters,
        casts_again=lowering.recompute_gathers_casts,
        **_moment_columns(
            inp, partial, gathered, gathered_narrow, table, rows.empty, compute.recomputed
        ),
        **_row_columns(partial, rows, compute.recomputed, op_s),
        staged_partial_full=row_table(staged, ng, rows.empty, op_s),
        tied_partial=row_table(
            [r for i, r in enumerate(rows.partial) if i in gone - apart and r.grad], ng, rows.empty
        ),
        layers=layers,
        iota_lookups=lookups,
        flash_cores=kernel,
    )


def _by_set(inp: TableInputs, tensors, n_sets: int) -> np.ndarray:
    """[n_sets] the bytes of `tensors`, summed by set."""
    out = np.zeros(n_sets)
    for t in tensors:
        out[inp.tset[t]] += inp.graph.tensors[t].nbytes
    return out


def _memory_columns(inp: TableInputs, n_sets: int) -> dict[str, np.ndarray]:
    """The `Tables` fields of the bytes a plan holds whole, by set: parameters, optimizer
    state, other inputs and the residuals kept for the backward (`kept_residuals`)."""
    graph = inp.graph
    param_coef = _by_set(inp, (leaf.tensor for leaf in graph.leaves(Role.PARAM)), n_sets)
    opt_coef = _by_set(inp, (leaf.tensor for leaf in graph.leaves(Role.OPT_STATE)), n_sets)
    other = (leaf.tensor for leaf in graph.inputs if leaf.role in (Role.BATCH, Role.OTHER))
    other_coef = _by_set(inp, other, n_sets)
    saved, saved_remat = kept_residuals(graph, inp.res, inp.lowering, inp.consumers)
    act_coef, act_remat_coef = _by_set(inp, saved, n_sets), _by_set(inp, saved_remat, n_sets)
    held = held_outputs(graph, narrow_params(graph, inp.update))
    tensor_set = np.array(inp.tset, dtype=np.int64)
    nbytes = np.array([t.nbytes for t in graph.tensors], dtype=float)
    return dict(
        param_coef=param_coef,
        opt_coef=opt_coef,
        other_coef=other_coef,
        act_coef=act_coef,
        act_remat_coef=act_remat_coef,
        memory_coef=np.stack([param_coef, opt_coef, act_coef, act_remat_coef, other_coef]),
        output_coef=output_coef(held, nbytes, tensor_set, n_sets),
        early_output_coef=output_coef(held, nbytes, tensor_set, n_sets, sorted(inp.update)),
        param_leaves=np.bincount(
            [inp.tset[x.tensor] for x in graph.leaves(Role.PARAM) if graph.tensors[x.tensor].ndim],
            minlength=n_sets,
        ).astype(float),
    )


def _moment_columns(
    inp: TableInputs,
    partial: list[CandidateRow],
    gathered: Mapping[int, float],
    narrow: Mapping[int, float],
    sets: np.ndarray,
    empty: int,
    recomputed: Collection[int],
) -> dict:
    """The `Tables` fields of the step's peak moments (`moments`, `moments_remat`,
    `copies`, `split_operands`), where the backend frees each buffer at its last reader,
    else None."""
    if not inp.lowering.frees_at_last_use:
        return dict(
            moments=None, moments_remat=None, copies=None, split_operands=None, epilogues=None
        )
    graph, consumers = inp.graph, inp.consumers
    last = [max(consumers[t], default=-1) for t in range(len(graph.tensors))]
    grads = [(max(last[t] for t in graph.ops[r.op].outputs), r.nbytes) for r in partial if r.grad]
    if inp.layers is not None and inp.layers.reductions:
        # ZeRO-3 reduces each backward layer's gradients before the next (`_remat/_fsdp.py`)
        n_ops = len(graph.ops)
        due = [inp.layers.reduced_at(r.op) for r in partial if r.grad]
        grads = [(*g, n_ops if d is None else d) for g, d in zip(grads, due, strict=True)]
    step = dict(
        gathered=gathered,
        narrow=narrow,
        grads=grads,
        tensor_set=np.array(inp.tset, dtype=np.int64),
        nbytes=np.array([t.nbytes for t in graph.tensors], dtype=float),
        sets=sets,
        held=held_outputs(graph, narrow_params(graph, inp.update)),
    )
    once, once_flash, moments = _moments(inp, remat=False, **step)
    again, again_flash, moments_remat = _moments(inp, remat=True, **step)
    tset = step["tensor_set"]
    joins = inp.lowering.all_reduce_combine_bytes
    spared = (
        epilogues(graph, once, moments.at, tset, partial, (inp.ng, empty), joins, once_flash),
        epilogues(
            graph, again, moments_remat.at, tset, partial, (inp.ng, empty), joins, again_flash
        ),
    )
    recomputed_rows = [r for r in partial if r.op in recomputed and not r.grad]
    copies = None
    if inp.lowering.concatenates_combined:
        copies = combined_copies(recomputed_rows, again.blocks, moments_remat.at, inp.ng, empty)
    split = split_operands(graph, inp.res, consumers, inp.lowering, tset, moments.at)
    return dict(
        moments=moments,
        moments_remat=moments_remat,
        copies=copies,
        split_operands=split,
        epilogues=spared,
    )


def _moments(
    inp: TableInputs,
    *,
    remat: bool,
    gathered: Mapping[int, float],
    narrow: Mapping[int, float],
    grads: list[tuple[int, float]],
    tensor_set: np.ndarray,
    nbytes: np.ndarray,
    sets: np.ndarray,
    held: tuple,
):
    """The step's buffers, the same as the flash kernel leaves them (None where it runs no
    core), and the step's candidate peak moments, with or without `remat`."""
    graph, res, consumers = inp.graph, inp.res, inp.consumers
    buf = step_buffers(graph, res, consumers, remat, inp.lowering)
    flash = kernel_buffers(graph, buf, inp.kernel, res.recomputed if remat else ())
    # ZeRO-3 gathers layer by layer (`_fsdp.py`); a step without layers as XLA gathers.
    if inp.layers is not None:
        whole = layer_gathered_parameters(graph, inp.layers, gathered, buf.blocks, narrow)
    else:
        whole = gathered_parameters(graph, consumers, res.boundary, inp.update, remat, gathered)
    # What ZeRO-3 makes again from the shards for the backward (and, under remat, for the
    # recompute, where it reads a weight's cast as a layer input) is not held for it.
    again = inp.regathered if not remat or inp.layers is None else inp.layers.lazy
    made = (
        None if remat and inp.layers is None else past_forward(buf, again, consumers, res.boundary)
    )
    moments = step_moments(
        buf, whole, nbytes, tensor_set, sets, inp.ng, grads, len(graph.ops), made, held, flash
    )
    return buf, flash, moments


def _row_columns(
    partial: list[CandidateRow], rows: RowBuilder, recomputed: Collection[int], op_s: np.ndarray
) -> dict:
    """The `Tables` fields of the candidate collectives: per op, merged, and the
    recomputed ops' own; and each combined collective slot's trips. `op_s`: each op's
    unsharded compute seconds, on the partial-sum rows (`RowTable.op_s`)."""
    ng, empty = rows.ng, rows.empty
    partial_full = row_table(partial, ng, empty, op_s)
    reshard_full = row_table(list(rows.reshard.values()), ng, empty)
    return dict(
        partial=partial_full.merged(),
        reshard=reshard_full.merged(),
        partial_full=partial_full,
        reshard_full=reshard_full,
        remat_partial=row_table([r for r in partial if r.op in recomputed], ng, empty),
        remat_reshard=row_table(list(rows.reshard_again.values()), ng, empty),
        combine_trips=np.array([t for _, t in sorted(rows.slots.values())], dtype=float),
    )
