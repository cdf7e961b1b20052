"""The tables' candidate collectives: one row per op output whose reduced groups may be
split (a partial sum to all-reduce) and per input dim an op may need laid out otherwise
than its tensor is (a reshard), each happening when a plan puts an axis there.

Rows are found op by op, loop bodies included (`candidate_rows`), then merged where their
structure is identical (`RowTable.merged`: summing bytes and occurrences, as collective
times are linear in both). `_kernel.py` prices them under a plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import NamedTuple

import numpy as np

from .._graph import Graph
from .._groups import ARG_REDUCE, LOOPS, body_tensor_groups, rule
from ._residuals import matmuls_alone
from ._sets import SetIndex


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
    gathers: bool = False  # a lookup at an iota: its result gathered, not summed
    # A table lookup's rows (`lookup_tables`): 1 the gather's, 2 its scatter-add's; its
    # table's set and bytes, and the set of the indices' side (-1: the empty set).
    lookup: int = 0
    table: int = -1
    beside: int = -1
    table_bytes: float = 0.0


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
    # A partial-sum row of a lookup at an iota (`iota_lookups`): the result is all-gathered
    # over the rows' axes the output does not hold, where others are all-reduced.
    gathers: np.ndarray
    # A table lookup (`lookup_tables`): 1 the gather's rows, 2 its scatter-add's, else 0;
    # with its table's set and unsplit bytes, and `beside` the set of the tensor on the
    # indices' side (the gather's result, the scatter-add's updates): XLA keeps the axes
    # the indices hold there and regroups the table onto the others
    # (`_kernel._moved_lookups`). The empty set and 0 bytes on other rows.
    lookup: np.ndarray
    table: np.ndarray
    beside: np.ndarray
    table_bytes: np.ndarray
    # The compute seconds of the op that writes the row, unsharded (`Tables.op_coef`),
    # summed over merged rows: what XLA's split of a gradient dot beside data takes 1 - 1/n
    # of (`_beside.py`); merged rows share their ops' sets. 0 where not given.
    op_s: np.ndarray

    def read_sets(self, names: tuple[str, ...]) -> np.ndarray:
        """[rows, n] the sets in columns `names` (`PARTIAL_SETS`, `RESHARD_SETS`)."""
        cols = [getattr(self, c) for c in names]  # [rows] or [rows, width] each; no rows too
        return np.concatenate([c[:, None] if c.ndim == 1 else c for c in cols], axis=1)

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
            self.gathers,
            self.lookup,
            self.table,
            self.beside,
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
            gathers=rest[:, 7].astype(bool),
            lookup=rest[:, 8],
            table=rest[:, 9],
            beside=rest[:, 10],
            table_bytes=np.bincount(inv, self.table_bytes, minlength=n),
            op_s=np.bincount(inv, self.op_s, minlength=n),
            nbytes=np.bincount(inv, self.nbytes, minlength=n),
            count=np.bincount(inv, self.count, minlength=n),
            op=self.op[first],
        )


def row_table(rows: list[CandidateRow], pad_group: int, empty_set: int, op_s=None) -> RowTable:
    """Rows as arrays; the group and small lists padded to one width (pad: never split).
    A table's lookup takes three virtual rows (`_kernel._moved_lookups`): two columns.
    `op_s`: [n_ops] each op's unsharded compute seconds (`RowTable.op_s`), or None."""
    kr = max([1] + [2 if r.lookup == 1 else len(r.group) for r in rows])
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
        gathers=column("gathers", bool),
        lookup=column("lookup", np.int64),
        table=np.where(column("table", np.int64) < 0, empty_set, column("table", np.int64)),
        beside=np.where(column("beside", np.int64) < 0, empty_set, column("beside", np.int64)),
        table_bytes=column("table_bytes", float),
        op_s=np.zeros(len(rows)) if op_s is None else op_s[column("op", np.int64)],
    )


#: The set columns a partial-sum row's price reads, and a reshard row's.
PARTIAL_SETS = ("small", "tset", "table", "beside")
RESHARD_SETS = ("small", "tset", "tsmall", "other", "peer", "table", "beside")


