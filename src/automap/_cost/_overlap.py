"""ZeRO-3's prefetch: each weight's gather in flight while the forward computes with the
weight before it.

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
stays on the path, and so do vectors' gathers (XLA runs them synchronously) and the
backward's second gathers (XLA chains some, with less inside: left charged, the price
errs on the slow side).

What XLA does with the window (jax 0.10.2, libtpu 0.0.42.1, `_verify/_schedule.py`,
tests/test_schedule.py): on v5p, ZeRO-3 over a 2x2x1 or 2x2x2 slice, a GPT (4 layers,
hidden 512) and a Llama (4 layers, hidden 1024) chained five of each layer's six (seven)
matrices' forward gathers, each window holding the previous matrix's matmul (and
attention's between); the Llama chained 26 backward gathers too. At the model's own
rates (each chain's bandwidth term against its window's matmul FLOPs and written bytes)
the Llama's forward chains hide 386 us, this price 368 us; the backward's hide 252 us
more, not priced.

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
hidden 512.

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

from .._capture import loss_boundary
from .._graph import Graph
from .._groups import Groups
from .._remat import LayerGathers, layer_gathers
from ._collectives import AG
from ._fsdp import forward_reads
from ._zero import tensor_sets


@dataclasses.dataclass(frozen=True)
class Prefetch:
    """Per prefetched pair (a gathered matrix and the forward's ops from the previous
    matrix's first reader to its own), by group set as `Tables.param_coef`: what the
    gather moves and what those ops compute."""

    gather: np.ndarray  # [pairs, sets] bytes the matrix's gather moves whole (`Tables.gathered`)
    compute: np.ndarray  # [pairs, sets] unsharded seconds of the window's forward ops
    # [pairs, sets] the same under remat: a recomputed op's first forward (`remat_op_coef`)
    compute_remat: np.ndarray

    def sub(self, sets: np.ndarray) -> Prefetch:
        """The coefficients of some sets only (a scope's own, `_search/_mesh_terms.py`)."""
        return Prefetch(self.gather[:, sets], self.compute[:, sets], self.compute_remat[:, sets])

    @property
    def pairs(self) -> int:
        return len(self.gather)


def step_prefetch(graph: Graph, groups: Groups, T) -> Prefetch | None:
    """`Prefetch` of a step's ZeRO-3 layers (`_remat.layer_gathers`), None without a loss
    (no layers: ZeRO-3 gathers once for use)."""
    if loss_boundary(graph) is None:
        return None
    return prefetch_coefs(
        graph, layer_gathers(graph, groups), T, T.gathered, tensor_sets(groups, T)
    )


def prefetch_coefs(
    graph: Graph,
    lg: LayerGathers,
    T,
    gathered: Mapping[int, float],
    set_of: Callable[[int], int],
) -> Prefetch:
    """`Prefetch` of `graph` (`T`: its `Tables`; `set_of`: a tensor's set): one pair per
    gathered weight after the forward's first, in the order the forward first reads them,
    its gather against the forward's ops from the previous weight's first reader to just
    before its own (what XLA's TPU chains carry, `Lowering.overlaps_prefetch`)."""
    n_sets = len(T.sets)
    first_read: dict[int, int] = {}
    for (_, p), readers in forward_reads(graph, lg).items():
        if graph.tensors[p].ndim >= 2:  # XLA's TPU chains matrices' gathers, not vectors'
            first_read[p] = min(first_read.get(p, readers[0]), min(readers))
    weights = sorted(first_read, key=lambda p: (first_read[p], p))[1:]
    forward = np.arange(min(len(graph.ops), lg.regather.boundary + 1))
    forward = forward[~np.isin(forward, list(lg.remake)) & ~T.zero_op[forward]]
    first = np.where(T.remat_op_coef > 0, T.remat_op_coef, T.op_coef)
    body_first = np.where(T.body_remat_coef > 0, T.body_remat_coef, T.body_coef)
    gather = np.zeros((len(weights), n_sets))
    compute, compute_remat = np.zeros_like(gather), np.zeros_like(gather)
    reads = sorted(first_read.values())
    for k, p in enumerate(weights):
        gather[k, set_of(p)] = gathered.get(p, graph.tensors[p].nbytes)
        ops = forward[(forward >= reads[k]) & (forward < first_read[p])]
        np.add.at(compute[k], T.op_set[ops], T.op_coef[ops])
        np.add.at(compute_remat[k], T.op_set[ops], first[ops])
        body = np.isin(T.body_op, ops)  # a loop's bodies, where its op is in the window
        np.add.at(compute[k], T.body_set[body], T.body_coef[body])
        np.add.at(compute_remat[k], T.body_set[body], body_first[body])
    return Prefetch(gather, compute, compute_remat)


def gather_beta(ac, mask: int) -> float:
    """Seconds per byte of a gather over the axes `mask` (`AxisCosts`): the faster of its
    variants' bandwidth terms, the one a large gather runs at."""
    return float(ac.beta[AG, :, mask].min())


def stream_windows(
    graph: Graph, at: Sequence[int], again: Sequence[bool], split: Collection[int]
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
    weight gradients of the projections reading a norm's recomputed output)."""
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
    used: set[int] = set()  # each op beside one gather at most
    for g in sorted((g for g, r in enumerate(readers) if r is not None), key=readers.__getitem__):
        # The gather starts once its tensor is made: what makes it is not beside it; the
        # nearest matmul before the reader that does not is (a weight's gradient).
        k, feeds = bisect.bisect_left(matmuls, readers[g]), set()
        while k:
            k -= 1
            feeds = _made_by(graph, reads[g], matmuls[k])
            if matmuls[k] not in feeds:
                break
        else:
            continue  # every backward matmul before the reader makes its tensor
        window = [i for i in range(matmuls[k], readers[g]) if i not in feeds and i not in used]
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
