"""A matmul's elementwise epilogue: the matmul outputs XLA's TPU never writes, per plan.

XLA's TPU fuses the elementwise ops that alone read a matmul's output into the matmul's
kernel (an output fusion): the kernel writes what they make, not the matmul's result
(`Lowering.fuses_matmul_epilogues`; `epilogue_rows` marks the buffers it may spare,
for `_buffers.step_buffers`). Where a mesh axis splits the matmul's contraction, each device's kernel makes a
partial sum, which must be reduced before any reader sees it: that one is written. Which
contractions a plan splits is its layout's, not the graph's, so the buffers are tabled
apart from the step's moments (as `_buffers.split_operands` are) and taken out per plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .._graph import Graph
from .._groups import ELEMENTWISE
from ._apart import HELD, SHARED, apart_rows, siblings
from ._kernel import split_reductions
from ._liveness import Buffers
from ._rows import CandidateRow, RowTable, row_table


def epilogue_rows(graph: Graph, consumers, boundary: int, spans, serves, in_memory):
    """(per buffer, the matmul output whose contraction decides whether XLA's TPU writes
    it, -1 where none does; the `_apart.apart_rows` rows of the buffers the chains run
    apart hold otherwise), for the buffers `spans` (tensor, birth and last op of each).
    A buffer's own tensor decides where it is a matmul's output that only elementwise
    ops read, which the matmul's kernel runs where no mesh axis splits the matmul's
    contraction (its output fusion: the kernel writes what they make, not the matmul's
    result; `unwritten`). Not a forward buffer kept for the backward, nor one stored in
    place of another residual (`serves`: a matmul reads that one through it). Where two
    matmuls' outputs meet in one elementwise chain (SwiGLU's silu(gate) x up), only the
    later kernel runs it: the earlier output is written for it to read. Another matmul's
    output decides where the buffer is what that one's chain makes again in its matmul
    readers where the contraction is split (`_apart.py`).

    Read in the HLO compiled for v5p chips (libtpu 0.0.42.1): a float32 GPT's backward
    runs GELU's derivative times the incoming gradient, its convert to bf16 and the bias
    gradient's sum in the kernel of the matmul that makes that gradient, one a layer
    (gpt plans 1 on 64 and on 256 chips of the TPU bench, with and without remat), and
    never writes that matmul's float32 output; most other matmuls run a bias add and a
    convert so. Held by tests/test_tpu_memory.py."""
    tensor, born, dies = spans
    chains: dict[int, set[int]] = {}  # candidate tensor -> the elementwise ops it feeds
    for t in sorted(set(tensor.tolist())):
        p = graph.tensors[t].producer
        if p is None or graph.ops[p].primitive != "dot_general" or serves.get(t, {t}) != {t}:
            continue
        chain = _chain(graph, consumers, t, in_memory)
        if chain:
            chains[t] = chain
    owner: dict[int, int] = {}  # elementwise op -> the latest candidate whose chain has it
    for t in sorted(chains, key=lambda t: graph.tensors[t].producer):
        for c in chains[t]:
            owner[c] = t
    spared = {t for t, ops in chains.items() if all(owner[c] == t for c in ops)}
    held = (born <= boundary) & (boundary < dies)  # made in the forward, read in the backward
    fused, apart = apart_rows(graph, consumers, spans, owner, spared, serves, in_memory)
    decides = {t: t for t in spared} | fused
    out = np.where(held, -1, [decides.get(t, -1) for t in tensor.tolist()]).astype(np.int64)
    return out, apart


def _chain(graph: Graph, consumers, t: int, in_memory) -> set[int] | None:
    """The elementwise ops fused downstream of tensor t, up to the tensors written; None
    where one of them makes a value that a kernel of another kind reads unwritten (a
    convert a reduction reads): the matmul's kernel would have to write that value in its
    place, and XLA writes the matmul's output instead."""
    ops: set[int] = set()
    todo = [t]
    while todo:
        for c in consumers[todo.pop()]:
            if graph.ops[c].primitive not in ELEMENTWISE:
                return None
            if c not in ops:
                ops.add(c)
                todo += [o for o in graph.ops[c].outputs if not in_memory[o]]
    return ops


@dataclasses.dataclass(frozen=True)
class Epilogues:
    """The buffers a step's matmuls may spare (one column each), at the step's moments."""

    live: np.ndarray  # [moments, c] bytes alive at each moment (unsplit, at the width held)
    sets: np.ndarray  # [c] the tensor set of each
    # [c] whether it counts where its deciding matmul's contraction is split (what the
    # chain run apart spares or holds, `_apart.py`), not where it is whole (the
    # matmul's own output, which its kernel's epilogue spares)
    when_split: np.ndarray
    rows: RowTable | None  # the partial-sum rows of their matmuls (None: no contraction splits)
    owner: np.ndarray  # [rows] the column whose matmul each row is of
    # [c, k] per column a value takes over (`_apart.SHARED`), the tensor sets and bytes of
    # the partial sums XLA may join with the one it takes (`_apart.siblings`; padding: the
    # empty set, 0 bytes), and the most bytes it joins (`Lowering.all_reduce_combine_bytes`)
    shared: np.ndarray
    joined_sets: np.ndarray
    joined_bytes: np.ndarray
    combine_bytes: float
    # `live` where the attention cores run as the flash kernel (None where none can)
    flash: np.ndarray | None = None