@dataclasses.dataclass(frozen=True)
class RowBuilder:
    """The candidate collectives of one step as `candidate_rows` finds them, and what it
    needs to find them."""

    sets: SetIndex
    ng: int  # number of groups (a body's groups are numbered past them, `body_tensor_groups`)
    wide: int  # `Lowering.collective_float_bytes`
    recomputed: Collection[int]  # top-level ops rematerialization recomputes
    # A seam's input batch dim is untied from its output's, but moves only when the two
    # sides' axes differ: the other side is the row's peer (and, being the same logical
    # dim, never takes the axis from it as another of the op's groups would).
    after: Mapping[tuple[int, int], int]  # (op, group before the seam) -> group after it
    empty: int  # the empty set's id
    # A microbatch split (`Groups.microbatch_splits`) -> the batch groups: the batch its
    # input holds in blocks goes on as each microbatch's examples, which XLA reaches with
    # an all-to-all over the batch's axis (`_microbatch_row`).
    microbatch: Mapping[int, frozenset[int]] = dataclasses.field(default_factory=dict)
    # the gathers XLA partitions as parallel to their table's rows (`iota_lookups`)
    iota_lookups: Collection[int] = frozenset()
    # the table lookups XLA may regroup (`lookup_tables`): op -> (kind, table, beside)
    lookups: Mapping[int, tuple[int, int, int]] = dataclasses.field(default_factory=dict)
    partial: list[CandidateRow] = dataclasses.field(default_factory=list)
    # a top-level op's output -> its partial-sum row
    partial_row: dict[int, int] = dataclasses.field(default_factory=dict)
    # a top-level float32 partial sum only matmuls read -> the bytes it is reduced in
    # (`narrow_partials`)
    narrow: Mapping[int, float] = dataclasses.field(default_factory=dict)
    reshard: dict[tuple, CandidateRow] = dataclasses.field(default_factory=dict)
    # the recomputed ops' own reshards (XLA cannot reuse them)
    reshard_again: dict[tuple, CandidateRow] = dataclasses.field(default_factory=dict)
    # Combined collective slots: the step's gradients (0), then each loop body with
    # gradient rows, with its trips per step.
    slots: dict[tuple, tuple[int, float]] = dataclasses.field(
        default_factory=lambda: {(): (0, 1.0)}
    )


class At(NamedTuple):
    """Where an op's collectives happen: `scale` times per step; `scope` tells a loop
    body's tensors apart (() at the top level); `row_op` the top-level op they belong to.
    `hoist[t]`: (outer tensor, its scope, its scale) of a body tensor that is the same on
    every trip, whose reshard XLA hoists out of the loop (and shares, as CSE). `params`:
    the sets of the graph's tensors with a parameter's layout (in a body: those bound to
    such a tensor outside)."""

    scale: float
    scope: tuple
    row_op: int
    hoist: Mapping
    params: Collection[int]


def comm_bytes(g: Graph, t: int, wide: int) -> float:
    """Bytes a collective moves for tensor t of g (16-bit floats widened to `wide` bytes
    where the backend widens them, see Lowering.collective_float_bytes)."""
    x = g.tensors[t]
    if wide and x.dtype in ("bfloat16", "float16") and x.itemsize < wide:
        return x.size * wide
    return x.nbytes


#: Ops that move a tensor's elements without computing: a partial sum read through them
#: reaches its matmuls as itself (`narrow_partials`).
_LAYOUT = frozenset({"reshape", "transpose", "squeeze", "expand_dims", "copy"})


def narrow_partials(graph: Graph, consumers, operand: int) -> dict[int, float]:
    """Per float32 tensor that only default-precision matmuls read (through layout ops),
    the bytes a collective reducing it moves where those matmuls read their operands at
    `operand` bytes an element (`Lowering.matmul_operand_bytes`; none where 0). XLA's TPU
    converts such a partial sum to the matmuls' bf16 before it all-reduces it, halving
    the bytes: a float32 GPT whose hidden dim is split on the model axis all-reduces the
    backward's gradient of its attention context (dy @ Wo^T, read by the attention's two
    matmuls alone) as bf16, and the forward's Q, K, V projections (read by their bias'
    add) as float32 (libtpu 0.0.42.1, v5p 4x4x4 and 2x2x1; tests/test_verify_tpu.py)."""
    if not operand:
        return {}
    out = {}
    for x in graph.tensors:
        if x.dtype != "float32" or x.itemsize <= operand or x.producer is None:
            continue
        readers, frontier = [], [x.id]
        while frontier:
            for c in consumers[frontier.pop()]:
                op = graph.ops[c]
                if op.primitive in _LAYOUT:
                    frontier.extend(op.outputs)
                else:
                    readers.append(op)
        if matmuls_alone(readers):
            out[x.id] = float(x.size * operand)
    return out


