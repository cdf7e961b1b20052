"""The price of sequence parallelism (`Plan.sequence_parallel`), on top of the plan's
tensor-parallel cost.

The residual stream's tensors split on the sequence over the tensor-parallel axis t
(`_groups.sequence_parallel`) change three things, as XLA compiles them:

- each matmul whose partial sums over t make a residual tensor (a row-parallel matmul, and
  in the backward a column-parallel one's input gradient) reduce-scatters them where it
  all-reduced them: the same buffer, half the ring's bytes on the wire. XLA's CPU pipeline
  has no reduce-scatter (`Lowering.reduce_scatter`): there the all-reduce stays and the
  slice is local;
- each residual tensor a matmul reads whole is all-gathered first, once per tensor (XLA
  reuses the gathered copy for every matmul that reads it: queries, keys and values);
- the ops that make or read residual tensors (norms and their statistics, residual adds,
  dropout, the norms' backward) work on 1/t of them, and the residuals the backward keeps
  of them take 1/t of their bytes; the adds of partial sums before their reduce-scatter
  (the queries', keys' and values' input gradients) work on the whole buffer;
- where the backend gathers and scatters on a buffer's major dim alone
  (`Lowering.major_dim_collectives`) and the sequence is not the stream's major dim (a
  batch-major stream, microbatch over 1), each gathered copy and each reduce-scattered
  buffer is transposed between the collective's layout and the matmuls' (`layout_rate`);
- a matmul that reads a residual tensor and splits nothing else on t (BERT's masked-LM
  transform) runs on the local sequence, ungathered (`_local_matmul`);
- an op that sums a residual tensor over its sequence (the gradients of the norms' scales
  and biases and of the row-parallel biases; such a transform's weight gradient) makes
  partial sums over t, all-reduced (`SeqparTerms.summed`): in a pipeline, in every
  microbatch's backward program (`seqpar_op_costs`).

The embedding lookup keeps its all-reduce (`_groups/_seqpar.py` says why). Held against
XLA's GPU compiler in tests/test_seqpar.py (one program: kinds, counts and bytes equal).

Pipelines (`seqpar_op_costs`): the forward and backward run as programs apart. The
forward gathers each stream tensor once; the backward program once per matmul that reads
one (the queries', keys' and values' weight gradients each gather the norm's output,
which the forward's gathered copy no longer serves): on a tp=2 pp=2 GPT, 10 and 13
gathers per stage and microbatch, as XLA compiles them. A stage's memory shrinks with its
stream's kept tensors (`Layouts.inv` of the split tensors, 1/t).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

import numpy as np

from .._capture import Residuals
from .._graph import Graph
from .._groups import KEPT_WHOLE, Groups, layouts, reduced_dims
from .._plan import Collective, Cost, Plan
from . import _collectives as C
from ._buffers import step_buffers
from ._liveness import NO_BLOCKS, Buffers, alive_among
from ._overlap import gather_beta, stream_hidden, stream_windows
from ._residuals import kept_residuals
from ._seqpar_layout import buffer_bytes, layout_rate, layout_transposes, seq_dim, spec_axes

_MATMUL = "dot_general"
_ADDS = frozenset({"add", "add_any"})


@dataclasses.dataclass(frozen=True)
class SeqparTerms:
    """What sequence parallelism changes in one step, per device."""

    reduce_scattered: tuple[float, ...]  # per partial-sum matmul: its buffer's bytes
    gathered: tuple[float, ...]  # per residual tensor a matmul reads: the gathered bytes
    compute_ops: frozenset[int]  # ops that now run on 1/t of the sequence
    reduce_ops: frozenset[int] = frozenset()  # ops whose partial sums are reduce-scattered
    gathered_at: tuple[int, ...] = ()  # per entry of `gathered`: the op that reads it whole
    split: frozenset[int] = frozenset()  # the residual tensors split on the sequence
    # per op that sums a split tensor over its sequence (a norm's or a bias's gradient):
    # the bytes of its partial sums over t, all-reduced where they are made
    summed: tuple[float, ...] = ()
    summed_at: tuple[int, ...] = ()  # per entry of `summed`: that op
    # per entry of `gathered`: made again in the backward, where the recompute runs
    again: tuple[bool, ...] = ()
    # one program: per partial-sum matmul the recompute runs again, its buffer's bytes
    # (priced all-reduced among the recomputed ops' collectives, reduce-scattered as XLA)
    reduce_scattered_again: tuple[float, ...] = ()
    # one program: per entry of `gathered`, the backward ops XLA's TPU runs it beside
    # (`_overlap.stream_windows`; empty where it runs synchronously)
    windows: tuple[tuple[int, ...], ...] = ()
    # (tensor, op) of every op that reads a split tensor whole, from its gathered copy
    whole_reads: tuple[tuple[int, int], ...] = ()
    # per layout transpose around a gather or reduce-scatter (`layout_rate`): its seconds
    # at the backend's HBM rate, and the op it is charged to (the collective's reader, or
    # the matmul making the scattered partial sums)
    transposed: tuple[float, ...] = ()
    transposed_at: tuple[int, ...] = ()


def seqpar_terms(
    graph: Graph,
    groups: Groups,
    plan: Plan,
    float_bytes: int = 0,
    recomputed: Collection[int] | Residuals = (),
    boundary: int | None = None,
    taken: Collection[int] | None = (),
    layout_rate: float = 0.0,
) -> SeqparTerms:
    """The terms of `plan`'s sequence parallelism, read from its constraints: a residual
    tensor is one whose constraint puts the plan's `sequence_parallel` axis on a dim its
    plain layout leaves whole. `boundary` (pipelines: the last forward op): the backward
    is a program of its own, which gathers per reading matmul. `recomputed`: the ops run
    again in the backward, whose gathers run again (`_regathered`), or the `Residuals`,
    whose `reread` tensors are gathered again too; `taken`: as `stream_windows`'s.
    `layout_rate`: where the backend collects on major dims alone
    (`Lowering.major_dim_collectives`), the HBM bytes/s its layout transposes move at
    (`_seqpar_layout.layout_transposes`); 0 where it does not."""
    recomputed, reread = _run_again(recomputed)
    axis, assignment = plan.sequence_parallel, plan.assignment or {}
    lay = layouts(graph, groups, assignment)
    split = _split_tensors(plan, lay, str(axis))
    consumers = graph.consumers()
    walk = _Walk(graph, groups, plan, lay, split, consumers, float_bytes)
    read_whole = [(op.index, walk.visit(op)) for op in graph.ops]
    rs, rs_op, adding, ops, summed = walk.rs, walk.rs_op, walk.adding, walk.ops, walk.summed
    ag, at, tensors, whole = _gathers(graph, read_whole, boundary, plan, lay, float_bytes)
    extra = _regathered(graph, at, tensors, recomputed, boundary is not None, reread)
    again = [False] * len(ag) + [True] * len(extra)
    ag, at = ag + [ag[k] for k in extra], at + [at[k] for k in extra]
    tensors += [tensors[k] for k in extra]
    ops -= adding  # the partial sums are added whole, before they are scattered
    transposed: list[tuple[float, int]] = []
    if layout_rate:
        # a reduce-scatter of partial sums added first is transposed by the adds' kernel
        scattered = [
            e for e in rs if not adding & _adds_between(graph, walk.chains[e], e, consumers)
        ]
        scattered += [e for e in scattered if boundary is None and rs_op[e] in recomputed]
        transposed = layout_transposes(graph, plan, lay, str(axis), tensors, at, whole,
                                       scattered, rs_op, layout_rate)  # fmt: skip
    # A pipeline's recomputed rows carry their ops (`seqpar_op_costs` moves them alike).
    rs_again = [] if boundary is not None else [rs[e] for e in rs if rs_op[e] in recomputed]
    return SeqparTerms(
        tuple(rs.values()), tuple(ag), frozenset(ops), frozenset(walk.reducing), tuple(at),
        frozenset(split), tuple(summed.values()), tuple(summed), tuple(again), tuple(rs_again),
        () if boundary is not None or taken is None else stream_windows(graph, at, again, split, taken),
        tuple(whole), tuple(s for s, _ in transposed), tuple(i for _, i in transposed),
    )  # fmt: skip


@dataclasses.dataclass
class _Walk:
    """The walk over a step's ops that sorts them for `seqpar_terms` (a thin stateful
    shell, read once): `visit` records what one op does to the split stream and returns
    the split tensors it reads whole."""

    graph: Graph
    groups: Groups
    plan: Plan
    lay: object
    split: set[int]
    consumers: object
    float_bytes: int
    rs: dict[int, float] = dataclasses.field(default_factory=dict)  # scattered buffer: bytes
    rs_op: dict[int, int] = dataclasses.field(default_factory=dict)  # per entry of `rs`: its matmul
    reducing: set[int] = dataclasses.field(default_factory=set)
    ops: set[int] = dataclasses.field(default_factory=set)  # run on 1/t of the sequence
    summed: dict[int, float] = dataclasses.field(default_factory=dict)
    # the partial sums over t of the matmuls that make split tensors, the adds of such sums
    # alone (before the reduction: on the whole buffer), and per scattered buffer the
    # partial sum its chain of adds starts from
    partials: set[int] = dataclasses.field(default_factory=set)
    adding: set[int] = dataclasses.field(default_factory=set)
    chains: dict[int, int] = dataclasses.field(default_factory=dict)

    def bytes_of(self, t: int) -> float:
        return buffer_bytes(self.graph, t, self.lay[t], self.plan.mesh, self.float_bytes)

    def visit(self, op) -> list[int]:
        axis, split = self.plan.sequence_parallel, self.split
        made = [t for t in op.outputs if t in split]
        local = _local_matmul(op, split, self.plan.constraints, self.lay, axis)
        if local is not None:
            # Split on the sequence, nothing split on the axis beside it (an unsplit
            # projection: BERT's masked-LM transform): run on the local part, no gather.
            self.ops.add(op.index)
            if local:
                self.summed[op.index] = self.bytes_of(op.outputs[0])
            return []
        if op.primitive == _MATMUL:
            if made and _contracts_on(op, self.groups, self.plan.assignment or {}, axis):
                self._scatter(op, made[0])
            return [t for t in op.inputs if t in split]
        if op.primitive in KEPT_WHOLE:
            # The embedding's gradient reads its cotangent whole: gathered where it is made.
            return [t for t in op.inputs if _made_from(self.graph, t, split)]
        if op.primitive in _ADDS and op.inputs and all(i in self.partials for i in op.inputs):
            self.partials.update(op.outputs)
            self.adding.add(op.index)
        if made and len(made) == len(op.outputs):
            self.ops.add(op.index)
        elif _sums_sequence(op, self.graph, split, self.plan.constraints, axis):
            self.summed[op.index] = self.bytes_of(op.outputs[0])
            self.ops.add(op.index)  # on its 1/t of the sequence, as every reader of one
        elif any(t in split for t in op.inputs):
            # reads its part of the stream (a norm's statistics, its backward's row sums):
            # XLA runs every kernel on the split stream on 1/t of the rows
            self.ops.add(op.index)
        return []

    def _scatter(self, op, made: int) -> None:
        # Partial sums added before they are reduced (the input gradient of the queries',
        # keys' and values' matmuls) are reduce-scattered once, summed.
        end = _summed(self.graph, made, self.split, self.consumers)
        self.rs[end] = self.bytes_of(end)
        self.rs_op[end] = op.index
        self.reducing |= {op.index, self.graph.tensors[end].producer}
        self.partials.update(op.outputs)
        self.chains.setdefault(end, made)


def _gathers(graph: Graph, read_whole, boundary: int | None, plan: Plan, lay, float_bytes: int):
    """Per gather of a split tensor: its bytes, the op it is charged to and the tensor; and
    (tensor, op) of every read of a gathered copy. A pipeline's backward program gathers
    per matmul that reads the tensor (read on compile-only A100s and the CPU: no gather
    there is shared); one program, and a pipeline's forward, once per tensor. A tensor made
    whole for the embeddings' gradients is gathered once where it is made, whichever
    program: Hugging Face BERT's word, position and type tables read one cotangent (one
    gather on A100s)."""
    ag, at, tensors, whole, gathered = [], [], [], [], set()
    for index, reads in read_whole:
        apart = boundary is not None and index > boundary
        apart = apart and graph.ops[index].primitive == _MATMUL
        for t in reads:
            whole.append((t, index))
            if (t, index if apart else -1) not in gathered:
                gathered.add((t, index if apart else -1))
                tensors.append(t)
                ag.append(buffer_bytes(graph, t, lay[t], plan.mesh, float_bytes))
                at.append(index)
    return ag, at, tensors, whole


def _adds_between(graph: Graph, start: int, end: int, consumers) -> set[int]:
    """The adds `_summed` followed from a partial sum `start` to the tensor `end` it ends in."""
    out, t = set(), start
    while t != end:
        c = consumers[t][0]
        out.add(c)
        t = graph.ops[c].outputs[0]
    return out


def _run_again(recomputed: Collection[int] | Residuals) -> tuple[set[int], set[int]]:
    """(the ops a recomputation runs again, the tensors its backward reads afresh)."""
    if isinstance(recomputed, Residuals):
        return set(recomputed.recomputed), set(recomputed.reread)
    return set(recomputed), set()


def _split_tensors(plan: Plan, lay, axis: str) -> set[int]:
    """The stream's tensors: those whose constraint puts `axis` on a dim `lay` (the plan's
    layouts) leaves whole."""
    return {
        t
        for t, spec in plan.constraints.items()
        if axis in spec_axes(spec) and axis not in spec_axes(lay[t])
    }


def _regathered(
    graph: Graph,
    at: list[int],
    gathered: list[int],
    recomputed: set[int],
    staged: bool,
    reread: Collection[int] = (),
) -> list[int]:
    """Of the gathers (`gathered`: each one's tensor, `at`: the op reading it whole), the
    indices of those the backward makes again under recomputation. One program: a stream
    tensor made again (its producer recomputed: a norm's output under "full" and
    "projections") or read by a recomputed matmul is gathered again in the backward, once,
    for the recompute's matmuls and the weight gradients (the forward's gathered copy is
    not kept); under "selective" the norms' outputs are kept split and read afresh by the
    backward (`reread`, `_remat.regathered_reads`: Megatron-LM's gather again), so they
    are gathered again too. A pipeline's backward program (`staged`) gathers per reading
    backward matmul already (`seqpar_terms`): there only a recomputed forward matmul's
    gather runs again. Read in XLA's A100 programs of a 1-layer GPT and Llama at tp 2
    (tests/test_seqpar.py): two more gathers a layer under full and projections."""
    return [
        k
        for k, (t, op) in enumerate(zip(gathered, at, strict=True))
        if op in recomputed
        or (not staged and (graph.tensors[t].producer in recomputed or t in reread))
    ]


def _local_matmul(op, split, constraints, lay, axis: str) -> bool | None:
    """How XLA runs a matmul that reads split tensors without gathering them: False where
    one operand's sequence is a free dim, the other has nothing on `axis` and the result
    is split too (each device its part of the sequence); True where both operands'
    sequences are contracted together (partial sums over `axis`: the weight gradient of
    such a projection); None where it must gather."""
    if op.primitive != _MATMUL:
        return None
    contract, batch = op.params["dimension_numbers"]
    seq = [seq_dim(constraints[t], axis) if t in split else None for t in op.inputs[:2]]
    if seq[0] is not None and seq[1] is not None:
        paired = seq[0] in contract[0] and seq[1] in contract[1]
        paired = paired and contract[0].index(seq[0]) == contract[1].index(seq[1])
        whole = all(t not in split and axis not in spec_axes(lay[t]) for t in op.outputs)
        return True if paired and whole else None
    side = 0 if seq[0] is not None else 1
    if seq[side] is None or seq[side] in (*contract[side], *batch[side]):
        return None
    whole_other = axis not in spec_axes(lay[op.inputs[1 - side]])
    return False if whole_other and all(t in split for t in op.outputs) else None


def _sums_sequence(op, graph: Graph, split, constraints, axis: str) -> bool:
    """A reduction (not a matmul: those read the stream gathered) that sums a split tensor
    over its sequence dim: each device holds the sum over its 1/t of the sequence."""
    return any(
        t in split and axis in spec_axes(constraints[t][d : d + 1])
        for t, d in reduced_dims(op, graph)
    )


@dataclasses.dataclass(frozen=True)
class SplitMemory:
    """Of what a one-stage step holds, the bytes of the stream tensors the split makes 1/t
    of, per set as they are unsplit: what `CostModel` divides by t before it places the
    peak, so that the residuals XLA stores (`_residuals.stored_residuals`) and the buffers
    alive at each candidate moment (`_liveness.py`) are counted at their split size; and
    the gathered copies the matmuls read (`gathered_copies`), whole on the sequence."""

    kept: np.ndarray  # [sets] of the kept residuals (the activations, unscheduled backends)
    live: np.ndarray | None  # [moments, sets] of the buffers alive at each candidate moment
    # [moments, sets] of the gathered copies alive at each candidate moment (unsplit)
    copies: np.ndarray | None = None
    # [rows of `Tables.copies`] the recomputed partial sums no combined all-reduce copies
    # (`_buffers.combined_copies`): with the stream's reduced by reduce-scatters, each a
    # collective of its own, the recompute's last all-reduce (the embedding's lookup, where
    # the layer remakes it) has none to join (read in XLA's A100 program: it runs alone)
    uncombined: np.ndarray | None = None

    def at_moments(self, inv: np.ndarray, shrink: float) -> np.ndarray:
        """[moments] what the split changes at each candidate moment: the stream's buffers
        `shrink` (1 - 1/t) less, its gathered copies more (`inv`: the plan's per set)."""
        out = -shrink * (self.live @ inv)
        return out if self.copies is None else out + self.copies @ inv


def split_memory(model, terms: SeqparTerms, remat: bool) -> SplitMemory:
    """`SplitMemory` of the stream tensors `terms.split` in `model` (a `CostModel`), with
    or without recomputation. A recomputed layer's own residuals are made again inside its
    backward; where the backend has no reduce-scatter (XLA's CPU: it all-reduces and
    slices), that recompute holds the stream whole (the CPU's buffer assignment of a tp=4
    GPT saves what the inputs' split saves, not a quarter of the recomputed layer's), so
    there those are not split. An A100's program makes them split (a reduced GPT under
    full recomputation: 47.8 MB priced so, 46.7 MB in XLA's buffer assignment)."""
    graph, res, low, T = model.graph, model.residuals, model.cluster.lowering, model.tables
    split = terms.split
    if remat and not low.reduce_scatter:
        split = split - {t for ts in res.layer_saved for t in ts}
    consumers = graph.consumers()
    tensor_set = _tensor_sets(T, model.groups)
    nbytes = np.array([t.nbytes for t in graph.tensors], dtype=float)
    n_sets = len(T.sets)
    kept = np.zeros(n_sets)
    stored = kept_residuals(graph, res, low, consumers)[1 if remat else 0]
    mine = [t for t in stored if t in split]
    np.add.at(kept, tensor_set[mine], nbytes[mine])
    moments = T.moments_remat if remat else T.moments
    if moments is None:
        return SplitMemory(kept, None)
    buffers = step_buffers(graph, res, consumers, remat, low)
    live = alive_among(buffers, split, moments.at, nbytes, tensor_set, n_sets)
    again = set(res.recomputed) if remat else set()
    copies = gathered_copies(terms.whole_reads, res.boundary, again, buffers.blocks)
    gathered = alive_among(copies, set(copies.tensor), moments.at, nbytes, tensor_set, n_sets)
    uncombined = None
    if remat and T.copies is not None and low.reduce_scatter:
        uncombined = np.ones(len(T.copies.rows.op), dtype=bool)
    return SplitMemory(kept, live, gathered, uncombined)


def gathered_copies(
    reads: Collection[tuple[int, int]], boundary: int, recomputed: Collection[int], blocks
) -> Buffers:
    """The whole copies of the split stream tensors that matmuls read (`reads`: (tensor,
    op)), as XLA's A100 programs hold them: one gather serves every matmul that reads the
    tensor, so its copy lives from the first to the last. Per pass: the forward's copy dies
    at its last forward reader and the backward gathers its own, from its first reader (a
    recomputed matmul's: at its layer's recompute, `Buffers.blocks`) to its last, the
    weight gradients. Read in the buffer assignment of a 2-layer bf16 GPT at tp 8 under
    full recomputation: at its peak, an MLP's backward, the recomputed norms' outputs and
    the stream's cotangent gathered, 3 x 4 MB (tests/test_seqpar.py). Under selective
    recomputation the runtime reads a norm's output afresh in the backward, which gathers
    it again (`_remat.regathered_reads`), as Megatron-LM and Korthikanti et al.'s Table 2
    do; without recomputation XLA keeps the forward's copy for the weight gradients,
    which this does not price."""
    by: dict[int, list[int]] = {}
    for t, op in reads:
        by.setdefault(t, []).append(op)
    rows = []
    for t, ops in by.items():
        fwd = sorted(o for o in ops if o <= boundary)
        bwd = sorted(o for o in ops if o > boundary)
        if fwd:
            rows.append((t, fwd[0], fwd[-1]))
        # a recomputed forward matmul reads it again where its layer's recompute runs
        again = [int(b[2]) for o in fwd if o in recomputed for b in blocks if b[0] <= o <= b[1]]
        if bwd or again:
            rows.append((t, min(again + bwd), max(again + bwd)))
    t, b, d = np.array(rows, dtype=np.int64).reshape(-1, 3).T
    return Buffers(tensor=t, birth=b, death=d, width=np.ones(len(t)), blocks=NO_BLOCKS)


def _tensor_sets(T, groups: Groups) -> np.ndarray:
    """[tensors] each tensor's set in the tables `T` (its splittable groups, `_sets.py`)."""
    pad = len(groups.groups)
    ids = {tuple(int(g) for g in row if g != pad): i for i, row in enumerate(T.sets)}
    ok = T.splittable
    return np.array(
        [ids[tuple(sorted({g for g in gs if ok[g]}))] for gs in groups.tensor_groups],
        dtype=np.int64,
    )


def with_sequence_parallel(
    cost: Cost, terms: SeqparTerms, mesh: Mapping[str, int], axis: str, costs: C.AxisCosts,
    reduce_scatter: bool, overlaps: bool = False,
) -> Cost:  # fmt: skip
    """`cost` (the plan priced without it, its memory with the split: `split_memory`)
    with sequence parallelism's time: its collectives and the stream's ops on 1/t, and
    where the backend chains the backward's stream gathers beside its matmuls
    (`overlaps`: `Lowering.overlaps_stream_gathers`) their bandwidth terms hidden up to
    their windows' compute (`_overlap.stream_hidden`)."""
    t = mesh[axis]
    code = costs.codes[axis]
    scattered = (*terms.reduce_scattered, *terms.reduce_scattered_again)
    rs_bytes, ag_bytes = sum(scattered), sum(terms.gathered)
    n_rs, n_ag = len(scattered), len(terms.gathered)
    by_kind = {(c.kind, c.axis): c for c in cost.collectives}
    if reduce_scatter and n_rs:
        _move(by_kind, "all-reduce", axis, -rs_bytes, -n_rs, code, C.AR, costs)
        _move(by_kind, "reduce-scatter", axis, rs_bytes, n_rs, code, C.RS, costs)
    _move(by_kind, "all-gather", axis, ag_bytes, n_ag, code, C.AG, costs)
    # what `cost` runs beside compute (ZeRO-3's prefetch, `_overlap.py`) stays hidden
    hidden = sum(c.time_s for c in cost.collectives) - cost.comm_s
    comm = sum(c.time_s for c in by_kind.values()) - hidden
    shrink = 1 - 1 / t
    saved_s = shrink * sum(s for i, s, _ in cost.per_op if i in terms.compute_ops)
    if overlaps and terms.windows:  # each op's time as priced below, the stream's 1/t
        seconds = {i: s / t if i in terms.compute_ops else s for i, s, _ in cost.per_op}
        beta = gather_beta(costs, int(costs.bit[code]))
        comm -= stream_hidden(terms.windows, terms.gathered, seconds, beta)
    compute = cost.compute_s - saved_s + sum(terms.transposed)
    step = cost.step_time_s - (cost.compute_s - compute) - (cost.comm_s - comm)
    return dataclasses.replace(
        cost,
        step_time_s=step,
        compute_s=compute,
        comm_s=comm,
        mfu=cost.mfu * cost.step_time_s / step if step > 0 else cost.mfu,
        collectives=tuple(c for c in by_kind.values() if c.count > 0),
    )


def _move(by_kind, kind, axis, nbytes, count, code, k, costs: C.AxisCosts) -> None:
    old = by_kind.get((kind, axis))
    b = (old.bytes if old else 0.0) + nbytes
    n = (old.count if old else 0) + count
    by_kind[(kind, axis)] = Collective(kind, axis, max(b, 0.0), max(n, 0), 0.0)
    by_kind[(kind, axis)] = dataclasses.replace(
        by_kind[(kind, axis)], time_s=costs.time1(k, code, max(b, 0.0), max(n, 0))
    )


def _summed(graph: Graph, t: int, split: set[int], consumers) -> int:
    """The tensor a partial sum ends in: followed through the adds that join it to others."""
    while True:
        users = consumers[t]
        if len(users) != 1 or graph.ops[users[0]].primitive not in _ADDS:
            return t
        out = graph.ops[users[0]].outputs[0]
        if out not in split:
            return t
        t = out


def _made_from(graph: Graph, t: int, split: set[int]) -> bool:
    """Tensor t is whole but made by an op from split residual tensors."""
    producer = graph.tensors[t].producer
    return (
        t not in split
        and producer is not None
        and any(i in split for i in graph.ops[producer].inputs)
    )


def _contracts_on(op, groups: Groups, assignment: Mapping[int, str], axis: str) -> bool:
    """The matmul sums over a group split on `axis`: its output holds partial sums."""
    (contract, _), _ = op.params["dimension_numbers"]
    return any(assignment.get(groups.of(op.inputs[0], d)) == axis for d in contract)


def stage_sequence_parallel(model, plan: Plan, oc):
    """`seqpar_op_costs` of a pipeline plan's per-op costs (`_pipelined.plan_op_costs`)."""
    low, res = model.cluster.lowering, model.residuals
    float_bytes = low.collective_float_bytes
    again = res.recomputed if oc.remat else ()
    rate = layout_rate(model.cluster)
    terms = seqpar_terms(model.graph, model.groups, plan, float_bytes, again, res.boundary,
                         layout_rate=rate)  # fmt: skip
    return seqpar_op_costs(oc, terms, str(plan.sequence_parallel), low.reduce_scatter)


def seqpar_op_costs(oc, terms: SeqparTerms, axis: str, reduce_scatter: bool):
    """A pipeline's per-op costs (`_pipelined.OpCosts`, on the stage mesh) with sequence
    parallelism: the stream's partial-sum rows on `axis` reduce-scattered, an all-gather
    row at each op that reads a stream tensor whole, an all-reduce row at each op that
    sums the stream over its sequence, the stream's ops and tensors (what a stage keeps,
    and sends) 1/t.

    Those sums are the gradients of parameters applied to the stream (norms' scales and
    biases, row-parallel biases): accumulated over the microbatches, their reduction over
    the batch's axes waits for the stage's reduce program, but their partial sums over
    `axis` are all-reduced in every backward call, combined with that call's other
    gradients (read in the A100 HLO of a one-stage, four-microbatch GPT: one all-reduce
    of their bytes per microbatch)."""
    ac = oc.axis_costs
    t = oc.mesh[axis]
    mask = int(ac.bit[ac.codes[axis]])
    key = oc.row_key.copy()
    if reduce_scatter:
        ar = oc.row_partial & (key == C.AR * ac.masks + mask)
        ar &= np.isin(oc.row_op, list(terms.reduce_ops))
        key = np.where(ar, key + (C.RS - C.AR) * ac.masks, key)
    n, k = len(terms.gathered), len(terms.summed)
    new_key = np.concatenate(
        [np.full(n, C.AG * ac.masks + mask), np.full(k, C.AR * ac.masks + mask)]
    )
    new_bytes = np.asarray([*terms.gathered, *terms.summed], dtype=float)
    new_op = np.asarray([*terms.gathered_at, *terms.summed_at], dtype=np.int64)
    sums = np.arange(n + k) >= n
    comm = oc.comm.copy()
    old = ac.by_key(oc.row_key, oc.row_bytes, oc.row_count)
    new = ac.by_key(key, oc.row_bytes, oc.row_count)
    live = (oc.row_count > 0) & ~oc.row_grad
    np.add.at(comm, oc.row_op[live], (new - old)[live])
    np.add.at(comm, new_op[~sums], ac.by_key(new_key[~sums], new_bytes[~sums], np.ones(n)))
    grad_comm = oc.grad_comm.copy()
    np.add.at(grad_comm, new_op[sums], ac.by_key(new_key[sums], new_bytes[sums], np.ones(k)))
    compute = oc.compute.copy()
    ops = list(terms.compute_ops)
    compute[ops] /= t
    saved = None if oc.split_compute is None else oc.split_compute.copy()
    if saved is not None:  # what XLA's split beside data leaves out of them, alike
        saved[ops] /= t
    np.add.at(compute, list(terms.transposed_at), terms.transposed)
    inv = oc.layouts.inv.copy()
    inv[list(terms.split)] /= t
    pad = np.zeros(n + k, bool)
    # The gathers a recompute makes again are timed in the backward, as its other rows.
    again = np.concatenate([np.asarray(terms.again, bool), np.zeros(k, bool)])
    row_again = oc.row_again
    if row_again is None and again.any():
        row_again = np.zeros(len(oc.row_op), bool)
    extra = {
        "row_again": None if row_again is None else np.concatenate([row_again, again]),
        "row_whole": None if oc.row_whole is None else np.concatenate([oc.row_whole, pad]),
        "row_split": None if oc.row_split is None else np.concatenate([oc.row_split, 0 * pad]),
    }
    return dataclasses.replace(
        oc,
        compute=compute,
        split_compute=saved,
        comm=comm,
        grad_comm=grad_comm,
        layouts=dataclasses.replace(oc.layouts, inv=inv),
        row_op=np.concatenate([oc.row_op, new_op]),
        row_key=np.concatenate([key, new_key]),
        row_bytes=np.concatenate([oc.row_bytes, new_bytes]),
        row_count=np.concatenate([oc.row_count, np.ones(n + k)]),
        row_grad=np.concatenate([oc.row_grad, sums]),
        row_batched=np.concatenate([oc.row_batched, ~sums]),
        row_partial=np.concatenate([oc.row_partial, sums]),
        **extra,
    )
