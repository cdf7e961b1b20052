"""ZeRO-3's prefetch: each weight's gather in flight while the forward computes with the
weight before it, and the backward's second gathers beside the backward's matmuls.

The runtime ties forward layer L's gathers to layer L-1's input (`_run/_fsdp.py`), so a
gather may start when layer L-1 does and must end when its weight is read. XLA's TPU,
under the async collective fusion flags the runtime compiles TPU programs with
(`_run/_compiler.py`), runs each matrix's gather as a chain of fusions carried on by the
matmul that reads the matrix before it: "one weight ahead", not one layer ahead. So a
pair here is one gathered matrix (after the forward's first) and the forward's ops from
the previous matrix's first reader up to its own; where the backend overlaps them
(`Lowering.overlaps_prefetch`) the pair costs max(gather, compute), not the sum: the step
saves min(gather, compute) per pair (`_terms.hidden_time`; the shard ILP's
`FactorProblem.overlaps`). Only the gather's bandwidth term hides: its latency (alpha)
stays on the path, and so do vectors' gathers (XLA runs them synchronously).

The backward's second gathers (each matrix gathered again, after the reader's backward
inputs, `_run/_fsdp.backward_anchors`) are pairs of the same kind
(`Lowering.overlaps_backward_gathers`, `backward_windows`): each beside the ops from the
nearest backward matmul before its first backward reader that does not make those
inputs up to the reader, "one matmul ahead"; none where a layer's gradient reduction
falls in between (the runtime ties the next layer's backward to it, and XLA gathers
after it, synchronously), nor under remat for a matrix the recompute reads (gathered
there, with its layer's). Their ops are not beside a split-stream gather as well
(`stream_windows`' `taken`: XLA runs one chain at a time).

What XLA does with the window (jax 0.10.2, libtpu 0.0.42.1, `_verify/_schedule.py`,
tests/test_schedule.py): on v5p, ZeRO-3 over a 2x2x1 or 2x2x2 slice, a GPT (4 layers,
hidden 512) and a Llama (4 layers, hidden 1024) chained five of each layer's six (seven)
matrices' forward gathers, each window holding the previous matrix's matmul (and
attention's between); the Llama chained 26 backward gathers too. At the model's own
rates (each chain's bandwidth term against its window's matmul FLOPs and written bytes)
the Llama's forward chains hide 386 us, this price 368 us; the backward's hide 252 us
more.

The backward, read on v5p 2x2x2 (a 4-layer Llama at hidden 1024, 8 heads, the runtime's
flags; positions from `ScheduledCollective.position`, the backward's chains those after
the step's first gradient reduction): at dp 8 each layer's backward chains five of its
seven matrices' gathers (the up and gate projections', the queries', keys' and
values'), each beside one matmul (a weight's gradient, or the reader of the matrix
gathered before), and gathers the down and output projections' synchronously, each
just after the gradient all-reduce of the block before (the head's as well); the
gradients' reductions are all synchronous (all-reduces here, reduce-scatters in
MaxText's shape below), the norms' vectors chained (a few KB). At the model's rates the
backward's chains hide 306 us, this price 203 us. Under `projections` XLA chains the
down projection's too, beside the recompute's attention matmuls (420 us; the price's
windows hold no recompute: 203 us); under "full" the recompute gathers each layer's
matrices at once, all but one synchronously (80 us; priced 0). MaxText's shape (dp 2,
tp 4, the stream split, `projections`): 24 of the backward's 39 data-axis gathers
chained, alternating with the stream's model-axis chains, never two at once: 169 us,
the price 131 us, the stream's price unchanged (424 us: its windows step past the
matmuls ZeRO-3's take). Smaller programs chain fewer, and the price hides more than the
schedule: 2 layers at hidden 512, dp 4 on 2x2x1, 49 against 27 us (one more gather per
block synchronous); at hidden 1024, dp 2, tp 2, 131 against 125 us (the first backward
layer's MLP gathers synchronous).

Sequence parallelism's split stream (issue 27 item 6; MaxText's shape, ZeRO-3 on the
data axis and the stream split on the model axis, `projections`, v5p, the runtime's
flags): XLA's TPU chains the backward's model-axis gathers (the cotangents a matmul
reads whole, the norms' outputs gathered again) beside the backward's matmuls, and runs
the forward's model-axis gathers, every reduce-scatter (the stream's and ZeRO-3's
gradient reductions) synchronously. A 4-layer Llama at hidden 1024 on 2x2x2: at dp 2,
tp 4, 18 of the backward's 23 model-axis gathers chained (302 of 537 MB of all the
model axis gathers), none of the forward's 9, none of 19 model and 7 data-axis
reduce-scatters; at dp 4, tp 2, 17 of 32 gathers (143 of 268 MB), no reduce-scatter.
Smaller gathers are chained less (hidden 512, 2 layers, tp 2 on 2x2x1: 3 of the
backward's 11).
`stream_windows` pairs each backward gather with the ops from the nearest backward
matmul before its reader that does not make the gathered tensor (a weight's gradient,
where the input gradient before it makes a cotangent) up to the reader, less those that
make the tensor, each op beside one gather at most; `stream_hidden` takes
min(bandwidth term, window) off per pair (`Lowering.overlaps_stream_gathers`, in
`_seqpar.with_sequence_parallel`: one-stage programs only; a pipeline's stages stay
serial). At the model's rates (as for the prefetch above) the chains hide, and the
price takes off: 1390 and 869 us on the 4-layer Llama at dp 2, tp 4; 413 and 324 us on
a 2-layer one (hidden 1024, dp 2, tp 2 on 2x2x1, tests/test_schedule.py). Where XLA
chains fewer, the price hides more than the schedule: 157 against 188 us with one
layer (the first layer's backward gathers stay synchronous), 79 against 146 us at
hidden 512. Read again since the stream's kernels are priced as XLA writes them (the
norms' backward on 1/t of the rows, no residual written for the backward to read) and
a chain's matmuls at the model's roofline (`ScheduledCollective.compute_s`), MaxText's
shape on 2x2x2 (dp 2, tp 4, 8 MiB gathers): the chains hide 616 us, the price 326 (695
and 424 before both). Each of the price's windows holds the compute from one matmul
before its reader, 7 to 41 us at the model's rates; XLA's 18 chains hold one to seven
matmuls, 19 to 261 us (the gathers' 39 us each hidden in all but four). Where the
window falls short, XLA starts the gather earlier; the price does not: its windows
tile the backward already, so an earlier start shares compute with another chain,
which XLA's one chain at a time does not allow (not priced: the price hides 0.53 of
the schedule).

XLA's GPU (8 compile-only A100s, a 2- and a 4-layer GPT at hidden 256) makes every
collective a start/done pair, but its default scheduler puts each forward gather's start
just before its done (a few elementwise ops inside, one matmul in one pair of the step:
0.8% of the step's time at the model's rates, where a layer-ahead price would hide 1.9%),
and its all-gather combiner joins two layers' gathers, closing the earlier one's window;
the latency-hiding scheduler left the windows as empty. No GPU preset prices it.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np

from .._axes import DATA
from .._capture import loss_boundary
from .._graph import Graph
from .._groups import Groups
from .._lowering import Lowering
from .._remat import LayerGathers, layer_gathers, made_after
from ._collectives import AG
from ._fsdp import backward_reads, forward_reads, roots, served_bytes
from ._zero import tensor_sets


@dataclasses.dataclass(frozen=True)
class Prefetch:
    """Per overlapped pair (a gathered matrix and the ops its gather runs beside: the
    forward's from the previous matrix's first reader to its own, or a backward window,
    `backward_windows`), by group set as `Tables.param_coef`: what the gather moves and
    what those ops compute."""

    gather: np.ndarray  # [pairs, sets] bytes the matrix's gather moves whole (`Tables.gathered`)
    compute: np.ndarray  # [pairs, sets] unsharded seconds of the window's ops
    # [pairs, sets] the same under remat: a recomputed op's first forward (`remat_op_coef`);
    # none for a second gather the recompute reads first (it runs there, synchronously)
    compute_remat: np.ndarray
    # the backward ops some second gather runs beside, without and with remat (each op
    # beside one gather at most: the split stream's gathers do not take them again)
    backward_ops: frozenset[int] = frozenset()
    backward_ops_remat: frozenset[int] = frozenset()

    def sub(self, sets: np.ndarray) -> Prefetch:
        """The coefficients of some sets only (a scope's own, `_search/_mesh_terms.py`)."""
        return dataclasses.replace(
            self,
            gather=self.gather[:, sets],
            compute=self.compute[:, sets],
            compute_remat=self.compute_remat[:, sets],
        )

    @property
    def pairs(self) -> int:
        return len(self.gather)


# A gathered matrix, the ops its gather runs beside, and those under remat.
Pair = tuple[int, Sequence[int], Sequence[int]]


def step_prefetch(
    graph: Graph, groups: Groups, T, lowering: Lowering, recomputed: Collection[int] = ()
) -> Prefetch | None:
    """`Prefetch` of a step's ZeRO-3 layers (`_remat.layer_gathers`), the gathers the
    lowering runs beside compute: the forward's (`Lowering.overlaps_prefetch`), the
    backward's second ones (`Lowering.overlaps_backward_gathers`; under remat, those of
    the matrices no `recomputed` op reads). None where it runs neither so, or without a
    loss (no layers: ZeRO-3 gathers once for use)."""
    forward, backward = lowering.overlaps_prefetch, lowering.overlaps_backward_gathers
    if not (forward or backward) or loss_boundary(graph) is None:
        return None
    lg = layer_gathers(graph, groups)
    pairs: list[Pair] = [(p, w, w) for p, w in prefetch_windows(graph, lg, T)] if forward else []
    moved = [T.gathered.get(p, graph.tensors[p].nbytes) for p, _, _ in pairs]
    if backward:
        # Under remat the recompute reading a matrix gathers it (`_fsdp.gather_coefs`), all
        # its layer's at once: XLA's TPU runs those synchronously ("full", read on v5p).
        root = roots(graph, lg)
        first = {p for i in recomputed for t in graph.ops[i].inputs for p in root.get(t, ())}
        reads = backward_reads(graph, lg)
        for p, w in backward_windows(graph, lg).items():
            pairs.append((p, w, () if p in first else w))
            moved.append(served_bytes(graph, p, reads[p], T.gathered, T.gathered_narrow))
    return prefetch_coefs(graph, pairs, T, moved, tensor_sets(groups, T), lg)


def backward_taken(prefetch: Prefetch | None, plan, lowering) -> frozenset[int] | None:
    """The backward ops ZeRO-3's second gathers run beside under `plan`
    (`Prefetch.backward_ops`, `backward_ops_remat`): none but where ZeRO-3 gathers layer
    by layer, over a data axis of more than one device (`_terms.layered`). None where the
    backend runs the split stream's gathers synchronously (`lowering`: no stream windows
    to make; a GPU's made them for nothing, 48 ms an estimate of a 4-layer Llama)."""
    if not lowering.overlaps_stream_gathers:
        return None
    if prefetch is None or plan.zero_stage < 3 or plan.mesh.get(DATA, 1) <= 1:
        return frozenset()
    return prefetch.backward_ops_remat if plan.remat else prefetch.backward_ops


def prefetch_windows(graph: Graph, lg: LayerGathers, T) -> list[tuple[int, np.ndarray]]:
    """(matrix, forward ops) per gathered matrix after the forward's first, in the order
    the forward first reads them: its gather against the forward's ops from the previous
    matrix's first reader to just before its own (what XLA's TPU chains carry,
    `Lowering.overlaps_prefetch`); the remade ops and those ZeRO pins left out."""
    first_read: dict[int, int] = {}
    for (_, p), readers in forward_reads(graph, lg).items():
        if graph.tensors[p].ndim >= 2:  # XLA's TPU chains matrices' gathers, not vectors'
            first_read[p] = min(first_read.get(p, readers[0]), min(readers))
    weights = sorted(first_read, key=lambda p: (first_read[p], p))[1:]
    forward = np.arange(min(len(graph.ops), lg.regather.boundary + 1))
    forward = forward[~np.isin(forward, list(lg.remake)) & ~T.zero_op[forward]]
    reads = sorted(first_read.values())
    return [
        (p, forward[(forward >= reads[k]) & (forward < first_read[p])])
        for k, p in enumerate(weights)
    ]


def backward_windows(graph: Graph, lg: LayerGathers) -> dict[int, tuple[int, ...]]:
    """Per matrix ZeRO-3 gathers again for the backward (`_fsdp.backward_reads`), the
    backward ops its gather runs beside where XLA's TPU chains it
    (`Lowering.overlaps_backward_gathers`): from the nearest backward matmul before its
    first backward reader that does not make the reader's backward inputs (the runtime's
    gather waits for them, `_run/_fsdp.backward_anchors`) up to the reader, less the ops
    that make them; "one matmul ahead", as the chains run (`_verify/_schedule.py`). None
    where a layer's gradient reduction (`LayerGathers.reductions`, before its `at`) falls
    after that matmul: XLA runs the gather synchronously after the reduction (the down
    and output projections' in a Llama). Each op beside one gather at most; matrices
    only, as the forward's (XLA chains the norms' vectors too: a few KB)."""
    boundary = lg.regather.boundary
    matmuls = [op.index for op in graph.ops[boundary + 1 :] if op.primitive == "dot_general"]
    ties = sorted(r.at for r in lg.reductions)
    firsts = sorted(
        (ops[0], p) for p, ops in backward_reads(graph, lg).items() if graph.tensors[p].ndim >= 2
    )
    out: dict[int, tuple[int, ...]] = {}
    used: set[int] = set()
    for reader, p in firsts:
        anchors = [
            t for t in graph.ops[reader].inputs
            if t not in lg.lazy and made_after(graph, t, boundary)
        ]  # fmt: skip
        start, feeds = _window_start(graph, matmuls, reader, anchors)
        if start is None:
            continue  # every backward matmul before the reader makes its inputs
        k = bisect.bisect_right(ties, start)
        if k < len(ties) and ties[k] <= reader:
            continue  # a gradient reduction between: XLA gathers after it, synchronously
        window = [i for i in range(start, reader) if i not in feeds and i not in used]
        used.update(window)
        out[p] = tuple(window)
    return out


def _window_start(
    graph: Graph,
    matmuls: Sequence[int],
    reader: int,
    tensors: Sequence[int],
    skip: Collection[int] = (),
) -> tuple[int | None, set[int]]:
    """The nearest of `matmuls` before `reader` that does not make `tensors` and is not
    in `skip` (None where there is none), and the ops from it on that make them
    (`_made_by`)."""
    k, feeds = bisect.bisect_left(matmuls, reader), set()
    while k:
        k -= 1
        if matmuls[k] in skip:
            continue
        feeds = _made_by(graph, tensors, matmuls[k])
        if matmuls[k] not in feeds:
            return matmuls[k], feeds
    return None, feeds


def prefetch_coefs(
    graph: Graph,
    pairs: Sequence[Pair],
    T,
    moved: Sequence[float],
    set_of: Callable[[int], int],
    lg: LayerGathers,
) -> Prefetch:
    """`Prefetch` of `pairs` in `graph` (`T`: its `Tables`; `moved`: the bytes each pair's
    gather moves whole; `set_of`: a tensor's set; `lg`: its layers, whose boundary tells
    the backward's windows)."""
    n_sets = len(T.sets)
    first = np.where(T.remat_op_coef > 0, T.remat_op_coef, T.op_coef)
    body_first = np.where(T.body_remat_coef > 0, T.body_remat_coef, T.body_coef)
    gather = np.zeros((len(pairs), n_sets))
    compute, compute_remat = np.zeros_like(gather), np.zeros_like(gather)
    for k, (p, window, window_remat) in enumerate(pairs):
        gather[k, set_of(p)] = moved[k]
        for out, coef, body_coef, ops in (
            (compute[k], T.op_coef, T.body_coef, window),
            (compute_remat[k], first, body_first, window_remat),
        ):
            ops = np.asarray(ops, dtype=np.int64)
            np.add.at(out, T.op_set[ops], coef[ops])
            body = np.isin(T.body_op, ops)  # a loop's bodies, where its op is in the window
            np.add.at(out, T.body_set[body], body_coef[body])
    end = lg.regather.boundary
    return Prefetch(
        gather, compute, compute_remat,
        frozenset(i for _, w, _ in pairs for i in w if i > end),
        frozenset(i for _, _, w in pairs for i in w if i > end),
    )  # fmt: skip


def gather_beta(ac, mask: int) -> float:
    """Seconds per byte of a gather over the axes `mask` (`AxisCosts`): the faster of its
    variants' bandwidth terms, the one a large gather runs at."""
    return float(ac.beta[AG, :, mask].min())


def stream_windows(
    graph: Graph,
    at: Sequence[int],
    again: Sequence[bool],
    split: Collection[int],
    taken: Collection[int] = (),
) -> tuple[tuple[int, ...], ...]:
    """Per gather of sequence parallelism's split stream (`_seqpar.SeqparTerms.gathered`:
    `at`, the op reading each whole; `again`, made again in the backward), the backward
    ops it runs beside where XLA's TPU chains it (`Lowering.overlaps_stream_gathers`):
    from the nearest backward matmul before its first backward reader that does not
    make the gathered tensor up to that reader, "one matmul ahead" as the chains run
    (`_verify/_schedule.py`), less the ops that make the tensor (the gather cannot
    start before them); each op in one window at most. Empty for the forward's
    gathers (XLA runs them synchronously) and for a step without a loss. A gather made
    again reads in the backward where its tensor's first backward matmul reads it (the
    weight gradients of the projections reading a norm's recomputed output). `taken`:
    the backward ops ZeRO-3's second gathers run beside (`Prefetch.backward_ops`): XLA's
    TPU runs one chain at a time, so none is beside a stream gather as well, whose window
    then starts at the nearest matmul before its reader that none of them takes."""
    boundary = loss_boundary(graph)
    if boundary is None:
        return tuple(() for _ in at)
    consumers = graph.consumers()
    matmuls = [op.index for op in graph.ops[boundary + 1 :] if op.primitive == "dot_general"]
    backward = set(matmuls)
    readers, reads = [], []
    for op, made_again in zip(at, again, strict=True):
        reads.append([t for t in graph.ops[op].inputs if t in split])
        reader = op if op > boundary and not made_again else None
        if made_again:
            reader = min(
                (c for t in reads[-1] for c in consumers[t] if c in backward), default=None
            )
        readers.append(reader)
    out: list[tuple[int, ...]] = [()] * len(at)
    used = set(taken)  # each op beside one gather at most
    for g in sorted((g for g, r in enumerate(readers) if r is not None), key=readers.__getitem__):
        # The gather starts once its tensor is made: what makes it is not beside it; the
        # nearest matmul before the reader that does not is (a weight's gradient).
        start, feeds = _window_start(graph, matmuls, readers[g], reads[g], taken)
        if start is None:
            continue  # every backward matmul before the reader makes its tensor
        window = [i for i in range(start, readers[g]) if i not in feeds and i not in used]
        used.update(window)
        out[g] = tuple(window)
    return tuple(out)


def _made_by(graph: Graph, tensors: Sequence[int], first: int) -> set[int]:
    """The ops from `first` on that `tensors` depend on."""
    seen: set[int] = set()
    todo = [graph.tensors[t].producer for t in tensors]
    while todo:
        op = todo.pop()
        if op is None or op < first or op in seen:
            continue
        seen.add(op)
        todo.extend(graph.tensors[t].producer for t in graph.ops[op].inputs)
    return seen


def stream_hidden(
    windows: Sequence[Sequence[int]],
    gathered: Sequence[float],
    op_seconds: Mapping[int, float],
    beta: float,
) -> float:
    """Seconds of the split stream's backward gathers off the step's path: per gather,
    min(its bandwidth term, its window's compute: `op_seconds`, per op as the plan
    prices it), each pair costing max(gather, compute). Its latency stays on the path."""
    return sum(
        min(beta * nbytes, sum(op_seconds.get(i, 0.0) for i in window))
        for window, nbytes in zip(windows, gathered, strict=True)
        if window
    )