def candidate_rows(rb: RowBuilder, op, g: Graph, tgs, tsets, at: At) -> None:
    """Adds to `rb` the candidate collectives of op (of graph g, its dims' groups `tgs`,
    its tensors' sets `tsets`), happening as `at` says, and its loop bodies' ops'."""
    split = rb.sets.split
    r = rule(op, g)
    outs = {x for o in op.outputs for x in tgs[o] if split[x]}
    red = {x for t, d in r.reduced if split[x := tgs[t][d]]} - outs
    it = outs | red
    looped = op.primitive in LOOPS and g.bodies.get(op.index)
    if red:
        _partial_rows(rb, op, g, tsets, sorted(red), it, at)
    _reshard_rows(rb, op, g, tgs, tsets, it, looped, at)
    if looped:
        _body_rows(rb, op, g, tgs, tsets, looped, at)


def _partial_rows(rb: RowBuilder, op, g: Graph, tsets, gs: list[int], it: set[int], at: At):
    """One partial-sum row per output of op, whose reduced groups `gs` (of its iteration
    space `it`) may be split."""
    small = [rb.sets.of(x for x in it if x < h) for h in gs]
    for o in op.outputs:
        nb = rb.narrow[o] if o in rb.narrow and not at.scope else comm_bytes(g, o, rb.wide)
        nb *= at.scale
        grad = tsets[o] in at.params
        # A body's gradient partial sums are combined per trip, not per step
        # (checked on XLA's CPU HLO in tests/test_loops.py).
        slot = (
            rb.slots.setdefault(at.scope, (len(rb.slots), at.scale))[0] if grad and at.scope else 0
        )
        if not at.scope:
            rb.partial_row[o] = len(rb.partial)
        rb.partial.append(
            _with_lookup(rb, g, tsets, op.index, at)(
                gs,
                small,
                tsets[o],
                0,
                0,
                False,
                nb,
                grad and not at.scope,
                at.row_op,
                rb.empty,
                at.scale,
                slot,
                op.index in rb.iota_lookups and not at.scope,
            )
        )


def _reshard_rows(rb: RowBuilder, op, g: Graph, tgs, tsets, it: set[int], looped, at: At):
    """One reshard row per input dim of op the op may need laid out otherwise than its
    tensor is (`it`: the op's iteration space; `looped`: its bodies, for a loop)."""
    split, sid = rb.sets.split, rb.sets.of
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
            if h in rb.microbatch.get(op.index, ()) and not at.scope:
                _microbatch_row(rb, op, g, tsets, (u, d, h), ugs, at)
                continue
            # A dim no body sees is a scan's stacked dim, sliced per trip: XLA gathers
            # it whole for the loop even when a result (the stacked gradient) keeps it.
            untied = h not in it or bool(looped)
            seam = rb.after.get((op.index, h)) if not at.scope else None
            # A loop's "iteration space" is every group it carries (dozens: one set of
            # them is an ILP scope of 3^dozens options); its stacked dim is gathered
            # whatever the others hold, so only the operand's own groups compete.
            rivals = it & ugs if looped else it
            op_small = {x for x in rivals if x < h and x != seam}
            if not untied and op_small <= ugs:
                continue  # the op drops the axis exactly where the tensor does
            peer = rb.empty if seam is None else sid((seam,))
            # XLA gathers a loop's operand for that loop (checked: a stacked weight split
            # on its layer dim is gathered once per scan reading it, not shared).
            where, ukey, times = (*at.scope, op.index) if looped else at.scope, u, at.scale
            if u in at.hoist and not looped:
                ukey, where, times = at.hoist[u]
            key = (where, ukey, d, untied, sid(op_small), sid((ugs & it) - {h}), peer)
            if key not in rb.reshard:
                small_u = sid(x for x in ugs if x < h)
                nb = comm_bytes(g, u, rb.wide)
                if op.primitive in ARG_REDUCE:  # XLA reduces (value, int32 index) pairs
                    nb += g.tensors[u].size * 4
                rb.reshard[key] = _with_lookup(rb, g, tsets, op.index, at)(
                    group=[h],
                    small=[key[4]],
                    tset=tsets[u],
                    tsmall=small_u,
                    other=key[5],
                    untied=untied,
                    nbytes=nb * times,
                    grad=False,
                    op=at.row_op,
                    peer=peer,
                    count=times,
                )
            if at.row_op in rb.recomputed:
                rb.reshard_again.setdefault(key, rb.reshard[key])