def epilogues(
    graph: Graph,
    buf: Buffers,
    at: np.ndarray,
    tensor_set: np.ndarray,
    partial: Sequence[CandidateRow],
    groups: tuple[int, int],
    combine_bytes: float,
    flash: Buffers | None = None,
) -> Epilogues | None:
    """The `Epilogues` of the step whose buffers are `buf` at its candidate moments `at`
    (`Moments.at`); `partial`: the step's partial-sum rows; `groups`: the number of
    groups and the empty set's index; `flash`: its buffers as the flash kernel leaves
    them, if it may run. None where none may be spared."""
    if buf.epilogue is None or not (buf.epilogue >= 0).any():
        return None
    own = np.flatnonzero(buf.epilogue >= 0)
    apart = buf.apart if buf.apart is not None else np.zeros((0, 5), dtype=np.int64)
    # a column per buffer spared, and one per span the chains run apart hold a buffer
    # longer (less) or a value takes one over (spared)
    idx = np.concatenate([own, apart[:, 0]])
    first = np.concatenate([buf.birth[own], apart[:, 1]])
    last = np.concatenate([buf.death[own], apart[:, 2]])
    decider = np.concatenate([buf.epilogue[own], apart[:, 3]])
    kind = np.concatenate([np.full(len(own), -1), apart[:, 4]])
    sign = np.where(kind == HELD, -1.0, 1.0)
    tensor = buf.tensor[idx]
    nbytes = sign * np.array([graph.tensors[t].nbytes for t in tensor.tolist()], dtype=float)
    on = (first[None, :] <= at[:, None]) & (at[:, None] <= last[None, :])
    rows, owner = _decided_by(graph, decider, partial)
    joined_sets, joined_bytes = _joined(graph, tensor, kind == SHARED, tensor_set, groups[1])
    return Epilogues(
        live=on * (nbytes * buf.width[idx]),
        flash=None if flash is None else on * (nbytes * flash.width[idx]),
        sets=tensor_set[tensor],
        when_split=(decider != tensor) | (kind >= 0),
        rows=row_table(rows, *groups) if rows else None,
        owner=np.array(owner, dtype=np.int64),
        shared=kind == SHARED,
        joined_sets=joined_sets,
        joined_bytes=joined_bytes,
        combine_bytes=combine_bytes,
    )


def _joined(graph: Graph, tensor: np.ndarray, shared: np.ndarray, tensor_set, empty: int):
    """([c, k] tensor sets, [c, k] bytes) of the partial sums XLA may join with each
    column's tensor into one all-reduce, where a value takes that tensor's buffer over
    (`_apart.siblings`), padded with the empty set and 0 bytes."""
    consumers = graph.consumers() if shared.any() else None
    joined = [
        siblings(graph, consumers, int(t)) if s else [] for t, s in zip(tensor, shared, strict=True)
    ]
    width = max(map(len, joined), default=0)
    sets = np.full((len(joined), width), empty, dtype=np.int64)
    nbytes = np.zeros((len(joined), width))
    for c, js in enumerate(joined):
        sets[c, : len(js)] = tensor_set[js]
        nbytes[c, : len(js)] = [graph.tensors[j].nbytes for j in js]
    return sets, nbytes


def _decided_by(graph: Graph, decider: np.ndarray, partial: Sequence[CandidateRow]):
    """The partial-sum rows of each column's deciding matmul, and the column of each."""
    by_op: dict[int, list[CandidateRow]] = {}
    for r in partial:
        by_op.setdefault(r.op, []).append(r)
    rows, owner = [], []
    for c, t in enumerate(decider.tolist()):
        for r in by_op.get(graph.tensors[t].producer, ()):
            rows.append(r)
            owner.append(c)
    return rows, owner


def less_unwritten(copied, both, codes: np.ndarray, P: np.ndarray, L):
    """What a plan `L` holds at each moment beside the step's buffers (`copied`, per
    moment, or None) less what its matmuls do not write (`unwritten` of `both`, the
    `Tables.epilogues` pair: without and with remat)."""
    spared = unwritten(both[int(L.remat)], codes, P, L.made_inv, L.flash) if both else None
    if spared is None:
        return copied
    return -spared if copied is None else copied - spared


def unwritten(
    E: Epilogues | None, codes: np.ndarray, P: np.ndarray, made_inv: np.ndarray, flash=False
):
    """[moments] bytes per device of `E`'s buffers the plan does not write: the outputs
    of the matmuls whose contraction no mesh axis splits (`codes`, the axis code of each
    group; `P`, which axes each set is split over: `_kernel.split_reductions`), and where
    one splits it, what its chain run apart spares and holds (`_apart.py`: less what it
    holds longer; a buffer a value would take over where XLA joins it into a combined
    all-reduce, not), laid as `made_inv` lays each set (`flash`: of the buffers the flash
    kernel leaves). None where there are none."""
    if E is None:
        return None
    live = E.flash if flash and E.flash is not None else E.live
    split = np.zeros(len(E.sets), dtype=bool)
    if E.rows is not None:
        split[E.owner[split_reductions(E.rows, codes, P)[1].any(axis=1)]] = True
    counts = split == E.when_split
    if E.shared.any():  # not taken over where XLA joins it into a combined all-reduce
        joined = (E.joined_bytes * made_inv[E.joined_sets]).sum(axis=1)
        several = (E.joined_bytes > 0).sum(axis=1) > 1
        counts &= ~(E.shared & several & (joined <= E.combine_bytes))
    return live[:, counts] @ made_inv[E.sets[counts]] if counts.any() else None