def _with_lookup(rb: RowBuilder, g: Graph, tsets, index: int, at: At):
    """`CandidateRow`, with its table's fields where op `index` is a table lookup (at the
    top level: `RowBuilder.lookups`)."""
    if at.scope or index not in rb.lookups:
        return CandidateRow
    kind, table, beside = rb.lookups[index]

    def row(*args, **kwargs) -> CandidateRow:
        return CandidateRow(*args, **kwargs)._replace(
            lookup=kind,
            table=tsets[table],
            beside=tsets[beside],
            table_bytes=comm_bytes(g, table, rb.wide),
        )

    return row


def _microbatch_row(rb: RowBuilder, op, g: Graph, tsets, dim, ugs: set[int], at: At):
    """The all-to-all of a microbatch split's input batch dim `d` (group `h`): its block
    layout (device i holds examples [i*B/n, (i+1)*B/n)) is not the split of each
    microbatch's examples the reshape's result keeps, so XLA moves the input's shard
    (seen on the CPU: an all-to-all, and with microbatches fewer than the axis a
    collective-permute of the same bytes beside it). `dim`: (tensor, dim, its group)."""
    u, d, h = dim
    key = (at.scope, u, d, "microbatch")
    if key in rb.reshard:
        return
    sid = rb.sets.of
    rb.reshard[key] = CandidateRow(
        group=[h],
        small=[rb.empty],
        tset=tsets[u],
        tsmall=sid(x for x in ugs if x < h),
        other=sid((h,)),  # h itself holds the axis: the kernel's all-to-all
        untied=True,
        nbytes=comm_bytes(g, u, rb.wide) * at.scale,
        grad=False,
        op=at.row_op,
        peer=rb.empty,
        count=at.scale,
    )


def _body_rows(rb: RowBuilder, op, g: Graph, tgs, tsets, looped, at: At) -> None:
    """The candidate collectives of loop op's bodies (`looped`), each op `body.trips` times
    per trip of op."""
    for k, (body, btg) in enumerate(
        zip(looped, body_tensor_groups(op, g, tgs, rb.ng), strict=True)
    ):
        if not body.priced:
            continue
        bsets = [rb.sets.of(x) for x in btg]
        inner_hoist = {
            inner: at.hoist.get(outer, (outer, at.scope, at.scale))
            for outer, inner, _ in body.binds[: body.invariant]
        }
        where = (*at.scope, op.index, k)
        inner_params = {bsets[i] for u, i, _ in body.binds if tsets[u] in at.params}
        inner = At(at.scale * body.trips, where, at.row_op, inner_hoist, inner_params)
        for bop in body.graph.ops:
            candidate_rows(rb, bop, body.graph, btg, bsets, inner)


def summed_partials(
    graph: Graph,
    rows: list[CandidateRow],
    partial_row: dict[int, int],
    consumers,
    through_transposes: bool = True,
) -> set[int]:
    """The partial-sum rows XLA's all-reduce reassociation removes: where two partial sums
    that would be all-reduced alike (the same row but for its op) are added and read by
    nothing else, XLA adds them first and all-reduces the sum once (the input gradient of
    separate Q, K and V projections: three partial sums, one all-reduce, as Megatron-LM's
    fused QKV). Following the adds, a sum of k partials keeps one row; the others go.
    `consumers`: `graph.consumers()`. `through_transposes` False: only partial sums added
    as they are (a pipeline's stages: see `Tables.staged_partial_full`)."""

    def alike(r: CandidateRow) -> tuple:
        # a tied table's lookup gradient adds to its projection's as any partial sum
        return r._replace(op=0, lookup=0, table=-1, beside=-1, table_bytes=0.0)

    root = dict(partial_row)  # tensor -> the row that reduces it (or the sum it feeds)
    # A partial sum read only through transposes that undo each other reaches its add as
    # itself: XLA's simplifier folds transpose(transpose(x)) before it reassociates (a tied
    # embedding's output-projection gradient, transposed there and back, then added to its
    # lookup's scatter-add: one all-reduce on an A100 compile, two on the CPU's).
    moved: dict[int, tuple[int, tuple[int, ...]]] = {}  # tensor -> (its row, permutation)
    gone: set[int] = set()
    for op in graph.ops:
        if op.primitive == "transpose" and through_transposes:
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


#: Ops an index array passes through unchanged in value on its way to a gather.
_INDEX_PATH = frozenset(
    {"broadcast_in_dim", "reshape", "copy", "convert_element_type", "squeeze", "expand_dims"}
)


def iota_lookups(graph: Graph) -> dict[int, int]:
    """Gather -> the iota op its indices are, for the gathers that look a table up at an
    iota as long as its rows (`take(table, arange(n))`, through broadcasts and `take`'s
    wrap of negative indices, a select XLA folds away for an iota): XLA's GPU partitioner
    sees the index dim as parallel to the rows (`Lowering.parallel_iota_lookups`)."""
    out = {}
    for op in graph.ops:
        if op.primitive != "gather":
            continue
        dn = op.params["dimension_numbers"]
        if len(dn.start_index_map) != 1 or dn.operand_batching_dims:
            continue
        rows = graph.tensors[op.inputs[0]].shape[dn.start_index_map[0]]
        iota = _iota_under(graph, op.inputs[1])
        if iota is not None and graph.tensors[iota].size == rows:
            out[op.index] = graph.tensors[iota].producer
    return out


def _iota_under(graph: Graph, t: int) -> int | None:
    """The iota tensor t's values are, passed through `_INDEX_PATH` and selects whose
    unselected case is the wrap of the same values, or None."""
    while True:
        producer = graph.tensors[t].producer
        if producer is None:
            return None
        op = graph.ops[producer]
        if op.primitive == "iota":
            return t if graph.tensors[t].ndim == 1 else None
        if op.primitive == "select_n" and len(op.inputs) == 3:
            t = op.inputs[1]  # the case taken where the index is not negative
        elif op.primitive in _INDEX_PATH:
            t = op.inputs[0]
        else:
            return None


def lookup_tables(graph: Graph, skip: Collection[int] = ()) -> dict[int, tuple[int, int, int]]:
    """Table lookups, op -> (kind, table, beside): each gather of whole rows of a table by
    one index (kind 1: the table, its result) and each scatter-add of rows into one (its
    transpose, kind 2: the table's gradient, the updates), but those in `skip` (the
    lookups at an iota, `iota_lookups`). XLA partitions them by index passthrough first
    (`PartitionGatherIndexPassthroughDimensions`): an axis the indices hold stays on the
    result, the table regrouped onto the others (`_kernel._moved_lookups`)."""
    out = {}
    for op in graph.ops:
        if op.index in skip or op.primitive not in ("gather", "scatter-add"):
            continue
        dn = op.params["dimension_numbers"]
        if op.primitive == "gather":
            index_map, collapsed = dn.start_index_map, dn.collapsed_slice_dims
            batching = dn.operand_batching_dims
            found = (1, op.inputs[0], op.outputs[0])
        else:
            index_map, collapsed = dn.scatter_dims_to_operand_dims, dn.inserted_window_dims
            batching = dn.operand_batching_dims
            found = (2, op.outputs[0], op.inputs[2])
        if len(index_map) == 1 and tuple(collapsed) == tuple(index_map) and not batching:
            out[op.index] = found
    return out
